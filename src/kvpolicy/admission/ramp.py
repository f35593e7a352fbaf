"""The brief's experiment as a controller: raise the share of remote reads until it hurts.

Start with a small allowed share of remote loads; after each observation window,
if p95 TTFT and throughput hold (p95 within ``(1 + tolerance)`` of the baseline,
throughput within ``(1 − tolerance)``), add ``step``; if either degrades,
multiply by ``backoff`` (AIMD). Every step is kept for the report.
Which loads are allowed is deterministic: a credit accumulator admits exactly
``share`` of eligible loads over time (no randomness).
"""

from __future__ import annotations

from typing import Any

import attrs

from .._validate import check_non_negative_number, check_positive_number, check_probability
from ..errors import ConfigError


@attrs.frozen
class RampStep:
    share: float
    p95_ttft_s: float
    throughput: float
    action: str  # "raise" | "back_off" | "hold"


class RampController:
    def __init__(self, baseline_p95_ttft_s: float, baseline_throughput: float, *, initial_share: float = 0.05, step: float = 0.05,
                 backoff: float = 0.5, tolerance: float = 0.05, max_share: float = 1.0) -> None:
        for name, v in (("baseline_p95_ttft_s", baseline_p95_ttft_s), ("baseline_throughput", baseline_throughput)):
            check_positive_number(name, v)  # an infinite baseline held every window, so the share only rose
        for name, v in (("initial_share", initial_share), ("step", step), ("backoff", backoff), ("tolerance", tolerance), ("max_share", max_share)):
            check_probability(name, v)
        if not initial_share <= max_share:
            raise ConfigError("initial_share", "need 0 <= initial_share <= max_share <= 1")
        for name, v, ok, need in (("step", step, step > 0, "0 < step <= 1"), ("backoff", backoff, 0 < backoff < 1, "0 < backoff < 1"),
                                  ("tolerance", tolerance, tolerance < 1, "0 <= tolerance < 1")):
            if not ok:
                raise ConfigError(name, f"need {need}, got {v!r}")
        self.baseline_p95_ttft_s = baseline_p95_ttft_s
        self.baseline_throughput = baseline_throughput
        self.share = initial_share
        self.step = step
        self.backoff = backoff
        self.tolerance = tolerance
        self.max_share = max_share
        self.history: list[RampStep] = []
        self._credit = 0.0

    def admit(self) -> bool:
        """Is this eligible load within the allowed share?"""
        self._credit += self.share
        if self._credit >= 1.0 - 1e-12:
            self._credit -= 1.0
            return True
        return False

    def observe_window(self, p95_ttft_s: float, throughput: float) -> RampStep:
        """One observation window's p95 TTFT and throughput (a window with no requests has neither: skip it). A NaN
        used to back the share off without a word."""
        check_non_negative_number("p95_ttft_s", p95_ttft_s)
        check_non_negative_number("throughput", throughput)
        holds = p95_ttft_s <= self.baseline_p95_ttft_s * (1 + self.tolerance) and throughput >= self.baseline_throughput * (1 - self.tolerance)
        if holds:
            new = min(self.share + self.step, self.max_share)
            action = "raise" if new > self.share else "hold"
        else:
            new = self.share * self.backoff
            action = "back_off"
        step = RampStep(self.share, p95_ttft_s, throughput, action)
        self.history.append(step)
        self.share = new
        return step

    def to_dict(self) -> dict[str, Any]:
        return {"share": self.share, "history": [attrs.asdict(s) for s in self.history]}
