"""Numba replay kernels: the same decisions as the online policies, at trace speed.

Each kernel replays a request-level trace (dense block ids, CSR) exactly as
:func:`kvpolicy.eviction.replay.replay` does with the online object — lookup of
the leading resident run (hits within the matchable range), every run block
accessed and pinned, the rest inserted root first until the policy declines or
nothing is evictable — and returns per-reference hit flags and the victims in
order. Differential tests check hits *and* victims against the online objects on
random prefix traces.

Shared state: one pair of linked-list arrays (a block is in at most one list at a
time), per-block resident-children counts, and ``pin[id] == r`` for blocks pinned
by the current request r (pins only live within a request in replay, and a
request pins a whole chain from the root, so "pinned or above a pinned block"
is just "pinned"). A block is an eviction candidate iff it is resident, has no
resident child and is not pinned.

LRU needs no candidate scan: with tail-first order (a request's blocks are
ordered deepest → root at the most-recent end) every child precedes its parent,
so the least recent block is always an unpinned leaf unless every resident block
belongs to the current request.
"""

from __future__ import annotations

from typing import Any

import numba as nb
import numpy as np

from ..errors import ConfigError
from .replay import ReplayResult

NIL = -1


# ----------------------------------------------------------------------------- lists


@nb.njit(cache=True, inline="always")
def _push_tail(L, x, prev, nxt, head, tail, where, size):
    where[x] = L
    prev[x] = tail[L]
    nxt[x] = NIL
    if tail[L] != NIL:
        nxt[tail[L]] = x
    else:
        head[L] = x
    tail[L] = x
    size[L] += 1


@nb.njit(cache=True, inline="always")
def _unlink(x, prev, nxt, head, tail, where, size):
    L = where[x]
    p, n = prev[x], nxt[x]
    if p != NIL:
        nxt[p] = n
    else:
        head[L] = n
    if n != NIL:
        prev[n] = p
    else:
        tail[L] = p
    where[x] = NIL
    size[L] -= 1


@nb.njit(cache=True, inline="always")
def _insert_before(L, x, before, prev, nxt, head, tail, where, size):
    """Insert x just before ``before`` (toward the head) in list L."""
    where[x] = L
    p = prev[before]
    prev[x] = p
    nxt[x] = before
    prev[before] = x
    if p != NIL:
        nxt[p] = x
    else:
        head[L] = x
    size[L] += 1


def _state(n_ids: int) -> tuple[np.ndarray, ...]:
    prev = np.full(n_ids, NIL, dtype=np.int64)
    nxt = np.full(n_ids, NIL, dtype=np.int64)
    where = np.full(n_ids, NIL, dtype=np.int64)
    children = np.zeros(n_ids, dtype=np.int64)
    pin = np.full(n_ids, -1, dtype=np.int64)
    parent = np.full(n_ids, NIL, dtype=np.int64)
    return prev, nxt, where, children, pin, parent


# ----------------------------------------------------------------------------- LRU / FIFO / SIEVE


@nb.njit(cache=True)
def lru_kernel(offsets, ids, matchable, cap, n_ids, hits, victims):
    prev = np.full(n_ids, NIL, np.int64)
    nxt = np.full(n_ids, NIL, np.int64)
    where = np.full(n_ids, NIL, np.int64)
    head = np.full(1, NIL, np.int64)
    tail = np.full(1, NIL, np.int64)
    size = np.zeros(1, np.int64)
    parent = np.full(n_ids, NIL, np.int64)
    nv = 0
    for r in range(offsets.size - 1):
        s, e = offsets[r], offsets[r + 1]
        j = s
        while j < e and where[ids[j]] != NIL:
            j += 1
        h = j - s
        for k in range(s, s + min(h, matchable[r])):
            hits[k] = True
        # the run moves to the most-recent end, deepest first, root last
        for k in range(j - 1, s - 1, -1):
            _unlink(ids[k], prev, nxt, head, tail, where, size)
            _push_tail(0, ids[k], prev, nxt, head, tail, where, size)
        seg = ids[j - 1] if h > 0 else NIL  # the request's least recent block so far
        while j < e:
            x = ids[j]
            if size[0] >= cap:
                v = head[0]
                if v == NIL or (h > 0 or j > s) and _in_request(v, ids, s, j):
                    break
                _unlink(v, prev, nxt, head, tail, where, size)
                victims[nv] = v
                nv += 1
            parent[x] = ids[j - 1] if j > s else NIL
            if seg == NIL:
                _push_tail(0, x, prev, nxt, head, tail, where, size)
            else:
                _insert_before(0, x, seg, prev, nxt, head, tail, where, size)
            seg = x
            j += 1
    return nv


@nb.njit(cache=True, inline="always")
def _in_request(v, ids, s, j):
    for k in range(s, j):
        if ids[k] == v:
            return True
    return False


@nb.njit(cache=True)
def fifo_kernel(offsets, ids, matchable, cap, n_ids, hits, victims):
    prev = np.full(n_ids, NIL, np.int64)
    nxt = np.full(n_ids, NIL, np.int64)
    where = np.full(n_ids, NIL, np.int64)
    head = np.full(1, NIL, np.int64)
    tail = np.full(1, NIL, np.int64)
    size = np.zeros(1, np.int64)
    children = np.zeros(n_ids, np.int64)
    pin = np.full(n_ids, -1, np.int64)
    parent = np.full(n_ids, NIL, np.int64)
    nv = 0
    for r in range(offsets.size - 1):
        s, e = offsets[r], offsets[r + 1]
        j = s
        while j < e and where[ids[j]] != NIL:
            pin[ids[j]] = r
            j += 1
        for k in range(s, s + min(j - s, matchable[r])):
            hits[k] = True
        npinned = j - s
        while j < e:
            x = ids[j]
            if size[0] >= cap:
                if size[0] - npinned < 1:
                    break
                v = head[0]
                while children[v] > 0 or pin[v] == r:
                    _unlink(v, prev, nxt, head, tail, where, size)
                    _push_tail(0, v, prev, nxt, head, tail, where, size)
                    v = head[0]
                _unlink(v, prev, nxt, head, tail, where, size)
                if parent[v] != NIL:
                    children[parent[v]] -= 1
                victims[nv] = v
                nv += 1
            parent[x] = ids[j - 1] if j > s else NIL
            if parent[x] != NIL:
                children[parent[x]] += 1
            _push_tail(0, x, prev, nxt, head, tail, where, size)
            pin[x] = r
            npinned += 1
            j += 1
    return nv


@nb.njit(cache=True)
def sieve_kernel(offsets, ids, matchable, cap, n_ids, hits, victims):
    prev = np.full(n_ids, NIL, np.int64)  # prev = older, nxt = newer
    nxt = np.full(n_ids, NIL, np.int64)
    where = np.full(n_ids, NIL, np.int64)
    head = np.full(1, NIL, np.int64)  # oldest
    tail = np.full(1, NIL, np.int64)  # newest
    size = np.zeros(1, np.int64)
    children = np.zeros(n_ids, np.int64)
    pin = np.full(n_ids, -1, np.int64)
    parent = np.full(n_ids, NIL, np.int64)
    visited = np.zeros(n_ids, np.bool_)
    hand = NIL
    nv = 0
    for r in range(offsets.size - 1):
        s, e = offsets[r], offsets[r + 1]
        j = s
        while j < e and where[ids[j]] != NIL:
            visited[ids[j]] = True
            pin[ids[j]] = r
            j += 1
        for k in range(s, s + min(j - s, matchable[r])):
            hits[k] = True
        npinned = j - s
        while j < e:
            x = ids[j]
            if size[0] >= cap:
                if size[0] - npinned < 1:
                    break
                k = hand if hand != NIL else head[0]
                while True:
                    if children[k] == 0 and pin[k] != r and not visited[k]:
                        break
                    visited[k] = False
                    k = nxt[k]
                    if k == NIL:
                        k = head[0]
                hand = nxt[k]
                _unlink(k, prev, nxt, head, tail, where, size)
                if parent[k] != NIL:
                    children[parent[k]] -= 1
                victims[nv] = k
                nv += 1
            parent[x] = ids[j - 1] if j > s else NIL
            if parent[x] != NIL:
                children[parent[x]] += 1
            visited[x] = False
            _push_tail(0, x, prev, nxt, head, tail, where, size)
            pin[x] = r
            npinned += 1
            j += 1
    return nv


# ----------------------------------------------------------------------------- S3-FIFO

S_Q, M_Q, G_Q = 0, 1, 2


@nb.njit(cache=True)
def s3fifo_kernel(offsets, ids, matchable, cap, n_ids, hits, victims, small_fraction):
    prev = np.full(n_ids, NIL, np.int64)
    nxt = np.full(n_ids, NIL, np.int64)
    where = np.full(n_ids, NIL, np.int64)
    head = np.full(3, NIL, np.int64)
    tail = np.full(3, NIL, np.int64)
    size = np.zeros(3, np.int64)
    children = np.zeros(n_ids, np.int64)
    pin = np.full(n_ids, -1, np.int64)
    parent = np.full(n_ids, NIL, np.int64)
    freq = np.zeros(n_ids, np.int64)
    cand = np.zeros(2, np.int64)
    small_bytes = small_fraction * cap
    ghost_cap = cap - small_bytes
    nv = 0
    for r in range(offsets.size - 1):
        s, e = offsets[r], offsets[r + 1]
        j = s
        while j < e and where[ids[j]] != NIL and where[ids[j]] != G_Q:
            x = ids[j]
            freq[x] = min(freq[x] + 1, 3)
            if children[x] == 0 and pin[x] != r:
                cand[where[x]] -= 1
            pin[x] = r
            j += 1
        for k in range(s, s + min(j - s, matchable[r])):
            hits[k] = True
        run_end = j
        npinned = j - s
        while j < e:
            x = ids[j]
            if size[0] + size[1] >= cap:
                if size[0] + size[1] - npinned < 1:
                    break
                while True:
                    use_small = (size[0] >= small_bytes and cand[0] > 0) or cand[1] == 0
                    if use_small:
                        t = head[S_Q]
                        is_c = children[t] == 0 and pin[t] != r
                        if (not is_c) or freq[t] > 1:
                            if is_c:
                                cand[0] -= 1
                            _unlink(t, prev, nxt, head, tail, where, size)
                            if freq[t] > 1:
                                freq[t] = 0
                            _push_tail(M_Q, t, prev, nxt, head, tail, where, size)
                            if is_c:
                                cand[1] += 1
                            continue
                        break
                    t = head[M_Q]
                    is_c = children[t] == 0 and pin[t] != r
                    if is_c and freq[t] == 0:
                        break
                    if is_c:
                        freq[t] -= 1
                    _unlink(t, prev, nxt, head, tail, where, size)
                    _push_tail(M_Q, t, prev, nxt, head, tail, where, size)
                q = where[t]
                cand[q] -= 1
                _unlink(t, prev, nxt, head, tail, where, size)
                p = parent[t]
                if p != NIL:
                    children[p] -= 1
                    if children[p] == 0 and pin[p] != r:
                        cand[where[p]] += 1
                if q == S_Q:
                    _push_tail(G_Q, t, prev, nxt, head, tail, where, size)
                    while size[G_Q] > ghost_cap and size[G_Q] > 0:
                        _unlink(head[G_Q], prev, nxt, head, tail, where, size)
                victims[nv] = t
                nv += 1
            p = ids[j - 1] if j > s else NIL
            parent[x] = p
            if p != NIL:
                children[p] += 1  # p is pinned (this request): no candidacy change
            freq[x] = 0
            if where[x] == G_Q:
                _unlink(x, prev, nxt, head, tail, where, size)
                _push_tail(M_Q, x, prev, nxt, head, tail, where, size)
            else:
                _push_tail(S_Q, x, prev, nxt, head, tail, where, size)
            pin[x] = r
            npinned += 1
            j += 1
        # unpin: blocks of this request that are leaves become candidates
        for k in range(s, j):
            x = ids[k]
            if children[x] == 0:
                cand[where[x]] += 1
            pin[x] = -1
        _ = run_end
    return nv


# ----------------------------------------------------------------------------- ARC

T1, T2, B1, B2 = 0, 1, 2, 3


@nb.njit(cache=True)
def arc_kernel(offsets, ids, matchable, cap, n_ids, hits, victims):
    prev = np.full(n_ids, NIL, np.int64)
    nxt = np.full(n_ids, NIL, np.int64)
    where = np.full(n_ids, NIL, np.int64)
    head = np.full(4, NIL, np.int64)
    tail = np.full(4, NIL, np.int64)
    size = np.zeros(4, np.int64)
    children = np.zeros(n_ids, np.int64)
    pin = np.full(n_ids, -1, np.int64)
    parent = np.full(n_ids, NIL, np.int64)
    cand = np.zeros(2, np.int64)
    p = 0.0
    c = cap
    nv = 0
    for r in range(offsets.size - 1):
        s, e = offsets[r], offsets[r + 1]
        j = s
        while j < e and (where[ids[j]] == T1 or where[ids[j]] == T2):
            x = ids[j]
            was = children[x] == 0 and pin[x] != r
            if was:
                cand[where[x]] -= 1
            _unlink(x, prev, nxt, head, tail, where, size)
            _push_tail(T2, x, prev, nxt, head, tail, where, size)
            pin[x] = r  # pinned: no longer a candidate
            j += 1
        for k in range(s, s + min(j - s, matchable[r])):
            hits[k] = True
        npinned = j - s
        while j < e:
            x = ids[j]
            adapted = False
            used = size[T1] + size[T2]
            if used + 1 > cap:
                if used - npinned < 1:
                    break
                # adapt p on a ghost hit (ARC's case II/III), before REPLACE
                if where[x] == B1:
                    p = min(float(c), p + max(size[B2] / size[B1], 1.0))
                    adapted = True
                elif where[x] == B2:
                    p = max(0.0, p - max(size[B1] / size[B2], 1.0))
                    adapted = True
                in_b2 = where[x] == B2
                from_t1 = cand[0] > 0 and (size[T1] > p or (in_b2 and size[T1] == p) or cand[1] == 0)
                q = T1 if from_t1 else T2
                t = head[q]
                while not (children[t] == 0 and pin[t] != r):
                    _unlink(t, prev, nxt, head, tail, where, size)
                    _push_tail(q, t, prev, nxt, head, tail, where, size)
                    t = head[q]
                cand[q] -= 1
                _unlink(t, prev, nxt, head, tail, where, size)
                pp = parent[t]
                if pp != NIL:
                    children[pp] -= 1
                    if children[pp] == 0 and pin[pp] != r:
                        cand[where[pp]] += 1
                _push_tail(B1 if q == T1 else B2, t, prev, nxt, head, tail, where, size)
                while size[B1] > c:
                    _unlink(head[B1], prev, nxt, head, tail, where, size)
                while size[B2] > c:
                    _unlink(head[B2], prev, nxt, head, tail, where, size)
                victims[nv] = t
                nv += 1
            if not adapted:
                if where[x] == B1:
                    p = min(float(c), p + max(size[B2] / size[B1], 1.0))
                elif where[x] == B2:
                    p = max(0.0, p - max(size[B1] / size[B2], 1.0))
            pa = ids[j - 1] if j > s else NIL
            parent[x] = pa
            if pa != NIL:
                children[pa] += 1
            if where[x] == B1 or where[x] == B2:
                _unlink(x, prev, nxt, head, tail, where, size)
                _push_tail(T2, x, prev, nxt, head, tail, where, size)
            else:
                if size[T1] + size[B1] >= c and size[B1] > 0:
                    _unlink(head[B1], prev, nxt, head, tail, where, size)
                elif size[T1] + size[T2] + size[B1] + size[B2] >= 2 * c and size[B2] > 0:
                    _unlink(head[B2], prev, nxt, head, tail, where, size)
                _push_tail(T1, x, prev, nxt, head, tail, where, size)
            pin[x] = r
            npinned += 1
            j += 1
        for k in range(s, j):
            x = ids[k]
            if children[x] == 0:
                cand[where[x]] += 1
            pin[x] = -1
    return nv


# ----------------------------------------------------------------------------- Belady


@nb.njit(cache=True, inline="always")
def _less(a0, a1, a2, b0, b1, b2):
    if a0 != b0:
        return a0 < b0
    if a1 != b1:
        return a1 < b1
    return a2 < b2


@nb.njit(cache=True)
def _hpush(hk0, hk1, hk2, hid, hver, n, k0, k1, k2, x, ver):
    i = n
    hk0[i], hk1[i], hk2[i], hid[i], hver[i] = k0, k1, k2, x, ver
    while i > 0:
        par = (i - 1) // 2
        if not _less(hk0[i], hk1[i], hk2[i], hk0[par], hk1[par], hk2[par]):
            break
        hk0[i], hk0[par] = hk0[par], hk0[i]
        hk1[i], hk1[par] = hk1[par], hk1[i]
        hk2[i], hk2[par] = hk2[par], hk2[i]
        hid[i], hid[par] = hid[par], hid[i]
        hver[i], hver[par] = hver[par], hver[i]
        i = par
    return n + 1


@nb.njit(cache=True)
def _hpop(hk0, hk1, hk2, hid, hver, n):
    n -= 1
    hk0[0], hk1[0], hk2[0], hid[0], hver[0] = hk0[n], hk1[n], hk2[n], hid[n], hver[n]
    i = 0
    while True:
        left = 2 * i + 1
        right = left + 1
        m = i
        if left < n and _less(hk0[left], hk1[left], hk2[left], hk0[m], hk1[m], hk2[m]):
            m = left
        if right < n and _less(hk0[right], hk1[right], hk2[right], hk0[m], hk1[m], hk2[m]):
            m = right
        if m == i:
            break
        hk0[i], hk0[m] = hk0[m], hk0[i]
        hk1[i], hk1[m] = hk1[m], hk1[i]
        hk2[i], hk2[m] = hk2[m], hk2[i]
        hid[i], hid[m] = hid[m], hid[i]
        hver[i], hver[m] = hver[m], hver[i]
        i = m
    return n


@nb.njit(cache=True)
def belady_kernel(offsets, ids, matchable, cap, n_ids, hits, victims, next_use, depth, bypass):
    resident = np.zeros(n_ids, np.bool_)
    children = np.zeros(n_ids, np.int64)
    pin = np.full(n_ids, -1, np.int64)
    parent = np.full(n_ids, NIL, np.int64)
    nu = np.zeros(n_ids, np.float64)
    seq = np.zeros(n_ids, np.int64)
    version = np.zeros(n_ids, np.int64)
    hmax = ids.size * 3 + 16
    hk0 = np.empty(hmax, np.float64)
    hk1 = np.empty(hmax, np.int64)
    hk2 = np.empty(hmax, np.int64)
    hid = np.empty(hmax, np.int64)
    hver = np.empty(hmax, np.int64)
    n = 0
    used = 0
    nseq = 0
    nv = 0
    for r in range(offsets.size - 1):
        s, e = offsets[r], offsets[r + 1]
        j = s
        while j < e and resident[ids[j]]:
            x = ids[j]
            nu[x] = next_use[j]
            version[x] += 1  # re-prioritised; pinned now, so not a candidate
            pin[x] = r
            j += 1
        for k in range(s, s + min(j - s, matchable[r])):
            hits[k] = True
        npinned = j - s
        while j < e:
            x = ids[j]
            if used + 1 > cap:
                if used - npinned < 1:
                    break
                while True:  # drop stale heap entries
                    t = hid[0]
                    if hver[0] == version[t] and resident[t] and children[t] == 0 and pin[t] != r:
                        break
                    n = _hpop(hk0, hk1, hk2, hid, hver, n)
                if bypass and not (next_use[j] < nu[t]):
                    break
                n = _hpop(hk0, hk1, hk2, hid, hver, n)
                resident[t] = False
                version[t] += 1
                used -= 1
                pp = parent[t]
                if pp != NIL:
                    children[pp] -= 1
                    if children[pp] == 0 and pin[pp] != r:
                        version[pp] += 1
                        n = _hpush(hk0, hk1, hk2, hid, hver, n, -nu[pp], -depth[pp], seq[pp], pp, version[pp])
                victims[nv] = t
                nv += 1
            pa = ids[j - 1] if j > s else NIL
            parent[x] = pa
            if pa != NIL:
                children[pa] += 1
            resident[x] = True
            used += 1
            nu[x] = next_use[j]
            depth[x] = j - s
            seq[x] = nseq
            nseq += 1
            version[x] += 1
            pin[x] = r
            npinned += 1
            j += 1
        for k in range(s, j):  # unpin: leaves become candidates, with their current next use
            x = ids[k]
            pin[x] = -1
            if children[x] == 0:
                version[x] += 1
                n = _hpush(hk0, hk1, hk2, hid, hver, n, -nu[x], -depth[x], seq[x], x, version[x])
        if n > hmax - 2 * (e - s) - 16:  # compact stale entries
            m = 0
            for i in range(n):
                t = hid[i]
                if hver[i] == version[t] and resident[t]:
                    hk0[m], hk1[m], hk2[m], hid[m], hver[m] = hk0[i], hk1[i], hk2[i], hid[i], hver[i]
                    m += 1
            n = 0
            for i in range(m):
                n = _hpush(hk0, hk1, hk2, hid, hver, n, hk0[i], hk1[i], hk2[i], hid[i], hver[i])
    return nv


# ----------------------------------------------------------------------------- driver

KERNEL_POLICIES = ("lru", "fifo", "sieve", "s3fifo", "arc", "belady", "belady-bypass")


def next_use_per_ref(trace: Any) -> np.ndarray:
    """For every block reference: the request index of the same block's next reference (inf if none)."""
    ids = trace.block_ids
    req = trace.request_of_block_ref()
    out = np.full(ids.size, np.inf)
    order = np.lexsort((req, ids))
    same = ids[order][1:] == ids[order][:-1]
    out[order[:-1][same]] = req[order][1:][same]
    return out


def replay_kernel(trace: Any, policy: str, capacity_blocks: int, *, small_fraction: float = 0.1) -> ReplayResult:
    """Kernel replay of ``policy`` (one of KERNEL_POLICIES): the same result as :func:`replay`."""
    if policy not in KERNEL_POLICIES:
        raise ConfigError("policy", f"no kernel for {policy!r}; kernels: {KERNEL_POLICIES}")
    if isinstance(capacity_blocks, bool) or not isinstance(capacity_blocks, int) or capacity_blocks < 0:
        raise ConfigError("capacity_blocks", f"must be a non-negative int, got {capacity_blocks!r}")
    off = trace.block_offsets
    ids = trace.block_ids
    n_ids = max(int(ids.max()) + 1 if ids.size else 1, 1)
    matchable = trace.matchable_blocks.astype(np.int64)
    hits = np.zeros(ids.size, dtype=np.bool_)
    victims = np.empty(ids.size + 1, dtype=np.int64)
    if policy == "lru":
        nv = lru_kernel(off, ids, matchable, capacity_blocks, n_ids, hits, victims)
    elif policy == "fifo":
        nv = fifo_kernel(off, ids, matchable, capacity_blocks, n_ids, hits, victims)
    elif policy == "sieve":
        nv = sieve_kernel(off, ids, matchable, capacity_blocks, n_ids, hits, victims)
    elif policy == "s3fifo":
        nv = s3fifo_kernel(off, ids, matchable, capacity_blocks, n_ids, hits, victims, small_fraction)
    elif policy == "arc":
        nv = arc_kernel(off, ids, matchable, capacity_blocks, n_ids, hits, victims)
    else:
        nv = belady_kernel(off, ids, matchable, capacity_blocks, n_ids, hits, victims, next_use_per_ref(trace), np.zeros(n_ids, np.int64), policy == "belady-bypass")
    name = policy
    return ReplayResult(name, capacity_blocks, hits, victims[:nv].tolist(), trace.block_size_tokens, trace.total_input_tokens)
