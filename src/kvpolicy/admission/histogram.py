"""Mergeable streaming histograms with log-spaced buckets (relative-error quantiles).

A value x > 0 lands in bucket ``ceil(log(x) / log(γ))`` with γ = (1 + α)/(1 − α);
every quantile is then within a relative error α of the true sample quantile
(the DDSketch construction). Values ≤ ``min_value`` share one zero bucket.
Two histograms with the same α merge by adding bucket counts — per replica,
per window, per class. Recording is a dict increment; quantiles are cached
until the next record.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Iterable
from typing import Any

import numpy as np

from ..errors import ConfigError


class LogHistogram:
    __slots__ = ("alpha", "_gamma_log", "min_value", "_counts", "_zero", "count", "sum", "min", "max", "_keys", "_sorted", "_qcache")

    def __init__(self, alpha: float = 0.01, min_value: float = 1e-9) -> None:
        if not 0 < alpha < 1:
            raise ConfigError("alpha", f"relative accuracy must be in (0, 1), got {alpha}")
        self.alpha = alpha
        self._gamma_log = math.log((1 + alpha) / (1 - alpha))
        self.min_value = min_value
        self._counts: dict[int, int] = {}
        self._zero = 0
        self.count = 0
        self.sum = 0.0
        self.min = math.inf
        self.max = -math.inf
        #: the buckets' keys in order, kept while records land in buckets that exist (a TTFT histogram holds hundreds)
        self._keys: list[int] | None = None
        self._sorted: tuple[list[int], list[int]] | None = None
        self._qcache: dict[float, float | None] = {}

    def record(self, x: float, n: int = 1) -> None:
        self._add(self._bucket(x, n), x, n)

    def _bucket(self, x: float, n: int) -> int | None:
        """The bucket ``x`` lands in (None: the zero bucket), after checking the observation."""
        if type(n) is not int and (isinstance(n, bool) or not isinstance(n, int)) or n <= 0:
            raise ConfigError("n", f"a count of observations must be a positive int, got {n!r}")
        if not x == x or x in (math.inf, -math.inf):  # NaN or inf
            raise ConfigError("value", f"must be finite, got {x!r}")
        if x < 0:
            raise ConfigError("value", f"latencies and sizes are non-negative, got {x!r}")
        return None if x <= self.min_value else math.ceil(math.log(x) / self._gamma_log)

    def _add(self, k: int | None, x: float, n: int) -> None:
        """Count ``n`` observations of ``x`` in bucket ``k`` (None: the zero bucket)."""
        if k is None:
            self._zero += n
        else:
            c = self._counts.get(k)
            if c is None:
                self._counts[k] = n
                self._keys = None  # a new bucket
            else:
                self._counts[k] = c + n
        self.count += n
        self.sum += x * n
        if x < self.min:
            self.min = x
        if x > self.max:
            self.max = x
        self._sorted = None
        self._qcache = {}

    def record_many(self, values: Iterable[float] | np.ndarray) -> None:
        v = np.asarray(values, dtype=np.float64).ravel()
        if v.size == 0:
            return
        if not np.all(np.isfinite(v)) or np.any(v < 0):
            raise ConfigError("values", "must be finite and non-negative")
        zero = v <= self.min_value
        self._zero += int(zero.sum())
        keys = np.ceil(np.log(v[~zero]) / self._gamma_log).astype(np.int64)
        if keys.size:
            uk, cnt = np.unique(keys, return_counts=True)
            for k, c in zip(uk.tolist(), cnt.tolist()):
                self._counts[k] = self._counts.get(k, 0) + c
            self._keys = None
        self.count += int(v.size)
        self.sum += float(v.sum())
        self.min = min(self.min, float(v.min()))
        self.max = max(self.max, float(v.max()))
        self._sorted = None
        self._qcache = {}

    def merge(self, other: LogHistogram) -> LogHistogram:
        if other.alpha != self.alpha:
            raise ConfigError("alpha", f"cannot merge histograms of accuracy {self.alpha} and {other.alpha}")
        for k, c in other._counts.items():
            self._counts[k] = self._counts.get(k, 0) + c
        self._keys = None
        self._zero += other._zero
        self.count += other.count
        self.sum += other.sum
        self.min = min(self.min, other.min)
        self.max = max(self.max, other.max)
        self._sorted = None
        self._qcache = {}
        return self

    def copy(self) -> LogHistogram:
        h = LogHistogram(self.alpha, self.min_value)
        return h.merge(self)

    def quantile(self, q: float) -> float | None:
        """The q-quantile (None when empty), within relative error α."""
        hit = self._qcache.get(q)
        if hit is not None or (q in self._qcache):
            return hit
        v = self._quantile(q)
        self._qcache[q] = v
        return v

    def _quantile(self, q: float) -> float | None:
        if not 0 <= q <= 1:
            raise ConfigError("q", f"must be in [0, 1], got {q}")
        if self.count == 0:
            return None
        if self._sorted is None:
            # plain lists: a histogram holds tens to hundreds of buckets, where numpy's per-call overhead is most of the
            # cost; the keys' order is kept until a new bucket appears, the running counts summed in C
            keys = self._keys
            if keys is None:
                keys = self._keys = sorted(self._counts)
            cum = list(itertools.accumulate(map(self._counts.__getitem__, keys), initial=self._zero))[1:]
            self._sorted = (keys, cum)
        keys, cum = self._sorted
        rank = q * (self.count - 1)
        if rank < self._zero:
            return 0.0
        i = bisect.bisect_right(cum, rank)  # ints against a float: compared exactly, as numpy's float64 cast does below 2**53
        if i >= len(keys):
            return self.max
        k = keys[i]
        # bucket k holds (γ^(k−1), γ^k]; its representative 2γ^k/(γ+1) has relative error ≤ α
        gamma = math.exp(self._gamma_log)
        value = 2 * math.exp(k * self._gamma_log) / (gamma + 1)
        return min(max(value, self.min), self.max)

    @property
    def mean(self) -> float | None:
        return self.sum / self.count if self.count else None

    def summary(self) -> dict[str, Any]:
        return {
            "count": self.count,
            "mean": self.mean,
            "p50": self.quantile(0.5),
            "p95": self.quantile(0.95),
            "p99": self.quantile(0.99),
            "min": self.min if self.count else None,
            "max": self.max if self.count else None,
        }


class WindowedHistogram:
    """Quantiles over recent observations only: two rotating windows of ``window_s``.

    Observations land in the current window; when the clock crosses into the next
    window, the current one becomes the previous and the one before is dropped.
    Quantiles merge the previous and current windows — between ``window_s`` and
    ``2 × window_s`` of history — so a link that recovered (or degraded) shows up
    within two windows instead of being outvoted by its whole past.
    """

    def __init__(self, window_s: float, now_s: Any) -> None:
        if not window_s > 0:
            raise ConfigError("window_s", f"must be positive, got {window_s}")
        self.window_s = float(window_s)
        self._now = now_s
        self._epoch = int(self._now() // self.window_s)
        self.cur = LogHistogram()
        self.prev = LogHistogram()
        self._merged: LogHistogram | None = None

    def _rotate(self) -> None:
        e = int(self._now() // self.window_s)
        if e != self._epoch:
            self.prev = self.cur if e == self._epoch + 1 else LogHistogram()
            self.cur = LogHistogram()
            self._epoch = e
            self._merged = None

    def record(self, x: float, n: int = 1) -> None:
        self._rotate()
        k = self.cur._bucket(x, n)
        self.cur._add(k, x, n)
        if self._merged is not None:  # kept whole: the same buckets, count, min and max as merging again would give
            self._merged._add(k, x, n)

    @property
    def count(self) -> int:
        self._rotate()
        return self.cur.count + self.prev.count

    def quantile(self, q: float) -> float | None:
        self._rotate()
        if self._merged is None:
            self._merged = self.prev.copy().merge(self.cur)
        return self._merged.quantile(q)
