"""Reuse times and reuse distances, per access and per prefix group.

*Reuse time* of a block access: seconds since the previous request that used the
same block. *Reuse distance*: the volume of distinct KV blocks requested between
the two (the request-level stack distance, in blocks and in bytes). A prefix
whose reuse distance exceeds the effective pool capacity is gone before it is
re-read, whatever its TTL; the TTL should follow the observed reuse interval.

A *prefix group* is the chain of the first ``depth_blocks`` blocks of a request
(its block id at that depth): e.g. one application's system prompt + template.
"""

from __future__ import annotations

from typing import Any

import numba as nb
import numpy as np

from .._validate import check_positive_int
from ..traces.model import check_trace
from .stack import request_stack_distances


@nb.njit(cache=True)
def _reuse_times(offsets, ids, arrival, n_ids, out):
    last = np.full(n_ids, -1.0)
    for r in range(offsets.size - 1):
        t = arrival[r]
        for j in range(offsets[r], offsets[r + 1]):
            x = ids[j]
            out[j] = t - last[x] if last[x] >= 0 else -1.0
        for j in range(offsets[r], offsets[r + 1]):
            last[ids[j]] = t


def reuse_times_s(trace: Any) -> np.ndarray:
    """Per block reference: seconds since the block's previous use (−1 on first use)."""
    out = np.empty(trace.block_ids.size, dtype=np.float64)
    if trace.block_ids.size:
        _reuse_times(trace.block_offsets, trace.block_ids, trace.arrival_s, max(trace.num_block_ids, 1), out)
    return out


def percentiles(values: np.ndarray, qs: tuple[int, ...] = (50, 90, 99)) -> dict[str, float | None]:
    if values.size == 0:
        return {f"p{q}": None for q in qs}
    return {f"p{q}": float(np.percentile(values, q)) for q in qs}


def reuse_summary(trace: Any, bytes_per_token: int, distances: np.ndarray | None = None) -> dict[str, Any]:
    """Percentiles of reuse distance (blocks, bytes) and reuse time over all re-references."""
    check_positive_int("bytes_per_token", bytes_per_token)  # a NaN one made every byte figure NaN
    d = request_stack_distances(trace.block_offsets, trace.block_ids) if distances is None else distances
    rt = reuse_times_s(trace)
    re = d >= 0
    block_bytes = bytes_per_token * trace.block_size_tokens
    return {
        "rereferences": int(re.sum()),
        "reuse_distance_blocks": percentiles(d[re].astype(np.float64)),
        "reuse_distance_bytes": {k: (None if v is None else v * block_bytes) for k, v in percentiles(d[re].astype(np.float64)).items()},
        "reuse_time_s": percentiles(rt[rt >= 0]),
    }


def prefix_groups(trace: Any, bytes_per_token: int, depth_blocks: int = 1, top: int = 10, distances: np.ndarray | None = None) -> list[dict[str, Any]]:
    """The most-used prefix groups with their reuse-interval and distance distributions (``top`` None: all of them)."""
    check_trace(trace)
    check_positive_int("bytes_per_token", bytes_per_token)  # a NaN one made every byte figure NaN
    check_positive_int("depth_blocks", depth_blocks)
    if top is not None:
        check_positive_int("top", top)
    full = trace.full_blocks
    has = full >= depth_blocks
    if not has.any():
        return []
    idx = np.nonzero(has)[0]
    ref = trace.block_offsets[idx] + depth_blocks - 1
    group = trace.block_ids[ref]
    d = request_stack_distances(trace.block_offsets, trace.block_ids) if distances is None else distances
    dist_at = d[ref]
    block_bytes = bytes_per_token * trace.block_size_tokens
    order = np.argsort(group, kind="stable")
    g_sorted = group[order]
    bounds = np.flatnonzero(np.diff(g_sorted)) + 1
    starts = np.concatenate([[0], bounds])
    ends = np.concatenate([bounds, [g_sorted.size]])
    sizes = ends - starts
    best = np.argsort(-sizes, kind="stable")[:top]
    out = []
    for b in best:
        members = order[starts[b] : ends[b]]
        req = idx[members]
        times = trace.arrival_s[req]
        intervals = np.diff(times)
        dd = dist_at[members]
        dd = dd[dd >= 0].astype(np.float64) * block_bytes
        out.append({
            "group_block_id": int(g_sorted[starts[b]]),
            "depth_blocks": depth_blocks,
            "requests": int(req.size),
            "input_tokens": int(trace.input_tokens[req].sum()),
            "reuse_interval_s": percentiles(intervals),
            "reuse_distance_bytes": percentiles(dd),
        })
    return out
