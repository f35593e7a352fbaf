"""Per-source circuit breaker: a failing source gets recompute, not retries.

closed ──(``failure_threshold`` failures or timeouts within ``window_s``)──▶ open
open ──(``open_s`` elapsed)──▶ half-open: up to ``half_open_probes`` loads go through
half-open ──success──▶ closed;  half-open ──failure──▶ open (timer restarts)
"""

from __future__ import annotations

import math
from collections import deque
from typing import Literal

from ..clock import MonotonicClock
from ..errors import ConfigError
from ..protocols import Clock

State = Literal["closed", "open", "half_open"]


class CircuitBreaker:
    MAX_TRANSITIONS = 1024

    def __init__(self, failure_threshold: int = 5, window_s: float = 30.0, open_s: float = 10.0, half_open_probes: int = 1, clock: Clock | None = None) -> None:
        for name, v in (("failure_threshold", failure_threshold), ("half_open_probes", half_open_probes)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ConfigError(name, f"must be a positive int, got {v!r}")
        for name, t in (("window_s", window_s), ("open_s", open_s)):
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
                raise ConfigError(name, f"must be a finite positive number of seconds, got {t!r}")
        self.failure_threshold = failure_threshold
        self.window_s = window_s
        self.open_s = open_s
        self.half_open_probes = half_open_probes
        self.clock = clock or MonotonicClock()
        self._state: State = "closed"
        self._failures: deque[float] = deque()
        self._opened_at = 0.0
        self._probes_in_flight = 0
        #: the newest MAX_TRANSITIONS state changes (time, state): a link that flaps for days must not grow it forever
        self.transitions: deque[tuple[float, State]] = deque(maxlen=self.MAX_TRANSITIONS)

    @property
    def state(self) -> State:
        if self._state == "open" and self.clock.now_s() - self._opened_at >= self.open_s:
            self._set("half_open")
            self._probes_in_flight = 0
        return self._state

    def _set(self, state: State) -> None:
        self._state = state
        self.transitions.append((self.clock.now_s(), state))

    def allow(self) -> bool:
        """May a load start now? In half-open, reserves one probe slot."""
        s = self.state
        if s == "closed":
            return True
        if s == "half_open" and self._probes_in_flight < self.half_open_probes:
            self._probes_in_flight += 1
            return True
        return False

    def release(self) -> None:
        """A reserved load was not started after all."""
        if self._state == "half_open" and self._probes_in_flight > 0:
            self._probes_in_flight -= 1

    def record_success(self) -> None:
        if self.state == "half_open":
            self._failures.clear()
            self._probes_in_flight = 0
            self._set("closed")

    def record_failure(self) -> None:
        now = self.clock.now_s()
        s = self.state
        if s == "half_open":
            self._opened_at = now
            self._probes_in_flight = 0
            self._set("open")
            return
        if s == "open":
            return
        self._failures.append(now)
        while self._failures and now - self._failures[0] > self.window_s:
            self._failures.popleft()
        if len(self._failures) >= self.failure_threshold:
            self._opened_at = now
            self._failures.clear()
            self._set("open")
