"""The event loop and the clock (issue #48's first room).

Every room of the simulator schedules work the same way: ``_push(t, kind, obj)`` puts an event on one heap, ordered by
time and then by the order it was pushed (so ties resolve the same way on every run), and :meth:`EventLoop._loop` pops
them in order, sets the clock, and hands each to its room's handler. The kinds are numbers, one per handler; a room
names its events, the loop knows nothing of what they mean.
"""

from __future__ import annotations

import gc
import heapq
from collections.abc import Callable, Sequence
from typing import Any

#: the event kinds, in the order of :meth:`kvpolicy.sim.engine.Simulator._handlers`
(ARRIVE, LOAD_DONE, PREFILL_DONE, DECODE_DONE, WRITE_DONE, WARM_DONE, SCALE_OUT, READY, NET, LOAD_TIMEOUT, MEET, CAPACITY, SAMPLE,
 SWITCH, WRITE_TIMEOUT, NEW_REQUEST) = range(16)


class _Clock:
    """The simulated time, as the online objects (eviction policies, the admission controller) read it."""

    __slots__ = ("t",)

    def __init__(self) -> None:
        self.t = 0.0

    def now_s(self) -> float:
        return self.t


class EventLoop:
    """One heap of (time, sequence, kind, object) and the clock it drives."""

    heap: list[tuple[float, int, int, Any]]
    clock: _Clock
    _seq: int

    def _push(self, t: float, kind: int, obj: Any) -> None:
        self._seq += 1
        heapq.heappush(self.heap, (t, self._seq, kind, obj))

    def _loop(self, handlers: Sequence[Callable[[Any, float], None]], *, pause_gc: bool = False) -> None:
        """Run every event, in time order (ties in the order pushed), until none is left.

        ``pause_gc``: hold Python's cyclic garbage collector for the loop and give it back as it was, however the loop
        ends. A run allocates millions of short-lived objects, nearly none of them in reference cycles, and the
        collector's passes over them cost about a sixth of a run (measured: ``benchmarks/bench_sim_speed.py``)."""
        heap = self.heap
        clock = self.clock
        pop = heapq.heappop
        paused = pause_gc and gc.isenabled()
        if paused:
            gc.disable()
        try:
            while heap:
                t, _, kind, obj = pop(heap)
                clock.t = t
                handlers[kind](obj, t)
        finally:
            if paused:
                gc.enable()
