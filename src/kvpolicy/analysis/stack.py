"""Exact reuse (stack) distances.

``stack_distances(ids)``: for every access, the number of distinct *other* ids
referenced since the previous access to the same id (−1 on a first access). LRU
with capacity C hits an access iff its distance < C, so one pass gives the miss
ratio of every capacity at once.

The kernel keeps a Fenwick tree over time holding 1 at the latest access of each
id; the distance is the count of live marks after the id's previous access. The
tree is compacted (live marks renumbered in order) whenever it fills, so it stays
~2× the number of distinct ids instead of the trace length: O(N log M) time,
O(M) memory. The weighted variant puts a weight (bytes) on each mark and returns
the *volume* of distinct data in between. ``stack_distances_reference`` is the
O(N·M) brute force they must equal.

Unit weights (the common case) use a faster structure with the same answers: a
bitset of live marks (one bit per time slot, ~2 bits per distinct id, so it
stays in cache) plus a Fenwick tree over 512-slot superblocks; counting the
marks after a slot is one tree walk over a few thousand entries plus at most
eight hardware popcounts.

``request_stack_distances(trace)``: the same for a request-level trace, with the
semantics of a prefix cache: all blocks of a request are *looked up* against the
cache as it was when the request arrived, and then *inserted*, tail block first
— so a chain's root is always more recent than its descendants, the LRU-resident
set stays prefix-closed, and LRU evicts tail blocks first, as vLLM does.
"""

from __future__ import annotations

import numba as nb
import numpy as np
from numba.core import types
from numba.extending import intrinsic

from ..errors import ConfigError
from ..traces.model import _min_max

_SB_WORDS = 8  # 64-bit words per superblock: 512 time slots
_UNIT_MAX_IDS = 1 << 29  # the bitset kernels keep slots in int32: 2 slots per id must fit


@nb.njit(cache=True, inline="always")
def _bit_add(tree, i, v):
    n = tree.size - 1
    i += 1
    while i <= n:
        tree[i] += v
        i += i & (-i)


@nb.njit(cache=True, inline="always")
def _bit_prefix(tree, i):
    """Sum of positions 0..i inclusive."""
    s = 0
    i += 1
    while i > 0:
        s += tree[i]
        i -= i & (-i)
    return s


@intrinsic
def _popcount64(typingctx, x):  # type: ignore[no-untyped-def]
    """LLVM ``ctpop`` on a uint64 (a single instruction on x86-64 and arm64)."""
    sig = types.uint64(types.uint64)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        fn = builder.module.declare_intrinsic("llvm.ctpop", [args[0].type])
        return builder.call(fn, args)

    return sig, codegen


@nb.njit(cache=True, inline="always")
def _bits_live_upto(bits, sbt, p):
    """Live marks at slots 0..p inclusive."""
    w = p >> 6
    sb = w // _SB_WORDS
    c = _bit_prefix(sbt, sb - 1) if sb > 0 else 0
    for k in range(sb * _SB_WORDS, w):
        c += _popcount64(bits[k])
    mask = np.uint64(0xFFFFFFFFFFFFFFFF) >> np.uint64(63 - (p & 63))
    return c + _popcount64(bits[w] & mask)


@nb.njit(cache=True, inline="always")
def _bits_set(bits, sbt, p):
    bits[p >> 6] |= np.uint64(1) << np.uint64(p & 63)
    _bit_add(sbt, (p >> 6) // _SB_WORDS, 1)


@nb.njit(cache=True, inline="always")
def _bits_clear(bits, sbt, p):
    bits[p >> 6] &= ~(np.uint64(1) << np.uint64(p & 63))
    _bit_add(sbt, (p >> 6) // _SB_WORDS, -1)


@nb.njit(cache=True)
def _bits_compact(bits, sbt, owner, last, t):
    """Renumber live slots 0..k−1 in time order; rebuild bitset and tree. Returns k."""
    k = 0
    for pos in range(t):
        x = owner[pos]
        if x >= 0 and last[x] == pos:
            owner[k] = x
            last[x] = k
            k += 1
    owner[k:] = -1
    bits[:] = 0
    sbt[:] = 0
    for pos in range(k):
        bits[pos >> 6] |= np.uint64(1) << np.uint64(pos & 63)
    n = sbt.size - 1
    for sb in range(n):
        c = 0
        for w in range(sb * _SB_WORDS, (sb + 1) * _SB_WORDS):
            c += _popcount64(bits[w])
        sbt[sb + 1] = c
    for i in range(1, n + 1):
        j = i + (i & (-i))
        if j <= n:
            sbt[j] += sbt[i]
    return k


@nb.njit(cache=True)
def _bits_alloc(cap_slots):
    n_sb = (cap_slots + 64 * _SB_WORDS - 1) // (64 * _SB_WORDS)
    bits = np.zeros(n_sb * _SB_WORDS, dtype=np.uint64)
    sbt = np.zeros(n_sb + 1, dtype=np.int64)
    owner = np.full(n_sb * _SB_WORDS * 64, -1, dtype=np.int32)
    return bits, sbt, owner


@nb.njit(cache=True)
def _stack_kernel_unit(ids, n_ids, out):
    bits, sbt, owner = _bits_alloc(max(2 * n_ids, 64))
    last = np.full(n_ids, -1, dtype=np.int32)  # int32 halves the one random-access array
    _stack_pass(ids, ids.size, bits, sbt, owner, last, out)


@nb.njit(cache=True)
def _stack_pass(ids, k, bits, sbt, owner, last, out):
    """Exact LRU stack distances of ``ids[:k]`` into ``out[:k]`` (−1: first use), on a bit array of at least twice
    the distinct ids' slots (compacted when full); ``last`` is −1 for every id. SHARDS runs it on its sample."""
    cap = owner.size
    total = 0
    t = 0
    for i in range(k):
        x = ids[i]
        if t == cap:
            t = _bits_compact(bits, sbt, owner, last, t)
        p = last[x]
        if p < 0:
            out[i] = -1
            total += 1
        else:
            out[i] = total - _bits_live_upto(bits, sbt, p)
            _bits_clear(bits, sbt, p)
            owner[p] = -1
        _bits_set(bits, sbt, t)
        owner[t] = x
        last[x] = t
        t += 1


@nb.njit(cache=True)
def _request_stack_kernel_unit(offsets, ids, n_ids, out):
    max_len = 0
    for r in range(offsets.size - 1):
        max_len = max(max_len, offsets[r + 1] - offsets[r])
    bits, sbt, owner = _bits_alloc(max(2 * n_ids, 2 * max_len + 64))
    cap = owner.size
    last = np.full(n_ids, -1, dtype=np.int32)
    total = 0
    t = 0
    for r in range(offsets.size - 1):
        s = offsets[r]
        e = offsets[r + 1]
        for j in range(s, e):  # lookups against the cache as the request found it
            p = last[ids[j]]
            out[j] = -1 if p < 0 else total - _bits_live_upto(bits, sbt, p)
        if t + (e - s) > cap:
            t = _bits_compact(bits, sbt, owner, last, t)
        for j in range(e - 1, s - 1, -1):  # inserts, tail first: the root ends most recent
            x = ids[j]
            p = last[x]
            if p < 0:
                total += 1
            else:
                _bits_clear(bits, sbt, p)
                owner[p] = -1
            _bits_set(bits, sbt, t)
            owner[t] = x
            last[x] = t
            t += 1


@nb.njit(cache=True)
def _compact(tree, owner, last, weight, t):
    """Renumber live marks 0..k−1 in time order; rebuild the tree. Returns k."""
    k = 0
    for pos in range(t):
        x = owner[pos]
        if x >= 0 and last[x] == pos:
            owner[k] = x
            last[x] = k
            k += 1
    for pos in range(k, owner.size):
        owner[pos] = -1
    tree[:] = 0
    for pos in range(k):
        tree[pos + 1] = weight[owner[pos]]
    n = tree.size - 1
    for i in range(1, n + 1):
        j = i + (i & (-i))
        if j <= n:
            tree[j] += tree[i]
    return k


@nb.njit(cache=True)
def _stack_kernel(ids, n_ids, weight, out):
    cap = max(2 * n_ids, 64)
    tree = np.zeros(cap + 1, dtype=np.int64)
    owner = np.full(cap, -1, dtype=np.int64)
    last = np.full(n_ids, -1, dtype=np.int64)
    total = 0
    t = 0
    for i in range(ids.size):
        x = ids[i]
        w = weight[x]
        if t == cap:
            t = _compact(tree, owner, last, weight, t)
        p = last[x]
        if p < 0:
            out[i] = -1
            total += w
        else:
            out[i] = total - _bit_prefix(tree, p)
            _bit_add(tree, p, -w)
            owner[p] = -1
        _bit_add(tree, t, w)
        owner[t] = x
        last[x] = t
        t += 1


@nb.njit(cache=True)
def _request_stack_kernel(offsets, ids, n_ids, weight, out):
    """Look up every block of a request first, then insert them tail first."""
    cap = max(2 * n_ids, 64)
    n_req = offsets.size - 1
    max_len = 0
    for r in range(n_req):
        if offsets[r + 1] - offsets[r] > max_len:
            max_len = offsets[r + 1] - offsets[r]
    cap = max(cap, 2 * max_len + 64)
    tree = np.zeros(cap + 1, dtype=np.int64)
    owner = np.full(cap, -1, dtype=np.int64)
    last = np.full(n_ids, -1, dtype=np.int64)
    total = 0
    t = 0
    for r in range(n_req):
        s = offsets[r]
        e = offsets[r + 1]
        for j in range(s, e):  # lookups against the cache as the request found it
            p = last[ids[j]]
            out[j] = -1 if p < 0 else total - _bit_prefix(tree, p)
        if t + (e - s) > cap:
            t = _compact(tree, owner, last, weight, t)
        for j in range(e - 1, s - 1, -1):  # inserts, tail first: the root ends most recent
            x = ids[j]
            w = weight[x]
            p = last[x]
            if p < 0:
                total += w
            else:
                _bit_add(tree, p, -w)
                owner[p] = -1
            _bit_add(tree, t, w)
            owner[t] = x
            last[x] = t
            t += 1


def _dense(ids: np.ndarray, field: str) -> tuple[np.ndarray, int]:
    a = np.ascontiguousarray(ids)
    if a.ndim != 1 or (a.size and not np.issubdtype(a.dtype, np.integer)):
        raise ConfigError(field, "must be a 1-D integer array")
    a = a.astype(np.int64, copy=False)
    lo, hi = _min_max(a) if a.size else (0, -1)
    if lo < 0:
        raise ConfigError(field, "ids must be non-negative (remap them with kvpolicy.traces.first_appearance_ids)")
    n_ids = int(hi) + 1
    if n_ids > max(64 * a.size, 1 << 24):  # the kernels keep a slot per id: raw hashes as ids would allocate 2**63 of them
        raise ConfigError(field, f"ids must be dense: the largest is {n_ids - 1:,} for {a.size:,} accesses "
                                 "(remap them with kvpolicy.traces.first_appearance_ids)")
    return a, n_ids


def _weights(weights: np.ndarray | None, n_ids: int) -> np.ndarray:
    if weights is None:
        return np.ones(max(n_ids, 1), dtype=np.int64)
    w = np.ascontiguousarray(weights, dtype=np.int64)
    if w.ndim != 1 or w.size < n_ids:
        raise ConfigError("weights", f"needs one weight per id (at least {n_ids})")
    if w.size and w.min() < 0:
        raise ConfigError("weights", "must be non-negative")
    return w


def stack_distances(ids: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
    """Exact stack distance of every access (−1 on a first access).

    ``ids`` must be dense non-negative ints (see
    :func:`kvpolicy.traces.first_appearance_ids`); with ``weights[id]`` (e.g. bytes)
    the distance is the total weight of the distinct other ids in between.
    """
    a, n_ids = _dense(ids, "ids")
    out = np.empty(a.size, dtype=np.int64)
    if a.size:
        if weights is None and n_ids <= _UNIT_MAX_IDS:
            _stack_kernel_unit(a, n_ids, out)
        else:
            _stack_kernel(a, n_ids, _weights(weights, n_ids), out)
    return out


def request_stack_distances(offsets: np.ndarray, ids: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
    """Stack distance of every block reference of a request-level trace (CSR).

    Lookup-then-insert, tail-first semantics (module doc). Aligned with ``ids``.
    """
    a, n_ids = _dense(ids, "ids")
    off = np.ascontiguousarray(offsets, dtype=np.int64)
    if off.ndim != 1 or off.size < 1 or off[0] != 0 or off[-1] != a.size or np.any(np.diff(off) < 0):
        raise ConfigError("offsets", "must be CSR offsets from 0 to len(ids), non-decreasing")
    out = np.empty(a.size, dtype=np.int64)
    if a.size:
        if weights is None and n_ids <= _UNIT_MAX_IDS and a.size <= _UNIT_MAX_IDS:
            _request_stack_kernel_unit(off, a, n_ids, out)
        else:
            _request_stack_kernel(off, a, n_ids, _weights(weights, n_ids), out)
    return out


def stack_distances_reference(ids, weights=None) -> np.ndarray:
    """O(N·M) brute force: an explicit LRU stack (list), for testing the kernel."""
    stack: list[int] = []
    out = []
    for x in [int(v) for v in ids]:
        if x in stack:
            k = stack.index(x)
            out.append(sum(1 if weights is None else int(weights[y]) for y in stack[:k]))
            stack.pop(k)
        else:
            out.append(-1)
        stack.insert(0, x)
    return np.asarray(out, dtype=np.int64)


def request_stack_distances_reference(offsets, ids, weights=None) -> np.ndarray:
    """Brute force of :func:`request_stack_distances`."""
    stack: list[int] = []
    out = []
    ids = [int(v) for v in ids]
    offsets = [int(v) for v in offsets]
    for r in range(len(offsets) - 1):
        req = ids[offsets[r] : offsets[r + 1]]
        for x in req:
            if x in stack:
                k = stack.index(x)
                out.append(sum(1 if weights is None else int(weights[y]) for y in stack[:k]))
            else:
                out.append(-1)
        for x in reversed(req):
            if x in stack:
                stack.remove(x)
            stack.insert(0, x)
    return np.asarray(out, dtype=np.int64)
