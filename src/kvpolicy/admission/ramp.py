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
            if not v > 0:
                raise ConfigError(name, f"must be positive, got {v}")
        if not 0 <= initial_share <= max_share <= 1:
            raise ConfigError("initial_share", "need 0 <= initial_share <= max_share <= 1")
        if not 0 < step <= 1 or not 0 < backoff < 1 or not 0 <= tolerance < 1:
            raise ConfigError("step", "need 0 < step <= 1, 0 < backoff < 1, 0 <= tolerance < 1")
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
