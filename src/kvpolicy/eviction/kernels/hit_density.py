"""Hit density, the adaptive policy and lrb at trace speed. References: :mod:`kvpolicy.eviction.hit_density` (``HitDensityPolicy``, ``AdaptivePolicy``) and :class:`kvpolicy.eviction.learned.LearnedRelaxedBeladyPolicy`."""

from __future__ import annotations

import math

import numba as nb
import numpy as np

from ..learned import lrb_features, lrb_logit, logistic_fit, sigmoid1
from ._base import NIL, PREFETCH_AHEAD, _prefetch


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
