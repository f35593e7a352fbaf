"""The latency model: every term of the brief's inequality, as distributions.

    T_remote    = T_lookup + T_queue + S_load / B_eff + T_stage + T_install
    T_recompute = T_dispatch + T_prefill(T_useful)

Each term starts from a **prior** (configuration and the measured profile) and
is corrected **online** from observed outcomes. Quantiles come from mergeable
log histograms (:class:`~kvpolicy.admission.histogram.LogHistogram`); a term uses
its observations once it has ``min_samples`` of them, the prior before that.

* Transfer: ``T_xfer(S) = α_q + β_q · S`` per quantile q, fitted (non-negative
  least squares) over per-size-bucket histograms of observed transfer times —
  ``1/β`` is the useful bandwidth B_eff under the contention the transfers saw,
  α the per-transfer overhead. Linear in S, so the controller's benefit is convex
  in the number of blocks loaded.
* Queue: ``T_queue = β_q × Q(S)``, Q the bytes ahead of a load of S bytes on its
  path — every byte in that direction on the source's egress and the receiving
  NIC, reads and writes from every replica, as the transport reports it:
  ``Q(S) = backlog + Σ_i min(r_i, S)`` over the flows r_i sharing the bottleneck
  fairly (exact for processor sharing: each competing flow delays S by at most
  its own remaining bytes). Transfers are fitted on ``S + Q``, so B_eff is the
  link's rate, not the contention it happened to see.
* Per source: a source with enough observations of its own (a quarter of
  ``min_samples``, at least 3) uses its own fit — a degraded node is slow, not
  the whole pool; the others use the pool-wide one.
* A timeout is data: a load that timed out after ``e`` seconds is a sample of at
  least ``e``. It is recorded, and it raises that source's p95 at once: a floor
  ``β ≥ (e − α)/(S + Q)`` that holds until a faster load on that source is
  observed or ``window_s`` passes.
* Stage (copy through CPU memory when the path is not direct): ``β_stage · S``,
  a second leg with its own prior and observations.
* Install: per block. Dispatch: per request.
* Prefill: the profile's fitted model, as the marginal cost of the loaded
  stretch [L, L + k blocks) after L cached blocks (``PrefillModel.marginal_s``:
  ``T_prefill(L + k) − T_prefill(L)`` with the causal cross term; the fit's fixed
  per-request term is paid either way), scaled by the observed ratio of
  measured to predicted prefill (its p50 for p50).
* Interference: seconds stolen from active requests per byte moved, scaled by the
  active decodes on the receiving replica: ``s_per_byte × S × (1 + active_decodes)``
  by default — never zero by assumption; an engine feeds observed stalls with
  :meth:`LatencyModel.observe_interference`.

Sums of per-term quantiles bound the quantile of the sum from above (for
comonotone terms they are equal), so ``p95(T_remote)`` here is conservative.
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import numpy as np

from .._validate import check_count as _count
from .._validate import check_real as _measured
from .._validate import non_negative_number as _nonneg
from .._validate import positive_number as _pos
from ..errors import ConfigError
from ..profile import PrefillModel
from .histogram import LogHistogram, WindowedHistogram



@attrs.frozen
class LinkPrior:
    """What the deployment believes before measuring (all seconds, bytes)."""

    bandwidth_bytes_per_s: float = attrs.field(validator=_pos)
    lookup_s: float = attrs.field(default=0.0005, validator=_nonneg)
    transfer_overhead_s: float = attrs.field(default=0.0002, validator=_nonneg)
    stage_bytes_per_s: float | None = attrs.field(default=None)  # None: direct path, no staging leg
    install_s_per_block: float = attrs.field(default=0.00002, validator=_nonneg)
    dispatch_s: float = attrs.field(default=0.002, validator=_nonneg)
    interference_s_per_byte: float = attrs.field(default=0.5e-3 / 1e9, validator=_nonneg)  # 0.5 ms per GB
    #: spread of the prior: p95 = p50 × this until observations exist
    prior_p95_factor: float = attrs.field(default=1.5, validator=_pos)

    def __attrs_post_init__(self) -> None:
        if self.stage_bytes_per_s is not None:
            _pos(self, attrs.fields(LinkPrior).stage_bytes_per_s, self.stage_bytes_per_s)


class _Term:
    """A scalar term: prior until ``min_samples`` observations, then its histogram."""

    def __init__(self, prior_s: float, p95_factor: float, min_samples: int, hist: Any = None) -> None:
        self.prior_s = prior_s
        self.p95_factor = p95_factor
        self.min_samples = min_samples
        self.hist = hist if hist is not None else LogHistogram()

    def q(self, q: float) -> float:
        if self.hist.count >= self.min_samples:
            v = self.hist.quantile(q)
            assert v is not None
            return v
        return self.prior_s * (self.p95_factor if q > 0.5 else 1.0)


class TransferModel:
    """``T_xfer(S) = α_q + β_q · S`` fitted over per-size-bucket histograms."""

    def __init__(self, prior: LinkPrior, min_samples: int, make_hist: Any = LogHistogram) -> None:
        self.prior = prior
        self.min_samples = min_samples
        self._make = make_hist
        self.buckets: dict[int, tuple[Any, Any]] = {}  # log2 size → (times, sizes)
        self._fit: dict[float, tuple[tuple[int, ...], tuple[float, float]]] = {}
        # the last fit per quantile by the points it was fitted to: a new observation that moves no bucket's quantile
        # (most of them: the quantiles are bucketed) refits nothing
        self._by_points: dict[float, tuple[list[tuple[Any, Any]], tuple[float, float]]] = {}

    def observe(self, size_bytes: float, seconds: float) -> None:
        """One transfer of ``size_bytes`` (its own bytes plus the backlog ahead of it) in ``seconds``."""
        if not size_bytes > 0 or not math.isfinite(size_bytes):
            return
        if not seconds >= 0 or not math.isfinite(seconds):
            raise ConfigError("transfer_s", f"must be finite and >= 0, got {seconds!r}")
        b = int(math.log2(size_bytes))
        if b not in self.buckets:
            self.buckets[b] = (self._make(), self._make())
        times, sizes = self.buckets[b]
        times.record(seconds)
        sizes.record(size_bytes)
        self._fit.clear()

    def coefficients(self, q: float) -> tuple[float, float]:
        """(α_q seconds, β_q seconds per byte)."""
        sig = tuple(t.count for t, _ in self.buckets.values())  # windowed histograms age: a stale fit must not outlive its data
        hit = self._fit.get(q)
        if hit is not None and hit[0] == sig:
            return hit[1]
        pts = [(s.quantile(0.5), t.quantile(q)) for t, s in self.buckets.values() if t.count >= self.min_samples]
        last = self._by_points.get(q)
        if last is not None and last[0] == pts:
            self._fit[q] = (sig, last[1])
            return last[1]
        factor = self.prior.prior_p95_factor if q > 0.5 else 1.0
        alpha0 = self.prior.transfer_overhead_s * factor
        beta0 = factor / self.prior.bandwidth_bytes_per_s
        if not pts:
            fit = (alpha0, beta0)
        elif len(pts) == 1:
            size, t = pts[0]
            assert size is not None and t is not None
            beta = max(t - alpha0, 0.0) / size if size > 0 else beta0
            fit = (alpha0 if beta > 0 else t, beta)
        else:
            x = np.asarray([p[0] for p in pts], dtype=np.float64)
            y = np.asarray([p[1] for p in pts], dtype=np.float64)
            fit = _nnls_line(x, y)
        self._fit[q] = (sig, fit)
        self._by_points[q] = (pts, fit)
        return fit

    def seconds(self, size_bytes: float, q: float) -> float:
        a, b = self.coefficients(q)
        return a + b * size_bytes if size_bytes > 0 else 0.0

    def fitted(self) -> bool:
        """Has some size bucket enough observations to replace the prior?"""
        return any(t.count >= self.min_samples for t, _ in self.buckets.values())

    def bandwidth_bytes_per_s(self, q: float = 0.5) -> float:
        _, b = self.coefficients(q)
        return 1.0 / b if b > 0 else math.inf


def _nnls_line(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Least squares y ≈ a + b x with a, b ≥ 0, relative error weighting."""
    w = 1.0 / np.maximum(y, 1e-12)
    # the weighted design once: a column of it is the same product whichever columns a fit takes
    A2 = np.stack([np.ones_like(x), x], axis=1) * w[:, None]
    ones = np.ones_like(y)
    lstsq = np.linalg.lstsq
    best = None
    for cols in ((0, 1), (1,), (0,)):
        coef = lstsq(A2 if len(cols) == 2 else A2[:, cols], ones, rcond=None)[0]
        if (coef < 0).any():
            continue
        a = float(coef[0]) if cols[0] == 0 else 0.0
        b = float(coef[-1]) if cols[-1] == 1 else 0.0
        sse = float(np.sum(((a + b * x) * w - 1) ** 2))
        if best is None or sse < best[0]:
            best = (sse, a, b)
    assert best is not None
    return best[1], best[2]


@attrs.frozen
class Coefficients:
    """Every term of the model at one quantile, as plain floats (seconds, bytes)."""

    lookup_s: float
    transfer_overhead_s: float
    s_per_byte: float  # 1 / B_eff
    stage_s_per_byte: float
    install_s_per_block: float
    dispatch_s: float
    prefill_ratio: float
    prefill_b_s_per_token: float
    prefill_c_s_per_token2: float
    #: seconds per (new token × cached token): the profile's cross term (2c unless measured)
    prefill_cross_s_per_token2: float
    interference_s_per_byte: float

    def remote(self, load_bytes: float, n_blocks: int, queue_bytes: float) -> float:
        xfer = self.transfer_overhead_s + self.s_per_byte * load_bytes if load_bytes > 0 else 0.0
        return self.lookup_s + queue_bytes * self.s_per_byte + xfer + self.stage_s_per_byte * load_bytes + self.install_s_per_block * n_blocks

    def recompute(self, start_tokens: int, end_tokens: int) -> float:
        q = end_tokens - start_tokens
        marginal = self.prefill_b_s_per_token * q + self.prefill_c_s_per_token2 * q * q + self.prefill_cross_s_per_token2 * q * start_tokens
        return self.dispatch_s + self.prefill_ratio * max(marginal, 0.0)


class LatencyModel:
    """Priors + online corrections for every term; quantiles on demand."""

    def __init__(self, prior: LinkPrior, prefill: PrefillModel, *, min_samples: int = 20, window_s: float | None = 300.0,
                 clock: Any = None) -> None:
        if not isinstance(prior, LinkPrior):
            raise ConfigError("prior", "must be a LinkPrior")
        if not isinstance(prefill, PrefillModel):
            raise ConfigError("prefill", "must be a PrefillModel (e.g. MeasuredProfile.prefill_model())")
        if window_s is not None and (isinstance(window_s, bool) or not isinstance(window_s, (int, float)) or not window_s > 0):
            raise ConfigError("window_s", f"must be a positive number of seconds or None, got {window_s!r}")
        self.prior = prior
        self.prefill = prefill
        self.window_s = window_s
        #: the controller that owns this model lends it its clock unless one is given here
        self.clock = clock
        f = prior.prior_p95_factor

        def make() -> Any:
            return LogHistogram() if window_s is None else WindowedHistogram(window_s, self._now)

        self.lookup = _Term(prior.lookup_s, f, min_samples, make())
        self.install_per_block = _Term(prior.install_s_per_block, f, min_samples, make())
        self.dispatch = _Term(prior.dispatch_s, f, min_samples, make())
        self.stage_per_byte = _Term(1.0 / prior.stage_bytes_per_s if prior.stage_bytes_per_s else 0.0, f, min_samples, make())
        self.prefill_ratio = _Term(1.0, 1.0, min_samples, make())
        self.interference_per_byte = _Term(prior.interference_s_per_byte, 1.0, min_samples, make())
        self._make = make
        self.min_samples = min_samples
        self.transfer = TransferModel(prior, min_samples, make)
        #: per-source transfer fits (used once a source has enough observations of its own)
        self.source_transfer: dict[str, TransferModel] = {}
        #: per-source p95 floors from timeouts: (recorded at s, seconds per byte)
        self.timeout_floors: dict[str, list[tuple[float, float]]] = {}
        self.version = 0
        self._snap: dict[tuple[float, str | None], tuple[Any, Coefficients]] = {}

    def _now(self) -> float:
        if self.clock is None:
            import time

            return time.monotonic()
        return float(self.clock.now_s())

    def _epoch(self) -> int:
        return -1 if self.window_s is None else int(self._now() // self.window_s)

    def transfer_for(self, source: str | None) -> TransferModel:
        """The source's own fit once it has enough observations, else the global one."""
        if source is not None:
            m = self.source_transfer.get(source)
            if m is not None and m.fitted():
                return m
        return self.transfer

    def _floor(self, source: str | None) -> float:
        floors = self.timeout_floors.get(source) if source is not None else None
        if not floors:
            return 0.0
        horizon = self.window_s if self.window_s is not None else 300.0
        now = self._now()
        floors[:] = [f for f in floors if now - f[0] <= horizon]
        return max((b for _, b in floors), default=0.0)

    def coefficients(self, q: float, source: str | None = None) -> Coefficients:
        """All terms at quantile q, for loads from ``source`` (cached until the next
        observation or window rotation)."""
        key = (self.version, self._epoch())
        hit = self._snap.get((q, source))
        if hit is not None and hit[0] == key:
            return hit[1]
        alpha, beta = self.transfer_for(source).coefficients(q)
        if q > 0.5:
            beta = max(beta, self._floor(source))
        c = Coefficients(
            lookup_s=self.lookup.q(q), transfer_overhead_s=alpha, s_per_byte=beta, stage_s_per_byte=self.stage_per_byte.q(q),
            install_s_per_block=self.install_per_block.q(q), dispatch_s=self.dispatch.q(q), prefill_ratio=self.prefill_ratio.q(q),
            prefill_b_s_per_token=self.prefill.b_s_per_token, prefill_c_s_per_token2=self.prefill.c_s_per_token2,
            interference_s_per_byte=self.interference_per_byte.q(0.5), prefill_cross_s_per_token2=self.prefill.cross,
        )
        self._snap[(q, source)] = (key, c)
        return c

    # ---------------------------------------------------------------- observe

    def _source_model(self, source: str) -> TransferModel:
        m = self.source_transfer.get(source)
        if m is None:
            # a source's own fit takes over after a quarter of the samples the pool-wide fit needs: one bad
            # source must not hold every other source on the (polluted) pool-wide fit for long
            m = self.source_transfer[source] = TransferModel(self.prior, max(self.min_samples // 4, 3), self._make)
        return m

    def observe_load(self, *, bytes_loaded: float, n_blocks: int, lookup_s: float | None = None, transfer_s: float | None = None,
                     stage_s: float | None = None, install_s: float | None = None, source: str | None = None,
                     backlog_bytes: float = 0.0) -> None:
        """Feed one completed remote load's measured components (``backlog_bytes``: the
        bytes ahead of it on its path when it started, see :meth:`path_queue_bytes`; a negative backlog counts as none).
        Every argument is checked before anything is learned: a bad one raises a ConfigError naming it."""
        _measured("bytes_loaded", bytes_loaded)
        _count("n_blocks", n_blocks)
        for name, v in (("lookup_s", lookup_s), ("transfer_s", transfer_s), ("stage_s", stage_s), ("install_s", install_s)):
            if v is not None:
                _measured(name, v)
        _measured("backlog_bytes", backlog_bytes, negative_ok=True)
        self.version += 1
        if lookup_s is not None:
            self.lookup.hist.record(lookup_s)
        if transfer_s is not None and bytes_loaded > 0:
            x = bytes_loaded + max(backlog_bytes, 0.0)
            self.transfer.observe(x, transfer_s)
            if source is not None:
                self._source_model(source).observe(x, transfer_s)
                floors = self.timeout_floors.get(source)
                if floors:  # a load faster than a floor proves the link is no longer that slow
                    seen = max(transfer_s - self.prior.transfer_overhead_s, 0.0) / x
                    floors[:] = [f for f in floors if f[1] <= seen]
        if stage_s is not None and bytes_loaded > 0:
            self.stage_per_byte.hist.record(stage_s / bytes_loaded)
        if install_s is not None and n_blocks > 0:
            self.install_per_block.hist.record(install_s / n_blocks)

    def observe_timeout(self, *, bytes_loaded: float, elapsed_s: float, source: str | None = None, backlog_bytes: float = 0.0) -> None:
        """A load that had not finished after ``elapsed_s``: a sample of at least that long.

        Recorded as a transfer of ``elapsed_s`` (a lower bound, so the fit moves
        towards the truth), and, for its source, an immediate p95 floor of
        ``(elapsed − α)/(S + Q)`` seconds per byte — a run of timeouts can never
        leave the model believing "fast"."""
        _measured("elapsed_s", elapsed_s)
        _measured("bytes_loaded", bytes_loaded)
        _measured("backlog_bytes", backlog_bytes, negative_ok=True)
        if not bytes_loaded > 0:
            return
        self.version += 1
        x = bytes_loaded + max(backlog_bytes, 0.0)
        self.transfer.observe(x, elapsed_s)
        if source is not None:
            self._source_model(source).observe(x, elapsed_s)
            beta = max(elapsed_s - self.prior.transfer_overhead_s, 0.0) / x
            if beta > 0:
                self.timeout_floors.setdefault(source, []).append((self._now(), beta))

    def observe_prefill(self, tokens_before: int, tokens_computed: int, seconds: float, dispatch_s: float | None = None) -> None:
        """Feed a measured prefill of ``tokens_computed`` tokens after ``tokens_before`` cached ones (a prefill of
        0 seconds teaches nothing and is left out)."""
        _count("tokens_before", tokens_before)
        _count("tokens_computed", tokens_computed)
        _measured("seconds", seconds)
        if dispatch_s is not None:
            _measured("dispatch_s", dispatch_s)
        self.version += 1
        predicted = self.prefill_seconds(tokens_before, tokens_before + tokens_computed)
        if predicted > 0 and seconds > 0:
            self.prefill_ratio.hist.record(seconds / predicted)
        if dispatch_s is not None:
            self.dispatch.hist.record(dispatch_s)

    def observe_prefill_batch(self, predicted_s: float, seconds: float) -> None:
        """Feed a forward pass that prefilled several chunks together: ``predicted_s`` is the sum of
        :meth:`prefill_seconds` over its chunks, ``seconds`` what their prefill took (the step's fixed part
        left out: :class:`~kvpolicy.admission.steps.StepTimer`; a pass of 0 seconds or less after that is left out)."""
        _measured("predicted_s", predicted_s)
        _measured("seconds", seconds, negative_ok=True)
        self.version += 1
        if predicted_s > 0 and seconds > 0:
            self.prefill_ratio.hist.record(seconds / predicted_s)

    def observe_interference(self, bytes_moved: float, stall_s: float, active_decodes: int = 0) -> None:
        """Feed an observed stall of active requests attributed to a load of ``bytes_moved``."""
        _measured("bytes_moved", bytes_moved)
        _measured("stall_s", stall_s)
        _count("active_decodes", active_decodes)
        self.version += 1
        if bytes_moved > 0:
            self.interference_per_byte.hist.record(stall_s / bytes_moved / (1 + max(active_decodes, 0)))

    # ---------------------------------------------------------------- predict

    def prefill_seconds(self, start_tokens: int, end_tokens: int) -> float:
        """Marginal model seconds to prefill tokens [start, end) given [0, start) cached.

        :meth:`PrefillModel.marginal_s` — ``T_prefill(end) − T_prefill(start)`` when the cross
        term is the causal one: the fit's fixed per-request term is left out, because it is
        paid whether or not the prefix is loaded (the tail and the last token are always
        prefilled).
        """
        if end_tokens <= start_tokens:
            return 0.0
        return max(float(self.prefill.marginal_s(start_tokens, end_tokens)), 0.0)

    def t_remote(self, load_bytes: float, n_blocks: int, queue_bytes: float, q: float, source: str | None = None) -> dict[str, float]:
        c = self.coefficients(q, source)
        return {
            "lookup_s": self.lookup.q(q),
            "queue_s": queue_bytes * c.s_per_byte,
            "transfer_s": c.transfer_overhead_s + c.s_per_byte * load_bytes if load_bytes > 0 else 0.0,
            "stage_s": self.stage_per_byte.q(q) * load_bytes,
            "install_s": self.install_per_block.q(q) * n_blocks,
        }

    def t_recompute(self, start_tokens: int, end_tokens: int, q: float) -> dict[str, float]:
        return {
            "dispatch_s": self.dispatch.q(q),
            "prefill_s": self.prefill_seconds(start_tokens, end_tokens) * self.prefill_ratio.q(q),
        }

    @staticmethod
    def path_queue_bytes(size_bytes: float, backlog_bytes: float | None, flows_bytes: Any) -> float:
        """Bytes ahead of a transfer of ``size_bytes`` on its path: a FIFO backlog plus, for
        each flow sharing the bottleneck fairly, at most that flow's remaining bytes."""
        q = backlog_bytes or 0.0
        for r in flows_bytes:
            q += r if r < size_bytes else size_bytes
        return q

    def t_interference(self, load_bytes: float, active_decodes: int) -> float:
        return self.interference_per_byte.q(0.5) * load_bytes * (1 + max(active_decodes, 0))
