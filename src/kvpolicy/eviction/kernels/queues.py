"""LRU, FIFO and SIEVE at trace speed. References: :class:`kvpolicy.eviction.policies.LRUPolicy`, ``FIFOPolicy``, ``SievePolicy``."""

from __future__ import annotations

import numba as nb
import numpy as np
from ._base import NIL, PREFETCH_AHEAD, QUEUE_AHEAD, _prefetch


# ----------------------------------------------------------------------------- LRU / FIFO / SIEVE


@nb.njit(cache=True)
def lru_kernel(offsets, ids, tokens, bsz, shift, cap, n_ids, hits, victims):
    prev = np.full(n_ids, NIL, np.int32)  # toward the least recent end
    nxt = np.full(n_ids, NIL, np.int32)  # toward the most recent end
    res = np.zeros(n_ids, np.bool_)
    head = NIL  # least recent
    tail = NIL  # most recent
    size = 0
    nv = 0
    for r in range(offsets.size - 1):
        s = offsets[r]
        e = offsets[r + 1]
        if s + PREFETCH_AHEAD < ids.size:
            y = ids[s + PREFETCH_AHEAD]
            _prefetch(res, y)
            _prefetch(prev, y)
            _prefetch(nxt, y)
        if head != NIL and nxt[head] != NIL:  # the victim after the next one
            y = nxt[head]
            _prefetch(res, y)
            _prefetch(prev, y)
            _prefetch(nxt, y)
        j = s
        while j < e and res[ids[j]]:
            j += 1
        h = j - s
        if j > s:  # hits: the run, at most floor((T − 1) / B) blocks
            t = max(tokens[r] - 1, 0)
            m = t >> shift if shift >= 0 else t // bsz
            for k in range(s, s + min(j - s, m)):
                hits[k] = True
        # the run moves to the most recent end, deepest first, root last
        for k in range(j - 1, s - 1, -1):
            x = ids[k]
            if x != tail:
                p = prev[x]
                n = nxt[x]
                if p != NIL:
                    nxt[p] = n
                else:
                    head = n
                prev[n] = p
                prev[x] = tail
                nxt[x] = NIL
                nxt[tail] = x
                tail = x
        seg = ids[j - 1] if h > 0 else NIL  # the request's least recent block so far
        while j < e:
            x = ids[j]
            if size >= cap:
                v = head
                if v == NIL or (seg != NIL and v == seg):
                    break  # every resident block belongs to this request (pinned)
                head = nxt[v]
                if head != NIL:
                    prev[head] = NIL
                else:
                    tail = NIL
                res[v] = False
                size -= 1
                victims[nv] = v
                nv += 1
            if seg == NIL:  # the request's first block: most recent end
                prev[x] = tail
                nxt[x] = NIL
                if tail != NIL:
                    nxt[tail] = x
                else:
                    head = x
                tail = x
            else:  # deeper than the run so far: just before it
                p = prev[seg]
                prev[x] = p
                nxt[x] = seg
                prev[seg] = x
                if p != NIL:
                    nxt[p] = x
                else:
                    head = x
            res[x] = True
            size += 1
            seg = x
            j += 1
    return nv


@nb.njit(cache=True, inline="always")
def _ring_push(ring, head, count, n, x):
    """Write x at a ring's newest end (the caller counts it)."""
    t = head + count
    ring[t - n if t >= n else t] = x


@nb.njit(cache=True, inline="always")
def _ring_rotate(ring, head, count, n):
    """Move a ring's oldest entry to its newest end (also when the ring is full); the new head."""
    t = head + count
    if t >= n:
        t -= n
    ring[t] = ring[head]
    head += 1
    return 0 if head == n else head


@nb.njit(cache=True, inline="always")
def _in_run(v, ids, s, j):
    for k in range(s, j):
        if ids[k] == v:
            return True
    return False


@nb.njit(cache=True)
def fifo_kernel(offsets, ids, tokens, bsz, shift, cap, n_ids, hits, victims):
    # In replay FIFO only ever leaves from the oldest end (evicted, or rotated to
    # the newest end when it is not evictable), so the queue is a ring of ``cap``
    # slots read in order, not a linked list: only the per-block records are
    # random accesses.
    ring_n = max(cap, 1)
    ring = np.empty(ring_n, np.int32)
    qh = 0  # slot of the oldest block
    res = np.zeros(n_ids, np.bool_)
    fam = np.zeros(2 * n_ids, np.int32)  # interleaved per block: resident children, parent
    fam[1::2] = NIL
    size = 0
    nv = 0
    for r in range(offsets.size - 1):
        s = offsets[r]
        e = offsets[r + 1]
        if s + PREFETCH_AHEAD < ids.size:
            y = ids[s + PREFETCH_AHEAD]
            _prefetch(res, y)
            _prefetch(fam, 2 * y)
        if size > QUEUE_AHEAD:  # the records the oldest end will reach next
            qt = qh + QUEUE_AHEAD
            y = ring[qt - ring_n if qt >= ring_n else qt]
            _prefetch(fam, 2 * y)
            _prefetch(res, y)
        j = s
        while j < e and res[ids[j]]:
            j += 1
        if j > s:  # hits: the run, at most floor((T − 1) / B) blocks
            t = max(tokens[r] - 1, 0)
            m = t >> shift if shift >= 0 else t // bsz
            for k in range(s, s + min(j - s, m)):
                hits[k] = True
        npinned = j - s
        while j < e:
            x = ids[j]
            if size >= cap:
                if size - npinned < 1:
                    break
                v = ring[qh]
                # not evictable (a resident child, or pinned = in this request's run ids[s:j]): rotate to the newest end
                while fam[2 * v] > 0 or _in_run(v, ids, s, j):
                    qh = _ring_rotate(ring, qh, size, ring_n)
                    v = ring[qh]
                qh += 1
                if qh == ring_n:
                    qh = 0
                res[v] = False
                size -= 1
                pv = fam[2 * v + 1]
                if pv != NIL:
                    fam[2 * pv] -= 1
                victims[nv] = v
                nv += 1
            if j > s:  # a chain id always has the same parent: written once, kept
                fam[2 * x + 1] = ids[j - 1]
                fam[2 * ids[j - 1]] += 1
            _ring_push(ring, qh, size, ring_n, x)
            res[x] = True
            size += 1
            npinned += 1
            j += 1
    return nv


@nb.njit(cache=True)
def sieve_kernel(offsets, ids, tokens, bsz, shift, cap, n_ids, hits, victims):
    # SIEVE's queue in insertion order as an array with holes: blocks only leave at
    # the hand, so a removed slot just becomes a hole; the array is compacted when
    # it fills (every ~cap inserts, amortised O(1)). The hand walks the array in
    # order and only the per-block record is a random access.
    qn = 2 * max(cap, 1) + 2
    q = np.empty(qn, np.int32)
    lo = 0  # at or before the oldest live slot
    hi = 0  # the next slot to fill
    hand = -1  # slot of the hand; -1: start from the oldest
    res = np.zeros(n_ids, np.bool_)
    meta = np.zeros(4 * n_ids, np.int32)  # interleaved per block: resident children, pin (request), parent, visited
    meta[1::4] = -1
    meta[2::4] = NIL
    size = 0
    nv = 0
    for r in range(offsets.size - 1):
        s = offsets[r]
        e = offsets[r + 1]
        if s + PREFETCH_AHEAD < ids.size:
            y = ids[s + PREFETCH_AHEAD]
            _prefetch(res, y)
            _prefetch(meta, 4 * y)
        j = s
        while j < e and res[ids[j]]:
            x = ids[j]
            meta[4 * x + 3] = 1
            meta[4 * x + 1] = r
            j += 1
        if j > s:  # hits: the run, at most floor((T − 1) / B) blocks
            t = max(tokens[r] - 1, 0)
            m = t >> shift if shift >= 0 else t // bsz
            for k in range(s, s + min(j - s, m)):
                hits[k] = True
        npinned = j - s
        while j < e:
            x = ids[j]
            if size >= cap:
                if size - npinned < 1:
                    break
                if hand < 0:
                    while q[lo] == NIL:
                        lo += 1
                    pos = lo
                else:
                    pos = hand
                while True:
                    k = q[pos]
                    if meta[4 * k] == 0 and meta[4 * k + 1] != r and meta[4 * k + 3] == 0:
                        break
                    meta[4 * k + 3] = 0
                    pos += 1
                    while pos < hi and q[pos] == NIL:
                        pos += 1
                    if pos == hi:  # past the newest: back to the oldest
                        while q[lo] == NIL:
                            lo += 1
                        pos = lo
                q[pos] = NIL
                hp = pos + 1  # the hand stays on the next newer block, if any
                while hp < hi and q[hp] == NIL:
                    hp += 1
                hand = hp if hp < hi else -1
                res[k] = False
                size -= 1
                pk = meta[4 * k + 2]
                if pk != NIL:
                    meta[4 * pk] -= 1
                victims[nv] = k
                nv += 1
            if j > s:  # a chain id always has the same parent: written once, kept
                meta[4 * x + 2] = ids[j - 1]
                meta[4 * ids[j - 1]] += 1
            meta[4 * x + 3] = 0
            if hi == qn:  # compact: drop the holes, keep the order and the hand
                m = 0
                nh = -1
                for i in range(lo, hi):
                    if i == hand:
                        nh = m
                    if q[i] != NIL:
                        q[m] = q[i]
                        m += 1
                lo = 0
                hi = m
                hand = nh
            q[hi] = x
            hi += 1
            res[x] = True
            size += 1
            meta[4 * x + 1] = r
            npinned += 1
            j += 1
    return nv
