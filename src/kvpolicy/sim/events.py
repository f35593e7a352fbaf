"""The event loop and the clock (issue #48's first room).

Every room of the simulator schedules work the same way: ``loop.push(t, kind, obj)`` puts an event on one heap,
ordered by time and then by the order it was pushed (so ties resolve the same way on every run), and
:meth:`EventLoop.run` pops them in order, sets the clock, and hands each to the room that owns its kind (the handler the
simulator registered for it). The kinds are numbers, one per handler; a room names its events, the loop knows nothing
of what they mean.
"""

from __future__ import annotations

import gc
import heapq
import math
from collections.abc import Callable, Sequence
from typing import Any

#: the event kinds, in the order of :meth:`kvpolicy.sim.engine.Simulator.handlers` (which room owns each: docs/sim.md)
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
    """One heap of (time, sequence, kind, object) and the clock it drives.

    A trace's arrivals are a stream beside the heap (:meth:`arrivals_from`), not pushed into it: arrival ``i`` is the
    event (``times[i]``, sequence ``first_seq + i``) of kind NEW_REQUEST, merged with the heap by the same order, so
    the heap holds only what is in flight — its pushes and pops cost log(in flight), not log(trace length)."""

    __slots__ = ("heap", "clock", "_seq", "_arr_times", "_arr_next", "_arr_seq0")

    def __init__(self) -> None:
        self.heap: list[tuple[float, int, int, Any]] = []
        self.clock = _Clock()
        self._seq = 0
        self._arr_times: Sequence[float] = ()
        self._arr_next = 0
        self._arr_seq0 = 0

    def push(self, t: float, kind: int, obj: Any) -> None:
        self._seq += 1
        heapq.heappush(self.heap, (t, self._seq, kind, obj))

    def arrivals_from(self, times: Sequence[float]) -> None:
        """Arrival i happens at ``times[i]`` (non-decreasing) with the sequence numbers it would have had if each had
        been pushed now, in order."""
        self._arr_times = times
        self._arr_next = 0
        self._arr_seq0 = self._seq + 1
        self._seq += len(times)

    def arrivals_seen(self) -> int:
        """How many of the stream's arrivals have happened (they happen in index order: request ``n - 1`` is the last)."""
        return self._arr_next

    def arrivals_left(self) -> int:
        return len(self._arr_times) - self._arr_next

    def next_event_s(self) -> float:
        """When the next event happens (inf when none is left)."""
        t = self.heap[0][0] if self.heap else math.inf
        if self._arr_next < len(self._arr_times):
            t = min(t, self._arr_times[self._arr_next])
        return t

    def run(self, handlers: Sequence[Callable[[Any, float], None]], *, pause_gc: bool = False) -> None:
        """Run every event, in time order (ties in the order pushed), until none is left.

        ``pause_gc``: hold Python's cyclic garbage collector for the loop and give it back as it was, however the loop
        ends. A run allocates millions of short-lived objects, nearly none of them in reference cycles, and the
        collector's passes over them cost about a sixth of a run (measured: ``benchmarks/bench_sim_speed.py``)."""
        heap = self.heap
        clock = self.clock
        pop = heapq.heappop
        times = self._arr_times
        n = len(times)
        new_request = handlers[NEW_REQUEST]
        paused = pause_gc and gc.isenabled()
        if paused:
            gc.disable()
        try:
            while True:
                i = self._arr_next
                if i < n:
                    ta = times[i]
                    if not heap or ta < heap[0][0] or (ta == heap[0][0] and self._arr_seq0 + i < heap[0][1]):
                        self._arr_next = i + 1
                        clock.t = ta
                        new_request(i, ta)
                        continue
                elif not heap:
                    break
                t, _, kind, obj = pop(heap)
                clock.t = t
                handlers[kind](obj, t)
        finally:
            if paused:
                if gc.get_freeze_count() == 0:
                    # what the run allocated sits in the youngest generation, and the first collection after enable
                    # would walk all of it (a few million objects, ~4 % of a run). Moved to the oldest instead — a
                    # freeze and unfreeze splice the generation lists, touching no object — it waits for the next full
                    # collection, as anything long-lived does. Skipped when the caller has frozen objects of its own
                    # (unfreeze would release them too)
                    gc.freeze()
                    gc.unfreeze()
                gc.enable()
