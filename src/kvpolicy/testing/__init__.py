"""Property-based contracts for prefix-cache policies — kvpolicy's and yours.

Test your own eviction policy in a few lines::

    from kvpolicy.testing import EvictionPolicyContract, contract_test

    class MyPolicyContract(EvictionPolicyContract):
        def make_policy(self, capacity_bytes, clock):
            return MyPolicy(capacity_bytes, clock=clock)

    TestMyPolicy = contract_test(MyPolicyContract)
"""

from __future__ import annotations

from typing import Any

from .contracts import (
    AdmissionContract, BlockIndexContract, ContractViolation, DirectoryContract, EvictionPolicyContract, PublishFilterContract,
)
from .differential import Divergence, first_divergence
from .strategies import block_sizes, capacities, latency_distributions, link_figures, namespaces, prefix_traces, token_sequences


def contract_test(machine: type, *, max_examples: int | None = None, steps: int | None = None) -> Any:
    """The pytest ``TestCase`` of a contract subclass, with kvpolicy's settings."""
    from hypothesis import HealthCheck, settings

    from .plugin import options

    opts = options()
    test = machine.TestCase  # type: ignore[attr-defined]  # a RuleBasedStateMachine subclass: Hypothesis adds it
    test.settings = settings(max_examples=max_examples or opts["examples"], stateful_step_count=steps or opts["steps"], deadline=None, report_multiple_bugs=False,
                             suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
    return test


__all__ = [
    "AdmissionContract",
    "BlockIndexContract",
    "ContractViolation",
    "DirectoryContract",
    "Divergence",
    "EvictionPolicyContract",
    "PublishFilterContract",
    "block_sizes",
    "capacities",
    "contract_test",
    "first_divergence",
    "latency_distributions",
    "link_figures",
    "namespaces",
    "prefix_traces",
    "token_sequences",
]
