"""Reuse analytics: stack distances, miss-ratio curves, SHARDS, replica views, reports."""

from .capacity import EffectiveCapacity
from .mrc import PrefixMRC, ShardsResult, default_capacities, hits_at, lru_hit_ratio_curve, mean_absolute_error, shards
from .replicas import ROUTINGS, ReplicaView, replica_view, route, worst_window_rate
from .report import VERDICTS, analyze, render
from .reuse import prefix_groups, reuse_summary, reuse_times_s
from .stack import (
    request_stack_distances,
    request_stack_distances_reference,
    stack_distances,
    stack_distances_reference,
)

__all__ = [
    "ROUTINGS",
    "VERDICTS",
    "EffectiveCapacity",
    "PrefixMRC",
    "ReplicaView",
    "ShardsResult",
    "analyze",
    "default_capacities",
    "hits_at",
    "lru_hit_ratio_curve",
    "mean_absolute_error",
    "prefix_groups",
    "render",
    "replica_view",
    "request_stack_distances",
    "request_stack_distances_reference",
    "reuse_summary",
    "reuse_times_s",
    "route",
    "shards",
    "stack_distances",
    "stack_distances_reference",
    "worst_window_rate",
]
