"""The admission controller: load remote blocks only when that wins.

For a request whose leading ``L`` blocks are local and the next ``R`` are found
remotely, the decision is a **split plan** over the first ``k ≤ R`` of them:
compute blocks ``[L, L+s)`` on the GPU while blocks ``[L+s, L+k)`` load, the two
meeting in the middle (compute while loading — Cake, arXiv 2410.03065), then
prefill the rest. A plain load that runs past its p95 prediction turns into a
split (``Decision.compute_after_s``). A plan is taken only if the range is ready
before recompute would have produced it:

    p95(T_remote(k−s)) + T_interference(k−s) < margin × (W + p50(T_recompute(L → L+k)))

``W`` is the wait for a prefill slot the engine reports (``ctx.queue_wait_s``,
0 by default) and ``T_recompute(L → L+k)`` dispatch plus prefilling those k
blocks after the L local ones; with ``s = 0`` this is the brief's rule exactly.
``T_remote`` sees the path: the bytes ahead of the load on its source and the
receiving NIC (``ctx.path_backlog_bytes``, ``ctx.path_flows_bytes``), reads and
writes from every replica.

**Which winning plan** (issue #44: GPU time has a price). Every plan that passes
the inequality is ready before recompute; they differ in the GPU seconds they
spend — a split computes a front it could have loaded::

    gpu_saved(k, s) = p50(T_recompute(L → L+k)) − p50(T_recompute(L → L+s))

``AdmissionConfig.gpu_s_price`` (seconds of this request's TTFT one GPU second
is worth) ranks them: ``inf`` (the default) takes the plan that saves the most
GPU seconds, the fastest among equals — a load exists to save GPU time, and
beating recompute is the latency it must keep (a split then computes the least
front that still wins, and starts it late enough to meet the load there);
``0`` takes the fastest plan whatever it computes (the rule before #44: a split
at the meeting point ``W + T_compute(s) ≈ T_remote(k−s)`` whenever faster,
recomputing fronts on an idle link); in between, benefit + price × gpu_saved.
Declining is weighed on the inequality's own terms: its recompute side charges
each GPU second of recompute to the requests it delays —
``AdmissionContext.externality`` = the requests queued now + ρ/(1 − ρ) for
those that arrive while the replica is busy (ρ its measured prefill
utilisation; the M/M/1 delay a second of work adds) — so under a queue a load
wins where, on an idle replica, recompute would. Without ``compute_while_loading``
(engines that cannot overlap them) ``s = 0``. Candidates are
``k ∈ {1, 2, 4, …} ∪ {R}``: the model's benefit is convex in k (prefill is
convex, every remote term linear), so a faster link or a longer shared prefix
never turns a load into a recompute, and a slower link never turns a recompute
into a load. Under the model a plan's predicted time is never above
recompute-only's (``s = k``, no load, is always a candidate).

Guard rails, checked after the inequality: the source's circuit breaker
(``source_unhealthy``), concurrent loads per replica (``replica_cap``; lower
while ``ctx.warming``) and per source (``source_cap``), bytes queued on the
source (``queue_full``), and the ramp's allowed share (``ramp_share``). A load
gets a soft timeout derived from the predicted recompute time; an overrunning
load is abandoned for recompute. Failure policy ``recompute`` (default) falls
back; ``fail`` raises :class:`~kvpolicy.errors.RemoteLoadError`.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Literal, get_args

import attrs

from .._validate import check_non_negative_number, check_positive_number, non_negative_int, non_negative_number
from ..clock import MonotonicClock
from ..errors import ConfigError, RemoteLoadError
from ..matching import PrefixMatch
from ..protocols import Clock
from .breaker import CircuitBreaker
from .model import LatencyModel
from .ramp import RampController

Action = Literal["local_only", "load", "recompute"]
FailurePolicy = Literal["recompute", "fail"]
REASONS = ("wins", "within_slo", "probe", "no_remote_blocks", "slower_than_recompute", "source_unhealthy", "replica_cap", "source_cap", "queue_full", "ramp_share",
           "trimmed_to_zero", "committed")


def _pos_int(inst: Any, a: attrs.Attribute, v: Any) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ConfigError(a.name, f"must be a positive int, got {v!r}")


@attrs.frozen
class AdmissionConfig:
    #: a load must be ready within margin × the recompute time (p95 against p50: "markedly below")
    margin: float = 0.8
    max_loads_per_replica: int = attrs.field(default=4, validator=_pos_int)
    max_loads_per_source: int = attrs.field(default=32, validator=_pos_int)
    max_queue_bytes_per_source: float = 8 * 2**30
    warming_max_loads_per_replica: int = attrs.field(default=1, validator=_pos_int)
    timeout_factor: float = 2.0
    failure_policy: FailurePolicy = "recompute"
    #: after a source has been judged slower than recompute for this long, admit one load
    #: anyway (a probe, still under every guard rail and the soft timeout) so the model
    #: sees the link as it is now; None: never probe
    probe_interval_s: float | None = 30.0
    #: plan splits: the engine computes the leading blocks of a load range while the rest
    #: loads (from the back), meeting in the middle; False for engines that cannot overlap them
    compute_while_loading: bool = False
    #: how the plans that beat recompute (by the margin: each is ready before recompute would be) are ranked — the
    #: seconds of this request's TTFT one GPU second is worth. ``inf`` (default): the plan that saves the most GPU
    #: seconds, the fastest among equals — a load exists to save GPU time, and beating recompute is the latency it
    #: must keep (a split computes the least front that still wins, started late enough to meet the load there).
    #: ``0``: the fastest plan whatever it computes (splits at the meeting point whenever faster: the rule before
    #: issue #44). In between: benefit + ``gpu_s_price`` × GPU seconds saved. It never makes a load that loses to
    #: recompute acceptable: that is the margin's inequality, whose recompute side already charges the requests the
    #: recompute would delay (:meth:`AdmissionContext.externality`)
    gpu_s_price: float = math.inf
    #: a p95 TTFT target (seconds) a load may spend latency up to: a plan that loses to recompute is still taken when
    #: the request's predicted p95 TTFT under it stays within the target — its delay cannot move the p95, the GPU seconds
    #: it saves are real. None (default): derived, the p95 of the TTFTs the engine reports (:meth:`observe_ttft`, the
    #: model's window; until ``min_samples`` are seen, no target). 0: none — only plans that beat recompute (the brief's
    #: inequality alone)
    ttft_slo_s: float | None = None

    def __attrs_post_init__(self) -> None:
        if isinstance(self.margin, bool) or not isinstance(self.margin, (int, float)) or not 0 < self.margin <= 1:
            raise ConfigError("margin", f"must be in (0, 1], got {self.margin!r}")
        check_positive_number("max_queue_bytes_per_source", self.max_queue_bytes_per_source)
        check_positive_number("timeout_factor", self.timeout_factor)
        if self.probe_interval_s is not None:  # None: never probe
            check_positive_number("probe_interval_s", self.probe_interval_s)
        if not isinstance(self.compute_while_loading, bool):
            raise ConfigError("compute_while_loading", f"must be True or False, got {self.compute_while_loading!r}")
        if self.ttft_slo_s is not None:
            check_non_negative_number("ttft_slo_s", self.ttft_slo_s)
        p = self.gpu_s_price
        if isinstance(p, bool) or not isinstance(p, (int, float)) or math.isnan(p) or p < 0:
            raise ConfigError("gpu_s_price", f"must be a number >= 0 (seconds of TTFT per GPU second; inf, the default: the plan "
                                             f"that saves the most GPU seconds), got {p!r}")
        if self.failure_policy not in ("recompute", "fail"):
            raise ConfigError("failure_policy", f"must be 'recompute' or 'fail', got {self.failure_policy!r}")


def _finite_nonneg(v: Any) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v) and v >= 0


@attrs.frozen
class AdmissionContext:
    """What the engine knows about one request's situation when it asks."""

    block_bytes: int
    replica: str = "replica-0"
    source: str = "pool"
    active_decodes: int = 0
    warming: bool = False
    request_class: str = "default"
    #: bytes queued ahead on the load's path in FIFO order (a storage node's or transport's backlog
    #: figure: reads *and* writes from every replica, in that direction); None: unknown
    path_backlog_bytes: float | None = None
    #: remaining bytes of each flow sharing the path's bottleneck link fairly (a transport that
    #: tracks its flows); each delays a load of S bytes by at most min(r, S)
    path_flows_bytes: tuple[float, ...] = ()
    #: the wait before this request's prefill can start (the engine's scheduler queue), seconds
    queue_wait_s: float = 0.0
    #: requests waiting for a prefill slot on this replica now: every GPU second this request's
    #: recompute takes is a second each of the requests queued behind it waits (their expected
    #: number: as many as wait now). The mirror of T_interference, which a load steals
    prefill_queue_requests: int = 0
    #: the replica's recent prefill utilisation, 0..1 (the share of its prefill slots busy over the last seconds, as
    #: the engine's scheduler measures it); None: unknown (only the requests queued now are counted). A GPU second of
    #: recompute adds ρ/(1 − ρ) seconds of waiting, on average, to the requests that arrive while the replica is busy
    #: (M/M/1), on top of the one second each request already queued waits
    prefill_utilisation: float | None = None
    #: loads this replica's engine was already told it may start but has not admitted yet (vLLM
    #: answers ``get_num_new_matched_tokens`` for several requests before it admits their loads
    #: when it defers async loads to a later step): the replica and source caps count them as in
    #: flight, so the loads admitted later as committed never exceed the caps
    promised_loads: int = 0

    def __attrs_post_init__(self) -> None:
        if isinstance(self.block_bytes, bool) or not isinstance(self.block_bytes, int) or self.block_bytes <= 0:
            raise ConfigError("block_bytes", f"must be a positive int, got {self.block_bytes!r}")
        if isinstance(self.active_decodes, bool) or not isinstance(self.active_decodes, int) or self.active_decodes < 0:
            raise ConfigError("active_decodes", f"must be a non-negative int, got {self.active_decodes!r}")
        if self.path_backlog_bytes is not None and not _finite_nonneg(self.path_backlog_bytes):
            raise ConfigError("path_backlog_bytes", f"must be finite and >= 0 or None, got {self.path_backlog_bytes!r}")
        for name in ("replica", "source", "request_class"):  # keys of the controller's per-replica / per-source state
            v = getattr(self, name)
            if not isinstance(v, str) or not v:
                raise ConfigError(name, f"must be a non-empty string, got {v!r}")
        if not isinstance(self.warming, bool):
            raise ConfigError("warming", f"must be True or False, got {self.warming!r}")
        if isinstance(self.path_flows_bytes, (str, bytes)) or not hasattr(self.path_flows_bytes, "__iter__") or not all(
                _finite_nonneg(r) for r in self.path_flows_bytes):
            raise ConfigError("path_flows_bytes", f"must be the remaining bytes of each flow, each finite and >= 0, got {self.path_flows_bytes!r:.80}")
        if not _finite_nonneg(self.queue_wait_s):
            raise ConfigError("queue_wait_s", f"must be finite and >= 0, got {self.queue_wait_s!r}")
        n = self.prefill_queue_requests
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ConfigError("prefill_queue_requests", f"must be a non-negative int, got {n!r}")
        n = self.promised_loads
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ConfigError("promised_loads", f"must be a non-negative int, got {n!r}")
        u = self.prefill_utilisation
        if u is not None and (not _finite_nonneg(u) or u > 1):
            raise ConfigError("prefill_utilisation", f"must be in [0, 1] or None, got {u!r}")

    @property
    def externality(self) -> float:
        """Seconds of other requests' waiting one GPU second of this request's prefill causes: the requests queued
        now, plus ρ/(1 − ρ) for those that will queue while the replica is busy (ρ capped at 0.99; 0 when unknown)."""
        u = self.prefill_utilisation
        rho = 0.0 if u is None else min(float(u), 0.99)
        return self.prefill_queue_requests + rho / (1.0 - rho)

    @property
    def knows_path(self) -> bool:
        return self.path_backlog_bytes is not None or bool(self.path_flows_bytes)


@attrs.frozen
class Decision:
    """What to do, why, and every predicted term that drove it."""

    action: Action
    reason: str
    local_blocks: int
    remote_blocks_found: int
    load_blocks: int
    t_remote_p50_s: float | None
    t_remote_p95_s: float | None
    t_recompute_p50_s: float | None
    interference_s: float | None
    terms: dict[str, float]
    soft_timeout_s: float | None = None
    load_id: int | None = None
    source: str = "pool"
    replica: str = "replica-0"
    load_bytes: int = 0
    #: compute while loading: the engine requests blocks [L, L+load_blocks) from the back and prefills
    #: from the front; they are predicted to meet here (blocks [L, L+split_blocks) computed, the rest
    #: loaded). 0 = a plain load of the whole range
    split_blocks: int = 0
    #: bytes ahead on the path the prediction used (fed back with the outcome)
    queue_bytes: float = 0.0
    #: compute while loading: if the load has not finished this many seconds after it started, start
    #: prefilling from the front while it goes on from the back (0 for a split plan: at once; the p95
    #: prediction for a plain load — then ask :meth:`AdmissionController.keep_waiting` whether the bytes, at the
    #: rate they arrive now, still beat recompute; a late load costs at most what recompute would). None: off
    compute_after_s: float | None = None

    @property
    def loads(self) -> bool:
        return self.action == "load"

    @property
    def plan_s(self) -> float | None:
        """Predicted seconds until the found range is ready under what was decided (the split plan
        if it loads, recompute otherwise); None when nothing remote was found."""
        if not self.terms:
            return None
        return self.terms["t_plan_s"] if self.loads else self.terms["t_recompute_only_s"]



#: how a load ended
LoadStatus = Literal["ok", "failed", "timeout", "incompatible"]
LOAD_STATUSES: tuple[str, ...] = get_args(LoadStatus)


def _status(inst: Any, a: attrs.Attribute, v: Any) -> None:
    if v not in LOAD_STATUSES:
        raise ConfigError("status", f"unknown load status {v!r}; one of {', '.join(LOAD_STATUSES)}")


def _int(inst: Any, a: attrs.Attribute, v: Any) -> None:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ConfigError(a.name, f"must be an int, got {v!r}")


_optional_time = attrs.validators.optional(non_negative_number)


@attrs.frozen
class LoadOutcome:
    """What happened to a load the controller admitted (times in seconds). Checked when built: a NaN time would
    reach the latency model's histograms; :meth:`AdmissionController.record` checks ``ok_blocks`` against the load."""

    load_id: int = attrs.field(validator=_int)
    status: LoadStatus = attrs.field(validator=_status)
    #: blocks that arrived intact before the load ended, in transfer order (the range's leading
    #: blocks; its trailing ones when computing while loading, which loads from the back)
    ok_blocks: int = attrs.field(validator=non_negative_int)
    lookup_s: float | None = attrs.field(default=None, validator=_optional_time)
    #: for "ok": the transfer's duration; for "timeout": how long it ran before it was given up
    transfer_s: float | None = attrs.field(default=None, validator=_optional_time)
    stage_s: float | None = attrs.field(default=None, validator=_optional_time)
    install_s: float | None = attrs.field(default=None, validator=_optional_time)
    stall_s: float | None = attrs.field(default=None, validator=_optional_time)  # observed interference, if the engine measures it
    #: bytes actually moved, when the load ended early (a split plan's compute caught up); None: all of it
    bytes_delivered: float | None = attrs.field(default=None, validator=_optional_time)


@attrs.frozen
class LoadResult:
    #: blocks that may be used (partial use: whatever arrived intact before the end, in transfer order)
    usable_blocks: int
    recompute_blocks: int
    status: str


_TERMS_P95, _TERMS_P50 = (tuple(f"{term}_{tag}_s" for term in ("lookup", "queue", "transfer", "stage", "install", "t_remote"))
                           for tag in ("p95", "p50"))


class _Sides:
    """The two sides of a plan for one request: the GPU's front and the link's far end (seconds).

        front(s)          = T_dispatch + T_prefill(L → L+s)                         (p50)
        remote(n)         = T_remote(n blocks, with the path's queue) + T_interference   (p95)
        plan(k, s)        = max(W + front(s), remote(k − s)) + behind × front(s)
        recompute_only(k) = W + front(k) × (1 + behind)

    ``behind``: seconds of other requests' waiting each GPU second this request computes causes
    (:attr:`AdmissionContext.externality`: the requests queued behind it, and those the busy replica will queue)."""

    def __init__(self, ctl: AdmissionController, start_tokens: int, Bt: int, ctx: AdmissionContext, c95: Any, c50: Any,
                 prompt_tokens: int | None = None) -> None:
        self.ctl, self.start, self.Bt, self.ctx, self.c95, self.c50 = ctl, start_tokens, Bt, ctx, c95, c50
        self.prompt_tokens = prompt_tokens
        self.spread = 1 + max(ctx.active_decodes, 0)
        self.behind = ctx.externality
        # without an engine-reported path, the bytes ahead do not depend on the load's size: look them up once
        self._own_queue = None if ctx.knows_path else ctl.queued_bytes(ctx.source)
        self._remote: dict[int, float] = {}
        self._front: dict[int, float] = {}

    def front(self, s: int) -> float:
        if s <= 0:
            return 0.0
        t = self._front.get(s)
        if t is None:  # one decision asks for the same fronts many times (the plans, their searches, the ranking)
            t = self._front[s] = self.c50.recompute(self.start, self.start + s * self.Bt)
        return t

    def remote(self, n: int) -> float:
        if n <= 0:
            return 0.0
        t = self._remote.get(n)
        if t is None:
            S = n * self.ctx.block_bytes
            q = self.queue_bytes(S)
            t = self._remote[n] = self.c95.remote(S, n, q) + self.c50.interference_s_per_byte * S * self.spread
        return t

    def queue_bytes(self, load_bytes: float) -> float:
        """Bytes ahead of a load of ``load_bytes`` on its path (looked up once per decision when the engine reports no path)."""
        return self._own_queue if self._own_queue is not None else self.ctl.path_queue_bytes(self.ctx, load_bytes)

    def plan(self, k: int, s: int) -> float:
        if s <= 0:
            return self.remote(k)
        f = self.front(s)
        return max(self.ctx.queue_wait_s + f, self.remote(k - s)) + self.behind * f

    def recompute_only(self, k: int) -> float:
        return self.ctx.queue_wait_s + self.front(k) * (1 + self.behind)

    def ttft(self, k: int, s: int) -> float:
        """This request's predicted TTFT under plan (k, s), at the load's p95: the range ready (the bytes arrive while
        it waits for its slot), then the rest of the prompt prefilled."""
        W = self.ctx.queue_wait_s
        ready = max(W, self.remote(k)) if s <= 0 else max(W + self.front(s), self.remote(k - s))
        end = self.prompt_tokens if self.prompt_tokens is not None else self.start + k * self.Bt
        rest = self.c50.recompute(self.start + k * self.Bt, end) if end > self.start + k * self.Bt else 0.0
        return ready + rest


class AdmissionController:
    def __init__(self, model: LatencyModel, config: AdmissionConfig | None = None, *, clock: Clock | None = None,
                 ramp: RampController | None = None, breaker_factory: Any = None) -> None:
        if not isinstance(model, LatencyModel):
            raise ConfigError("model", "must be a LatencyModel")
        self.model = model
        self.config = config or AdmissionConfig()
        self.clock = clock or MonotonicClock()
        self.ramp = ramp
        self._breaker_factory = breaker_factory or (lambda: CircuitBreaker(clock=self.clock))
        self.breakers: dict[str, CircuitBreaker] = {}
        self._ids = itertools.count(1)
        self._inflight: dict[int, Decision] = {}
        self._replica_loads: dict[str, int] = {}
        self._source_loads: dict[str, int] = {}
        self._source_bytes: dict[str, float] = {}
        self._last_load_s: dict[str, float] = {}
        self._busy_until: dict[str, tuple[float, float]] = {}  # source -> (since s, bytes ahead then)
        self._ttft = model._make()  # observed TTFTs, in the model's window: the derived p95 target
        if getattr(model, "clock", None) is None:
            model.clock = self.clock

    # ------------------------------------------------------------------ state

    def breaker(self, source: str) -> CircuitBreaker:
        b = self.breakers.get(source)
        if b is None:
            b = self._breaker_factory()
            self.breakers[source] = b
        return b

    def loads_in_flight(self, replica: str | None = None, source: str | None = None) -> int:
        if replica is not None:
            return self._replica_loads.get(replica, 0)
        if source is not None:
            return self._source_loads.get(source, 0)
        return len(self._inflight)

    def queued_bytes(self, source: str) -> float:
        """Bytes still ahead of a new load on ``source``: the admitted loads in flight,
        drained at the model's p50 B_eff since they were admitted (a FIFO link empties
        while we wait; counting every in-flight load whole until it reports back would
        charge a nearly finished transfer as if it had not started)."""
        inflight = self._source_bytes.get(source, 0.0)
        if inflight <= 0:
            return 0.0
        mark = self._busy_until.get(source)
        if mark is None:
            return inflight
        since, backlog = mark
        s_per_byte = self.model.coefficients(0.5, source).s_per_byte
        drained = (self.clock.now_s() - since) / s_per_byte if s_per_byte > 0 else 0.0
        return min(max(backlog - drained, 0.0), inflight)

    # ------------------------------------------------------------------ decide

    def path_queue_bytes(self, ctx: AdmissionContext, load_bytes: float) -> float:
        """Bytes ahead of a load of ``load_bytes`` on its path: what the engine reports
        (every byte in that direction, any replica, reads and writes) or, when it reports
        nothing, this controller's own admitted loads still in flight on the source."""
        if ctx.knows_path:
            return self.model.path_queue_bytes(load_bytes, ctx.path_backlog_bytes, ctx.path_flows_bytes)
        return self.queued_bytes(ctx.source)

    def _best_plan(self, L: int, R: int, Bt: int, ctx: AdmissionContext, c95: Any, c50: Any,
                   prompt_tokens: int | None = None, slo: float = 0.0) -> tuple[int, int, float, _Sides]:
        """(k, s, benefit, sides) of the plan to take over k in {1, 2, 4, ...} ∪ {R}: plain loads and, with
        ``compute_while_loading``, splits. Among the plans that win (benefit > 0) the one ranked first by
        ``gpu_s_price`` (GPU seconds saved, then benefit, at ``inf``; benefit + price × GPU seconds saved otherwise);
        when none wins, the one that comes closest (for the refusal's terms). ``slo``: the p95 TTFT target (0: none) a
        plan that loses to recompute may still be taken within."""
        sides = self._sides(L, Bt, ctx, c95, c50, prompt_tokens)  # one per decision: its memo of remote(n) serves every k
        price = self.config.gpu_s_price
        split = self.config.compute_while_loading
        extents = [1 << i for i in range(max(R - 1, 0).bit_length())] + [R]  # 1, 2, 4, … below R, then R
        # At price inf a plan's key starts with the GPU seconds it saves, at most front(k) (a front costs >= 0), and
        # front(k) grows with k (every coefficient is >= 0: PrefillModel's validators, non-negative observations):
        # once an extent's whole range saves less than the best plan found, no smaller extent can win. So the extents
        # are searched from the largest down, and the search ends there. Ties go to the smaller extent, as in an
        # ascending search.
        bounded = price == math.inf
        best: tuple[tuple[float, float], int, int, float] | None = None
        closest = (1, 0, -math.inf)
        for kk in reversed(extents):
            if bounded and best is not None and sides.front(kk) < best[0][0]:
                break
            here: tuple[tuple[float, float], int, int, float] | None = None
            near = (kk, 0, -math.inf)
            for s_, benefit in self._plans(kk, sides, split=split):
                if benefit > near[2]:
                    near = (kk, s_, benefit)
                if benefit <= 0 and not (slo > 0 and sides.ttft(kk, s_) <= slo):
                    continue
                saved = sides.front(kk) - sides.front(s_)  # GPU seconds this plan does not spend, against recomputing the range
                key = (saved, benefit) if price == math.inf else (benefit + price * saved, saved)
                if here is None or key > here[0]:
                    here = (key, kk, s_, benefit)
            if near[2] > closest[2] or near[2] == closest[2] > -math.inf:
                closest = near
            if here is not None and (best is None or here[0] >= best[0]):
                best = here
        if best is not None:
            return best[1], best[2], best[3], sides
        return closest[0], closest[1], closest[2], sides

    def _sides(self, L: int, Bt: int, ctx: AdmissionContext, c95: Any, c50: Any, prompt_tokens: int | None = None) -> _Sides:
        return _Sides(self, L * Bt, Bt, ctx, c95, c50, prompt_tokens)

    def observe_ttft(self, ttft_s: float) -> None:
        """One request's measured time to first token (any request, loaded or not): the derived p95 target learns from it."""
        check_non_negative_number("ttft_s", ttft_s)
        self._ttft.record(max(float(ttft_s), 1e-9))

    def slo_s(self) -> float:
        """The p95 TTFT target a load may spend latency up to (0: none): ``ttft_slo_s``, or the p95 of the observed TTFTs
        once ``min_samples`` are in the model's window."""
        if self.config.ttft_slo_s is not None:
            return float(self.config.ttft_slo_s)
        h = self._ttft
        if h.count < self.model.min_samples:
            return 0.0
        q = h.quantile(0.95)
        return float(q) if q is not None else 0.0

    def _plans(self, k: int, sides: _Sides, *, split: bool) -> list[tuple[int, float]]:
        """The plans for the load extent k, as (split s, benefit): the plain load and, with ``split``, the fastest
        split (the front and the load meet: ``W + front(s) ≈ remote(k − s)``) and the one that computes least and
        still wins (the smallest s below the meeting point whose benefit is > 0: plan(k, s) falls as s grows
        towards it)."""
        margin = self.config.margin
        recompute = sides.recompute_only(k)
        out = [(0, margin * recompute - sides.plan(k, 0))]
        if not split or k < 2:
            return out
        W = sides.ctx.queue_wait_s
        lo, hi = 0, k  # smallest s with front(s) >= remote(k - s): the two sides meet there
        while lo < hi:
            mid = (lo + hi) // 2
            front = W + sides.front(mid) if mid > 0 else 0.0
            if front >= sides.remote(k - mid):
                hi = mid
            else:
                lo = mid + 1
        meet, meet_p = lo, sides.plan(k, lo) if lo < k else math.inf
        if lo > 0 and sides.plan(k, lo - 1) < meet_p:
            meet, meet_p = lo - 1, sides.plan(k, lo - 1)
        if meet <= 0 or meet >= k:
            return out
        out.append((meet, margin * recompute - meet_p))
        lo, hi = 1, meet
        while lo < hi:
            mid = (lo + hi) // 2
            if margin * recompute - sides.plan(k, mid) > 0:
                hi = mid
            else:
                lo = mid + 1
        if lo < meet:
            out.append((lo, margin * recompute - sides.plan(k, lo)))
        return out

    def evaluate(self, local_blocks: int, remote_blocks: int, k: int, block_size_tokens: int, ctx: AdmissionContext,
                 split_blocks: int = 0) -> dict[str, float]:
        """Every predicted term for loading blocks [L+split, L+k) of the remote run (no side effects)."""
        for name, v in (("local_blocks", local_blocks), ("remote_blocks", remote_blocks), ("k", k), ("block_size_tokens", block_size_tokens),
                        ("split_blocks", split_blocks)):
            if isinstance(v, bool) or not isinstance(v, int) or v < (1 if name == "block_size_tokens" else 0):
                raise ConfigError(name, f"must be an int >= {1 if name == 'block_size_tokens' else 0}, got {v!r}")
        if split_blocks > k:
            raise ConfigError("split_blocks", f"{split_blocks} computed while loading, but only k = {k} blocks are planned")
        if not isinstance(ctx, AdmissionContext):
            raise ConfigError("ctx", f"must be an AdmissionContext, got {type(ctx).__name__}")
        c50 = self.model.coefficients(0.5, ctx.source)
        return self._terms(k, ctx, split_blocks, self._sides(local_blocks, block_size_tokens, ctx, self.model.coefficients(0.95, ctx.source), c50))

    def _terms(self, k: int, ctx: AdmissionContext, split_blocks: int, sides: _Sides) -> dict[str, float]:
        """:meth:`evaluate`'s terms, read from a decision's own sides (its coefficients and its memo of fronts)."""
        n = k - split_blocks
        load_bytes = n * ctx.block_bytes
        queue = sides.queue_bytes(load_bytes)
        out: dict[str, float] = {}
        for names, c in ((_TERMS_P95, sides.c95), (_TERMS_P50, sides.c50)):
            lookup, queued, transfer, stage, install, remote = names
            out[lookup] = c.lookup_s
            out[queued] = queue * c.s_per_byte
            out[transfer] = c.transfer_overhead_s + c.s_per_byte * load_bytes if load_bytes > 0 else 0.0
            out[stage] = c.stage_s_per_byte * load_bytes
            out[install] = c.install_s_per_block * n
            out[remote] = c.remote(load_bytes, n, queue)
        c50 = sides.c50
        recompute = sides.front(k) if k > 0 else c50.dispatch_s  # the memo's; a range of no blocks costs the dispatch alone
        out["queue_bytes"] = queue
        out["queue_wait_s"] = ctx.queue_wait_s
        out["dispatch_p50_s"] = c50.dispatch_s
        out["prefill_p50_s"] = recompute - c50.dispatch_s
        out["t_recompute_p50_s"] = recompute
        out["t_front_p50_s"] = sides.front(split_blocks)
        out["interference_s"] = c50.interference_s_per_byte * load_bytes * (1 + max(ctx.active_decodes, 0))
        out["b_eff_p50_bytes_per_s"] = 1.0 / c50.s_per_byte if c50.s_per_byte > 0 else float("inf")
        out["prefill_queue_requests"] = ctx.prefill_queue_requests
        out["t_plan_s"] = sides.plan(k, split_blocks)
        out["t_recompute_only_s"] = sides.recompute_only(k)
        out["benefit_s"] = self.config.margin * out["t_recompute_only_s"] - out["t_plan_s"]
        out["externality"] = sides.behind
        out["gpu_saved_s"] = sides.front(k) - sides.front(split_blocks)  # GPU seconds not spent, against recomputing the range
        return out

    def decide(self, match: PrefixMatch, ctx: AdmissionContext) -> Decision:
        """Propose and admit in one step: a load decision holds its slots until :meth:`record` or :meth:`cancel`."""
        d = self.propose(match, ctx)
        return self.admit(d, ctx) if d.loads else d

    def propose(self, match: PrefixMatch, ctx: AdmissionContext) -> Decision:
        """What :meth:`decide` would answer now, **without side effects**: no slot is taken, no
        half-open probe reserved, no ramp credit spent — so an engine may ask as often as it likes
        (vLLM calls ``get_num_new_matched_tokens`` several times for one request). A load proposal
        has ``load_id=None``; :meth:`admit` takes its slots."""
        if not isinstance(match, PrefixMatch):
            raise ConfigError("match", "must be a kvpolicy.matching.PrefixMatch")
        if not isinstance(ctx, AdmissionContext):
            raise ConfigError("ctx", "must be a kvpolicy.admission.AdmissionContext")
        L = match.local_blocks
        R = match.remote_total_blocks
        no_load: Action = "local_only" if L > 0 else "recompute"
        if R == 0:
            return Decision(no_load, "no_remote_blocks", L, 0, 0, None, None, None, None, {}, source=ctx.source, replica=ctx.replica)
        c95 = self.model.coefficients(0.95, ctx.source)
        c50 = self.model.coefficients(0.5, ctx.source)
        Bt = match.block_size_tokens
        slo = self.slo_s()  # the p95 TTFT target this decision is held to, read once
        best_k, best_s, _, sides = self._best_plan(L, R, Bt, ctx, c95, c50, match.num_prompt_tokens, slo)
        if best_s >= best_k:  # nothing left to load: the plan is to compute it all
            best_s = 0
        best = self._terms(best_k, ctx, best_s, sides)

        def refuse(reason: str) -> Decision:
            return Decision(no_load, reason, L, R, 0, best["t_remote_p50_s"], best["t_remote_p95_s"], best["t_recompute_p50_s"],
                            best["interference_s"], best, source=ctx.source, replica=ctx.replica)

        best["ttft_p95_s"] = sides.ttft(best_k, best_s)  # this request's predicted TTFT under the plan
        best["ttft_slo_s"] = slo
        reason = "wins"
        if best["benefit_s"] <= 0 and slo > 0 and best["ttft_p95_s"] <= slo:
            reason = "within_slo"
        elif best["benefit_s"] <= 0:
            last = self._last_load_s.get(ctx.source)
            probe = self.config.probe_interval_s
            if probe is None or last is None or self.clock.now_s() - last < probe:
                return refuse("slower_than_recompute")
            reason = "probe"  # the model only knows the past: look at the link again
        refusal = self._guard_rails(ctx, best["queue_bytes"])
        if refusal is not None:
            return refuse(refusal)
        cfg = self.config
        return Decision(
            "load", reason, L, R, best_k, best["t_remote_p50_s"], best["t_remote_p95_s"], best["t_recompute_p50_s"], best["interference_s"],
            best, soft_timeout_s=cfg.timeout_factor * best["t_recompute_only_s"], load_id=None, source=ctx.source,
            replica=ctx.replica, load_bytes=best_k * ctx.block_bytes,  # requested (a split plan is cut where compute meets it)
            split_blocks=best_s, queue_bytes=best["queue_bytes"],
            compute_after_s=self._compute_after_s(sides, best_k, best_s, best["t_plan_s"]) if cfg.compute_while_loading else None,
        )

    def wait_limit_s(self, decision: Decision) -> float:
        """Compute while loading: how long after it started a plain load may keep the request waiting for its bytes
        before the GPU starts on the front. ``gpu_s_price`` = 0: its p95 prediction (``t_plan_s``; the fastest — a
        late load turns into a split at once). Otherwise the longest wait that still pays: while the load is ready
        before recompute would have produced the range (``t_recompute_only_s``), waiting saves the range's GPU seconds
        (``gpu_saved_s``) — taken when they are worth, at ``gpu_s_price``, the TTFT the wait may add past the
        prediction (``gpu_s_price × gpu_saved_s ≥ t_recompute_only_s − t_plan_s``). And while the request's TTFT stays
        within the p95 target the decision was held to (``ttft_slo_s``): bytes that arrive δ late add at most δ to it, so
        the wait may run past the prediction by the plan's slack to the target, ``t_plan_s + ttft_slo_s − ttft_p95_s``
        — the same latency a load ``within_slo`` is admitted on, spent to save the range's GPU seconds on the same terms
        (at ``gpu_s_price``). The limit is the later of the two. Never below ``t_plan_s``; a split (it computes from the
        start) gets ``t_plan_s``."""
        if not isinstance(decision, Decision) or not decision.loads or not decision.terms:
            raise ConfigError("decision", "must be a load decision from this controller")
        t = decision.terms
        plan = float(t["t_plan_s"])
        if decision.split_blocks > 0:
            return plan  # a split computes from the start: nothing to wait for
        bound = float(t["t_recompute_only_s"])
        saved = float(t["gpu_saved_s"])
        slo = float(t.get("ttft_slo_s") or 0.0)
        if slo > 0:  # the p95 target's slack: what this request may still spend without touching the target
            bound = max(bound, plan + slo - float(t["ttft_p95_s"]))
        if bound <= plan or saved <= 0 or self.config.gpu_s_price * saved < bound - plan:
            return plan
        return bound

    def keep_waiting(self, decision: Decision, elapsed_s: float, remaining_s: float) -> bool:
        """At a plain load's switch time (``compute_after_s``): wait on for its bytes (True) or start the front now
        (False)? ``remaining_s``: the engine's estimate of the time until the rest arrives at the rates it sees now
        (``inf`` for a load that has stalled). Waits while the load is on course to arrive within
        :meth:`wait_limit_s` — re-planned with what the link shows now, not what was predicted at admission."""
        check_non_negative_number("elapsed_s", elapsed_s)
        if isinstance(remaining_s, bool) or not isinstance(remaining_s, (int, float)) or math.isnan(remaining_s) or remaining_s < 0:
            raise ConfigError("remaining_s", f"must be a number >= 0 (inf: not moving), got {remaining_s!r}")
        return elapsed_s + remaining_s <= self.wait_limit_s(decision)

    @staticmethod
    def _compute_after_s(sides: _Sides, k: int, s: int, t_plan_s: float) -> float:
        """When the GPU should start on the front: a plain load at its p95 prediction (late, it turns into a split);
        a split so that s blocks of front meet the last k − s loaded ones — the front starts no earlier than it
        must, so it computes no more than the plan's s (0 at the meeting point: at once)."""
        if s <= 0:
            return t_plan_s
        return max(sides.remote(k - s) - sides.ctx.queue_wait_s - sides.front(s), 0.0)

    def _guard_rails(self, ctx: AdmissionContext, queued: float) -> str | None:
        """The refusal reason of the first guard rail a load would hit now (pure)."""
        if self.breaker(ctx.source).state == "open":
            return "source_unhealthy"
        cfg = self.config
        cap = cfg.warming_max_loads_per_replica if ctx.warming else cfg.max_loads_per_replica
        if self._replica_loads.get(ctx.replica, 0) + ctx.promised_loads >= cap:
            return "replica_cap"
        if self._source_loads.get(ctx.source, 0) + ctx.promised_loads >= cfg.max_loads_per_source:
            return "source_cap"
        if queued > cfg.max_queue_bytes_per_source:
            return "queue_full"  # the cap bounds the bytes a load would wait behind, never its own size
        return None

    def admit(self, proposal: Decision, ctx: AdmissionContext, load_blocks: int | None = None, *, committed: bool = False) -> Decision:
        """Take the slots of a load :meth:`propose` returned (and that the engine now starts), at most
        ``load_blocks`` of it when the engine trimmed it (vLLM may allocate fewer blocks than asked).
        Guard rails are checked again — another request may have taken the last slot meanwhile — and
        a refusal comes back as a decision that does not load. ``committed``: the engine already counts
        these tokens as loaded (vLLM, once ``get_num_new_matched_tokens`` answered them) — refusing now
        would leave its blocks unfilled or its request waiting for a load that never starts — so the
        load is admitted past any guard rail, with reason ``"committed"`` when one would have refused
        (the ramp and the breaker are not consulted: the decision is no longer theirs). Each admitted
        load is released by :meth:`record` or :meth:`cancel`, exactly once."""
        if not isinstance(proposal, Decision) or not proposal.loads or proposal.load_id is not None:
            raise ConfigError("proposal", "must be a load decision from propose() that was not admitted yet")
        k = proposal.load_blocks if load_blocks is None else load_blocks
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= proposal.load_blocks:
            raise ConfigError("load_blocks", f"must be an int in [0, {proposal.load_blocks}], got {load_blocks!r}")
        if not isinstance(ctx, AdmissionContext):
            raise ConfigError("ctx", "must be a kvpolicy.admission.AdmissionContext")
        if (ctx.source, ctx.replica) != (proposal.source, proposal.replica):
            # the slots are taken on ctx's source and replica and released on the proposal's: they must be one load's
            raise ConfigError("ctx", f"admits a load from {ctx.source!r} to {ctx.replica!r}; the proposal was for "
                                     f"{proposal.source!r} to {proposal.replica!r}")
        no_load: Action = "local_only" if proposal.local_blocks > 0 else "recompute"
        if k == 0:
            return attrs.evolve(proposal, action=no_load, reason="trimmed_to_zero", load_blocks=0, load_bytes=0, split_blocks=0)
        refusal = self._guard_rails(ctx, self.path_queue_bytes(ctx, k * ctx.block_bytes))
        if not committed:
            if refusal is None and self.ramp is not None and not self.ramp.admit():
                refusal = "ramp_share"
            if refusal is None and not self.breaker(ctx.source).allow():
                refusal = "source_unhealthy"
            if refusal is not None:
                return attrs.evolve(proposal, action=no_load, reason=refusal, load_blocks=0, load_bytes=0, split_blocks=0)
        load_id = next(self._ids)
        now = self.clock.now_s()
        self._last_load_s[ctx.source] = now
        load_bytes = k * ctx.block_bytes
        reason = "committed" if committed and refusal is not None else proposal.reason
        d = attrs.evolve(proposal, load_id=load_id, load_blocks=k, load_bytes=load_bytes, split_blocks=min(proposal.split_blocks, k - 1),
                         reason=reason)
        self._inflight[load_id] = d
        self._replica_loads[ctx.replica] = self._replica_loads.get(ctx.replica, 0) + 1
        self._source_loads[ctx.source] = self._source_loads.get(ctx.source, 0) + 1
        ahead = self.queued_bytes(ctx.source)  # before this load joins: what is still draining
        self._source_bytes[ctx.source] = self._source_bytes.get(ctx.source, 0.0) + load_bytes
        self._busy_until[ctx.source] = (now, ahead + load_bytes)
        return d

    # ------------------------------------------------------------------ outcomes

    def _release(self, load_id: int) -> Decision:
        d = self._inflight.pop(load_id, None)
        if d is None:
            raise ConfigError("load_id", f"{load_id} is not an admitted load in flight (already recorded or cancelled?)")
        self._replica_loads[d.replica] -= 1
        self._source_loads[d.source] -= 1
        self._source_bytes[d.source] = max(self._source_bytes[d.source] - d.load_bytes, 0.0)
        if self._source_loads[d.source] == 0:  # nothing of ours left on the link: it has drained
            self._busy_until.pop(d.source, None)
        return d

    def cancel(self, load_id: int) -> None:
        """The engine did not start an admitted load."""
        d = self._release(load_id)
        self.breaker(d.source).release()

    def record(self, outcome: LoadOutcome) -> LoadResult:
        """Feed a load's outcome: releases its slot, updates the breaker and the model."""
        if not isinstance(outcome, LoadOutcome):
            raise ConfigError("outcome", f"must be a LoadOutcome, got {type(outcome).__name__}")
        d = self._inflight.get(outcome.load_id)
        if d is None:
            raise ConfigError("load_id", f"{outcome.load_id} is not an admitted load in flight (already recorded or cancelled?)")
        n = d.load_blocks
        if outcome.ok_blocks > n:  # its status, types and times were checked when it was built (LoadOutcome's validators)
            raise ConfigError("ok_blocks", f"{outcome.ok_blocks!r} outside [0, {n}] for load {outcome.load_id}")
        self._release(outcome.load_id)  # validated first: a bad outcome changes nothing
        breaker = self.breaker(d.source)
        moved = d.load_bytes if outcome.bytes_delivered is None else min(outcome.bytes_delivered, d.load_bytes)
        if outcome.status == "ok":
            breaker.record_success()
            self.model.observe_load(bytes_loaded=moved, n_blocks=outcome.ok_blocks, lookup_s=outcome.lookup_s,
                                    transfer_s=outcome.transfer_s, stage_s=outcome.stage_s, install_s=outcome.install_s, source=d.source,
                                    backlog_bytes=d.queue_bytes)
            if outcome.stall_s is not None:
                self.model.observe_interference(moved, outcome.stall_s)
        elif outcome.status in ("failed", "timeout"):
            breaker.record_failure()
            if outcome.status == "timeout" and outcome.transfer_s is not None:  # a timeout is data: at least this long
                self.model.observe_timeout(bytes_loaded=d.load_bytes, elapsed_s=outcome.transfer_s, source=d.source, backlog_bytes=d.queue_bytes)
        else:
            breaker.release()
        usable = 0 if outcome.status == "incompatible" else outcome.ok_blocks  # partial use: what arrived intact is kept
        if outcome.status != "ok" and self.config.failure_policy == "fail":
            raise RemoteLoadError(f"remote load {outcome.load_id} from {d.source!r} ended with {outcome.status!r} (failure_policy='fail')")
        return LoadResult(usable_blocks=usable, recompute_blocks=n - usable, status=outcome.status)

    def check_timeout(self, load_id: int, elapsed_s: float) -> bool:
        """Has this load overrun its soft timeout (abandon it for recompute)? A NaN elapsed time raises, naming
        ``elapsed_s``: it used to answer "no" for good, so the load was never abandoned."""
        check_non_negative_number("elapsed_s", elapsed_s)
        d = self._inflight.get(load_id)
        if d is None:
            raise ConfigError("load_id", f"{load_id} is not in flight")
        return d.soft_timeout_s is not None and elapsed_s > d.soft_timeout_s
