"""The admission controller: load remote blocks only when that wins.

For a request whose leading ``L`` blocks are local and the next ``R`` are found
remotely, load the first ``k ≤ R`` remote blocks only if

    p95(T_remote(k)) + T_interference(k) < margin × p50(T_recompute(k))

where ``T_recompute(k)`` is dispatch plus prefilling exactly those k blocks after
the L local ones. Among the k that win, the one with the largest margin of
victory is loaded; the rest of the prompt is recomputed (partial loads are
normal). Candidates are ``k ∈ {1, 2, 4, …} ∪ {R}``: the model's benefit is convex
in k (prefill is convex, every remote term linear), so this set is enough to
guarantee that a faster link or a longer shared prefix never turns a load into a
recompute, and a slower link never turns a recompute into a load.

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
from typing import Any, Literal

import attrs

from ..clock import MonotonicClock
from ..errors import ConfigError, RemoteLoadError
from ..matching import PrefixMatch
from ..protocols import Clock
from .breaker import CircuitBreaker
from .model import LatencyModel
from .ramp import RampController

Action = Literal["local_only", "load", "recompute"]
FailurePolicy = Literal["recompute", "fail"]
REASONS = ("wins", "probe", "no_remote_blocks", "slower_than_recompute", "source_unhealthy", "replica_cap", "source_cap", "queue_full", "ramp_share")


def _pos_int(inst: Any, a: attrs.Attribute, v: Any) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ConfigError(a.name, f"must be a positive int, got {v!r}")


@attrs.frozen
class AdmissionConfig:
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

    def __attrs_post_init__(self) -> None:
        if not 0 < self.margin <= 1.5:
            raise ConfigError("margin", f"must be in (0, 1.5], got {self.margin}")
        if not self.max_queue_bytes_per_source > 0:
            raise ConfigError("max_queue_bytes_per_source", "must be positive")
        if not self.timeout_factor > 0:
            raise ConfigError("timeout_factor", "must be positive")
        if self.probe_interval_s is not None and not self.probe_interval_s > 0:
            raise ConfigError("probe_interval_s", f"must be positive or None, got {self.probe_interval_s}")
        if self.failure_policy not in ("recompute", "fail"):
            raise ConfigError("failure_policy", f"must be 'recompute' or 'fail', got {self.failure_policy!r}")


@attrs.frozen
class AdmissionContext:
    block_bytes: int
    replica: str = "replica-0"
    source: str = "pool"
    active_decodes: int = 0
    warming: bool = False
    request_class: str = "default"

    def __attrs_post_init__(self) -> None:
        if isinstance(self.block_bytes, bool) or not isinstance(self.block_bytes, int) or self.block_bytes <= 0:
            raise ConfigError("block_bytes", f"must be a positive int, got {self.block_bytes!r}")
        if self.active_decodes < 0:
            raise ConfigError("active_decodes", "must be non-negative")


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

    @property
    def loads(self) -> bool:
        return self.action == "load"


@attrs.frozen
class LoadOutcome:
    """What happened to a load the controller admitted (times in seconds)."""

    load_id: int
    status: Literal["ok", "failed", "timeout", "incompatible"]
    ok_blocks: int  # leading blocks loaded and installed intact
    lookup_s: float | None = None
    transfer_s: float | None = None
    stage_s: float | None = None
    install_s: float | None = None
    stall_s: float | None = None  # observed interference, if the engine measures it


@attrs.frozen
class LoadResult:
    usable_blocks: int  # leading remote blocks that may be used; everything after is recomputed
    recompute_blocks: int
    status: str


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
        self._busy_until: dict[str, float] = {}
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
        busy = self._busy_until.get(source)
        s_per_byte = self.model.coefficients(0.5).s_per_byte
        if busy is None or s_per_byte <= 0:
            return inflight
        return min(max(busy - self.clock.now_s(), 0.0) / s_per_byte, inflight)

    # ------------------------------------------------------------------ decide

    def evaluate(self, local_blocks: int, remote_blocks: int, k: int, block_size_tokens: int, ctx: AdmissionContext) -> dict[str, float]:
        """Every predicted term for loading k of the remote blocks (no side effects)."""
        load_bytes = k * ctx.block_bytes
        queue = self.queued_bytes(ctx.source)
        start = local_blocks * block_size_tokens
        end = start + k * block_size_tokens
        out: dict[str, float] = {}
        for tag, c in (("p95", self.model.coefficients(0.95)), ("p50", self.model.coefficients(0.5))):
            out[f"lookup_{tag}_s"] = c.lookup_s
            out[f"queue_{tag}_s"] = queue * c.s_per_byte
            out[f"transfer_{tag}_s"] = c.transfer_overhead_s + c.s_per_byte * load_bytes if load_bytes > 0 else 0.0
            out[f"stage_{tag}_s"] = c.stage_s_per_byte * load_bytes
            out[f"install_{tag}_s"] = c.install_s_per_block * k
            out[f"t_remote_{tag}_s"] = c.remote(load_bytes, k, queue)
        c50 = self.model.coefficients(0.5)
        out["dispatch_p50_s"] = c50.dispatch_s
        out["prefill_p50_s"] = c50.recompute(start, end) - c50.dispatch_s
        out["t_recompute_p50_s"] = c50.recompute(start, end)
        out["interference_s"] = c50.interference_s_per_byte * load_bytes * (1 + max(ctx.active_decodes, 0))
        out["b_eff_p50_bytes_per_s"] = 1.0 / c50.s_per_byte if c50.s_per_byte > 0 else float("inf")
        out["benefit_s"] = self.config.margin * out["t_recompute_p50_s"] - out["t_remote_p95_s"] - out["interference_s"]
        return out

    def decide(self, match: PrefixMatch, ctx: AdmissionContext) -> Decision:
        if not isinstance(match, PrefixMatch):
            raise ConfigError("match", "must be a kvpolicy.matching.PrefixMatch")
        L = match.local_blocks
        R = match.remote_total_blocks
        no_load: Action = "local_only" if L > 0 else "recompute"
        if R == 0:
            return Decision(no_load, "no_remote_blocks", L, 0, 0, None, None, None, None, {}, source=ctx.source, replica=ctx.replica)
        # benefit(k) in closed form from cached coefficients; full terms for the winner only
        c95 = self.model.coefficients(0.95)
        c50 = self.model.coefficients(0.5)
        queue = self.queued_bytes(ctx.source)
        Bt = match.block_size_tokens
        start = L * Bt
        margin = self.config.margin
        spread = 1 + max(ctx.active_decodes, 0)
        best_k, best_benefit = 1, -float("inf")
        k = 1
        while True:
            kk = min(k, R)
            S = kk * ctx.block_bytes
            benefit = margin * c50.recompute(start, start + kk * Bt) - c95.remote(S, kk, queue) - c50.interference_s_per_byte * S * spread
            if benefit > best_benefit:
                best_k, best_benefit = kk, benefit
            if kk == R:
                break
            k *= 2
        best = self.evaluate(L, R, best_k, Bt, ctx)

        def refuse(reason: str) -> Decision:
            return Decision(no_load, reason, L, R, 0, best["t_remote_p50_s"], best["t_remote_p95_s"], best["t_recompute_p50_s"],
                            best["interference_s"], best, source=ctx.source, replica=ctx.replica)

        reason = "wins"
        if best["benefit_s"] <= 0:
            last = self._last_load_s.get(ctx.source)
            probe = self.config.probe_interval_s
            if probe is None or last is None or self.clock.now_s() - last < probe:
                return refuse("slower_than_recompute")
            reason = "probe"  # the model only knows the past: look at the link again
        breaker = self.breaker(ctx.source)
        if breaker.state == "open":
            return refuse("source_unhealthy")
        cfg = self.config
        cap = cfg.warming_max_loads_per_replica if ctx.warming else cfg.max_loads_per_replica
        if self._replica_loads.get(ctx.replica, 0) >= cap:
            return refuse("replica_cap")
        if self._source_loads.get(ctx.source, 0) >= cfg.max_loads_per_source:
            return refuse("source_cap")
        load_bytes = best_k * ctx.block_bytes
        queued = self.queued_bytes(ctx.source)
        if queued > 0 and queued + load_bytes > cfg.max_queue_bytes_per_source:
            return refuse("queue_full")  # an idle source always takes one load, however large: the cap bounds waiting, not size
        if self.ramp is not None and not self.ramp.admit():
            return refuse("ramp_share")
        if not breaker.allow():
            return refuse("source_unhealthy")
        load_id = next(self._ids)
        self._last_load_s[ctx.source] = self.clock.now_s()
        d = Decision(
            "load", reason, L, R, best_k, best["t_remote_p50_s"], best["t_remote_p95_s"], best["t_recompute_p50_s"], best["interference_s"],
            best, soft_timeout_s=cfg.timeout_factor * best["t_recompute_p50_s"], load_id=load_id, source=ctx.source,
            replica=ctx.replica, load_bytes=load_bytes,
        )
        self._inflight[load_id] = d
        self._replica_loads[ctx.replica] = self._replica_loads.get(ctx.replica, 0) + 1
        self._source_loads[ctx.source] = self._source_loads.get(ctx.source, 0) + 1
        self._source_bytes[ctx.source] = self._source_bytes.get(ctx.source, 0.0) + load_bytes
        now = self.clock.now_s()
        self._busy_until[ctx.source] = max(self._busy_until.get(ctx.source, now), now) + load_bytes * c50.s_per_byte
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
        d = self._release(outcome.load_id)
        if not 0 <= outcome.ok_blocks <= d.load_blocks:
            raise ConfigError("ok_blocks", f"{outcome.ok_blocks} outside [0, {d.load_blocks}] for load {outcome.load_id}")
        breaker = self.breaker(d.source)
        if outcome.status == "ok":
            breaker.record_success()
            self.model.observe_load(bytes_loaded=d.load_bytes, n_blocks=d.load_blocks, lookup_s=outcome.lookup_s,
                                    transfer_s=outcome.transfer_s, stage_s=outcome.stage_s, install_s=outcome.install_s)
            if outcome.stall_s is not None:
                self.model.observe_interference(d.load_bytes, outcome.stall_s)
            usable = outcome.ok_blocks
        elif outcome.status in ("failed", "timeout"):
            breaker.record_failure()
            usable = 0 if outcome.status == "timeout" else outcome.ok_blocks
        elif outcome.status == "incompatible":
            breaker.release()
            usable = 0
        else:
            raise ConfigError("status", f"unknown load status {outcome.status!r}")
        if outcome.status != "ok" and self.config.failure_policy == "fail":
            raise RemoteLoadError(f"remote load {outcome.load_id} from {d.source!r} ended with {outcome.status!r} (failure_policy='fail')")
        return LoadResult(usable_blocks=usable, recompute_blocks=d.load_blocks - usable, status=outcome.status)

    def check_timeout(self, load_id: int, elapsed_s: float) -> bool:
        """Has this load overrun its soft timeout (abandon it for recompute)?"""
        d = self._inflight.get(load_id)
        if d is None:
            raise ConfigError("load_id", f"{load_id} is not in flight")
        return d.soft_timeout_s is not None and elapsed_s > d.soft_timeout_s
