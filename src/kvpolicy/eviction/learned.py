"""Learned relaxed Belady (LRB, NSDI'20) on a prefix cache's structural features.

Belady evicts the block used again furthest in the future. *Relaxed*, it is enough to evict a block that will not be
used again within a horizon H: such a block was not worth keeping at the cache's current size. ``lrb`` learns, online,
the probability that a block is used again within H, and evicts the sampled leaf with the lowest.

* **Horizon** H = ``horizon`` × the mean eviction age (hit density's running, decayed estimate: how long this cache
  keeps blocks now, learned, not picked).
* **Candidates**: hit density's ``samples`` leaves, drawn uniformly with a seeded splitmix64 (the same draws).
* **Features** of a candidate at the decision (:meth:`LearnedRelaxedBeladyPolicy.features`, 55 of them):

  - its age since last use, relative to H: a one-hot log2 bin (2^-8 .. 2^5 of H), the same bin again for reused
    and for branched blocks, ``min(age/H, 64)`` and ``log(age/H)`` (again for reused blocks);
  - ``log1p`` of: hits (≈ distinct requests that read it), child inserts (a branch point or a truncated chain),
    depth, the turn count of its chain (requests that extended it), its last inter-use gap / H, how long it lived
    before its last use / H, how long it has been resident / H, its root block's hits (the prefix group's
    popularity); whether it is a root.

* **Model**: logistic regression, P(used again within H) = σ(w · x), refit every ``refit`` new labels on the last
  ``window`` by damped Newton steps (IRLS; every step halves until the penalised loss falls) with an L2 ``ridge``
  on every weight but the intercept — so at the optimum the mean prediction equals the positive rate of the window
  (:meth:`LogisticWindow.calibration`).
* **Labels** come from the decisions themselves: the first of each eviction's samples (a uniform draw from the
  candidates, the population the model ranks) is recorded with its features and H; it is labelled 1 if its key is
  used again (a hit, or inserted again after its eviction) within H of the decision, else 0 — either label once H
  has passed, so the model's window holds the outcomes of consecutive decisions (labelled at once, returns would
  arrive up to H before the non-returns of the same decisions and inflate the window's positive rate).
* **Memory**: at most ``window`` samples wait for their outcome at once (about as many decisions as there are
  blocks in the cache would wait otherwise: one H of evictions); past that a decision is not recorded. Whether it
  is recorded is settled before its outcome is known, so the labels stay unbiased.
* **Victim**: the sample with the lowest w · x (the first drawn wins ties). Until the first fit: hit density's
  victim (so with no fit it evicts exactly what :class:`HitDensityPolicy` does, sample for sample).

Knobs and defaults: ``horizon`` 1, ``window`` 16,384 labels, ``refit`` 2,048, ``ridge`` 1, and hit density's
(``samples`` 16, ``bins``, ``span``, ``interval``, ``decay``, ``seed``). They were set once before any run; the
variants tried (H = ½ the mean eviction age; hit density's value as a feature) were tried on the synthetic presets at
seeds 1–2 only, and changed nothing. Measured in docs/benchmarks.md (``benchmarks/bench_learned_eviction.py``).

Replay: the Numba kernel (``replay_kernel(trace, "lrb", ...)``, in :mod:`kvpolicy.eviction.kernels`, hit density's
kernel with this policy's learning) makes the same decisions, victim for victim, with the same labels, fits and
calibration: both call the compiled :func:`lrb_features`, :func:`lrb_logit` and :func:`logistic_fit` below
(tests/test_learned_eviction.py). Its cost is 16 feature vectors per eviction and a 55 × 55 Newton solve over the
window per refit: 0.13–0.9 M references/s on the conversation trace (docs/benchmarks.md), under the 5 M floor of the
kernels whose decisions cost no learning — and the features alone, with the learning free, cap it at ~0.4 M on the
floor's stream (``benchmarks/bench_lrb_floor.py``).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Hashable
from typing import Any

import numba as nb
import numpy as np

from .._validate import check_positive_int, check_positive_number
from ..errors import ConfigError
from ..protocols import Clock
from .base import Node
from .hit_density import HitDensityPolicy, splitmix64

AGE_BINS = 14  # log2(age / H) from -8 to +5, one-hot
N_FEATURES = 1 + 3 * AGE_BINS + 12
MAX_WINDOW = 1 << 20  # labels kept, at most (window x 55 floats)


def sigmoid(z: Any) -> Any:
    return 1.0 / (1.0 + np.exp(-np.clip(z, -30.0, 30.0)))


# ----------------------------------------------------------------------------- compiled arithmetic
# The online policy and the replay kernel call these same functions, so their features, logits and fits agree to the
# bit and their decisions can be compared victim for victim. The NumPy reference of the fit is ``LogisticWindow.loss``
# / ``gradient`` (and tests/test_learned_eviction.py's Newton); the feature definition is the module docstring.

@nb.njit(cache=True)
def sigmoid1(z):  # pragma: no cover - compiled
    """σ(z) of one float, clipped to ±30 as :func:`sigmoid`."""
    return 1.0 / (1.0 + math.exp(-min(max(z, -30.0), 30.0)))


@nb.njit(cache=True)
def lrb_features(x, t_last_s, hits, kids, depth, gap_s, turn, t_insert_s, root_hits, now_s, h_s):  # pragma: no cover - compiled
    """Write the 55 features of a resident block into ``x`` (the module docstring; negative intervals count as 0)."""
    r = (now_s - t_last_s) / h_s
    for i in range(x.size):
        x[i] = 0.0
    x[0] = 1.0
    b = 0 if r <= 0 else int(min(max(math.log2(r) + 8.0, 0.0), AGE_BINS - 1.0))
    x[1 + b] = 1.0
    if hits > 0:
        x[1 + AGE_BINS + b] = 1.0
    if kids >= 2:
        x[1 + 2 * AGE_BINS + b] = 1.0
    log_r = math.log(max(r, 1e-6))
    k = 1 + 3 * AGE_BINS
    x[k] = math.log1p(min(hits, 64))
    x[k + 1] = math.log1p(kids)
    x[k + 2] = math.log1p(depth) / 4
    x[k + 3] = math.log1p(turn)
    x[k + 4] = math.log1p(max(gap_s, 0.0) / h_s)
    x[k + 5] = math.log1p(max(t_last_s - t_insert_s, 0.0) / h_s)
    x[k + 6] = math.log1p(root_hits) / 4
    x[k + 7] = 1.0 if depth == 0 else 0.0
    x[k + 8] = math.log1p(max(now_s - t_insert_s, 0.0) / h_s)
    x[k + 9] = min(r, 64.0)
    x[k + 10] = log_r
    x[k + 11] = log_r if hits > 0 else 0.0


@nb.njit(cache=True)
def lrb_logit(x, w):  # pragma: no cover - compiled
    """w · x, summed in index order."""
    z = 0.0
    for i in range(x.size):
        z += x[i] * w[i]
    return z


@nb.njit(cache=True, inline="always")
def _row_dot(X, r, w, nz, nnz):  # pragma: no cover - compiled
    """w · X[r] over the row's nonzero columns, in column order."""
    z = 0.0
    for a in range(nnz[r]):
        i = nz[r, a]
        z += X[r, i] * w[i]
    return z


@nb.njit(cache=True)
def _penalised_loss(X, y, m, w, lam, nz, nnz):  # pragma: no cover - compiled
    out = 0.0
    for r in range(m):
        z = _row_dot(X, r, w, nz, nnz)
        out += max(z, 0.0) + math.log1p(math.exp(-abs(z))) - y[r] * z  # log(1 + e^z) - y z, without overflow
    pen = 0.0
    for i in range(w.size):
        pen += lam[i] * w[i] * w[i]
    return out + 0.5 * pen


@nb.njit(cache=True)
def logistic_fit(X, y, m, w, lam, steps):  # pragma: no cover - compiled
    """Damped Newton on the first ``m`` rows of (``X``, ``y``) from ``w`` (updated in place): each step solves
    (Xᵀ D X + diag λ) s = Xᵀ (p − y) + λ w (Cholesky) and halves until the penalised loss does not rise; stops after
    ``steps``, when a step gains < 1e-6 of the loss, or when no step of length ≥ 1e-4 helps. Rows are sparse (one-hot
    age bins), so each row's nonzero columns are listed once. Returns (mean prediction, positive rate) at the end."""
    k = X.shape[1]
    nz = np.empty((m, k), np.int64)
    nnz = np.zeros(m, np.int64)
    for r in range(m):
        c = 0
        for i in range(k):
            if X[r, i] != 0.0:
                nz[r, c] = i
                c += 1
        nnz[r] = c
    H = np.empty((k, k))
    g = np.empty(k)
    step = np.empty(k)
    trial = np.empty(k)
    cur = _penalised_loss(X, y, m, w, lam, nz, nnz)
    for _ in range(steps):
        for i in range(k):
            g[i] = lam[i] * w[i]
            for j in range(k):
                H[i, j] = 0.0
            H[i, i] = lam[i]
        for r in range(m):
            p = sigmoid1(_row_dot(X, r, w, nz, nnz))
            d = p * (1.0 - p) + 1e-9
            e = p - y[r]
            for a in range(nnz[r]):
                i = nz[r, a]
                xi = X[r, i]
                g[i] += e * xi
                dxi = d * xi
                for b in range(a, nnz[r]):
                    j = nz[r, b]
                    H[i, j] += dxi * X[r, j]
        for i in range(k):  # the rows' nonzero columns come in increasing order: the upper triangle was filled
            for j in range(i):
                H[i, j] = H[j, i]
        _cholesky_solve(H, g, step)
        t = 1.0
        while True:
            for i in range(k):
                trial[i] = w[i] - t * step[i]
            if not (t > 1e-4 and _penalised_loss(X, y, m, trial, lam, nz, nnz) > cur):
                break
            t *= 0.5
        if t <= 1e-4:
            break
        for i in range(k):
            w[i] = w[i] - t * step[i]
        new = _penalised_loss(X, y, m, w, lam, nz, nnz)
        done = cur - new < 1e-6 * max(cur, 1.0)
        cur = new
        if done:
            break
    sp = 0.0
    sy = 0.0
    for r in range(m):
        sp += sigmoid1(_row_dot(X, r, w, nz, nnz))
        sy += y[r]
    return sp / m, sy / m


@nb.njit(cache=True)
def _cholesky_solve(A, b, out):  # pragma: no cover - compiled
    """Solve A x = b for symmetric positive definite A (overwritten by its Cholesky factor)."""
    n = A.shape[0]
    for j in range(n):
        s = A[j, j]
        for q in range(j):
            s -= A[j, q] * A[j, q]
        A[j, j] = math.sqrt(max(s, 1e-300))
        for i in range(j + 1, n):
            s = A[i, j]
            for q in range(j):
                s -= A[i, q] * A[j, q]
            A[i, j] = s / A[j, j]
    for i in range(n):
        s = b[i]
        for q in range(i):
            s -= A[i, q] * out[q]
        out[i] = s / A[i, i]
    for i in range(n - 1, -1, -1):
        s = out[i]
        for q in range(i + 1, n):
            s -= A[q, i] * out[q]
        out[i] = s / A[i, i]


class LogisticWindow:
    """Logistic regression refit on a sliding window of labelled feature vectors (damped Newton, L2 ridge)."""

    def __init__(self, n_features: int, *, window: int = 16384, refit: int = 2048, ridge: float = 1.0) -> None:
        check_positive_int("n_features", n_features)
        check_positive_int("window", window)
        check_positive_int("refit", refit)
        check_positive_number("ridge", ridge)
        if window > MAX_WINDOW:
            raise ConfigError("window", f"must be at most {MAX_WINDOW} labels, got {window!r}")
        self.X = np.zeros((window, n_features))
        self.y = np.zeros(window)
        self.window, self.refit, self.ridge = window, refit, float(ridge)
        self.n = 0  # labels added, ever
        self.fits = 0
        self._since = 0
        self.w: np.ndarray | None = None  # None until a window holding both labels was fit
        self._fitted_on = (math.nan, math.nan)  # (mean prediction, positive rate) on the window of the last fit
        self._oos: list[float] = [0.0, 0.0, 0.0]  # out of sample: predictions made at decision time, their labels, how many

    def add(self, x: np.ndarray, label: float, predicted: float = math.nan) -> None:
        """One labelled vector; ``predicted``: what the model said when the decision was taken (NaN: no model yet)."""
        if not math.isnan(predicted):
            self._oos[0] += predicted
            self._oos[1] += label
            self._oos[2] += 1
        i = self.n % self.window
        self.X[i], self.y[i] = x, label
        self.n += 1
        self._since += 1
        if self._since >= self.refit:
            self._since = 0
            self.fit()

    def penalty(self) -> np.ndarray:
        lam = np.full(self.X.shape[1], self.ridge)
        lam[0] = 1e-6  # the intercept is (all but) not shrunk: the fit stays calibrated
        return lam

    def loss(self, w: np.ndarray) -> float:
        """The penalised negative log-likelihood of the window at ``w``."""
        m = min(self.n, self.window)
        z = self.X[:m] @ w
        return float(np.sum(np.logaddexp(0.0, z) - self.y[:m] * z) + 0.5 * np.sum(self.penalty() * w * w))

    def gradient(self, w: np.ndarray) -> np.ndarray:
        m = min(self.n, self.window)
        return self.X[:m].T @ (sigmoid(self.X[:m] @ w) - self.y[:m]) + self.penalty() * w

    def fit(self, steps: int = 8) -> None:
        """Damped Newton from the last weights (:func:`logistic_fit`); a window with one label only is not fit (the
        weights stay)."""
        m = min(self.n, self.window)
        if m == 0 or self.y[:m].min() == self.y[:m].max():
            return
        w = np.zeros(self.X.shape[1]) if self.w is None else self.w.copy()
        mean_p, rate = logistic_fit(self.X, self.y, m, w, self.penalty(), steps)
        self.w = w
        self.fits += 1
        self._fitted_on = (float(mean_p), float(rate))

    def predict(self, X: np.ndarray) -> np.ndarray:
        if self.w is None:
            raise ConfigError("model", "not fit yet: no window with both labels has been seen")
        return sigmoid(np.asarray(X, dtype=float) @ self.w)

    def calibration(self) -> tuple[float, float]:
        """(mean predicted probability, positive rate) on the window of the last fit — equal at the optimum (the
        intercept is not shrunk); NaN while the model was never fit."""
        return self._fitted_on

    def out_of_sample(self) -> tuple[float, float, int]:
        """(mean predicted probability, positive rate, labels) over the labels whose prediction was made before the
        outcome was known (at the decision) — the calibration that matters online; NaN before any."""
        p, y, n = self._oos
        return (p / n, y / n, int(n)) if n else (math.nan, math.nan, 0)


class LearnedRelaxedBeladyPolicy(HitDensityPolicy):
    """Sampled leaves ranked by the learned P(used again within H) (the module docstring)."""

    name = "lrb"

    def __init__(self, capacity_bytes: int, *, horizon: float = 1.0, window: int = 16384, refit: int = 2048, ridge: float = 1.0,
                 clock: Clock | None = None, **kw: Any) -> None:
        check_positive_number("horizon", horizon)
        super().__init__(capacity_bytes, clock=clock, **kw)
        self.horizon = float(horizon)
        self.model = LogisticWindow(N_FEATURES, window=window, refit=refit, ridge=ridge)
        # key -> [last inter-use gap (s), turn, root key, insert time (s), request that inserted it]
        self._extra: dict[Hashable, list[Any]] = {}
        # key -> [[decision time + H, x, the model's P at the decision or NaN, 1.0 once used again by then]]
        self._pending: dict[Hashable, list[list[Any]]] = {}
        self._deadlines: deque[tuple[float, Hashable]] = deque()  # (time + H, key), in recording order
        self.unrecorded = 0  # decisions not sampled because ``window`` samples were waiting for their outcome

    # ------------------------------------------------------------------ hooks

    def _admit(self, node: Node) -> None:
        now = self.clock.now_s()
        self._label_use(node.key, now)  # inserted again after its eviction: a use
        super()._admit(node)
        p = node.parent
        if p is None:
            turn, root = 0, node.key
        else:
            pe = self._extra[p.key]
            turn, root = pe[1] + (1 if pe[4] < self.requests else 0), pe[2]  # a later request than the parent's extended the chain
        self._extra[node.key] = [0.0, turn, root, now, self.requests]

    def _hit(self, node: Node) -> None:
        now = self.clock.now_s()
        self._label_use(node.key, now)
        gap = now - node.data[0]
        super()._hit(node)
        self._extra[node.key][0] = gap

    def _forget(self, node: Node) -> None:
        super()._forget(node)
        del self._extra[node.key]

    def _choose(self) -> Node:
        now = self.clock.now_s()
        self._label_expired(now)
        h = self.horizon_s()
        w = self.model.w
        if w is None or h is None or h <= 0:
            first = self._pick(splitmix64(self._rng)[1])  # the sample hit density draws first (nothing drawn here)
            best = super()._choose()  # hit density until the first fit
            first_x = first_logit = None
        else:
            best, best_logit, first = None, math.inf, None
            for _ in range(self.samples):
                self._rng, z = splitmix64(self._rng)
                node = self._pick(z)
                x = self.features(node, now, h)
                logit = lrb_logit(x, w)
                if first is None:
                    first, first_x, first_logit = node, x, logit
                if logit < best_logit:  # the first drawn wins ties
                    best, best_logit = node, logit
        if h is not None and h > 0:
            assert first is not None
            if len(self._deadlines) < self.model.window:
                self._record(first, now, h, first_x, first_logit)
            else:  # as many samples wait for their outcome as the window holds: this decision is not a sample
                self.unrecorded += 1
        assert best is not None
        return best

    def priority_of(self, node: Node, now_s: float, expert: int | None = None) -> tuple:
        """What a decision compares (lower is evicted first): the model's logit of P(used again within H) once it is
        fit, hit density's before."""
        h, w = self.horizon_s(), self.model.w
        if w is None or h is None or h <= 0:
            return super().priority_of(node, now_s, expert)
        return (lrb_logit(self.features(node, now_s, h), w),)

    # ------------------------------------------------------------------ learning

    def horizon_s(self) -> float | None:
        """H: ``horizon`` × the mean eviction age; None before the first eviction."""
        return self.horizon * self._age_sum_s / self._age_n if self._age_n > 0 else None

    def features(self, node: Node, now_s: float, h_s: float) -> np.ndarray:
        """The feature vector of resident ``node`` at ``now_s`` under horizon ``h_s`` (the module docstring). An engine
        clock that steps back makes no negative interval: each is taken as 0."""
        t_last, hits, kids = node.data
        gap, turn, root, t_insert, _ = self._extra[node.key]
        x = np.empty(N_FEATURES)  # its root is resident: the tree is prefix-closed
        lrb_features(x, t_last, hits, kids, node.depth, gap, turn, t_insert, self.nodes[root].data[1], now_s, h_s)
        return x

    def _record(self, node: Node, now_s: float, h_s: float, x: np.ndarray | None = None, logit: float | None = None) -> None:
        """Sample ``node`` (its features ``x`` and the model's ``logit``, when the decision computed them already)."""
        if x is None:
            x = self.features(node, now_s, h_s)
        if logit is None and self.model.w is not None:
            logit = lrb_logit(x, self.model.w)
        p = math.nan if logit is None else sigmoid1(logit)
        deadline = now_s + h_s
        self._pending.setdefault(node.key, []).append([deadline, x, p, 0.0])
        self._deadlines.append((deadline, node.key))

    def _label_use(self, key: Hashable, now_s: float) -> None:
        """A use of ``key``: every record of it still within its H is a return (labelled when its H ends)."""
        for item in self._pending.get(key, ()):
            if now_s <= item[0]:
                item[3] = 1.0

    def _label_expired(self, now_s: float) -> None:
        """Records whose H has passed go to the model with their label, in recording order. A return is not labelled
        before its H ends either: labelled at once, returns would reach the model up to H before the non-returns of
        the same decisions, and a window would hold more of them than the decisions had (at the start, and whenever
        the eviction rate grows)."""
        q = self._deadlines
        while q and q[0][0] < now_s:
            _, key = q.popleft()
            waiting = self._pending.get(key)
            if not waiting:
                continue
            keep = []
            for item in waiting:
                if item[0] < now_s:  # the test that popped its deadline: a record never outlives its entry
                    self.model.add(item[1], item[3], item[2])
                else:
                    keep.append(item)
            if keep:
                self._pending[key] = keep
            else:
                del self._pending[key]

    def stats(self) -> dict:
        """Labels seen, fits done, the horizon now, the model's calibration on the window of its last fit, and out of
        sample (its predictions at the decisions against what happened)."""
        mean_p, rate = self.model.calibration()
        oos_p, oos_rate, oos_n = self.model.out_of_sample()
        return {"labels": self.model.n, "fits": self.model.fits, "horizon_s": self.horizon_s(), "unrecorded": self.unrecorded,
                "window_mean_prediction": mean_p, "window_positive_rate": rate,
                "out_of_sample_mean_prediction": oos_p, "out_of_sample_positive_rate": oos_rate, "out_of_sample_labels": oos_n}
