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

from ...errors import ConfigError
from ...traces.model import check_trace
from ..learned import N_FEATURES
from ..replay import ReplayResult
from ._base import INF_USE, NIL
from .arc import arc_kernel
from .belady import belady_kernel
from .hit_density import (L_AGEN, L_AGESUM, L_FITP, L_FITS, L_FITY, L_FREE, L_HOR, L_N, L_OOSN, L_OOSP, L_OOSY, L_REFIT, L_UNREC, L_WIN,
                          N_LRB_SCALARS, _splitmix64, hit_density_kernel)
from .priority import PRIORITY_KINDS, priority_kernel
from .queues import fifo_kernel, lru_kernel, sieve_kernel
from .s3fifo import S3_MAX_CAP, s3fifo_kernel


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
        _sampled_ids_kernel(np.uint64(policy.mini.seed), np.uint64(policy.mini.bound), out)
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
        from ..policies import check_small_fraction

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
        from ..policies import TTLPolicy
        from ..replay import check_options
        from ..reuse_distance import ReuseDistancePolicy

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
        from ..hit_density import AdaptivePolicy, HitDensityPolicy
        from ..learned import LearnedRelaxedBeladyPolicy
        from ..replay import check_options

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
