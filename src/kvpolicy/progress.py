"""Progress on stderr: a tqdm bar on a terminal, one log line per finished unit elsewhere.

On a terminal, a ``tqdm`` bar counts the units of work (with a total and an ETA when
the caller knows how many there are) and shows the current one. In a pipe, a log or
CI, each unit (a scenario x policy set, a profile point) prints one line when it
finishes — ``compare: [3] steady / kvpolicy done in 4.1s (12.0s total)`` — so a long
run is never silent and the log stays readable. ``enabled=False`` (``--quiet`` /
``--no-progress``) prints nothing.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO


class Progress:
    def __init__(self, label: str, enabled: bool | None = None, stream: TextIO | None = None, total: int | None = None) -> None:
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.enabled = True if enabled is None else enabled
        self.label = label
        self.total = total
        self.t0 = time.perf_counter()
        self.steps = 0
        self._current: str | None = None
        self._t_step = self.t0
        self._bar: Any = None

    def _finish_step(self) -> None:
        if self._current is not None:
            if self._bar is not None:
                self._bar.update(1)
            else:
                now = time.perf_counter()
                of = f"/{self.total}" if self.total else ""
                self.stream.write(f"{self.label}: [{self.steps}{of}] {self._current} done in {now - self._t_step:.1f}s ({now - self.t0:.1f}s total)\n")
                self.stream.flush()
        self._current = None

    def __call__(self, message: str) -> None:
        if not self.enabled:
            self.steps += 1
            return
        if self.tty and self._bar is None:
            from tqdm import tqdm

            self._bar = tqdm(total=self.total, desc=self.label, file=self.stream, unit="step", leave=True, dynamic_ncols=True)
        self._finish_step()
        self.steps += 1
        self._current = message
        self._t_step = time.perf_counter()
        if self._bar is not None:
            self._bar.set_postfix_str(message, refresh=True)

    def set_total(self, n: int) -> None:
        """The number of units, once the caller knows it (the bar gains a total and an ETA)."""
        self.total = n
        if self._bar is not None:
            self._bar.total = n
            self._bar.refresh()

    def done(self) -> None:
        if not self.enabled:
            return
        self._finish_step()
        if self._bar is not None:
            self._bar.set_postfix_str(f"done in {time.perf_counter() - self.t0:.1f}s", refresh=False)
            self._bar.close()
            self._bar = None
        else:
            self.stream.write(f"{self.label}: done in {time.perf_counter() - self.t0:.1f}s\n")
            self.stream.flush()
