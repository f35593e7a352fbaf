"""A minimal progress line on stderr — only when stderr is a terminal."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    def __init__(self, label: str, enabled: bool | None = None, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.label = label
        self.t0 = time.perf_counter()
        self.steps = 0

    def __call__(self, message: str) -> None:
        self.steps += 1
        if self.enabled:
            self.stream.write(f"\r\x1b[K{self.label}: [{self.steps}] {message} ({time.perf_counter() - self.t0:.1f}s)")
            self.stream.flush()

    def done(self) -> None:
        if self.enabled:
            self.stream.write(f"\r\x1b[K{self.label}: done in {time.perf_counter() - self.t0:.1f}s\n")
            self.stream.flush()
