"""Eviction: prefix- and pin-aware policies, the Belady bound, replay and kernels."""

from .base import EvictionPolicy, Node, PriorityPolicy
from .facade import PolicyCache
from .hit_density import AdaptivePolicy, HitDensityPolicy
from .learned import LearnedRelaxedBeladyPolicy, LogisticWindow
from .policies import (
    POLICIES,
    ARCPolicy,
    BeladyPolicy,
    FIFOPolicy,
    GDSFPolicy,
    LFUPolicy,
    LRUPolicy,
    S3FIFOPolicy,
    SIEVEPolicy,
    TraceOracle,
    TTLPolicy,
    depth_cost,
)
from .replay import ALL_POLICIES, ReplayResult, make_policy, replay
from .reuse_distance import ReuseDistancePolicy

__all__ = [
    "ALL_POLICIES",
    "AdaptivePolicy",
    "POLICIES",
    "ARCPolicy",
    "BeladyPolicy",
    "EvictionPolicy",
    "FIFOPolicy",
    "HitDensityPolicy",
    "GDSFPolicy",
    "LFUPolicy",
    "LearnedRelaxedBeladyPolicy",
    "LogisticWindow",
    "LRUPolicy",
    "Node",
    "PolicyCache",
    "PriorityPolicy",
    "ReplayResult",
    "ReuseDistancePolicy",
    "S3FIFOPolicy",
    "SIEVEPolicy",
    "TTLPolicy",
    "TraceOracle",
    "depth_cost",
    "make_policy",
    "replay",
]
