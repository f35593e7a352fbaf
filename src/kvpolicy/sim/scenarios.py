"""The brief's four load views as presets, each sized to the trace it runs on.

With D the trace's duration:

| scenario | what happens |
|---|---|
| ``steady`` | the trace as it is: steady remote hits on long prefixes |
| ``scale-out`` | at 0.35·D traffic doubles (the reason to scale) and N new, empty replicas join at once, all pulling the same hot blocks |
| ``spike`` | arrival rate × 4 from 0.40·D to 0.50·D: misses force recompute while new blocks are published |
| ``degraded`` | storage node 0 runs at 10 % bandwidth and fails 20 % of transfers from 0.30·D to 0.70·D; its traffic must shift to the others |

Cluster defaults sized to the trace (:func:`default_cluster`): 8 replicas of
28 GiB effective local KV each, and a pool of 4 storage nodes holding together
25 % of the trace's distinct KV bytes (so the pool evicts, as real ones do).
"""

from __future__ import annotations

import math
from typing import Any

import attrs

from .._validate import check_non_negative_number, check_positive_int, check_positive_number
from ..errors import ConfigError
from ..profile import PrefillModel
from .config import ClusterConfig, Degrade, ScaleOut, Spike
from .engine import apply_spike

SCENARIOS = ("steady", "scale-out", "spike", "degraded")


def default_cluster(trace: Any, *, bytes_per_token: int, prefill: PrefillModel, replicas: int = 8, local_kv_gib: float = 28.0,
                    pool_share: float = 0.25, storage_nodes: int = 4, **overrides: Any) -> ClusterConfig:
    """A cluster sized to ``trace``: local caches from GPU memory, the pool from the trace's distinct bytes."""
    check_positive_int("bytes_per_token", bytes_per_token)  # None failed in a multiplication below
    check_positive_number("pool_share", pool_share)  # an infinite share failed converting to int
    check_non_negative_number("local_kv_gib", local_kv_gib)
    if not math.isfinite(local_kv_gib * 2**30):
        raise ConfigError("local_kv_gib", f"must be a finite non-negative number of GiB, got {local_kv_gib}")
    check_positive_int("storage_nodes", storage_nodes)  # divided by just below
    block_bytes = bytes_per_token * trace.block_size_tokens
    distinct = int(trace.summary()["distinct_blocks"])
    pool_blocks_per_node = max(int(distinct * pool_share / storage_nodes), 1)
    return ClusterConfig(bytes_per_token=bytes_per_token, prefill=prefill, replicas=replicas, local_capacity_bytes=int(local_kv_gib * 2**30),
                         storage_nodes=storage_nodes, pool_capacity_bytes_per_node=pool_blocks_per_node * block_bytes, **overrides)


@attrs.frozen
class Scenario:
    name: str
    trace: Any
    cluster: ClusterConfig
    events: tuple[Any, ...]
    description: str


def build(name: str, trace: Any, cluster: ClusterConfig) -> Scenario:
    """The scenario ``name`` on ``trace`` with ``cluster`` (timed events placed by the trace's duration)."""
    if len(trace) == 0:
        raise ConfigError("trace", "has no requests")
    t0 = float(trace.arrival_s[0])
    D = max(float(trace.arrival_s[-1]) - t0, 1e-9)
    if name == "steady":
        return Scenario(name, trace, cluster, (), "the trace as it is")
    if name == "scale-out":
        t = t0 + 0.35 * D
        spiked = apply_spike(trace, Spike(t, t0 + D, 2.0))
        return Scenario(name, spiked, cluster, (ScaleOut(t, cluster.replicas),),
                        f"traffic x2 from t={t - t0:.0f}s; {cluster.replicas} new empty replicas join at that moment")
    if name == "spike":
        t1, t2 = t0 + 0.40 * D, t0 + 0.50 * D
        return Scenario(name, apply_spike(trace, Spike(t1, t2, 4.0)), cluster, (), f"arrival rate x4 from t={t1 - t0:.0f}s to t={t2 - t0:.0f}s")
    if name == "degraded":
        t1, t2 = t0 + 0.30 * D, t0 + 0.70 * D
        return Scenario(name, trace, cluster, (Degrade(0, t1, t2, bandwidth_factor=0.1, failure_rate=0.2),),
                        f"node-0 at 10% bandwidth, 20% failed transfers, t={t1 - t0:.0f}s..{t2 - t0:.0f}s")
    raise ConfigError("--scenario", f"unknown scenario {name!r}; known: {', '.join(SCENARIOS)}, all")
