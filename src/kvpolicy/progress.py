"""Progress on stderr: a live line on a terminal, one log line per finished unit elsewhere.

On a terminal the current step is redrawn in place. In a pipe, a log or CI, each unit
of work (a scenario x policy set, a profile point) prints one line when it finishes —
``compare: [3] steady / kvpolicy done in 4.1s (12.0s total)`` — so a long run is never
silent. ``enabled=False`` (``--quiet`` / ``--no-progress``) prints nothing.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    def __init__(self, label: str, enabled: bool | None = None, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.enabled = True if enabled is None else enabled
        self.label = label
        self.t0 = time.perf_counter()
        self.steps = 0
        self._current: str | None = None
        self._t_step = self.t0

    def _finish_step(self) -> None:
        if self._current is not None and not self.tty:
            now = time.perf_counter()
            self.stream.write(f"{self.label}: [{self.steps}] {self._current} done in {now - self._t_step:.1f}s ({now - self.t0:.1f}s total)\n")
            self.stream.flush()
        self._current = None

    def __call__(self, message: str) -> None:
        if not self.enabled:
            self.steps += 1
            return
        self._finish_step()
        self.steps += 1
        self._current = message
        self._t_step = time.perf_counter()
        if self.tty:
            self.stream.write(f"\r\x1b[K{self.label}: [{self.steps}] {message} ({self._t_step - self.t0:.1f}s)")
            self.stream.flush()

    def done(self) -> None:
        if not self.enabled:
            return
        self._finish_step()
        if self.tty:
            self.stream.write(f"\r\x1b[K{self.label}: done in {time.perf_counter() - self.t0:.1f}s\n")
        else:
            self.stream.write(f"{self.label}: done in {time.perf_counter() - self.t0:.1f}s\n")
        self.stream.flush()
