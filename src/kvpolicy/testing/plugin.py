"""pytest plugin (entry point ``pytest11``): settings for kvpolicy's contracts.

Adds ``--kvpolicy-examples N`` (Hypothesis examples per contract, default 50) and
``--kvpolicy-steps N`` (steps per stateful run, default 40), and the
``kvpolicy_contract`` marker. Contract TestCases made with
:func:`kvpolicy.testing.contract_test` pick these up.
"""

from __future__ import annotations

from typing import Any

_OPTIONS = {"examples": 50, "steps": 40}


def pytest_addoption(parser: Any) -> None:
    group = parser.getgroup("kvpolicy")
    group.addoption("--kvpolicy-examples", type=int, default=None, help="Hypothesis examples per kvpolicy contract (default 50)")
    group.addoption("--kvpolicy-steps", type=int, default=None, help="steps per stateful kvpolicy contract run (default 40)")


def pytest_configure(config: Any) -> None:
    config.addinivalue_line("markers", "kvpolicy_contract: a kvpolicy policy contract")
    if config.getoption("--kvpolicy-examples", default=None):
        _OPTIONS["examples"] = config.getoption("--kvpolicy-examples")
    if config.getoption("--kvpolicy-steps", default=None):
        _OPTIONS["steps"] = config.getoption("--kvpolicy-steps")


def options() -> dict[str, int]:
    return dict(_OPTIONS)
