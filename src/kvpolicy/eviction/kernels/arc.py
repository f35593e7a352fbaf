"""ARC at trace speed. Reference: :class:`kvpolicy.eviction.policies.ARCPolicy`."""

from __future__ import annotations

import numba as nb
import numpy as np
from ._base import NIL, PREFETCH_AHEAD, _prefetch


# ----------------------------------------------------------------------------- ARC

T1, T2, B1, B2 = 0, 1, 2, 3


@nb.njit(cache=True)
def arc_kernel(offsets, ids, tokens, bsz, shift, cap, n_ids, hits, victims):
    # one 32-byte record per block, so a block's list links and metadata share a cache line:
    #   prev, next, list (NIL: none), resident children, pin (request), unused, parent, unused
    rec = np.zeros(8 * n_ids, np.int32)
    rec[0::8] = NIL
    rec[1::8] = NIL
    rec[2::8] = NIL
    rec[4::8] = -1
    rec[6::8] = NIL
    ht = np.full(12, NIL, np.int64)  # head[L] · tail[4 + L] · length[8 + L]
    ht[8:] = 0
    cand = np.zeros(2, np.int64)
    p = 0.0
    c = cap
    nv = 0
    for r in range(offsets.size - 1):
        s, e = offsets[r], offsets[r + 1]
        if s + PREFETCH_AHEAD < ids.size:
            _prefetch(rec, 8 * ids[s + PREFETCH_AHEAD])
        if s + PREFETCH_AHEAD // 2 < ids.size:  # its record arrived: prefetch its list neighbours (unlinked on a hit)
            y = ids[s + PREFETCH_AHEAD // 2]
            if rec[8 * y] != NIL:
                _prefetch(rec, 8 * rec[8 * y])
            if rec[8 * y + 1] != NIL:
                _prefetch(rec, 8 * rec[8 * y + 1])
        j = s
        while j < e and (rec[8 * ids[j] + 2] == T1 or rec[8 * ids[j] + 2] == T2):
            x = ids[j]
            was = rec[8 * x + 3] == 0 and rec[8 * x + 4] != r
            if was:
                cand[rec[8 * x + 2]] -= 1
            _x = x
            _L = rec[8 * _x + 2]
            _p = rec[8 * _x]
            _q = rec[8 * _x + 1]
            if _p != NIL:
                rec[8 * _p + 1] = _q
            else:
                ht[_L] = _q
            if _q != NIL:
                rec[8 * _q] = _p
            else:
                ht[4 + _L] = _p
            rec[8 * _x + 2] = NIL
            ht[8 + _L] -= 1
            _L = T2
            _x = x
            _t = ht[4 + _L]
            rec[8 * _x + 2] = _L
            rec[8 * _x] = _t
            rec[8 * _x + 1] = NIL
            if _t != NIL:
                rec[8 * _t + 1] = _x
            else:
                ht[_L] = _x
            ht[4 + _L] = _x
            ht[8 + _L] += 1
            rec[8 * x + 4] = r  # pinned: no longer a candidate
            j += 1
        if j > s:  # hits: the run, at most floor((T − 1) / B) blocks
            t = max(tokens[r] - 1, 0)
            m = t >> shift if shift >= 0 else t // bsz
            for k in range(s, s + min(j - s, m)):
                hits[k] = True
        npinned = j - s
        while j < e:
            x = ids[j]
            adapted = False
            used = ht[8 + T1] + ht[8 + T2]
            if used + 1 > cap:
                if used - npinned < 1:
                    break
                # adapt p on a ghost hit (ARC's case II/III), before REPLACE
                if rec[8 * x + 2] == B1:
                    p = min(float(c), p + max(ht[8 + B2] / ht[8 + B1], 1.0))
                    adapted = True
                elif rec[8 * x + 2] == B2:
                    p = max(0.0, p - max(ht[8 + B1] / ht[8 + B2], 1.0))
                    adapted = True
                in_b2 = rec[8 * x + 2] == B2
                from_t1 = cand[0] > 0 and (ht[8 + T1] > p or (in_b2 and ht[8 + T1] == p) or cand[1] == 0)
                q = T1 if from_t1 else T2
                t = ht[q]
                if not (rec[8 * t + 3] == 0 and rec[8 * t + 4] != r):
                    # the oldest blocks that are not candidates rotate to the MRU end, in their order, as the online
                    # ARC rotates them one at a time: find the first candidate, then move the run before it in one
                    # splice (on long chains the run is a chain's whole prefix, evicted leaf by leaf)
                    u = t
                    while True:
                        v = rec[8 * u + 1]
                        if rec[8 * v + 3] == 0 and rec[8 * v + 4] != r:
                            break
                        u = v
                    # run = ht[q] .. u; v = the first candidate (a candidate exists in q: cand[q] > 0)
                    tail = ht[4 + q]
                    ht[q] = v
                    rec[8 * v] = NIL
                    rec[8 * tail + 1] = t
                    rec[8 * t] = tail
                    rec[8 * u + 1] = NIL
                    ht[4 + q] = u
                    t = v
                cand[q] -= 1
                _x = t
                _L = rec[8 * _x + 2]
                _p = rec[8 * _x]
                _q = rec[8 * _x + 1]
                if _p != NIL:
                    rec[8 * _p + 1] = _q
                else:
                    ht[_L] = _q
                if _q != NIL:
                    rec[8 * _q] = _p
                else:
                    ht[4 + _L] = _p
                rec[8 * _x + 2] = NIL
                ht[8 + _L] -= 1
                pp = rec[8 * t + 6]
                if pp != NIL:
                    rec[8 * pp + 3] -= 1
                    if rec[8 * pp + 3] == 0 and rec[8 * pp + 4] != r:
                        cand[rec[8 * pp + 2]] += 1
                _L = B1 if q == T1 else B2
                _x = t
                _t = ht[4 + _L]
                rec[8 * _x + 2] = _L
                rec[8 * _x] = _t
                rec[8 * _x + 1] = NIL
                if _t != NIL:
                    rec[8 * _t + 1] = _x
                else:
                    ht[_L] = _x
                ht[4 + _L] = _x
                ht[8 + _L] += 1
                while ht[8 + B1] > c:
                    _x = ht[B1]
                    _L = rec[8 * _x + 2]
                    _p = rec[8 * _x]
                    _q = rec[8 * _x + 1]
                    if _p != NIL:
                        rec[8 * _p + 1] = _q
                    else:
                        ht[_L] = _q
                    if _q != NIL:
                        rec[8 * _q] = _p
                    else:
                        ht[4 + _L] = _p
                    rec[8 * _x + 2] = NIL
                    ht[8 + _L] -= 1
                while ht[8 + B2] > c:
                    _x = ht[B2]
                    _L = rec[8 * _x + 2]
                    _p = rec[8 * _x]
                    _q = rec[8 * _x + 1]
                    if _p != NIL:
                        rec[8 * _p + 1] = _q
                    else:
                        ht[_L] = _q
                    if _q != NIL:
                        rec[8 * _q] = _p
                    else:
                        ht[4 + _L] = _p
                    rec[8 * _x + 2] = NIL
                    ht[8 + _L] -= 1
                victims[nv] = t
                nv += 1
            if not adapted:
                if rec[8 * x + 2] == B1:
                    p = min(float(c), p + max(ht[8 + B2] / ht[8 + B1], 1.0))
                elif rec[8 * x + 2] == B2:
                    p = max(0.0, p - max(ht[8 + B1] / ht[8 + B2], 1.0))
            if j > s:  # a chain id always has the same parent: written once, kept
                rec[8 * x + 6] = ids[j - 1]
                rec[8 * ids[j - 1] + 3] += 1
            if rec[8 * x + 2] == B1 or rec[8 * x + 2] == B2:
                _x = x
                _L = rec[8 * _x + 2]
                _p = rec[8 * _x]
                _q = rec[8 * _x + 1]
                if _p != NIL:
                    rec[8 * _p + 1] = _q
                else:
                    ht[_L] = _q
                if _q != NIL:
                    rec[8 * _q] = _p
                else:
                    ht[4 + _L] = _p
                rec[8 * _x + 2] = NIL
                ht[8 + _L] -= 1
                _L = T2
                _x = x
                _t = ht[4 + _L]
                rec[8 * _x + 2] = _L
                rec[8 * _x] = _t
                rec[8 * _x + 1] = NIL
                if _t != NIL:
                    rec[8 * _t + 1] = _x
                else:
                    ht[_L] = _x
                ht[4 + _L] = _x
                ht[8 + _L] += 1
            else:
                if ht[8 + T1] + ht[8 + B1] >= c and ht[8 + B1] > 0:
                    _x = ht[B1]
                    _L = rec[8 * _x + 2]
                    _p = rec[8 * _x]
                    _q = rec[8 * _x + 1]
                    if _p != NIL:
                        rec[8 * _p + 1] = _q
                    else:
                        ht[_L] = _q
                    if _q != NIL:
                        rec[8 * _q] = _p
                    else:
                        ht[4 + _L] = _p
                    rec[8 * _x + 2] = NIL
                    ht[8 + _L] -= 1
                elif ht[8 + T1] + ht[8 + T2] + ht[8 + B1] + ht[8 + B2] >= 2 * c and ht[8 + B2] > 0:
                    _x = ht[B2]
                    _L = rec[8 * _x + 2]
                    _p = rec[8 * _x]
                    _q = rec[8 * _x + 1]
                    if _p != NIL:
                        rec[8 * _p + 1] = _q
                    else:
                        ht[_L] = _q
                    if _q != NIL:
                        rec[8 * _q] = _p
                    else:
                        ht[4 + _L] = _p
                    rec[8 * _x + 2] = NIL
                    ht[8 + _L] -= 1
                _L = T1
                _x = x
                _t = ht[4 + _L]
                rec[8 * _x + 2] = _L
                rec[8 * _x] = _t
                rec[8 * _x + 1] = NIL
                if _t != NIL:
                    rec[8 * _t + 1] = _x
                else:
                    ht[_L] = _x
                ht[4 + _L] = _x
                ht[8 + _L] += 1
            rec[8 * x + 4] = r
            npinned += 1
            j += 1
        for k in range(s, j):
            x = ids[k]
            if rec[8 * x + 3] == 0:
                cand[rec[8 * x + 2]] += 1
            rec[8 * x + 4] = -1
    return nv
