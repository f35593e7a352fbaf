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

import math
from typing import Any

import numba as nb
import numpy as np
from llvmlite import binding as llvm_binding
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ..errors import ConfigError
from ..traces.model import check_trace
from .learned import N_FEATURES, lrb_features, lrb_logit, logistic_fit, sigmoid1
from .replay import ReplayResult

NIL = -1
INF_USE = np.int32(2**31 - 1)  # next use of a block never referenced again (int32 sentinel)


# the intrinsic's mangled name: typed pointers up to LLVM 14, opaque ones after
_PREFETCH_NAME = "llvm.prefetch.p0" if llvm_binding.llvm_version_info >= (15,) else "llvm.prefetch.p0i8"


@intrinsic
def _prefetch(typingctx, arr, idx):  # pragma: no cover - compiled
    """A hint that ``arr[idx]`` will be read soon (LLVM's prefetch; never faults)."""
    if not isinstance(arr, types.Array) or not isinstance(idx, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        aryty = signature.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, [args[1]], wraparound=False)
        i8p = ir.IntType(8).as_pointer()
        fnty = ir.FunctionType(ir.VoidType(), [i8p, ir.IntType(32), ir.IntType(32), ir.IntType(32)])
        fn = cgutils.get_or_insert_function(builder.module, fnty, _PREFETCH_NAME)
        i32 = ir.IntType(32)
        builder.call(fn, [builder.bitcast(ptr, i8p), i32(0), i32(3), i32(1)])  # read, high locality, data
        return context.get_dummy_value()

    return types.void(arr, idx), codegen


PREFETCH_AHEAD = 16  # block references ahead whose record is prefetched
QUEUE_AHEAD = 4  # queue entries ahead of the oldest whose record is prefetched


# ----------------------------------------------------------------------------- layout

# What made these fast (each measured A/B in one process, docs/benchmarks.md):
# prefetching — the trace says which block comes 16 references ahead, and a
# queue read in order says which records its oldest end reaches next, so their
# cache misses overlap the current one (1.1-1.9x everywhere); list code written
# inline (an array argument to a helper costs reference-count traffic per call:
# 5x on LRU); a block's fields interleaved in one record so a block costs one
# cache line, 16 bytes where they fit; and a queue that only loses its oldest
# entry kept as an array read in order (FIFO, SIEVE, S3-FIFO) instead of a
# linked list. ARC's list code is written out at each use on purpose: the same
# kernel through two inline helpers (unlink, append) measured 0.84x (A/B), while
# the small ring helpers below cost nothing measurable.


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


# ----------------------------------------------------------------------------- hit density (kvpolicy's adaptive policy)
# The candidate-slot code (a block enters or leaves the sampled array) is written out at each of its two uses on
# purpose: the same kernel through inline helpers taking the arrays ran at half the speed (3.2 vs 6.6M acc/s, A/B).


@nb.njit(cache=True, inline="always")
def _splitmix64(state):
    state = state + np.uint64(0x9E3779B97F4A7C15)
    z = state
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return state, z ^ (z >> np.uint64(31))


@nb.njit(cache=True, inline="always")
def _hd_bin(age, inv_width, nbins):
    return np.int64(min(age * inv_width, nbins - 1.0))  # branch-free: minsd, then truncate (ages are >= 0)


@nb.njit(cache=True, inline="always")
def _hd_excess(age, inv_width, nbins):
    """How many bins past the last one an age lies (0 inside the histogram)."""
    b = age * inv_width - (nbins - 1)
    return b if b > 0 else 0.0


@nb.njit(cache=True)
def _hd_reconfigure(H, E, X, D, decay, span, age_sum, age_n, inv_width):
    """Recompute the densities, decay the histograms, re-derive the bin width from the mean eviction age; returns the
    reset request and event counters, 1 / bin width and the decayed eviction-age sums."""
    nbins = H.shape[1]
    if age_n > 0:
        inv_width = 1.0 / max(span * (age_sum / age_n) / nbins, 1e-9)
    for c in range(H.shape[0]):
        hu = 0.0
        eu = 0.0
        lt = X[c]  # the last bin's events lived past it by X bins in all
        for a in range(H.shape[1] - 1, -1, -1):
            hu += H[c, a]
            eu += H[c, a] + E[c, a]
            lt += eu
            D[c, a] = hu / lt if lt > 0 else 0.0
        for a in range(H.shape[1]):
            H[c, a] *= decay
            E[c, a] *= decay
        X[c] *= decay
    return 0, 0, inv_width, age_sum * decay, age_n * decay


# one hit-density cache's scalars between calls of _hd_run, as float64 slots (exact: every count stays under 2**31)
S_NC, S_USED, S_NV, S_NEV, S_REQ, S_EVT, S_LEARNED, S_INVW, S_AGESUM, S_AGEN, S_HITS, S_SJ, S_TREQ = range(13)  # S_SJ: adaptive's
N_SCALARS = 13  # S_TREQ: requests ever (lrb's turns)
BATCH_REQUESTS = 4096  # the mini-simulations' batch: requests and block references (plus the longest request)
BATCH_REFS = 65536


# ----------------------------------------------------------------------------- lrb's learning, for _hd_run
# lrb's state is one tuple LS = (lf, li, rf, ri, fr, dq_t, dq_k, MX, MY, mw, lam, ls, xb); None for hit density:
#   lf[2x] last inter-use gap, lf[2x+1] insert time; li[6x] turn, +1 root, +2 request that inserted it, +3 depth,
#   +4/+5 first/last of its waiting samples (-1: none);
#   a waiting sample in slot s: rf[s, 0] its deadline (decision time + H), rf[s, 1] the model's P at the decision
#   (NaN: no model), rf[s, 2] 1.0 once used again by the deadline, rf[s, 3:] its features; ri[s] the key's next;
#   fr: free slots (a stack); dq_t/dq_k: the deadlines queue, in recording order (a ring of `window`);
#   MX/MY the model's window of labelled rows, mw its weights, lam its ridge; ls the scalars L_*; xb one feature row
#   per sample of a decision. Every piece mirrors LearnedRelaxedBeladyPolicy (kvpolicy.eviction.learned).
L_HOR, L_WIN, L_REFIT, L_N, L_SINCE, L_FITS, L_HASW, L_FITP, L_FITY, L_OOSP, L_OOSY, L_OOSN, L_UNREC, L_DQH, L_DQN, L_FREE = range(16)
L_AGESUM, L_AGEN = 16, 17  # the cache's eviction-age sums at the end (its horizon)
N_LRB_SCALARS = 18


@nb.njit(cache=True, inline="always")
def _lrb_use(x, now, li, rf, ri):
    """A use of block x: each of its waiting samples whose deadline has not passed is a return."""
    s = li[6 * x + 4]
    while s >= 0:
        if now <= rf[s, 0]:
            rf[s, 2] = 1.0
        s = ri[s]


@nb.njit(cache=True)
def _lrb_add(s, rf, MX, MY, mw, lam, ls):
    """LogisticWindow.add of waiting sample s (and its refit when due)."""
    p = rf[s, 1]
    label = rf[s, 2]
    if not math.isnan(p):
        ls[L_OOSP] += p
        ls[L_OOSY] += label
        ls[L_OOSN] += 1.0
    win = np.int64(ls[L_WIN])
    n = np.int64(ls[L_N])
    i = n % win
    for c in range(MX.shape[1]):
        MX[i, c] = rf[s, 3 + c]
    MY[i] = label
    n += 1
    ls[L_N] = n
    ls[L_SINCE] += 1.0
    if ls[L_SINCE] >= ls[L_REFIT]:
        ls[L_SINCE] = 0.0
        m = min(n, win)
        lo = MY[0]
        hi = MY[0]
        for r in range(m):
            lo = min(lo, MY[r])
            hi = max(hi, MY[r])
        if lo != hi:
            mean_p, rate = logistic_fit(MX, MY, m, mw, lam, 8)  # from the last weights (zeros before the first fit)
            ls[L_HASW] = 1.0
            ls[L_FITS] += 1.0
            ls[L_FITP] = mean_p
            ls[L_FITY] = rate


@nb.njit(cache=True)
def _lrb_expire(now, li, rf, ri, fr, dq_t, dq_k, MX, MY, mw, lam, ls):
    """LearnedRelaxedBeladyPolicy._label_expired: pop the queue while its head's deadline has passed; each popped
    key's samples whose deadline has passed go to the model, in their recording order."""
    win = np.int64(ls[L_WIN])
    while ls[L_DQN] > 0:
        hd = np.int64(ls[L_DQH])
        if not dq_t[hd] < now:
            break
        key = dq_k[hd]
        ls[L_DQH] = (hd + 1) % win
        ls[L_DQN] -= 1.0
        s = li[6 * key + 4]
        prev = -1
        while s >= 0:
            nxt = ri[s]
            if rf[s, 0] < now:
                _lrb_add(s, rf, MX, MY, mw, lam, ls)
                if prev < 0:
                    li[6 * key + 4] = nxt
                else:
                    ri[prev] = nxt
                fr[np.int64(ls[L_FREE])] = s
                ls[L_FREE] += 1.0
            else:
                prev = s
            s = nxt
        li[6 * key + 5] = prev


@nb.njit(cache=True, inline="always")
def _lrb_features(xrow, v, t_last, now, h, W, lf, li):
    lrb_features(xrow, t_last, W[16 * v + 8], W[16 * v + 9], li[6 * v + 3], lf[2 * v], li[6 * v], lf[2 * v + 1],
                 W[16 * li[6 * v + 1] + 8], now, h)


@nb.njit(cache=True)
def _lrb_record(v, now, h, q, p, li, rf, ri, fr, dq_t, dq_k, ls, xb):
    """Sample v (features xb[q], the model's P or NaN) waits for its outcome until now + h."""
    ls[L_FREE] -= 1.0
    s = fr[np.int64(ls[L_FREE])]
    deadline = now + h
    rf[s, 0] = deadline
    rf[s, 1] = p
    rf[s, 2] = 0.0
    for c in range(xb.shape[1]):
        rf[s, 3 + c] = xb[q, c]
    ri[s] = -1
    t = li[6 * v + 5]
    if t < 0:
        li[6 * v + 4] = s
    else:
        ri[t] = s
    li[6 * v + 5] = s
    win = np.int64(ls[L_WIN])
    pos = (np.int64(ls[L_DQH]) + np.int64(ls[L_DQN])) % win
    dq_t[pos] = deadline
    dq_k[pos] = v
    ls[L_DQN] += 1.0


# lrb's hooks in _hd_run. With LS None (hit density, adaptive and its mini-simulations) Numba prunes the branch
# before typing: each hook compiles to nothing, and the hit-density kernel is the code it was without lrb.

@nb.njit(cache=True)
def _lrb_on_use(LS, x, now, t_last):
    """A hit on x (last used at t_last): a use for its waiting samples; its inter-use gap."""
    if LS is not None:
        _lrb_use(x, now, LS[1], LS[2], LS[3])
        LS[0][2 * x] = now - t_last


@nb.njit(cache=True)
def _lrb_on_insert(LS, x, p, now, treq):
    """x inserted under p (NIL: a root) by request ``treq``: a use for its waiting samples; its chain's facts."""
    if LS is not None:
        lf, li = LS[0], LS[1]
        _lrb_use(x, now, li, LS[2], LS[3])  # inserted again after its eviction: a use
        lf[2 * x] = 0.0
        lf[2 * x + 1] = now
        if p == NIL:
            li[6 * x] = 0
            li[6 * x + 1] = x
            li[6 * x + 3] = 0
        else:  # a later request than the parent's extended the chain: one more turn
            li[6 * x] = li[6 * p] + (1 if li[6 * p + 2] < treq else 0)
            li[6 * x + 1] = li[6 * p + 1]
            li[6 * x + 3] = li[6 * p + 3] + 1
        li[6 * x + 2] = treq


@nb.njit(cache=True)
def _lrb_begin(LS, now, age_sum, age_n):
    """A decision begins: expired samples go to the model (refits). Returns H (-1: none yet) and whether the model
    ranks this decision's samples."""
    if LS is not None:
        ls = LS[11]
        _lrb_expire(now, LS[1], LS[2], LS[3], LS[4], LS[5], LS[6], LS[7], LS[8], LS[9], LS[10], ls)
        h = ls[L_HOR] * age_sum / age_n if age_n > 0 else -1.0
        return h, ls[L_HASW] != 0.0 and h > 0
    return -1.0, False


@nb.njit(cache=True)
def _lrb_logit(LS, q, v, t_last, now, h, W):
    """The model's logit for sample q (block v, last used at t_last); its features stay in row q."""
    if LS is not None:
        xb = LS[12]
        _lrb_features(xb[q], v, t_last, now, h, W, LS[0], LS[1])
        return lrb_logit(xb[q], LS[9])
    return 0.0


@nb.njit(cache=True)
def _lrb_sample(LS, v, t_last, now, h, W, use_model, logit0):
    """The decision's first sample (block v) waits for its label, unless ``window`` samples already wait."""
    if LS is not None:
        ls, xb = LS[11], LS[12]
        if use_model:
            p0 = sigmoid1(logit0)  # its features are in row 0
        else:
            _lrb_features(xb[0], v, t_last, now, h, W, LS[0], LS[1])
            p0 = np.nan
        if ls[L_DQN] < ls[L_WIN]:
            _lrb_record(v, now, h, 0, p0, LS[1], LS[2], LS[3], LS[4], LS[5], LS[6], ls, xb)
        else:
            ls[L_UNREC] += 1.0


@nb.njit(cache=True)
def _hd_run(offsets, ids, m_blocks, rid, t_now, r_lo, r_hi, cap, hits, victims, I, F, W, cand, crec, drawn, H, E, D, X, sc, su,
            samples, nbins, span, interval, decay, expert, learn, b_off, b_ids, b_m, b_rid, b_now, b_room, no_judge_r, LS):
    """Requests ``r_lo .. r_hi - 1`` of ``(offsets, ids)`` through one hit-density cache whose state is the arrays
    passed in (its records, candidates, histograms, scalars ``sc`` and generator ``su``): the main cache, or one of
    adaptive's mini-simulations. ``expert`` picks the victim among the samples: 0 the lowest hit density, 1 the
    oldest (LRU), 2 the fewest hits (0..3+) then the oldest (LFU). ``m_blocks[r]``: the blocks of request r that may
    be hits; ``rid[r]`` its index in the trace (what pins a block); ``t_now[r]`` its time. ``hits``/``victims`` of size
    0 are not written; the cache's hits are counted in ``sc[S_HITS]``. ``learn`` false (a mini-simulation): no
    histograms are kept; hit density ranks by ``D`` and the bin width and learned flag in ``sc``, the real cache's.

    With ``b_off.size > 0``, each request's sampled references (record slot ``W[16x + 2]`` ≥ 0: the block's id in the
    mini-simulations) are appended to the batch ``b_*`` as one request — the requests the mini-simulations replay
    next — and the run stops before a request that will recompute the densities (the judge's turn: the
    mini-simulations must rank by the densities those requests saw; until they are first computed, every
    ``interval`` requests), except request ``no_judge_r``, or once fewer than ``b_room`` slots are left in the
    batch. Returns how many requests the batch holds, the next request to run and whether it stopped for the judge.

    ``LS`` not None (and ``learn``): lrb — the samples are ranked by the learned model once it is fit, the first
    sample of each decision waits for its label (the block comment above ``L_HOR``)."""
    # one 64-byte record per block, in three views of the same memory (I int64, F float64, W int32 halves):
    # F[8x] last use (kept while it is a ghost), W[16x+2] its id in the mini-simulations (-1: not sampled), F[8x+2]
    # ghost's excess, I[8x+3] ghost's eviction count (-1: none), W[16x+8] hits, +9 child inserts, +10 resident
    # children, +11 parent, +12 pinning request, +13 candidate slot, +14 ghost's class*bins+bin, +15 resident
    # per candidate slot i: crec[2i] last use, crec[2i+1] (parent + 1) * 8 + class (exact in a float64) — all a
    # sample reads: a candidate's last use and class cannot change while it is one (a use pins it, a child makes it
    # a parent)
    nc = np.int64(sc[S_NC])
    used = np.int64(sc[S_USED])
    nv = np.int64(sc[S_NV])
    nev = np.int64(sc[S_NEV])
    requests = np.int64(sc[S_REQ])  # since the last reconfiguration
    events = np.int64(sc[S_EVT])  # uses and inserts since then
    learned = sc[S_LEARNED] != 0.0
    inv_width = sc[S_INVW]
    age_sum = sc[S_AGESUM]
    age_n = sc[S_AGEN]
    nhit = np.int64(sc[S_HITS])
    treq = np.int64(sc[S_TREQ])
    st = su[0]
    collect = b_off.size > 0
    nb = 0
    bp = 0
    judge = False
    r_next = r_hi
    for r in range(r_lo, r_hi):
        s = offsets[r]
        e = offsets[r + 1]
        if s == e:
            continue
        if collect and r != no_judge_r and ((requests + 1 >= interval and events >= 8 * nbins) or (not learned and sc[S_SJ] + 1 >= interval)):
            judge = True  # this request recomputes the densities (or, until they are first computed, `interval` went by)
            r_next = r
            break
        sc[S_SJ] += 1  # requests since the last judging
        now = t_now[r]
        g = rid[r]
        bs = bp
        if s + PREFETCH_AHEAD < ids.size:
            y = ids[s + PREFETCH_AHEAD]
            _prefetch(I, 8 * y)
        j = s
        while j < e and W[16 * ids[j] + 15]:
            j += 1
        if j > s:
            mm = min(j - s, m_blocks[r])
            nhit += mm
            if hits.size:
                for k in range(s, s + mm):
                    hits[k] = True
        for k in range(s, j):
            x = ids[k]
            if k == s:
                requests += 1
                treq += 1
                if learn and requests >= interval and events >= 8 * nbins:  # rare: a call (not inlined) costs nothing here
                    requests, events, inv_width, age_sum, age_n = _hd_reconfigure(H, E, X, D, decay, span, age_sum, age_n, inv_width)
                    learned = True
            nh = W[16 * x + 8]
            if learn:
                c = min(nh, 3) * 2 + (1 if W[16 * x + 9] >= 2 else 0)
                age = now - F[8 * x]
                H[c, _hd_bin(age, inv_width, nbins)] += 1.0
                X[c] += _hd_excess(age, inv_width, nbins)
            if learn:
                _lrb_on_use(LS, x, now, F[8 * x])
            F[8 * x] = now
            W[16 * x + 8] = nh + 1
            events += 1
            W[16 * x + 12] = g
            if collect and W[16 * x + 2] >= 0:
                b_ids[bp] = W[16 * x + 2]
                bp += 1
        if j > s:
            x = ids[j - 1]
            i = W[16 * x + 13]
            if i != NIL:  # the run's deepest block was an evictable leaf: pinned now
                nc -= 1
                y = cand[nc]
                if y != x:
                    cand[i] = y
                    crec[2 * i] = crec[2 * nc]
                    crec[2 * i + 1] = crec[2 * nc + 1]
                    W[16 * y + 13] = i
                W[16 * x + 13] = NIL
        while j < e:
            x = ids[j]
            if used + 1 > cap:
                if nc == 0:
                    break  # everything resident is pinned by this request
                h, use_model = _lrb_begin(LS, now, age_sum, age_n) if learn else (-1.0, False)
                logit0 = 0.0
                bi = NIL
                best_rank = np.inf  # every rank is finite: the first sample always takes it (first drawn wins ties)
                t_b = np.inf
                c_b = 99
                for q in range(samples):  # draw every sample first, prefetching its slot: the cache misses overlap
                    st, z = _splitmix64(st)
                    i = np.int64(((z >> np.uint64(32)) * np.uint64(nc)) >> np.uint64(32))  # Lemire's multiply-shift: [0, nc)
                    drawn[q] = i
                    _prefetch(crec, 2 * i)
                for q in range(samples):
                    i = drawn[q]
                    t_i = crec[2 * i]
                    if use_model:
                        rk = _lrb_logit(LS, q, cand[i], t_i, now, h, W)
                        if q == 0:
                            logit0 = rk
                        if rk < best_rank:
                            bi = i
                            best_rank = rk
                    elif expert == 0:
                        if learned:
                            rk = D[np.int64(crec[2 * i + 1]) & 7, _hd_bin(now - t_i, inv_width, nbins)]
                        else:
                            rk = -(now - t_i)
                        if rk < best_rank:
                            bi = i
                            best_rank = rk
                    elif expert == 1:
                        if t_i < t_b:
                            bi = i
                            t_b = t_i
                    else:
                        c_i = (np.int64(crec[2 * i + 1]) & 7) // 2
                        if c_i < c_b or (c_i == c_b and t_i < t_b):
                            bi = i
                            c_b = c_i
                            t_b = t_i
                if h > 0:  # lrb: the decision's first sample waits for its label
                    _lrb_sample(LS, cand[drawn[0]], crec[2 * drawn[0]], now, h, W, use_model, logit0)
                v = cand[bi]
                i = bi
                # the victim's record is only written from here on: what is read comes from its candidate slot
                t_v = crec[2 * i]
                c = np.int64(crec[2 * i + 1])
                p = (c >> 3) - 1
                c &= 7
                nc -= 1
                y = cand[nc]
                if y != v:
                    cand[i] = y
                    crec[2 * i] = crec[2 * nc]
                    crec[2 * i + 1] = crec[2 * nc + 1]
                    W[16 * y + 13] = i
                W[16 * v + 13] = NIL
                W[16 * v + 15] = 0
                used -= 1
                if p != NIL:
                    W[16 * p + 10] -= 1
                    if W[16 * p + 10] == 0 and W[16 * p + 12] != g:
                        cand[nc] = p
                        crec[2 * nc] = F[8 * p]
                        crec[2 * nc + 1] = ((W[16 * p + 11] + 1) << 3) | (min(W[16 * p + 8], 3) * 2 + (1 if W[16 * p + 9] >= 2 else 0))
                        W[16 * p + 13] = nc
                        nc += 1
                age = now - t_v
                b = _hd_bin(age, inv_width, nbins)
                if learn:
                    E[c, b] += 1.0
                    F[8 * v + 2] = _hd_excess(age, inv_width, nbins)
                    X[c] += F[8 * v + 2]
                    age_sum += age
                    age_n += 1.0
                I[8 * v + 3] = nev  # its last use stays in F[8v] until it returns
                W[16 * v + 14] = c * nbins + b
                nev += 1
                if victims.size:
                    victims[nv] = v
                nv += 1
            p = ids[j - 1] if j > s else NIL
            W[16 * x + 11] = p
            if p != NIL:
                W[16 * p + 10] += 1
                W[16 * p + 9] += 1
            else:
                requests += 1
                treq += 1
                if learn and requests >= interval and events >= 8 * nbins:  # rare: a call (not inlined) costs nothing here
                    requests, events, inv_width, age_sum, age_n = _hd_reconfigure(H, E, X, D, decay, span, age_sum, age_n, inv_width)
                    learned = True
            if learn:
                _lrb_on_insert(LS, x, p, now, treq)
            if I[8 * x + 3] >= 0 and nev - I[8 * x + 3] <= cap:  # a ghost hit: the eviction is taken back, the hit counted
                c = W[16 * x + 14] // nbins
                if learn:
                    b = W[16 * x + 14] % nbins
                    E[c, b] = max(E[c, b] - 1.0, 0.0)
                    X[c] = max(X[c] - F[8 * x + 2], 0.0)
                    age = now - F[8 * x]
                    H[c, _hd_bin(age, inv_width, nbins)] += 1.0
                    X[c] += _hd_excess(age, inv_width, nbins)
                W[16 * x + 8] = min(c // 2 + 1, 3)  # back within the window: it keeps its history (+ this use), as ARC's B2 does
                W[16 * x + 9] = 2 * (c & 1)
            else:
                W[16 * x + 8] = 0
                W[16 * x + 9] = 0
            I[8 * x + 3] = -1
            W[16 * x + 15] = 1
            events += 1
            F[8 * x] = now
            W[16 * x + 12] = g
            used += 1
            if collect and W[16 * x + 2] >= 0:
                b_ids[bp] = W[16 * x + 2]
                bp += 1
            j += 1
        d = ids[j - 1] if j > s else NIL
        if d != NIL and W[16 * d + 10] == 0:  # unpinned: the chain's deepest block is an evictable leaf again
            cand[nc] = d
            crec[2 * nc] = F[8 * d]
            crec[2 * nc + 1] = ((W[16 * d + 11] + 1) << 3) | (min(W[16 * d + 8], 3) * 2 + (1 if W[16 * d + 9] >= 2 else 0))
            W[16 * d + 13] = nc
            nc += 1
        if collect and bp > bs:  # the request's sampled references: one request of the mini-simulations
            b_m[nb] = bp - bs
            b_rid[nb] = g
            b_now[nb] = now
            nb += 1
            b_off[nb] = bp
        if collect and (bp + b_room > b_ids.size or nb + 1 >= b_off.size):
            r_next = r + 1
            break
    sc[S_NC] = nc
    sc[S_USED] = used
    sc[S_NV] = nv
    sc[S_NEV] = nev
    sc[S_REQ] = requests
    sc[S_EVT] = events
    sc[S_LEARNED] = 1.0 if learned else 0.0
    sc[S_INVW] = inv_width
    sc[S_AGESUM] = age_sum
    sc[S_AGEN] = age_n
    sc[S_HITS] = nhit
    sc[S_TREQ] = treq
    su[0] = st
    return nb, r_next, judge


@nb.njit(cache=True)
def _lrb_end(LS, age_sum, age_n):
    if LS is not None:
        LS[11][L_AGESUM] = age_sum
        LS[11][L_AGEN] = age_n


@nb.njit(cache=True)
def hit_density_kernel(offsets, ids, m_blocks, rid, t_now, cap, hits, victims, I, F, W, samples, nbins, span, interval, decay, seed,
                       pin, sub_cap, SI, SF, SW, executed, sub_hits, sub_refs, LS):
    """:class:`~kvpolicy.eviction.hit_density.HitDensityPolicy` and :class:`~kvpolicy.eviction.hit_density.AdaptivePolicy`,
    decision for decision.

    ``pin`` ≥ 0: that expert evicts throughout (hit density: 0). ``pin`` < 0: adaptive — the mini-simulations, one
    per expert, each a cache of ``sub_cap`` blocks whose records are ``SI``/``SF``/``SW`` (three equal parts), replay
    the sampled references in batches; before each request that will recompute the real cache's densities (and
    every ``interval`` requests until they are first computed), the
    expert whose mini-simulation hit most (hits decayed by ``decay`` each time) takes over. ``executed``: evictions
    per expert; ``sub_hits``/``sub_refs``: the mini-simulations' hits and references. ``LS``: lrb's state (None
    for hit density and adaptive; :func:`_hd_run`). Returns the number of victims."""
    n_ids = W.size // 16
    ncap = min(n_ids, cap + 1) + 1  # candidates are resident leaves: at most cap of them
    cand = np.empty(ncap, np.int32)
    crec = np.empty(2 * ncap, np.float64)
    drawn = np.empty(samples, np.int64)
    H = np.zeros((8, nbins))
    E = np.zeros((8, nbins))
    D = np.zeros((8, nbins))
    X = np.zeros(8)
    sc = np.zeros(N_SCALARS)
    sc[S_INVW] = 1.0
    su = np.full(1, seed, np.uint64)
    judge = SW.size > 0
    n_sub = SW.size // 48  # records per mini-simulation
    scap = min(n_sub, sub_cap + 1) + 1
    Q = 3 if judge else 0
    cand3 = np.empty((Q, scap), np.int32)
    crec3 = np.empty((Q, 2 * scap), np.float64)
    sc3 = np.zeros((Q, N_SCALARS))
    su3 = np.full((Q, 1), seed, np.uint64)
    longest = 0
    for r in range(offsets.size - 1):
        longest = max(longest, offsets[r + 1] - offsets[r])
    room = longest if judge else 0
    b_off = np.zeros(BATCH_REQUESTS + 1 if judge else 0, np.int64)
    b_ids = np.empty(BATCH_REFS + room if judge else 0, np.int64)
    b_m = np.empty(b_off.size, np.int64)
    b_rid = np.empty(b_off.size, np.int64)
    b_now = np.empty(b_off.size, np.float64)
    none_i = np.empty(0, np.int64)
    none_f = np.empty(0, np.float64)
    none_b = np.empty(0, np.bool_)
    score = np.zeros(3)
    window = np.zeros(3, np.int64)
    for q in range(Q):
        sc3[q, S_INVW] = 1.0
    for q in range(3):
        executed[q] = 0
        sub_hits[q] = 0
    sub_refs[0] = 0
    lead = pin if pin >= 0 else 0
    r = 0
    n = offsets.size - 1
    no_judge = -1
    while r < n:
        nv0 = np.int64(sc[S_NV])
        nb, r_next, judged = _hd_run(offsets, ids, m_blocks, rid, t_now, r, n, cap, hits, victims, I, F, W, cand, crec, drawn, H, E, D, X,
                                     sc, su, samples, nbins, span, interval, decay, lead, True, b_off, b_ids, b_m, b_rid, b_now, room, no_judge, LS)
        executed[lead] += np.int64(sc[S_NV]) - nv0
        r = r_next
        if not judge:
            continue
        if nb > 0:
            sub_refs[0] += b_off[nb]
            for q in range(3):
                h0 = np.int64(sc3[q, S_HITS])
                sc3[q, S_INVW] = sc[S_INVW]  # the mini-simulations rank by the real cache's densities
                sc3[q, S_LEARNED] = sc[S_LEARNED]
                _hd_run(b_off, b_ids, b_m, b_rid, b_now, 0, nb, sub_cap, none_b, none_i, SI[q * 8 * n_sub : (q + 1) * 8 * n_sub],
                        SF[q * 8 * n_sub : (q + 1) * 8 * n_sub], SW[q * 16 * n_sub : (q + 1) * 16 * n_sub], cand3[q], crec3[q], drawn,
                        H, E, D, X, sc3[q], su3[q], samples, nbins, span, interval, decay, q, False, none_i, none_i, none_i, none_i, none_f, 0, -1, None)
                h = np.int64(sc3[q, S_HITS]) - h0
                sub_hits[q] += h
                window[q] += h
        no_judge = -1
        if judged:  # the next request recomputes the densities: the mini-simulations' hits since the last time are scored
            no_judge = r
            sc[S_SJ] = 0
            for q in range(3):
                score[q] = score[q] * decay + window[q]
                window[q] = 0
            if pin < 0:
                for q in range(3):
                    if score[q] > score[lead]:  # ties keep the current leader
                        lead = q
    _lrb_end(LS, sc[S_AGESUM], sc[S_AGEN])
    return np.int64(sc[S_NV])


# ----------------------------------------------------------------------------- driver

@nb.njit(cache=True)
def _sampled_ids_kernel(seed, bound, out):
    s = np.uint64(seed)
    for x in range(out.size):
        _, z = _splitmix64(np.uint64(x) ^ s)
        out[x] = z < bound


def sampled_ids(policy: Any, n_ids: int) -> np.ndarray:
    """Which of the int ids ``0 .. n_ids - 1`` an :class:`~kvpolicy.eviction.hit_density.AdaptivePolicy`'s
    mini-simulations see: its ``is_sampled``, id by id, at kernel speed."""
    out = np.ones(n_ids, dtype=np.bool_)
    if policy.sample_rate < 1.0:
        _sampled_ids_kernel(np.uint64(policy.seed), np.uint64(policy._bound), out)
    return out


def _hd_records(n_ids: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The hit-density kernel's block records: 8 int64 slots per block, 64-byte aligned, as int64/float64/int32 views."""
    buf = np.zeros(8 * n_ids + 8, dtype=np.int64)
    skip = (-buf.ctypes.data % 64) // 8
    rec = buf[skip : skip + 8 * n_ids]
    w = rec.view(np.int32)
    rec[3::8] = -1  # no ghost
    w[2::16] = -1  # not sampled by the mini-simulations
    w[11::16] = NIL  # no parent
    w[12::16] = -1  # not pinned
    w[13::16] = NIL  # not a candidate
    return rec, rec.view(np.float64), w


KERNEL_POLICIES = ("lru", "fifo", "lfu", "ttl", "sieve", "s3fifo", "arc", "gdsf", "reuse-distance", "hit-density", "adaptive", "lrb",
                   "belady", "belady-bypass")


def _lrb_state(p: Any, n_ids: int) -> tuple:
    """lrb's state for :func:`_hd_run`, from a fresh :class:`~kvpolicy.eviction.learned.LearnedRelaxedBeladyPolicy`
    (its knobs; the layout is the block comment above ``L_HOR``)."""
    win = p.model.window
    li = np.zeros(6 * n_ids, np.int64)
    li[4::6] = -1
    li[5::6] = -1
    ls = np.zeros(N_LRB_SCALARS)
    ls[L_HOR], ls[L_WIN], ls[L_REFIT], ls[L_FREE] = p.horizon, win, p.model.refit, win
    ls[L_FITP] = ls[L_FITY] = np.nan
    return (np.zeros(2 * n_ids), li, np.zeros((win, 3 + N_FEATURES)), np.full(win, -1, np.int64), np.arange(win, dtype=np.int64),
            np.zeros(win), np.zeros(win, np.int64), np.zeros((win, N_FEATURES)), np.zeros(win), np.zeros(N_FEATURES),
            p.model.penalty(), ls, np.zeros((p.samples, N_FEATURES)))


def _lrb_stats(ls: np.ndarray) -> dict:
    """LearnedRelaxedBeladyPolicy.stats from the kernel's scalars."""
    age_sum, age_n = ls[L_AGESUM], ls[L_AGEN]
    n_oos = int(ls[L_OOSN])
    return {"labels": int(ls[L_N]), "fits": int(ls[L_FITS]), "horizon_s": float(ls[L_HOR] * age_sum / age_n) if age_n > 0 else None,
            "unrecorded": int(ls[L_UNREC]), "window_mean_prediction": float(ls[L_FITP]), "window_positive_rate": float(ls[L_FITY]),
            "out_of_sample_mean_prediction": float(ls[L_OOSP] / n_oos) if n_oos else math.nan,
            "out_of_sample_positive_rate": float(ls[L_OOSY] / n_oos) if n_oos else math.nan, "out_of_sample_labels": n_oos}


@nb.njit(cache=True)
def _next_use_i32_kernel(offsets, ids, n_ids, out):
    last = np.full(n_ids, INF_USE, np.int32)
    for r in range(offsets.size - 2, -1, -1):
        for k in range(offsets[r + 1] - 1, offsets[r] - 1, -1):
            x = ids[k]
            out[k] = last[x]
        for k in range(offsets[r], offsets[r + 1]):
            last[ids[k]] = r
    return out


def _next_use_i32(trace: Any) -> np.ndarray:
    """``next_use_per_ref`` as int32 request indices, ``INF_USE`` for never (what the Belady kernel reads)."""
    ids = trace.block_ids
    out = np.empty(ids.size, dtype=np.int32)
    if ids.size:
        _next_use_i32_kernel(trace.block_offsets, ids, int(ids.max()) + 1, out)
    return out


def next_use_per_ref(trace: Any) -> np.ndarray:
    """For every block reference: the request index of the same block's next reference (inf if none). One backward pass."""
    nu = _next_use_i32(trace)
    out = nu.astype(np.float64)
    out[nu == INF_USE] = np.inf
    return out


def replay_kernel(trace: Any, policy: str, capacity_blocks: int, *, small_fraction: float | None = None, **kw: Any) -> ReplayResult:
    """Kernel replay of ``policy`` (one of KERNEL_POLICIES): the same result as :func:`replay`."""
    check_trace(trace)
    if policy not in KERNEL_POLICIES:
        raise ConfigError("policy", f"no kernel for {policy!r}; kernels: {KERNEL_POLICIES}")
    if kw and policy not in ("hit-density", "adaptive", "lrb", "ttl", "reuse-distance"):
        raise ConfigError(next(iter(kw)), f"the {policy} kernel takes no such option")
    if small_fraction is not None:
        if policy != "s3fifo":
            raise ConfigError("small_fraction", f"the {policy} kernel takes no such option (S3-FIFO's)")
        from .policies import check_small_fraction

        check_small_fraction(small_fraction)  # the kernel would run with 1.5 or fail deep in Numba's typing on a string
    if isinstance(capacity_blocks, bool) or not isinstance(capacity_blocks, int) or capacity_blocks < 0:
        raise ConfigError("capacity_blocks", f"must be a non-negative int, got {capacity_blocks!r}")
    off = trace.block_offsets
    ids = trace.block_ids
    n_ids = max(int(ids.max()) + 1 if ids.size else 1, 1)
    tokens = np.ascontiguousarray(trace.input_tokens, dtype=np.int64)
    bsz = int(trace.block_size_tokens)
    shift = bsz.bit_length() - 1 if bsz & (bsz - 1) == 0 else -1  # a shift instead of a division for powers of two
    hits = np.zeros(ids.size, dtype=np.bool_)
    victims = np.empty(ids.size + 1, dtype=np.int64)
    stats: dict[str, Any] = {}
    if policy == "lru":
        nv = lru_kernel(off, ids, tokens, bsz, shift, capacity_blocks, n_ids, hits, victims)
    elif policy == "fifo":
        nv = fifo_kernel(off, ids, tokens, bsz, shift, capacity_blocks, n_ids, hits, victims)
    elif policy == "sieve":
        nv = sieve_kernel(off, ids, tokens, bsz, shift, capacity_blocks, n_ids, hits, victims)
    elif policy == "s3fifo":
        if capacity_blocks >= S3_MAX_CAP:
            raise ConfigError("capacity_blocks", f"the s3fifo kernel holds fewer than {S3_MAX_CAP:,} blocks; use replay() beyond that")
        nv = s3fifo_kernel(off, ids, tokens, bsz, shift, capacity_blocks, n_ids, hits, victims, 0.1 if small_fraction is None else float(small_fraction))
    elif policy == "arc":
        nv = arc_kernel(off, ids, tokens, bsz, shift, capacity_blocks, n_ids, hits, victims)
    elif policy in PRIORITY_KINDS:
        if ids.size >= 2**31 - 1:
            raise ConfigError("trace", f"the {policy} kernel replays fewer than 2**31 block references, got {ids.size:,}; use replay()")
        from .policies import TTLPolicy
        from .replay import check_options
        from .reuse_distance import ReuseDistancePolicy

        ttl_s, ewma, aging, boost, c_eff = 0.0, 0.0, 0.0, 0.0, 0.0
        if policy in ("ttl", "reuse-distance"):
            check_options(TTLPolicy if policy == "ttl" else ReuseDistancePolicy, policy, kw)
            if "clock" in kw:
                raise ConfigError("clock", "the kernel runs on the trace's arrival times; a clock is for the online policy")
            if policy == "ttl":  # built to validate the knobs as online
                ttl_s = float(TTLPolicy(capacity_blocks, **kw).ttl_s)
            else:
                rd = ReuseDistancePolicy(capacity_blocks, **kw)
                ewma, aging, boost, c_eff = rd.ewma, rd.aging, rd.boost, rd.c_eff
        n = len(trace)
        t_now = np.ascontiguousarray(trace.arrival_s, dtype=np.float64) + np.arange(n, dtype=np.int64) * 1e-9  # as replay's clock reads
        nv = priority_kernel(off, ids, tokens, bsz, shift, capacity_blocks, n_ids, t_now, PRIORITY_KINDS[policy], ttl_s,
                             float(ewma), float(aging), float(boost), float(c_eff), hits, victims)
    elif policy in ("hit-density", "adaptive", "lrb"):
        if n_ids >= 2**31 - 1 or ids.size >= 2**31 - 1:
            raise ConfigError("trace", f"the {policy} kernel replays fewer than 2**31 distinct blocks and block references, got {n_ids:,} and {ids.size:,}; use replay()")
        from .hit_density import AdaptivePolicy, HitDensityPolicy
        from .learned import LearnedRelaxedBeladyPolicy
        from .replay import check_options

        hd_cls: type[HitDensityPolicy] = {"hit-density": HitDensityPolicy, "adaptive": AdaptivePolicy, "lrb": LearnedRelaxedBeladyPolicy}[policy]
        check_options(hd_cls, policy, kw)
        if "clock" in kw:
            raise ConfigError("clock", "the kernel runs on the trace's arrival times; a clock is for the online policy")
        p = hd_cls(capacity_blocks, **kw)  # validates the knobs as online
        n = len(trace)
        rid = np.arange(n, dtype=np.int64)
        t_now = np.ascontiguousarray(trace.arrival_s, dtype=np.float64) + rid * 1e-9  # as replay's clock reads
        m_blocks = np.ascontiguousarray(trace.matchable_blocks, dtype=np.int64)
        rec_i, rec_f, rec_w = _hd_records(n_ids)
        executed = np.zeros(3, np.int64)
        sub_hits = np.zeros(3, np.int64)
        sub_refs = np.zeros(1, np.int64)
        if isinstance(p, AdaptivePolicy):
            sampled = sampled_ids(p, n_ids)
            n_sub = int(sampled.sum())
            rec_w[2::16] = np.where(sampled, np.cumsum(sampled) - 1, -1)
            si, sf, sw = _hd_records(3 * max(n_sub, 1))
            pin = AdaptivePolicy.EXPERTS.index(p.expert) if p.expert else -1
            sub_cap = p.mini_capacity_bytes
        else:
            si, sf, sw = np.empty(0, np.int64), np.empty(0, np.float64), np.empty(0, np.int32)
            pin, sub_cap = 0, 0
        lrb_state = _lrb_state(p, n_ids) if policy == "lrb" else None
        nv = hit_density_kernel(off, ids, m_blocks, rid, t_now, capacity_blocks, hits, victims, rec_i, rec_f, rec_w, p.samples, p.bins,
                                p.span, p.interval, p.decay, np.uint64(p._rng), pin, sub_cap, si, sf, sw, executed, sub_hits, sub_refs,
                                lrb_state)
        if policy == "adaptive":
            stats = AdaptivePolicy.judge_stats(executed.tolist(), sub_hits.tolist(), int(sub_refs[0]))
        elif policy == "lrb":
            stats = _lrb_stats(lrb_state[11])  # type: ignore[index]
    else:
        if ids.size >= 2**31 - 1:
            raise ConfigError("trace", f"the Belady kernel replays fewer than 2**31 block references, got {ids.size:,}; use replay()")
        nu32 = _next_use_i32(trace)
        nv = belady_kernel(off, ids, tokens, bsz, shift, capacity_blocks, n_ids, hits, victims, nu32, policy == "belady-bypass")
    name = policy
    return ReplayResult(name, capacity_blocks, hits, victims[:nv], trace.block_size_tokens, trace.total_input_tokens, stats)
