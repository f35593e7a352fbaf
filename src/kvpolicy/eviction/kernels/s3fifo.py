"""S3-FIFO at trace speed. Reference: :class:`kvpolicy.eviction.policies.S3FIFOPolicy`."""

from __future__ import annotations

import numba as nb
import numpy as np
from ._base import NIL, PREFETCH_AHEAD, QUEUE_AHEAD, _prefetch
from .queues import _ring_push, _ring_rotate


# ----------------------------------------------------------------------------- S3-FIFO

S_Q, M_Q, G_Q, NO_Q = 0, 1, 2, 3
S3_MAX_CAP = 2**26  # the ghost array (≈ 2·cap entries) must stay below the 2**27 versions a record holds


@nb.njit(cache=True)
def s3fifo_kernel(offsets, ids, tokens, bsz, shift, cap, n_ids, hits, victims, small_fraction):
    # S and M only ever lose their oldest block (evicted, promoted or rotated), so
    # both are rings read in order. The ghost also loses a block from its middle
    # (a ghost hit): its array keeps (id, version) entries in order, a ghost hit
    # leaves a stale entry behind (the block's version or queue moved on), stale
    # entries are skipped at the oldest end and dropped when the array is
    # compacted (amortised O(1)). Per block one 16-byte record:
    #   children, pin (request), parent, packed = freq | queue << 2 | ghost version << 4
    # (16 rather than 32 bytes: a million blocks' records then fit in L3). A block
    # has at most one entry per array slot, so versions modulo 2**27 never collide
    # while the array holds fewer than 2**27 entries (cap < S3_MAX_CAP).
    meta = np.zeros(4 * n_ids, np.int32)
    meta[1::4] = -1
    meta[2::4] = NIL
    meta[3::4] = NO_Q << 2
    rn = max(cap, 1) + 1
    sq = np.empty(rn, np.int32)
    sh = 0
    sn = 0
    mq = np.empty(rn, np.int32)
    mh = 0
    mn = 0
    gsize = 2 * rn + 16
    gq = np.empty(2 * gsize, np.int32)  # interleaved entries: id, version
    gh = 0  # oldest entry
    ge = 0  # next entry to fill
    glive = 0
    cand = np.zeros(2, np.int64)
    small_bytes = small_fraction * cap
    ghost_cap = cap - small_bytes
    nv = 0
    for r in range(offsets.size - 1):
        s, e = offsets[r], offsets[r + 1]
        if s + PREFETCH_AHEAD < ids.size:
            _prefetch(meta, 4 * ids[s + PREFETCH_AHEAD])
        # and the records the queues will reach next: S's and M's oldest few, the ghost's
        if sn > QUEUE_AHEAD:
            qt = sh + QUEUE_AHEAD
            _prefetch(meta, 4 * sq[qt - rn if qt >= rn else qt])
        if mn > QUEUE_AHEAD:
            qt = mh + QUEUE_AHEAD
            _prefetch(meta, 4 * mq[qt - rn if qt >= rn else qt])
        if gh + QUEUE_AHEAD < ge:
            _prefetch(meta, 4 * gq[2 * (gh + QUEUE_AHEAD)])
        j = s
        while j < e:
            x = ids[j]
            a = 4 * x
            pk = meta[a + 3]
            qx = (pk >> 2) & 3
            if qx > M_Q:
                break
            if pk & 3 < 3:
                meta[a + 3] = pk + 1  # freq = min(freq + 1, 3)
            if meta[a] == 0 and meta[a + 1] != r:
                cand[qx] -= 1
            meta[a + 1] = r
            j += 1
        if j > s:  # hits: the run, at most floor((T − 1) / B) blocks
            t = max(tokens[r] - 1, 0)
            m = t >> shift if shift >= 0 else t // bsz
            for k in range(s, s + min(j - s, m)):
                hits[k] = True
        npinned = j - s
        while j < e:
            x = ids[j]
            if sn + mn >= cap:
                if sn + mn - npinned < 1:
                    break
                while True:
                    use_small = (sn >= small_bytes and cand[0] > 0) or cand[1] == 0
                    if use_small:
                        t = sq[sh]
                        a = 4 * t
                        is_c = meta[a] == 0 and meta[a + 1] != r
                        pk = meta[a + 3]
                        if (not is_c) or pk & 3 > 1:  # promote to M (freq > 1 restarts at 0)
                            if is_c:
                                cand[0] -= 1
                            sh += 1
                            if sh == rn:
                                sh = 0
                            sn -= 1
                            f = pk & 3
                            if f > 1:
                                f = 0
                            meta[a + 3] = (pk & ~15) | (M_Q << 2) | f
                            _ring_push(mq, mh, mn, rn, t)
                            mn += 1
                            if is_c:
                                cand[1] += 1
                            continue
                        break
                    t = mq[mh]
                    a = 4 * t
                    is_c = meta[a] == 0 and meta[a + 1] != r
                    if is_c:
                        if meta[a + 3] & 3 == 0:
                            break
                        meta[a + 3] -= 1
                    mh = _ring_rotate(mq, mh, mn, rn)
                # t is the oldest block of S (use_small) or of M
                pk = meta[a + 3]
                q = (pk >> 2) & 3
                cand[q] -= 1
                if q == S_Q:
                    sh += 1
                    if sh == rn:
                        sh = 0
                    sn -= 1
                else:
                    mh += 1
                    if mh == rn:
                        mh = 0
                    mn -= 1
                p = meta[a + 2]
                if p != NIL:
                    b = 4 * p
                    meta[b] -= 1
                    if meta[b] == 0 and meta[b + 1] != r:
                        cand[(meta[b + 3] >> 2) & 3] += 1
                if q == S_Q:  # into the ghost, with the next version
                    if ge == gsize:  # compact: drop stale entries, keep the order
                        w = 0
                        for i in range(gh, ge):
                            g = gq[2 * i]
                            if meta[4 * g + 3] >> 2 == (gq[2 * i + 1] << 2) | G_Q:
                                gq[2 * w] = g
                                gq[2 * w + 1] = gq[2 * i + 1]
                                w += 1
                        gh = 0
                        ge = w
                    ver = ((pk >> 4) + 1) & (2**27 - 1)
                    meta[a + 3] = (ver << 4) | (G_Q << 2) | (pk & 3)
                    gq[2 * ge] = t
                    gq[2 * ge + 1] = ver
                    ge += 1
                    glive += 1
                    while glive > ghost_cap and glive > 0:
                        g = gq[2 * gh]
                        pg = meta[4 * g + 3]
                        if pg >> 2 == (gq[2 * gh + 1] << 2) | G_Q:  # a live entry: forget the block
                            meta[4 * g + 3] = (pg & ~12) | (NO_Q << 2)
                            glive -= 1
                        gh += 1
                else:
                    meta[a + 3] = (pk & ~12) | (NO_Q << 2)
                victims[nv] = t
                nv += 1
            a = 4 * x
            p = ids[j - 1] if j > s else NIL
            meta[a + 2] = p
            if p != NIL:
                meta[4 * p] += 1  # p is pinned (this request): no candidacy change
            pk = meta[a + 3] & ~15  # freq 0, keep the version
            if (meta[a + 3] >> 2) & 3 == G_Q:  # a ghost hit goes to M; its ghost entry goes stale
                glive -= 1
                _ring_push(mq, mh, mn, rn, x)
                mn += 1
                meta[a + 3] = pk | (M_Q << 2)
            else:
                _ring_push(sq, sh, sn, rn, x)
                sn += 1
                meta[a + 3] = pk | (S_Q << 2)
            meta[a + 1] = r
            npinned += 1
            j += 1
        # unpin: blocks of this request that are leaves become candidates
        for k in range(s, j):
            a = 4 * ids[k]
            if meta[a] == 0:
                cand[(meta[a + 3] >> 2) & 3] += 1
            meta[a + 1] = -1
    return nv
