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
* Queue: ``T_queue = bytes in flight ahead on the same source × β_q``.
* Stage (copy through CPU memory when the path is not direct): ``β_stage · S``,
  a second leg with its own prior and observations.
* Install: per block. Dispatch: per request.
* Prefill: the profile's fitted ``T_prefill(T)``, as the marginal cost of the
  loaded stretch ``T_prefill(L + k blocks) − T_prefill(L blocks)`` (the fit's
  fixed per-request term is paid either way), scaled by the observed ratio of
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
        self._fit: dict[float, tuple[float, float]] = {}

    def observe(self, size_bytes: float, seconds: float) -> None:
        if size_bytes <= 0:
            return
        b = int(math.log2(size_bytes))
        if b not in self.buckets:
            self.buckets[b] = (self._make(), self._make())
        times, sizes = self.buckets[b]
        times.record(seconds)
        sizes.record(size_bytes)
        self._fit.clear()

    def coefficients(self, q: float) -> tuple[float, float]:
        """(α_q seconds, β_q seconds per byte)."""
        fit = self._fit.get(q)
        if fit is not None:
            return fit
        pts = [(s.quantile(0.5), t.quantile(q)) for t, s in self.buckets.values() if t.count >= self.min_samples]
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
        self._fit[q] = fit
        return fit

    def seconds(self, size_bytes: float, q: float) -> float:
        a, b = self.coefficients(q)
        return a + b * size_bytes if size_bytes > 0 else 0.0

    def bandwidth_bytes_per_s(self, q: float = 0.5) -> float:
        _, b = self.coefficients(q)
        return 1.0 / b if b > 0 else math.inf


def _nnls_line(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Least squares y ≈ a + b x with a, b ≥ 0, relative error weighting."""
    w = 1.0 / np.maximum(y, 1e-12)
    best = None
    for cols in ((0, 1), (1,), (0,)):
        A = np.stack([np.ones_like(x), x], axis=1)[:, cols] * w[:, None]
        coef, *_ = np.linalg.lstsq(A, np.ones_like(y), rcond=None)
        if np.any(coef < 0):
            continue
        full = np.zeros(2)
        full[list(cols)] = coef
        sse = float(np.sum(((full[0] + full[1] * x) * w - 1) ** 2))
        if best is None or sse < best[0]:
            best = (sse, full)
    assert best is not None
    return float(best[1][0]), float(best[1][1])


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
    interference_s_per_byte: float

    def remote(self, load_bytes: float, n_blocks: int, queue_bytes: float) -> float:
        xfer = self.transfer_overhead_s + self.s_per_byte * load_bytes if load_bytes > 0 else 0.0
        return self.lookup_s + queue_bytes * self.s_per_byte + xfer + self.stage_s_per_byte * load_bytes + self.install_s_per_block * n_blocks

    def recompute(self, start_tokens: int, end_tokens: int) -> float:
        marginal = self.prefill_b_s_per_token * (end_tokens - start_tokens) + self.prefill_c_s_per_token2 * (end_tokens * end_tokens - start_tokens * start_tokens)
        return self.dispatch_s + self.prefill_ratio * max(marginal, 0.0)


class LatencyModel:
    """Priors + online corrections for every term; quantiles on demand."""

    def __init__(self, prior: LinkPrior, prefill: PrefillModel, *, min_samples: int = 20, window_s: float | None = 300.0,
                 clock: Any = None) -> None:
        if not isinstance(prior, LinkPrior):
            raise ConfigError("prior", "must be a LinkPrior")
        if not isinstance(prefill, PrefillModel):
            raise ConfigError("prefill", "must be a PrefillModel (e.g. MeasuredProfile.prefill_model())")
        if window_s is not None and not window_s > 0:
            raise ConfigError("window_s", f"must be positive or None, got {window_s}")
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
        self.transfer = TransferModel(prior, min_samples, make)
        self.version = 0
        self._snap: dict[float, tuple[Any, Coefficients]] = {}

    def _now(self) -> float:
        if self.clock is None:
            import time

            return time.monotonic()
        return float(self.clock.now_s())

    def _epoch(self) -> int:
        return -1 if self.window_s is None else int(self._now() // self.window_s)

    def coefficients(self, q: float) -> Coefficients:
        """All terms at quantile q (cached until the next observation or window rotation)."""
        key = (self.version, self._epoch())
        hit = self._snap.get(q)
        if hit is not None and hit[0] == key:
            return hit[1]
        alpha, beta = self.transfer.coefficients(q)
        c = Coefficients(
            lookup_s=self.lookup.q(q), transfer_overhead_s=alpha, s_per_byte=beta, stage_s_per_byte=self.stage_per_byte.q(q),
            install_s_per_block=self.install_per_block.q(q), dispatch_s=self.dispatch.q(q), prefill_ratio=self.prefill_ratio.q(q),
            prefill_b_s_per_token=self.prefill.b_s_per_token, prefill_c_s_per_token2=self.prefill.c_s_per_token2,
            interference_s_per_byte=self.interference_per_byte.q(0.5),
        )
        self._snap[q] = (key, c)  # type: ignore[assignment]
        return c

    # ---------------------------------------------------------------- observe

    def observe_load(self, *, bytes_loaded: float, n_blocks: int, lookup_s: float | None = None, transfer_s: float | None = None,
                     stage_s: float | None = None, install_s: float | None = None) -> None:
        """Feed one completed remote load's measured components."""
        self.version += 1
        if lookup_s is not None:
            self.lookup.hist.record(lookup_s)
        if transfer_s is not None and bytes_loaded > 0:
            self.transfer.observe(bytes_loaded, transfer_s)
        if stage_s is not None and bytes_loaded > 0:
            self.stage_per_byte.hist.record(stage_s / bytes_loaded)
        if install_s is not None and n_blocks > 0:
            self.install_per_block.hist.record(install_s / n_blocks)

    def observe_prefill(self, tokens_before: int, tokens_computed: int, seconds: float, dispatch_s: float | None = None) -> None:
        """Feed a measured prefill of ``tokens_computed`` tokens after ``tokens_before`` cached ones."""
        self.version += 1
        predicted = self.prefill_seconds(tokens_before, tokens_before + tokens_computed)
        if predicted > 0 and seconds > 0:
            self.prefill_ratio.hist.record(seconds / predicted)
        if dispatch_s is not None:
            self.dispatch.hist.record(dispatch_s)

    def observe_interference(self, bytes_moved: float, stall_s: float, active_decodes: int = 0) -> None:
        """Feed an observed stall of active requests attributed to a load of ``bytes_moved``."""
        self.version += 1
        if bytes_moved > 0:
            self.interference_per_byte.hist.record(stall_s / bytes_moved / (1 + max(active_decodes, 0)))

    # ---------------------------------------------------------------- predict

    def prefill_seconds(self, start_tokens: int, end_tokens: int) -> float:
        """Marginal model seconds to prefill tokens [start, end) given [0, start) cached.

        ``T_prefill(end) − T_prefill(start)``: the fit's fixed per-request term
        cancels, because it is paid whether or not the prefix is loaded (the tail
        and the last token are always prefilled).
        """
        if end_tokens <= start_tokens:
            return 0.0
        return max(float(self.prefill(end_tokens)) - float(self.prefill(start_tokens)), 0.0)

    def t_remote(self, load_bytes: float, n_blocks: int, queue_bytes: float, q: float) -> dict[str, float]:
        beta = self.transfer.coefficients(q)[1]
        return {
            "lookup_s": self.lookup.q(q),
            "queue_s": queue_bytes * beta,
            "transfer_s": self.transfer.seconds(load_bytes, q),
            "stage_s": self.stage_per_byte.q(q) * load_bytes,
            "install_s": self.install_per_block.q(q) * n_blocks,
        }

    def t_recompute(self, start_tokens: int, end_tokens: int, q: float) -> dict[str, float]:
        return {
            "dispatch_s": self.dispatch.q(q),
            "prefill_s": self.prefill_seconds(start_tokens, end_tokens) * self.prefill_ratio.q(q),
        }

    def t_interference(self, load_bytes: float, active_decodes: int) -> float:
        return self.interference_per_byte.q(0.5) * load_bytes * (1 + max(active_decodes, 0))
