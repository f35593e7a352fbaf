"""The priority policies (LFU, GDSF, TTL, reuse-distance) at trace speed, one heap kernel. References: their classes in :mod:`kvpolicy.eviction.policies`."""

from __future__ import annotations

import math

import numba as nb
import numpy as np
from ._base import NIL, PREFETCH_AHEAD, _prefetch


# ----------------------------------------------------------------------------- priority policies (LFU, GDSF, TTL, reuse-distance)
# The online PriorityPolicy keeps a heap of (priority tuple, seq, version) and pushes a block whenever it may be a
# candidate; pushes it invalidates at once (an insert, or a hit, followed by the request's own pin) decide nothing, so
# the kernel makes only the pushes that can stand: a request's last block when it is unpinned as a leaf, and a parent
# whose last child was just evicted. A priority tuple (a, b, −depth) and the seq tie-break are three heap words —
# a and b float64, then (2**31 − 1 − depth) << 32 | seq — compared in that order, as Python compares the tuples.

PRIO_LFU, PRIO_GDSF, PRIO_TTL, PRIO_REUSE = 0, 1, 2, 3
PRIORITY_KINDS = {"lfu": PRIO_LFU, "gdsf": PRIO_GDSF, "ttl": PRIO_TTL, "reuse-distance": PRIO_REUSE}


@nb.njit(cache=True, inline="always")
def _plt(hf, hi, i, a, b, c):
    """Heap entry i orders before (a, b, c). An entry is two float64 words (a, b) in ``hf`` and two int64 words
    (c, payload) in ``hi`` (measured no faster than four separate arrays on the one-block stream, nor slower)."""
    if hf[2 * i] != a:
        return hf[2 * i] < a
    if hf[2 * i + 1] != b:
        return hf[2 * i + 1] < b
    return hi[2 * i] < c


@nb.njit(cache=True, inline="always")
def _pset(hf, hi, i, a, b, c, payload):
    hf[2 * i] = a
    hf[2 * i + 1] = b
    hi[2 * i] = c
    hi[2 * i + 1] = payload


@nb.njit(cache=True)
def _ppush(hf, hi, n, a, b, c, payload):  # pragma: no cover - compiled
    """Push onto a 4-ary heap (half the levels of a binary one; measured no faster than binary here — the per-block
    record, not the heap, was the cost)."""
    i = n
    while i > 0:
        par = (i - 1) >> 2
        if _plt(hf, hi, par, a, b, c):
            break
        _pset(hf, hi, i, hf[2 * par], hf[2 * par + 1], hi[2 * par], hi[2 * par + 1])
        i = par
    _pset(hf, hi, i, a, b, c, payload)
    return n + 1


@nb.njit(cache=True)
def _ppop(hf, hi, n):  # pragma: no cover - compiled
    """Pop the root, bottom-up (Floyd): the hole goes down to a leaf along the least children, with no comparison
    against the entry that fills it — the heap's last, usually among its largest (a push lands near the bottom) —
    which then climbs from there, seldom far. 1.04x on reuse-distance, 1.05x on LFU, GDSF even (A/B, one-block
    stream); any correct heap makes the same decisions (one valid entry per block, keys unique). The climb is
    _ppush's loop written out again: shared through an inline helper, both kernels ran 2-4 % slower (A/B)."""
    n -= 1
    a = hf[2 * n]
    b = hf[2 * n + 1]
    c = hi[2 * n]
    payload = hi[2 * n + 1]
    i = 0
    while True:
        m = 4 * i + 1
        if m >= n:
            break
        last = min(m + 4, n)
        for k in range(m + 1, last):
            if _plt(hf, hi, k, hf[2 * m], hf[2 * m + 1], hi[2 * m]):
                m = k
        _pset(hf, hi, i, hf[2 * m], hf[2 * m + 1], hi[2 * m], hi[2 * m + 1])
        i = m
    while i > 0:
        par = (i - 1) >> 2
        if _plt(hf, hi, par, a, b, c):
            break
        _pset(hf, hi, i, hf[2 * par], hf[2 * par + 1], hi[2 * par], hi[2 * par + 1])
        i = par
    _pset(hf, hi, i, a, b, c, payload)
    return n


@nb.njit(cache=True, inline="always")
def _pkey(kind, rec, recf, ext, x, L, w, ttl_s, aging, boost, c_eff):
    """(a, b) of block x's priority tuple now (W: reuse-distance's learned wait, 0 before its first observation)."""
    if kind == PRIO_LFU:
        return float(rec[8 * x + 6]), recf[8 * x + 7]
    if kind == PRIO_GDSF:
        return L + (1 + rec[8 * x + 6]) * (1.0 + (np.int64(2**31 - 1) - (rec[8 * x + 5] >> 32))) / 1.0, 0.0
    if kind == PRIO_TTL:
        return recf[8 * x + 7] + ttl_s, 0.0
    h = rec[8 * x + 6]
    sh = aging * w if h == 0 else (-boost * w if h >= 2 else 0.0)
    est = ext[4 * x + 2]
    return (0.0 if (not np.isnan(est) and est > c_eff) else 1.0), recf[8 * x + 7] - sh


@nb.njit(cache=True)
def priority_kernel(offsets, ids, tokens, bsz, shift, cap, n_ids, t_now, kind, ttl_s, ewma, aging, boost, c_eff, hits, victims):
    """LFU ``(hits, last access, −depth)``, GDSF ``(L + (1 + hits)·(1 + depth), −depth)``, TTL ``(last access + ttl,
    −depth)`` with expiry before each request, and reuse-distance ``(not doomed, last access − shift, −depth)`` with
    its EWMA and learned W — each then by insertion order, as :class:`~kvpolicy.eviction.base.PriorityPolicy` does.

    One 64-byte record per block (resident, resident children, pin, parent, version, (2**31 − 1 − depth) << 32 | seq,
    hits, last access as float64 bits) so a reference touches one cache line; reuse-distance keeps three more words
    apart (insert time, V at last use, the EWMA reuse distance). GDSF's floor L rises to the victim's heap key, the
    value it was pushed with; after each eviction the next victim's record is prefetched."""
    n_req = offsets.size - 1
    rec = np.zeros(8 * n_ids, np.int64)
    rec[2::8] = -1
    rec[3::8] = NIL
    recf = rec.view(np.float64)
    ext = np.zeros(4 * n_ids if kind == PRIO_REUSE else 4, np.float64)
    if kind == PRIO_REUSE:
        ext[2::4] = np.nan
    hcap = min(4 * max(cap, 1), ids.size + n_req) + 64  # valid entries <= min(cap, blocks); pushes <= requests + evictions
    hf = np.empty(2 * hcap, np.float64)
    hi = np.empty(2 * hcap, np.int64)
    hn = 0
    stale_pops = 0  # stale entries popped since the last compaction
    used = 0
    nseq = 0
    nv = 0
    L = 0.0
    V = 0.0
    log_w = 0.0
    n_w = 0
    w_s = 0.0  # W = exp(log_w) once a first reuse was seen, else 0 (recomputed only when log_w moves)
    top = np.int64(2**31 - 1)
    for r in range(n_req):
        now = t_now[r]
        s = offsets[r]
        e = offsets[r + 1]
        if s + PREFETCH_AHEAD < ids.size:
            _prefetch(rec, 8 * ids[s + PREFETCH_AHEAD])
            if ext.size > 4:
                _prefetch(ext, 4 * ids[s + PREFETCH_AHEAD])
        j = s
        for phase in range(2):  # 0: TTL expiry before the request; 1: the request
            if phase == 0 and kind != PRIO_TTL:
                continue
            if phase == 1:
                while j < e and rec[8 * ids[j]]:
                    x = ids[j]
                    rec[8 * x + 6] += 1
                    recf[8 * x + 7] = now
                    if kind == PRIO_REUSE:
                        d = max(V - ext[4 * x + 1], 1.0)
                        est = ext[4 * x + 2]
                        ext[4 * x + 2] = d if np.isnan(est) else (1 - ewma) * est + ewma * d
                        ext[4 * x + 1] = V
                        if rec[8 * x + 6] == 1:  # first reuse: W learns how long it waited
                            wait = max(now - ext[4 * x], 1e-6)
                            n_w += 1
                            log_w += (math.log(wait) - log_w) / n_w
                            w_s = math.exp(log_w)
                    rec[8 * x + 2] = r
                    j += 1
                if j > s:
                    t = max(tokens[r] - 1, 0)
                    m = t >> shift if shift >= 0 else t // bsz
                    for k in range(s, s + min(j - s, m)):
                        hits[k] = True
            while True:
                if phase == 1:
                    if j >= e:
                        break
                    if used + 1 > cap and used - (j - s) < 1:  # every resident block is this request's: CapacityError
                        break
                if phase == 0 or used + 1 > cap:  # the top valid candidate goes
                    t_ = NIL
                    while hn > 0:
                        c_ = hi[1] >> 32
                        if (hi[1] & 0xFFFFFFFF) == (rec[8 * c_ + 4] & 0xFFFFFFFF) and rec[8 * c_] and rec[8 * c_ + 1] == 0 and rec[8 * c_ + 2] != r:
                            t_ = c_
                            break
                        hn = _ppop(hf, hi, hn)
                        stale_pops += 1
                    if t_ == NIL or (phase == 0 and recf[8 * t_ + 7] + ttl_s > now):
                        break  # nothing (more) expired; or no candidate at all, which freeable >= 1 rules out
                    v_top = hf[0]  # GDSF: the value the victim was pushed with
                    hn = _ppop(hf, hi, hn)
                    if hn > 0:  # the next victim's record, fetched while this one is handled
                        _prefetch(rec, 8 * (hi[1] >> 32))
                    rec[8 * t_] = 0
                    rec[8 * t_ + 4] += 1
                    used -= 1
                    pp = rec[8 * t_ + 3]
                    if pp != NIL:
                        rec[8 * pp + 1] -= 1
                        if rec[8 * pp + 1] == 0 and rec[8 * pp + 2] != r:  # the parent is a candidate: pushed with today's priority
                            rec[8 * pp + 4] += 1
                            a_, b_ = _pkey(kind, rec, recf, ext, pp, L, w_s, ttl_s, aging, boost, c_eff)
                            if hn == hcap:
                                hn = _pcompact(hf, hi, hn, rec)
                                stale_pops = 0
                            hn = _ppush(hf, hi, hn, a_, b_, rec[8 * pp + 5], (pp << 32) | (rec[8 * pp + 4] & 0xFFFFFFFF))
                    if kind == PRIO_GDSF and v_top > L:  # the evicted block's value is the new floor (after its parent's push)
                        L = v_top
                    if phase == 0:
                        continue
                    victims[nv] = t_
                    nv += 1
                    continue
                # insert ids[j] under the block before it
                x = ids[j]
                pa = ids[j - 1] if j > s else NIL
                rec[8 * x] = 1
                rec[8 * x + 3] = pa
                dp = np.int64(0)
                if pa != NIL:
                    rec[8 * pa + 1] += 1
                    dp = top - (rec[8 * pa + 5] >> 32) + 1
                rec[8 * x + 5] = ((top - dp) << 32) | nseq
                nseq += 1
                rec[8 * x + 6] = 0
                recf[8 * x + 7] = now
                if kind == PRIO_REUSE:
                    ext[4 * x] = now
                    ext[4 * x + 1] = V
                    ext[4 * x + 2] = np.nan
                    V += 1.0
                used += 1
                rec[8 * x + 2] = r
                j += 1
        if j > s:  # unpin: the request's last block is a candidate if it is a leaf
            x = ids[j - 1]
            rec[8 * x + 2] = -1
            if rec[8 * x + 1] == 0:
                rec[8 * x + 4] += 1
                a_, b_ = _pkey(kind, rec, recf, ext, x, L, w_s, ttl_s, aging, boost, c_eff)
                # compact when full, or early when stale entries are surfacing: a stale pop costs a sift as deep as a
                # victim's, and a compaction one pass; early only past 1.25x the resident blocks, so each pass is paid
                # for by at least a quarter of the capacity in pushes (amortised O(1))
                if hn == hcap or (4 * stale_pops > hn - used and 4 * hn > 5 * used + 256):
                    hn = _pcompact(hf, hi, hn, rec)
                    stale_pops = 0
                hn = _ppush(hf, hi, hn, a_, b_, rec[8 * x + 5], (x << 32) | (rec[8 * x + 4] & 0xFFFFFFFF))
    return nv


@nb.njit(cache=True)
def _pcompact(hf, hi, hn, rec):  # pragma: no cover - compiled
    """Drop stale entries and rebuild the heap (the order of valid entries is a total order: nothing changes)."""
    m = 0
    for i in range(hn):
        c_ = hi[2 * i + 1] >> 32
        if (hi[2 * i + 1] & 0xFFFFFFFF) == (rec[8 * c_ + 4] & 0xFFFFFFFF) and rec[8 * c_] and rec[8 * c_ + 1] == 0:
            _pset(hf, hi, m, hf[2 * i], hf[2 * i + 1], hi[2 * i], hi[2 * i + 1])
            m += 1
    n = 0
    for i in range(m):
        n = _ppush(hf, hi, n, hf[2 * i], hf[2 * i + 1], hi[2 * i], hi[2 * i + 1])
    return n
