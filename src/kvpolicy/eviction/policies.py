"""The baselines and the bound, each a short class over the shared base.

Priority policies (lower priority evicted first; ties → deeper block first, then
insertion order):

=========  ==========================================================
LRU        ``(last access, −depth)`` — vLLM's tie-break: a chain's tail goes first
LFU        ``(accesses, last access, −depth)`` — LRU among equals
TTL        ``(last access + ttl, −depth)`` and, on :meth:`TTLPolicy.expire`, every
           expired leaf is dropped even with free space (kept to show why a TTL
           is the wrong knob: it throws away blocks the capacity could hold)
GDSF       ``H = L + (1 + hits) × cost(depth) / size``; ``L`` = H of the last
           victim (aging). cost grows with depth: the recompute seconds of that
           block from a prefill model, else ``1 + depth``
Belady     ``−next use`` — offline MIN from the trace's own future; ``bypass=True``
           also declines to cache a block whose next use is later than every
           candidate's (it would be the next victim)
=========  ==========================================================

Queue policies (a block the eviction scan meets that is not evictable — it has
resident children or is pinned — is rotated, as a recently used block would be):

=========  ==========================================================
FIFO       insertion order
SIEVE      FIFO queue + visited bit; a hand sweeps from old to new, clearing
           bits, and evicts the first unvisited evictable block (NSDI'24)
S3-FIFO    small FIFO (10 %), main FIFO with up to 3 reinsertions, ghost FIFO of
           keys evicted from the small queue (SOSP'23)
ARC        T1/T2 with ghosts B1/B2 and adaptive target p (FAST'03); blocks of
           one size
=========  ==========================================================
"""

from __future__ import annotations

import bisect
import math
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import Any

import numpy as np

from ..errors import CapacityError, ConfigError, OracleRequiredError
from ..protocols import Clock
from .base import EvictionPolicy, Node, PriorityPolicy


class LRUPolicy(PriorityPolicy):
    name = "lru"

    def priority(self, node: Node) -> tuple:
        return (node.t_access, -node.depth)


class LFUPolicy(PriorityPolicy):
    name = "lfu"

    def priority(self, node: Node) -> tuple:
        return (node.hits, node.t_access, -node.depth)


class TTLPolicy(PriorityPolicy):
    name = "ttl"

    def __init__(self, capacity_bytes: int, *, ttl_s: float = 300.0, clock: Clock | None = None) -> None:
        if isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or not ttl_s > 0:  # inf: nothing expires
            raise ConfigError("ttl_s", f"must be a positive number of seconds (inf: never), got {ttl_s!r}")
        super().__init__(capacity_bytes, clock=clock)
        self.ttl_s = ttl_s
        self.expired = 0

    def priority(self, node: Node) -> tuple:
        return (node.t_access + self.ttl_s, -node.depth)

    def expire(self) -> list[Hashable]:
        """Drop every evictable block whose TTL has passed (leaves first, repeatedly)."""
        now = self.clock.now_s()
        out = []
        while True:
            try:
                node = self._choose()
            except CapacityError:
                break
            if node.t_access + self.ttl_s > now:
                break
            out.append(node.key)
            self._remove(node)
            self.expired += 1
        return out


def depth_cost(prefill: Any = None, block_size_tokens: int = 16) -> Callable[[int], float]:
    """Recompute cost of the block at ``depth``: from a PrefillModel, else ``1 + depth``."""
    if prefill is None:
        return lambda depth: 1.0 + depth

    def cost(depth: int) -> float:
        return float(prefill.marginal_s(depth * block_size_tokens, (depth + 1) * block_size_tokens))

    return cost


class GDSFPolicy(PriorityPolicy):
    name = "gdsf"

    def __init__(self, capacity_bytes: int, *, cost: Callable[[int], float] | None = None, clock: Clock | None = None) -> None:
        super().__init__(capacity_bytes, clock=clock)
        if cost is not None and not callable(cost):
            raise ConfigError("cost", f"must be a callable depth -> cost (or None: depth_cost()), got {cost!r}")
        self.cost = cost or depth_cost()
        self.L = 0.0

    def priority(self, node: Node) -> tuple:
        node.data = self.L + (1 + node.hits) * self.cost(node.depth) / node.size
        return (node.data, -node.depth)

    def _forget(self, node: Node) -> None:
        if node.data is not None and node.data > self.L:
            self.L = node.data


class TraceOracle:
    """Next use of every block, from a trace: the request index of its next reference."""

    def __init__(self, trace: Any) -> None:
        req = trace.request_of_block_ref()
        order = np.argsort(trace.block_ids, kind="stable")
        ids = trace.block_ids[order]
        reqs = req[order]
        bounds = np.flatnonzero(np.diff(ids)) + 1
        self._uses: dict[int, np.ndarray] = {}
        for s, e in zip(np.concatenate([[0], bounds]), np.concatenate([bounds, [ids.size]])):
            if e > s:
                self._uses[int(ids[s])] = reqs[s:e]
        self.now = -1

    def __call__(self, key: Hashable) -> float:
        uses = self._uses.get(key)  # type: ignore[call-overload]  # a key that is no int has no future: None
        if uses is None:
            raise OracleRequiredError(f"the oracle has no future for block {key!r}")
        i = bisect.bisect_right(uses, self.now)
        return float(uses[i]) if i < uses.size else math.inf


class BeladyPolicy(PriorityPolicy):
    name = "belady"

    def __init__(self, capacity_bytes: int, *, oracle: Callable[[Hashable], float] | None = None, bypass: bool = False, clock: Clock | None = None) -> None:
        if oracle is None:
            raise OracleRequiredError("Belady needs the future: pass oracle=TraceOracle(trace) (or any key -> next-use callable)")
        super().__init__(capacity_bytes, clock=clock)
        self.oracle = oracle
        self.bypass = bypass
        if bypass:
            self.name = "belady-bypass"

    def priority(self, node: Node) -> tuple:
        node.data = self.oracle(node.key)
        return (-node.data, -node.depth)

    def _hit(self, node: Node) -> None:
        super()._hit(node)

    def admit(self, key: Hashable, size: int, parent: Hashable | None = None) -> bool:
        if not self.bypass or self.used_bytes + size <= self.capacity_bytes or self.freeable_bytes == 0:
            return True
        return self.oracle(key) < self._choose().data


class _Queue:
    """An ordered set of keys, oldest first (OrderedDict underneath)."""

    __slots__ = ("d", "bytes")

    def __init__(self) -> None:
        self.d: OrderedDict[Hashable, Node] = OrderedDict()
        self.bytes = 0

    def push(self, node: Node) -> None:
        self.d[node.key] = node
        self.bytes += node.size

    def pop(self, node: Node) -> None:
        del self.d[node.key]
        self.bytes -= node.size

    def rotate(self, node: Node) -> None:
        self.d.move_to_end(node.key)

    def oldest(self) -> Node:
        return next(iter(self.d.values()))

    def __len__(self) -> int:
        return len(self.d)


class FIFOPolicy(EvictionPolicy):
    name = "fifo"

    def __init__(self, capacity_bytes: int, *, clock: Clock | None = None) -> None:
        super().__init__(capacity_bytes, clock=clock)
        self.q = _Queue()

    def _admit(self, node: Node) -> None:
        self.q.push(node)

    def _forget(self, node: Node) -> None:
        self.q.pop(node)

    def _choose(self) -> Node:
        while True:
            n = self.q.oldest()
            if n.is_candidate:
                return n
            self.q.rotate(n)

    def _peek_order(self) -> Iterator[Node]:
        return (n for n in self.q.d.values() if n.is_candidate)  # oldest first, as _choose rotates past the rest


class SIEVEPolicy(EvictionPolicy):
    """Doubly linked list old→new; ``hand`` walks toward newer blocks and wraps."""

    name = "sieve"

    def __init__(self, capacity_bytes: int, *, clock: Clock | None = None) -> None:
        super().__init__(capacity_bytes, clock=clock)
        self._newer: dict[Hashable, Hashable | None] = {}
        self._older: dict[Hashable, Hashable | None] = {}
        self._oldest: Hashable | None = None
        self._newest: Hashable | None = None
        self._hand: Hashable | None = None

    def _admit(self, node: Node) -> None:
        node.data = False  # visited
        k = node.key
        self._older[k] = self._newest
        self._newer[k] = None
        if self._newest is not None:
            self._newer[self._newest] = k
        else:
            self._oldest = k
        self._newest = k

    def _hit(self, node: Node) -> None:
        node.data = True

    def _forget(self, node: Node) -> None:
        k = node.key
        o, n = self._older.pop(k), self._newer.pop(k)
        if o is not None:
            self._newer[o] = n
        else:
            self._oldest = n
        if n is not None:
            self._older[n] = o
        else:
            self._newest = o
        if self._hand == k:
            self._hand = n

    def _choose(self) -> Node:
        k = self._hand if self._hand is not None else self._oldest
        while True:
            node = self.nodes[k]
            if node.is_candidate and not node.data:
                self._hand = k
                return node
            node.data = False
            k = self._newer[k]
            if k is None:
                k = self._oldest


def check_small_fraction(v: Any) -> None:
    """S3-FIFO's small queue as a share of the capacity (the policy and its kernel)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < 1:
        raise ConfigError("small_fraction", f"must be a number in (0, 1), got {v!r}")


class S3FIFOPolicy(EvictionPolicy):
    name = "s3fifo"

    def __init__(self, capacity_bytes: int, *, small_fraction: float = 0.1, clock: Clock | None = None) -> None:
        check_small_fraction(small_fraction)
        super().__init__(capacity_bytes, clock=clock)
        self.small_bytes = small_fraction * capacity_bytes
        self.S, self.M = _Queue(), _Queue()
        self.ghost: OrderedDict[Hashable, int] = OrderedDict()
        self.ghost_bytes = 0
        self.cand = {"S": 0, "M": 0}

    def _admit(self, node: Node) -> None:
        g = self.ghost.pop(node.key, None)
        if g is not None:
            self.ghost_bytes -= g
            node.data = ["M", 0]
            self.M.push(node)
        else:
            node.data = ["S", 0]
            self.S.push(node)

    def _hit(self, node: Node) -> None:
        node.data[1] = min(node.data[1] + 1, 3)

    def _candidate(self, node: Node, yes: bool) -> None:
        if node.data is not None:
            self.cand[node.data[0]] += 1 if yes else -1

    def _admit_and_count(self, node: Node) -> None:  # pragma: no cover - documentation aid
        pass

    def _move_to_main(self, node: Node) -> None:
        was = node.is_candidate
        if was:
            self.cand["S"] -= 1
        self.S.pop(node)
        node.data = ["M", 0 if node.data[1] > 1 else node.data[1]]
        self.M.push(node)
        if was:
            self.cand["M"] += 1

    def _choose(self) -> Node:
        while True:
            use_small = (self.S.bytes >= self.small_bytes and self.cand["S"] > 0) or self.cand["M"] == 0
            if use_small:
                t = self.S.oldest()
                if not t.is_candidate or t.data[1] > 1:
                    self._move_to_main(t)
                    continue
                return t
            t = self.M.oldest()
            if t.is_candidate and t.data[1] == 0:
                return t
            if t.is_candidate:
                t.data[1] -= 1
            self.M.rotate(t)

    def _forget(self, node: Node) -> None:
        q = self.S if node.data[0] == "S" else self.M
        q.pop(node)
        if node.data[0] == "S":
            self.ghost[node.key] = node.size
            self.ghost_bytes += node.size
            while self.ghost_bytes > self.capacity_bytes - self.small_bytes and self.ghost:
                _, sz = self.ghost.popitem(last=False)
                self.ghost_bytes -= sz


class ARCPolicy(EvictionPolicy):
    """ARC over blocks of one size (capacity c = capacity_bytes // block size)."""

    name = "arc"

    def __init__(self, capacity_bytes: int, *, clock: Clock | None = None) -> None:
        super().__init__(capacity_bytes, clock=clock)
        self.T1, self.T2 = _Queue(), _Queue()  # oldest first = LRU end
        self.B1: OrderedDict[Hashable, None] = OrderedDict()
        self.B2: OrderedDict[Hashable, None] = OrderedDict()
        self.p = 0.0
        self.block: int | None = None
        self.cand = {1: 0, 2: 0}
        self._adapted: Hashable | None = None

    @property
    def c(self) -> int:
        return self.capacity_bytes // self.block if self.block else 0

    def _adapt(self, key: Hashable) -> None:
        if key in self.B1:
            self.p = min(float(self.c), self.p + max(len(self.B2) / len(self.B1), 1.0))
        elif key in self.B2:
            self.p = max(0.0, self.p - max(len(self.B1) / len(self.B2), 1.0))
        else:
            return
        self._adapted = key

    def victims(self, need_bytes: int, incoming: Hashable | None = None) -> list[Hashable]:
        if incoming is not None and self.used_bytes + need_bytes > self.capacity_bytes:
            self._adapt(incoming)
        return super().victims(need_bytes, incoming)

    def _admit(self, node: Node) -> None:
        if self.block is None:
            self.block = node.size
        elif node.size != self.block:
            raise ConfigError("size", f"ARC needs blocks of one size ({self.block} bytes), got {node.size}")
        k = node.key
        if self._adapted != k:
            self._adapt(k)
        self._adapted = None
        if k in self.B1 or k in self.B2:
            self.B1.pop(k, None)
            self.B2.pop(k, None)
            node.data = 2
            self.T2.push(node)
        else:
            c = self.c
            if len(self.T1) + len(self.B1) >= c and self.B1:
                self.B1.popitem(last=False)
            elif len(self.T1) + len(self.T2) + len(self.B1) + len(self.B2) >= 2 * c and self.B2:
                self.B2.popitem(last=False)
            node.data = 1
            self.T1.push(node)

    def _hit(self, node: Node) -> None:
        was = node.is_candidate
        (self.T1 if node.data == 1 else self.T2).pop(node)
        if was:
            self.cand[node.data] -= 1
        node.data = 2
        self.T2.push(node)
        if was:
            self.cand[2] += 1

    def _candidate(self, node: Node, yes: bool) -> None:
        if node.data is not None:
            self.cand[node.data] += 1 if yes else -1

    def _choose(self) -> Node:
        in_b2 = self._incoming is not None and self._incoming in self.B2
        from_t1 = self.cand[1] > 0 and (len(self.T1) > self.p or (in_b2 and len(self.T1) == self.p) or self.cand[2] == 0)
        q = self.T1 if from_t1 else self.T2
        while True:
            t = q.oldest()
            if t.is_candidate:
                return t
            q.rotate(t)

    def _forget(self, node: Node) -> None:
        (self.T1 if node.data == 1 else self.T2).pop(node)
        (self.B1 if node.data == 1 else self.B2)[node.key] = None
        c = self.c
        while len(self.B1) > c:
            self.B1.popitem(last=False)
        while len(self.B2) > c:
            self.B2.popitem(last=False)


POLICIES: dict[str, type[EvictionPolicy]] = {
    "lru": LRUPolicy,
    "fifo": FIFOPolicy,
    "lfu": LFUPolicy,
    "ttl": TTLPolicy,
    "s3fifo": S3FIFOPolicy,
    "sieve": SIEVEPolicy,
    "arc": ARCPolicy,
    "gdsf": GDSFPolicy,
    "belady": BeladyPolicy,
}
