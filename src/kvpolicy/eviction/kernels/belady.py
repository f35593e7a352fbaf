"""Belady (and Belady with bypass) at trace speed. Reference: :class:`kvpolicy.eviction.policies.BeladyPolicy`."""

from __future__ import annotations

import numba as nb
import numpy as np
from ._base import INF_USE, NIL, PREFETCH_AHEAD, _prefetch


# ----------------------------------------------------------------------------- Belady


# The heap is one int64 array of (key, payload) pairs: key = (2**31 − 1 − depth) << 32 | seq
# orders by depth (deepest first), then seq (oldest first) in one comparison;
# payload = id << 32 | version. Depth and seq are below 2**31 (int32 positions).


@nb.njit(cache=True, inline="always")
def _hpush(h, n, key, payload):
    i = n
    while i > 0:  # sift up: move parents down until the key fits
        par = (i - 1) >> 1
        if h[2 * par] <= key:
            break
        h[2 * i] = h[2 * par]
        h[2 * i + 1] = h[2 * par + 1]
        i = par
    h[2 * i] = key
    h[2 * i + 1] = payload
    return n + 1


@nb.njit(cache=True, inline="always")
def _hpop(h, n):
    n -= 1
    key = h[2 * n]
    payload = h[2 * n + 1]
    i = 0
    while True:  # sift down the last entry from the root
        m = 2 * i + 1
        if m >= n:
            break
        if m + 1 < n and h[2 * (m + 1)] < h[2 * m]:
            m += 1
        if key <= h[2 * m]:
            break
        h[2 * i] = h[2 * m]
        h[2 * i + 1] = h[2 * m + 1]
        i = m
    h[2 * i] = key
    h[2 * i + 1] = payload
    return n


@nb.njit(cache=True, inline="always")
def _hkey(depth, seq):
    return ((np.int64(2**31 - 1) - depth) << 32) | seq


@nb.njit(cache=True, inline="always")
def _hpayload(x, ver):
    return (np.int64(x) << 32) | (np.int64(ver) & 0xFFFFFFFF)


@nb.njit(cache=True, inline="always")
def _msb(x):
    """Index of the highest set bit of a non-zero uint64 (six halving steps)."""
    r = 0
    if x >> np.uint64(32):
        x >>= np.uint64(32)
        r += 32
    if x >> np.uint64(16):
        x >>= np.uint64(16)
        r += 16
    if x >> np.uint64(8):
        x >>= np.uint64(8)
        r += 8
    if x >> np.uint64(4):
        x >>= np.uint64(4)
        r += 4
    if x >> np.uint64(2):
        x >>= np.uint64(2)
        r += 2
    if x >> np.uint64(1):
        r += 1
    return r


@nb.njit(cache=True, inline="always")
def _bits_top(words, summary, top_word):
    """Highest set bit at or below summary word ``top_word`` (−1 if none)."""
    w1 = top_word
    while w1 >= 0:
        sw = summary[w1]
        if sw != 0:
            w0 = w1 * 64 + _msb(sw)
            return w0 * 64 + _msb(words[w0])
        w1 -= 1
    return -1


@nb.njit(cache=True)
def belady_kernel(offsets, ids, tokens, bsz, shift, cap, n_ids, hits, victims, next_use, bypass):
    """MIN over candidates keyed (−next use, −depth, seq).

    Finite next uses are request indices: one bucket per index (entries chained
    in a pool), found through a two-level bitset; a bucket is scanned for the
    deepest, then oldest, valid candidate. Blocks never used again go to a heap
    keyed (−depth, seq). Entries are invalidated lazily by a per-block version.
    """
    n_req = offsets.size - 1
    # one 32-byte record per block: resident, children, pin, parent, version, seq, depth, next use (INF_USE = never)
    meta = np.zeros(8 * n_ids, np.int32)
    meta[2::8] = -1
    meta[3::8] = NIL
    # finite buckets
    bhead = np.full(n_req + 1, NIL, np.int32)
    n_w0 = (n_req + 1 + 63) // 64
    words = np.zeros(n_w0, np.uint64)
    summary = np.zeros((n_w0 + 63) // 64, np.uint64)
    top_word = -1
    pool_cap = ids.size * 2 + 16
    pool = np.empty(3 * pool_cap, np.int32)  # interleaved entries: block id, version, next entry in the bucket
    n_pool = 0
    free = NIL
    # never used again: heap of (depth/seq key, id/version payload) pairs
    hmax = ids.size * 2 + 16
    h = np.empty(2 * hmax, np.int64)
    n = 0
    used = 0
    nseq = 0
    nv = 0
    for r in range(n_req):
        s = offsets[r]
        e = offsets[r + 1]
        if s + PREFETCH_AHEAD < ids.size:
            _prefetch(meta, 8 * ids[s + PREFETCH_AHEAD])
            y = next_use[s + PREFETCH_AHEAD]
            if y != INF_USE:  # the bucket that block will be pushed into
                _prefetch(bhead, y)
                _prefetch(words, y >> 6)
        j = s
        while j < e and meta[8 * (ids[j]) + 0]:
            x = ids[j]
            meta[8 * (x) + 7] = next_use[j]
            meta[8 * (x) + 4] += 1  # re-prioritised; pinned now, so not a candidate
            meta[8 * (x) + 2] = r
            j += 1
        if j > s:  # hits: the run, at most floor((T − 1) / B) blocks
            t = max(tokens[r] - 1, 0)
            m = t >> shift if shift >= 0 else t // bsz
            for k in range(s, s + min(j - s, m)):
                hits[k] = True
        npinned = j - s
        while j < e:
            x = ids[j]
            if used + 1 > cap:
                if used - npinned < 1:
                    break
                # the victim: never-used-again candidates first (deepest, oldest), else the furthest finite next use
                t = NIL
                while n > 0:
                    c = h[1] >> 32
                    if (h[1] & 0xFFFFFFFF) == (np.int64(meta[8 * (c) + 4]) & 0xFFFFFFFF) and meta[8 * (c) + 0] and meta[8 * (c) + 1] == 0 and meta[8 * (c) + 2] != r:
                        t = c
                        break
                    n = _hpop(h, n)
                in_heap = t != NIL
                while t == NIL:
                    key = _bits_top(words, summary, top_word)
                    best = NIL
                    prev_e = NIL
                    cur = bhead[key]
                    while cur != NIL:  # drop stale entries, pick deepest then oldest
                        nxt_e = pool[3 * (cur) + 2]
                        c = pool[3 * (cur) + 0]
                        if pool[3 * (cur) + 1] == meta[8 * (c) + 4] and meta[8 * (c) + 0] and meta[8 * (c) + 1] == 0 and meta[8 * (c) + 2] != r:
                            if best == NIL or meta[8 * (c) + 6] > meta[8 * (best) + 6] or (meta[8 * (c) + 6] == meta[8 * (best) + 6] and meta[8 * (c) + 5] < meta[8 * (best) + 5]):
                                best = c
                            prev_e = cur
                        else:
                            if prev_e == NIL:
                                bhead[key] = nxt_e
                            else:
                                pool[3 * (prev_e) + 2] = nxt_e
                            pool[3 * (cur) + 2] = free
                            free = cur
                        cur = nxt_e
                    if best != NIL:
                        t = best
                    else:  # empty bucket: clear its bit
                        w0 = key // 64
                        words[w0] &= ~(np.uint64(1) << np.uint64(key % 64))
                        if words[w0] == 0:
                            summary[w0 // 64] &= ~(np.uint64(1) << np.uint64(w0 % 64))
                            while top_word >= 0 and summary[top_word] == 0:
                                top_word -= 1
                if bypass and not (next_use[j] < meta[8 * (t) + 7]):
                    break
                if in_heap:
                    n = _hpop(h, n)
                meta[8 * (t) + 0] = 0
                meta[8 * (t) + 4] += 1  # its bucket entry goes stale
                used -= 1
                pp = meta[8 * (t) + 3]
                if pp != NIL:
                    meta[8 * (pp) + 1] -= 1
                    if meta[8 * (pp) + 1] == 0 and meta[8 * (pp) + 2] != r:
                        meta[8 * (pp) + 4] += 1
                        if meta[8 * (pp) + 7] == INF_USE:
                            n = _hpush(h, n, _hkey(meta[8 * (pp) + 6], meta[8 * (pp) + 5]), _hpayload(pp, meta[8 * (pp) + 4]))
                        else:
                            key = meta[8 * (pp) + 7]
                            if free != NIL:
                                slot = free
                                free = pool[3 * (slot) + 2]
                            else:
                                slot = n_pool
                                n_pool += 1
                            pool[3 * (slot) + 0] = pp
                            pool[3 * (slot) + 1] = meta[8 * (pp) + 4]
                            pool[3 * (slot) + 2] = bhead[key]
                            bhead[key] = slot
                            w0 = key // 64
                            words[w0] |= np.uint64(1) << np.uint64(key % 64)
                            summary[w0 // 64] |= np.uint64(1) << np.uint64(w0 % 64)
                            if w0 // 64 > top_word:
                                top_word = w0 // 64
                victims[nv] = t
                nv += 1
            pa = ids[j - 1] if j > s else NIL
            meta[8 * (x) + 3] = pa
            if pa != NIL:
                meta[8 * (pa) + 1] += 1
            meta[8 * (x) + 0] = 1
            used += 1
            meta[8 * (x) + 7] = next_use[j]
            meta[8 * (x) + 6] = j - s
            meta[8 * (x) + 5] = nseq
            nseq += 1
            meta[8 * (x) + 4] += 1
            meta[8 * (x) + 2] = r
            npinned += 1
            j += 1
        for k in range(s, j):  # unpin: leaves become candidates, with their current next use
            x = ids[k]
            meta[8 * (x) + 2] = -1
            if meta[8 * (x) + 1] == 0:
                meta[8 * (x) + 4] += 1
                if meta[8 * (x) + 7] == INF_USE:
                    n = _hpush(h, n, _hkey(meta[8 * (x) + 6], meta[8 * (x) + 5]), _hpayload(x, meta[8 * (x) + 4]))
                else:
                    key = meta[8 * (x) + 7]
                    if free != NIL:
                        slot = free
                        free = pool[3 * (slot) + 2]
                    else:
                        slot = n_pool
                        n_pool += 1
                    pool[3 * (slot) + 0] = x
                    pool[3 * (slot) + 1] = meta[8 * (x) + 4]
                    pool[3 * (slot) + 2] = bhead[key]
                    bhead[key] = slot
                    w0 = key // 64
                    words[w0] |= np.uint64(1) << np.uint64(key % 64)
                    summary[w0 // 64] |= np.uint64(1) << np.uint64(w0 % 64)
                    if w0 // 64 > top_word:
                        top_word = w0 // 64
        if n > hmax - 2 * (e - s) - 16:  # compact stale heap entries
            m = 0
            for i in range(n):
                c = h[2 * i + 1] >> 32
                if (h[2 * i + 1] & 0xFFFFFFFF) == (np.int64(meta[8 * (c) + 4]) & 0xFFFFFFFF) and meta[8 * (c) + 0]:
                    h[2 * m] = h[2 * i]
                    h[2 * m + 1] = h[2 * i + 1]
                    m += 1
            n = 0
            for i in range(m):
                n = _hpush(h, n, h[2 * i], h[2 * i + 1])
    return nv
