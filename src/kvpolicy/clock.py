"""Clocks: the real one and a manual one for tests and simulation."""

from __future__ import annotations

import time

from .errors import ConfigError


class MonotonicClock:
    """Wall time from :func:`time.monotonic` (seconds)."""

    def now_s(self) -> float:
        return time.monotonic()


class WallClock:
    """Unix time from :func:`time.time` (seconds): the clock absolute expiry times are written in,
    the one Redis's ``TIME`` keeps, so an ``expires_at_s`` means the same on every directory backend."""

    def now_s(self) -> float:
        return time.time()


class ManualClock:
    """A clock that moves only when told to."""

    def __init__(self, start_s: float = 0.0) -> None:
        self._now_s = float(start_s)

    def now_s(self) -> float:
        return self._now_s

    def advance(self, seconds: float) -> float:
        if seconds < 0:
            raise ConfigError("seconds", f"time cannot go backwards ({seconds})")
        self._now_s += seconds
        return self._now_s
