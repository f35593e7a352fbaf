"""Trace-driven cluster simulator: kvpolicy's policies beside what engines do today."""

from .compare import checks, compare, figures, render
from .config import ROUTERS, ClusterConfig, Degrade, ScaleOut, Spike
from .engine import Prepared, SimResult, Simulator, apply_spike
from .policysets import POLICY_SETS, PRESETS, PolicySet, policy_set, recompute_twin
from .scenarios import SCENARIOS, Scenario, build, default_cluster

__all__ = [
    "ROUTERS", "POLICY_SETS", "PRESETS", "SCENARIOS", "ClusterConfig", "Degrade", "PolicySet", "Prepared", "ScaleOut", "Scenario",
    "SimResult", "Simulator", "Spike", "apply_spike", "build", "checks", "compare", "default_cluster", "figures", "policy_set", "recompute_twin", "render",
]
