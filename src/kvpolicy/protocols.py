"""The engine-facing seams, in one short file.

Engines implement or call these; kvpolicy never imports an engine. Later
components add their protocols here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable


@runtime_checkable
class BlockIndex(Protocol):
    """Anything that can say how many *leading* keys of a chain it holds.

    Prefix semantics (like SGLang's ``batch_exists``): return ``n`` such that
    ``keys[:n]`` are all present and ``keys[n]`` is not (or ``n == len(keys)``).
    A local cache, a remote pool and a directory all look like this.
    """

    def match_prefix(self, keys: Sequence[bytes]) -> int: ...


@runtime_checkable
class Clock(Protocol):
    """Injectable time source in seconds, so time-dependent policies are testable."""

    def now_s(self) -> float: ...
