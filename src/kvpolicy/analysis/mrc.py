"""Miss-ratio curves: exact LRU for every capacity in one pass, and SHARDS.

**Exact LRU.** An access with stack distance d hits an LRU cache of C blocks iff
0 ≤ d < C, so sorting the distances once gives the hit ratio at every capacity.

**Prefix rule.** For a request-level trace, a block is a hit only if every block
before it in the request is a hit too (a block behind a missing block is useless)
and it is *matchable* (not the block holding the last token, never a partial
block). With :func:`~kvpolicy.analysis.stack.request_stack_distances` the
effective distance of a block is the running maximum of distances along its
request; its hit test is the same ``< C``. Token hits count B tokens per hit
block; ratios are over *all* input tokens (partial tails included), so
they are directly "share of prefill avoided".

**SHARDS** (Waldspurger et al., FAST'15): spatially sample ids by a hash
(``hash(id) mod P < T``, rate R = T/P), compute exact distances on the sampled
stream, scale them by 1/R. *Fixed-rate* keeps R; *fixed-size* bounds the
sampled set to ``s_max`` ids by lowering T (evicting the largest-hash id) and
re-weights earlier samples by ``R_final / R_then``. At R = 1 it is exact.
Both apply SHARDS_adj: the difference between the expected sample weight
(R_final·N) and the actual one goes to the distance-0 bucket, which removes most
of the bias when a few very hot ids dominate the sample.
"""

from __future__ import annotations

from typing import Any

import attrs
import numba as nb
import numpy as np

from .._mix import splitmix64
from .._validate import check_non_negative_int
from ..errors import ConfigError
from .stack import _bits_alloc, _bits_clear, _bits_compact, _bits_live_upto, _bits_set, _stack_pass, request_stack_distances

INF = np.iinfo(np.int64).max
SHARDS_MODULUS = 1 << 24


def default_capacities(max_blocks: int) -> np.ndarray:
    """Powers of two (and 3×2^k) from 16 blocks up to ``max_blocks``."""
    caps = []
    k = 16
    while k < max_blocks:
        caps += [k, 3 * k // 2]
        k *= 2
    caps.append(max(max_blocks, 1))
    return np.unique(np.asarray([c for c in caps if c <= max(max_blocks, 1)], dtype=np.int64))


def hits_at(distances: np.ndarray, capacities: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
    """Hit count (or weight) at each capacity: Σ weight over accesses with 0 ≤ d < C.

    A histogram (O(N + max d)) when distances are bounded, as stack distances
    are (< distinct ids); a sort otherwise.
    """
    d = np.asarray(distances, dtype=np.int64)
    caps = np.asarray(capacities, dtype=np.int64)
    ok = d >= 0
    dd = d[ok]
    if dd.size == 0:
        return np.zeros(caps.size)
    top = int(dd.max())
    if top <= 4 * d.size + (1 << 20):
        w = None if weights is None else np.asarray(weights, dtype=np.float64)[ok]
        cum = np.concatenate([[0.0], np.cumsum(np.bincount(dd, weights=w, minlength=top + 1), dtype=np.float64)])
        return cum[np.clip(caps, 0, top + 1)]
    order = np.argsort(dd, kind="stable")
    sd = dd[order]
    idx = np.searchsorted(sd, caps, side="left")
    if weights is None:
        return idx.astype(np.float64)
    cw = np.concatenate([[0.0], np.cumsum(np.asarray(weights, dtype=np.float64)[ok][order])])
    return cw[idx]


def lru_hit_ratio_curve(distances: np.ndarray, capacities: np.ndarray) -> np.ndarray:
    """Per-access LRU hit ratio at each capacity from exact stack distances."""
    n = len(distances)
    return hits_at(distances, capacities) / max(n, 1)


@nb.njit(cache=True)
def _prefix_max(offsets, d, matchable, out):
    for r in range(offsets.size - 1):
        m = -1
        for j in range(offsets[r], offsets[r + 1]):
            x = d[j]
            if x < 0 or not matchable[j]:
                m = INF
            elif x > m:
                m = x
            out[j] = m


@attrs.frozen(eq=False)
class PrefixMRC:
    """LRU under the prefix rule for a request-level trace."""

    block_size_tokens: int
    total_input_tokens: int
    block_refs: int
    effective_distances: np.ndarray  # per block ref; INF = never a hit (cold, behind a miss, or unmatchable)
    compulsory_blocks: int

    @classmethod
    def from_trace(cls, trace: Any) -> PrefixMRC:
        d = request_stack_distances(trace.block_offsets, trace.block_ids)
        eff = np.empty_like(d)
        if d.size:
            _prefix_max(trace.block_offsets, d, trace.matchable_mask(), eff)
        return cls(
            block_size_tokens=trace.block_size_tokens,
            total_input_tokens=trace.total_input_tokens,
            block_refs=int(trace.block_ids.size),
            effective_distances=eff,
            compulsory_blocks=int((d < 0).sum()),
        )

    @property
    def ceiling_blocks(self) -> int:
        """Hit blocks with an infinite cache."""
        return int((self.effective_distances < INF).sum())

    @property
    def ceiling_token_hit_ratio(self) -> float:
        return self.ceiling_blocks * self.block_size_tokens / max(self.total_input_tokens, 1)

    def hit_blocks(self, capacities_blocks: np.ndarray) -> np.ndarray:
        fin = np.sort(self.effective_distances[self.effective_distances < INF])
        return np.searchsorted(fin, np.asarray(capacities_blocks, dtype=np.int64), side="left")

    def token_hit_ratio(self, capacities_blocks: np.ndarray) -> np.ndarray:
        return self.hit_blocks(capacities_blocks) * self.block_size_tokens / max(self.total_input_tokens, 1)

    def block_hit_ratio(self, capacities_blocks: np.ndarray) -> np.ndarray:
        return self.hit_blocks(capacities_blocks) / max(self.block_refs, 1)

    def capacity_for(self, fraction_of_ceiling: float) -> int:
        """Smallest LRU capacity (blocks) reaching ``fraction`` of the infinite-cache hits."""
        if not 0 < fraction_of_ceiling <= 1:
            raise ConfigError("fraction_of_ceiling", f"must be in (0, 1], got {fraction_of_ceiling}")
        fin = np.sort(self.effective_distances[self.effective_distances < INF])
        if fin.size == 0:
            return 0
        k = int(np.ceil(fraction_of_ceiling * fin.size))
        return int(fin[k - 1]) + 1

    def table(self, capacities_blocks: np.ndarray) -> list[dict[str, float]]:
        caps = np.asarray(capacities_blocks, dtype=np.int64)
        hb = self.hit_blocks(caps)
        return [
            {"capacity_blocks": int(c), "block_hit_ratio": float(h / max(self.block_refs, 1)), "token_hit_ratio": float(h * self.block_size_tokens / max(self.total_input_tokens, 1)), "hit_tokens": int(h * self.block_size_tokens)}
            for c, h in zip(caps, hb)
        ]


# --------------------------------------------------------------------------- SHARDS


@nb.njit(cache=True)
def _heap_push(hh, hi, size, h, x):
    i = size
    hh[i] = h
    hi[i] = x
    while i > 0:
        p = (i - 1) // 2
        if hh[p] >= hh[i]:
            break
        hh[p], hh[i] = hh[i], hh[p]
        hi[p], hi[i] = hi[i], hi[p]
        i = p
    return size + 1


@nb.njit(cache=True)
def _heap_pop(hh, hi, size):
    h, x = hh[0], hi[0]
    size -= 1
    hh[0] = hh[size]
    hi[0] = hi[size]
    i = 0
    while True:
        left = 2 * i + 1
        right = left + 1
        big = i
        if left < size and hh[left] > hh[big]:
            big = left
        if right < size and hh[right] > hh[big]:
            big = right
        if big == i:
            break
        hh[big], hh[i] = hh[i], hh[big]
        hi[big], hi[i] = hi[i], hi[big]
        i = big
    return h, x, size


@nb.njit(cache=True)
def _id_hashes(n_ids, seed):
    """The 24-bit sampling hash of every id, once (a lookup per access after that)."""
    out = np.empty(n_ids, dtype=np.int32)
    mod_mask = np.uint64(SHARDS_MODULUS - 1)
    s = np.uint64(seed)
    for x in range(n_ids):
        out[x] = np.int32(splitmix64(np.uint64(x) ^ s) & mod_mask)
    return out


@nb.njit(cache=True)
def _shards_kernel(ids, n_ids, threshold, s_max, seed, out_d, out_t):
    """Sampled accesses → (distance in sampled ids, threshold at the time). Returns count.

    Same bitset + superblock-tree structure as the exact kernel, sized to the
    sampled ids only (fixed-rate: those under the threshold; fixed-size: s_max).
    """
    hashes = _id_hashes(n_ids, seed)
    fixed_rate = s_max <= 0
    # fixed-rate: whether an id is sampled never changes, and a byte per id is a quarter of the cache lines its
    # hash takes — the filter over every access is most of the time on a 10M stream
    sampled = np.zeros(n_ids if fixed_rate else 0, dtype=np.uint8)
    if s_max > 0:
        live_max = s_max + 1
    else:
        live_max = 0
        for x in range(n_ids):
            if hashes[x] < threshold:
                sampled[x] = 1
                live_max += 1
    bits, sbt, owner = _bits_alloc(2 * live_max + 64)
    cap = owner.size
    last = np.full(n_ids, -1, dtype=np.int32)
    if fixed_rate:
        # two passes: the filter alone over every access (a tight loop), then the sampled ones — on a 10M stream at
        # R = 0.01, 25 ms in one loop against 17.5 ms in two (A/B, same distances); out_t holds the sampled ids between
        k = 0
        for i in range(ids.size):
            x = ids[i]
            if sampled[x]:
                out_t[k] = x
                k += 1
        _stack_pass(out_t, k, bits, sbt, owner, last, out_d)  # the sample's own exact stack distances
        out_t[:k] = threshold
        return k
    heap_h = np.zeros(max(s_max, 0) + 2, dtype=np.int64)
    heap_i = np.zeros(max(s_max, 0) + 2, dtype=np.int64)
    hsize = 0
    tracked = 0
    total = 0
    t = 0
    k = 0
    for i in range(ids.size):  # fixed-size: the threshold falls as the sample fills
        x = ids[i]
        hx = hashes[x]
        if hx >= threshold:
            continue
        if t == cap:
            t = _bits_compact(bits, sbt, owner, last, t)
        p = last[x]
        if p < 0:
            out_d[k] = -1
            total += 1
            tracked += 1
            if s_max > 0:
                hsize = _heap_push(heap_h, heap_i, hsize, hx, x)
        else:
            out_d[k] = total - _bits_live_upto(bits, sbt, p)
            _bits_clear(bits, sbt, p)
            owner[p] = -1
        out_t[k] = threshold
        k += 1
        _bits_set(bits, sbt, t)
        owner[t] = x
        last[x] = t
        t += 1
        while s_max > 0 and tracked > s_max:
            hy, y, hsize = _heap_pop(heap_h, heap_i, hsize)
            threshold = hy
            py = last[y]
            if py >= 0:
                _bits_clear(bits, sbt, py)
                owner[py] = -1
                last[y] = -1
                total -= 1
            tracked -= 1
    return k


@attrs.frozen(eq=False)
class ShardsResult:
    scaled_distances: np.ndarray  # distance / R at the time (−1 cold)
    weights: np.ndarray  # R_final / R_then
    final_rate: float
    sampled_accesses: int
    total_accesses: int
    fixed_rate: bool

    def hit_ratio(self, capacities: np.ndarray) -> np.ndarray:
        caps = np.asarray(capacities, dtype=np.int64)
        hits = hits_at(self.scaled_distances, caps, self.weights)
        expected = self.final_rate * self.total_accesses
        adjusted = (hits + (expected - float(self.weights.sum())) * (caps >= 1)) / max(expected, 1e-300)
        return np.clip(adjusted, 0.0, 1.0)


def shards(ids: np.ndarray, *, rate: float | None = None, s_max: int | None = None, seed: int = 0) -> ShardsResult:
    """SHARDS sampling of a per-access stream: fixed-rate (``rate``) or fixed-size (``s_max``)."""
    from .stack import _dense

    a, n_ids = _dense(ids, "ids")
    check_non_negative_int("seed", seed)  # a NaN or 1.5 seed reached the kernel's hash as a float
    if (rate is None) == (s_max is None):
        raise ConfigError("rate", "give exactly one of rate= (fixed-rate) or s_max= (fixed-size)")
    if rate is not None:
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 < rate <= 1:
            raise ConfigError("rate", f"must be a number in (0, 1], got {rate!r}")
        threshold, smax = max(1, int(round(rate * SHARDS_MODULUS))), 0
    else:
        if isinstance(s_max, bool) or not isinstance(s_max, int) or not 0 < s_max <= 1 << 40:
            raise ConfigError("s_max", f"must be an int in [1, 2**40], got {s_max!r}")
        threshold, smax = SHARDS_MODULUS, s_max
    out_d = np.empty(a.size, dtype=np.int64)
    out_t = np.empty(a.size, dtype=np.int64)
    k = _shards_kernel(a, max(n_ids, 1), threshold, smax, seed, out_d, out_t) if a.size else 0
    d, th = out_d[:k], out_t[:k]
    rate_then = th / SHARDS_MODULUS
    final_t = int(th[-1]) if k else threshold
    scaled = np.where(d >= 0, np.floor(d / rate_then).astype(np.int64), -1)
    w = (final_t / SHARDS_MODULUS) / rate_then
    return ShardsResult(
        scaled_distances=scaled, weights=w, final_rate=final_t / SHARDS_MODULUS, sampled_accesses=int(k),
        total_accesses=int(a.size), fixed_rate=rate is not None,
    )


def mean_absolute_error(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.mean(np.abs(np.asarray(a) - np.asarray(b))))
