"""Run two policies on the same traces and report the first divergence."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import attrs
import numpy as np

from ..clock import ManualClock
from ..eviction.replay import replay


@attrs.frozen
class Divergence:
    trace_index: int
    block_ref: int  # index into trace.block_ids, or −1 when only the victims differ
    request: int
    hit_a: bool | None
    hit_b: bool | None
    victims_a: list[Any]
    victims_b: list[Any]

    def __str__(self) -> str:
        if self.block_ref >= 0:
            return f"trace {self.trace_index}, request {self.request}, block ref {self.block_ref}: hit {self.hit_a} vs {self.hit_b}"
        return f"trace {self.trace_index}: same hits, victims differ: {self.victims_a[:10]} vs {self.victims_b[:10]}"


def first_divergence(make_a: Callable[[int, ManualClock], Any], make_b: Callable[[int, ManualClock], Any], traces: Iterable[Any], capacity_blocks: int) -> Divergence | None:
    """Replay each trace through fresh policies from both factories; the first difference, or None."""
    for i, tr in enumerate(traces):
        a = replay(tr, make_a(capacity_blocks, ManualClock()), record_victims=True)
        b = replay(tr, make_b(capacity_blocks, ManualClock()), record_victims=True)
        diff = np.flatnonzero(a.hits != b.hits)
        if diff.size:
            j = int(diff[0])
            req = int(np.searchsorted(tr.block_offsets, j, side="right") - 1)
            return Divergence(i, j, req, bool(a.hits[j]), bool(b.hits[j]), list(a.victims), list(b.victims))
        if list(a.victims) != list(b.victims):
            return Divergence(i, -1, -1, None, None, list(a.victims), list(b.victims))
    return None
