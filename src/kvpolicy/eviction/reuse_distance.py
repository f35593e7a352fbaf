"""kvpolicy's reuse-distance-aware eviction.

A block lives in the pool by how soon it will be used again relative to the
capacity that is really available — not by a TTL. The policy keeps LRU's
backbone (recency is the best single predictor of the next use in prefix
traces, and LRU's tail-first order keeps chains intact) and adds two learned
corrections:

1. **Doomed blocks first.** Virtual time V is the bytes of new KV inserted so far
   (the volume of unique blocks written). Each block keeps the EWMA (weight
   ``ewma``, default 0.5) of the reuse distances it has shown — V between its
   uses. A block whose expected reuse distance exceeds ``C_effective`` will be
   evicted before it is re-read whatever happens, so it goes first; holding it
   only displaces blocks that can still hit.
2. **Reuse history shifts recency by W.** Most blocks of a conversation are used
   once (a turn that never continues); a few are reused again and again (system
   prompts, long-lived sessions). A block not yet re-used is ranked as if its last
   use were ``W`` seconds earlier; a block reused at least twice as if it were
   ``W`` seconds later. ``W`` is learned from the population: the running geometric
   mean of the intervals between a block's first use and its first reuse (how long
   a block that *will* be reused typically waits). Until the first such
   observation W = 0 and the policy is exactly LRU.

Priority (lowest evicted first)::

    (0 if doomed else 1,  last_use − aging·W·[never reused] + boost·W·[reused ≥ 2],  −depth)

Knobs: ``effective_bytes`` (``C_effective``; default the capacity), ``ewma`` (0.5),
``aging`` and ``boost`` (multipliers on W, default 1.0; 0 disables each).
Priorities are computed when a block is used or becomes a candidate, with the W
of that moment.
"""

from __future__ import annotations

import heapq
import math

from .._validate import check_non_negative_number, check_positive_number
from ..errors import ConfigError
from ..protocols import Clock
from .base import Node, PriorityPolicy


class ReuseDistancePolicy(PriorityPolicy):
    name = "reuse-distance"

    def __init__(self, capacity_bytes: int, *, effective_bytes: int | None = None, ewma: float = 0.5, aging: float = 1.0, boost: float = 1.0,
                 clock: Clock | None = None) -> None:
        if isinstance(ewma, bool) or not isinstance(ewma, (int, float)) or not 0 < ewma <= 1:
            raise ConfigError("ewma", f"must be a number in (0, 1], got {ewma!r}")
        check_non_negative_number("aging", aging)
        check_non_negative_number("boost", boost)
        if effective_bytes is not None:
            check_positive_number("effective_bytes", effective_bytes)
        super().__init__(capacity_bytes, clock=clock)
        self.c_eff = float(effective_bytes if effective_bytes is not None else max(capacity_bytes, 1))
        self.ewma = ewma
        self.aging = aging
        self.boost = boost
        self.V = 0.0
        self._log_w = 0.0
        self._n_w = 0
        self._w = 0.0  # exp(_log_w) once learned: every priority reads it

    @property
    def first_reuse_interval_s(self) -> float:
        """W: the learned typical wait between a block's first use and its first reuse."""
        return self._w

    def _admit(self, node: Node) -> None:
        node.data = (self.V, None)  # V at last use, EWMA reuse distance (bytes): a tuple of numbers, which the collector untracks
        self.V += node.size

    _admit.moves_no_priority = True  # type: ignore[attr-defined]  # V moves, and no priority reads it

    def _hit(self, node: Node) -> None:
        v_last, est = node.data
        d = max(self.V - v_last, 1.0)
        node.data = (self.V, d if est is None else (1 - self.ewma) * est + self.ewma * d)
        if node.hits == 1:  # first reuse: learn W from how long it waited
            wait = max(node.t_access - node.t_insert, 1e-6)
            self._n_w += 1
            self._log_w += (math.log(wait) - self._log_w) / self._n_w
            self._w = math.exp(self._log_w)
        super()._hit(node)

    def doomed(self, node: Node) -> bool:
        est = node.data[1]
        return est is not None and est > self.c_eff

    def _push(self, node: Node) -> None:
        """The base's push of :meth:`_entry`'s flattened entry."""
        heap = self._heap
        heapq.heappush(heap, self._entry(node))
        if len(heap) > 4 * self._n_candidates + 64:
            self._compact()

    _push.pushes_its_entry = True  # type: ignore[attr-defined]

    def _entry(self, node: Node) -> tuple:
        """The base's entry with :meth:`priority`'s three fields flattened into it — (doomed, time, depth, seq, version,
        node) orders exactly as ((doomed, time, depth), seq, version, node), one tuple and one call fewer per push (the
        local cache's hottest line). A subclass with its own priority takes the base's entry."""
        if type(self).priority is not ReuseDistancePolicy.priority:
            return super()._entry(node)
        node.version += 1
        w = self._w
        hits = node.hits
        shift = self.aging * w if hits == 0 else (-self.boost * w if hits >= 2 else 0.0)
        est = node.data[1]
        return (0 if est is not None and est > self.c_eff else 1, node.t_access - shift, -node.depth, node.seq, node.version, node)

    def priority(self, node: Node) -> tuple:
        w = self._w  # first_reuse_interval_s
        hits = node.hits
        shift = self.aging * w if hits == 0 else (-self.boost * w if hits >= 2 else 0.0)
        est = node.data[1]  # doomed(node), inline: this runs on every push
        return (0 if est is not None and est > self.c_eff else 1, node.t_access - shift, -node.depth)
