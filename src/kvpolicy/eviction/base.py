"""The shared machinery every eviction policy stands on.

A policy sees a **resident prefix tree**: each block has a size in bytes and
(optionally) a parent that must already be resident. The base keeps:

* the tree (children counts, depth) — the resident set stays prefix-closed, and
  only **leaves** (no resident child) are ever evicted: a parent becomes a
  candidate once its last child is gone;
* **pins** (refcounts held by active decodes): a pinned block is never evicted.
  A per-node count of pinned nodes in its subtree, propagated only on 0↔1
  transitions (O(1) amortised for chain pins), gives the bytes that cannot be
  freed, so :meth:`victims` raises :class:`~kvpolicy.errors.CapacityError`
  *before* evicting anything when the request is impossible — never over-commits;
* capacity and used bytes.

A policy overrides a few hooks (cachetools-style: reading one teaches all):
``_admit`` (new block), ``_hit`` (access), ``_candidate`` (a block becomes or
stops being an eviction candidate), ``_choose`` (return a current candidate) and
``_forget`` (a block left the cache). :class:`PriorityPolicy` turns a priority
function into a policy (SGLang-style: lower priority is evicted first).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable, Iterable, Iterator, Sequence
from typing import Any

from ..clock import ManualClock
from ..errors import CapacityError, ConfigError
from ..protocols import Clock


class Node:
    __slots__ = ("key", "size", "parent", "children", "pins", "prot", "depth", "seq", "version", "t_insert", "t_access", "hits", "data")

    def __init__(self, key: Hashable, size: int, parent: Node | None, seq: int, now: float) -> None:
        self.key = key
        self.size = size
        self.parent = parent
        self.children = 0
        self.pins = 0
        self.prot = 0  # pinned nodes in this subtree, counted as: own pin (0/1) + children with prot > 0
        self.depth: int = 0 if parent is None else parent.depth + 1
        self.seq = seq
        self.version = 0
        self.t_insert = now
        self.t_access = now
        self.hits = 0
        self.data: Any = None

    @property
    def is_candidate(self) -> bool:
        return self.children == 0 and self.prot == 0


class EvictionPolicy:
    """Base class: the prefix tree, pins, capacity. Subclasses pick victims."""

    name = "base"

    def __init__(self, capacity_bytes: int, *, clock: Clock | None = None) -> None:
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes < 0:
            raise ConfigError("capacity_bytes", f"must be a non-negative int, got {capacity_bytes!r}")
        self.capacity_bytes = capacity_bytes
        self.clock = clock or ManualClock()
        self.nodes: dict[Hashable, Node] = {}
        self.used_bytes = 0
        self.protected_bytes = 0
        self._seq = itertools.count()
        self.evictions = 0
        self.hits = 0
        self.inserts = 0
        self._incoming: Hashable | None = None

    # ------------------------------------------------------------------ engine API

    def __contains__(self, key: object) -> bool:
        return key in self.nodes

    def __len__(self) -> int:
        return len(self.nodes)

    def __iter__(self) -> Iterator[Hashable]:
        return iter(self.nodes)

    @property
    def freeable_bytes(self) -> int:
        return self.used_bytes - self.protected_bytes

    def on_insert(self, key: Hashable, size: int, parent: Hashable | None = None) -> None:
        """A block became resident. Its parent must be resident; capacity must suffice."""
        self._candidate(self._new_node(key, size, parent), True)

    def insert_pinned(self, key: Hashable, size: int, parent: Hashable | None = None) -> None:
        """A block became resident already pinned (an engine allocating it for a running request): what
        ``on_insert(key, size, parent)`` then ``pin(key)`` leave, which is what this does unless a faster path is
        known to leave the same (:class:`PriorityPolicy`)."""
        self.on_insert(key, size, parent)
        self.pin(key)

    def place_pinned(self, key: Hashable, size: int, parent: Hashable | None = None) -> bool:
        """Make room for a block, ask :meth:`admit`, and insert it pinned — an engine caching a block it just computed
        for a running request. False, with nothing changed, when pinned blocks leave no room or the policy refuses it;
        True when it is resident and pinned. Exactly ``victims(size, key)``, ``admit``, ``insert_pinned``, with the
        parent held (pinned) while room is made when nothing else protects it: a block is never evicted to make room
        for its own child (which could then not be inserted)."""
        p = self.nodes.get(parent) if parent is not None else None
        hold = p is not None and p.prot == 0
        if hold:
            self.pin(parent)
        try:
            try:
                self.victims(size, key)
            except CapacityError:
                return False
            if not self.admit(key, size, parent):
                return False
            self.insert_pinned(key, size, parent)
            return True
        finally:
            if hold:
                self.unpin(parent)

    def place_pinned_chain(self, keys: Sequence[Hashable], start: int, end: int, size: int) -> int:
        """Place a run of one chain: ``place_pinned(keys[j], size, keys[j - 1])`` for j = start, start + 1, … — each block
        under the one before it — until ``end``, a key already resident, a parent not resident, or a block that finds no
        room or is refused. Returns the j it stopped at: ``keys[start:j]`` are now resident and pinned. An engine caching
        the blocks it just computed for a running request, in one call."""
        nodes = self.nodes
        for j in range(start, end):
            key = keys[j]
            if key in nodes:
                return j
            parent = keys[j - 1] if j else None
            if parent is not None and parent not in nodes:
                return j
            if not self.place_pinned(key, size, parent):
                return j
        return end

    def _new_node(self, key: Hashable, size: int, parent: Hashable | None) -> Node:
        """Check and add a resident block (not yet a candidate); its parent stops being one."""
        nodes = self.nodes
        if key in nodes:
            raise ConfigError("key", f"{key!r} is already resident")
        if type(size) is not int and (isinstance(size, bool) or not isinstance(size, int)) or size <= 0:  # a plain int skips the slow test
            raise ConfigError("size", f"must be a positive int (bytes), got {size!r}")
        p = None
        if parent is not None:
            p = nodes.get(parent)
            if p is None:
                raise ConfigError("parent", f"{parent!r} is not resident: the resident set must stay prefix-closed")
        if self.used_bytes + size > self.capacity_bytes:
            raise CapacityError(f"inserting {size} bytes would exceed capacity ({self.used_bytes} of {self.capacity_bytes} used); call victims() first")
        node = Node(key, size, p, next(self._seq), self.clock.now_s())
        nodes[key] = node
        self.used_bytes += size
        self.inserts += 1
        if p is not None:
            if p.children == 0 and p.prot == 0:
                self._candidate(p, False)
            p.children += 1
        self._admit(node)
        return node

    def on_access(self, key: Hashable) -> None:
        node = self.nodes.get(key)
        if node is None:
            raise ConfigError("key", f"{key!r} is not resident")
        node.hits += 1
        node.t_access = self.clock.now_s()
        self.hits += 1
        self._hit(node)

    def on_remove(self, key: Hashable) -> None:
        """The engine dropped a block itself (it must be an unpinned leaf)."""
        node = self.nodes.get(key)
        if node is None:
            raise ConfigError("key", f"{key!r} is not resident")
        if not node.is_candidate:
            raise ConfigError("key", f"{key!r} is pinned or has resident children; remove its descendants first")
        self._remove(node)

    def pin(self, key: Hashable) -> None:
        node = self.nodes.get(key)
        if node is None:
            raise ConfigError("key", f"{key!r} is not resident")
        node.pins += 1
        if node.pins == 1:
            self._prot_up(node)

    def unpin(self, key: Hashable) -> None:
        node = self.nodes.get(key)
        if node is None or node.pins == 0:
            raise ConfigError("key", f"{key!r} is not pinned")
        node.pins -= 1
        if node.pins == 0:
            self._prot_down(node)

    def unpin_all(self, keys: Iterable[Hashable]) -> None:
        """``unpin(key)`` for each key, in order (a request releasing the blocks it held)."""
        for key in keys:
            self.unpin(key)

    def victims(self, need_bytes: int, incoming: Hashable | None = None) -> list[Hashable]:
        """Evict until ``need_bytes`` more fit; return the evicted keys (leaves first).

        ``incoming`` names the block about to be inserted, for policies that use it
        (ARC's ghost lists). Raises CapacityError, evicting nothing, when pinned
        blocks make it impossible.
        """
        if type(need_bytes) is not int and (isinstance(need_bytes, bool) or not isinstance(need_bytes, int)) or need_bytes < 0:
            raise ConfigError("need_bytes", f"must be a non-negative int, got {need_bytes!r}")
        self._incoming = incoming
        short = self.used_bytes + need_bytes - self.capacity_bytes
        if short <= 0:
            return []
        if short > self.freeable_bytes:
            raise CapacityError(
                f"need {short} more bytes but only {self.freeable_bytes} are freeable "
                f"({self.protected_bytes} bytes pinned or under pinned blocks)"
            )
        out = []
        limit = self.capacity_bytes - need_bytes
        while self.used_bytes > limit:
            node = self._choose()
            assert node.children == 0 and node.prot == 0, f"{type(self).__name__} chose a non-candidate {node.key!r}"
            out.append(node.key)
            self._remove(node)
            self.evictions += 1
        return out

    def admit(self, key: Hashable, size: int, parent: Hashable | None = None) -> bool:
        """Should this block be cached at all? (Bypass policies say no.)"""
        return True

    def peek_victims(self, need_bytes: int) -> list[Hashable] | None:
        """The keys :meth:`victims` would evict for ``need_bytes`` now, in order, **without evicting anything** (what a
        write admission compares a candidate with: :class:`kvpolicy.write_admission.WriteAdmission`). ``[]``: it fits
        as things are. ``None``: this policy cannot name its victims without choosing them (its choice moves state:
        SIEVE's hand, S3-FIFO's queues, a sampled choice), or pinned blocks make the need impossible.

        The walk takes the current candidates in eviction order; a parent that would become a candidate once its last
        child went is not counted (the keys are an estimate of the first victims, exact for leaves)."""
        if isinstance(need_bytes, bool) or not isinstance(need_bytes, int) or need_bytes < 0:
            raise ConfigError("need_bytes", f"must be a non-negative int, got {need_bytes!r}")
        short = self.used_bytes + need_bytes - self.capacity_bytes
        if short <= 0:
            return []
        if short > self.freeable_bytes:
            return None
        order = self._peek_order()
        if order is None:
            return None
        out: list[Hashable] = []
        for node in order:
            out.append(node.key)
            short -= node.size
            if short <= 0:
                break
        return out

    def _peek_order(self) -> Iterator[Node] | None:
        """Current eviction candidates in the order :meth:`_choose` would take them, without side effects; None when the
        policy cannot tell without choosing (the default)."""
        return None

    # ------------------------------------------------------------------ internals

    def _remove(self, node: Node) -> None:
        self._candidate(node, False)
        del self.nodes[node.key]
        self.used_bytes -= node.size
        p = node.parent
        if p is not None:
            p.children -= 1
            if p.children == 0 and p.prot == 0:
                self._candidate(p, True)
        self._forget(node)

    def _prot_up(self, node: Node) -> None:
        n: Node | None = node
        while n is not None:
            was_candidate = n.children == 0 and n.prot == 0
            n.prot += 1
            if n.prot != 1:
                break
            self.protected_bytes += n.size
            if was_candidate:
                self._candidate(n, False)
            n = n.parent

    def _prot_down(self, node: Node) -> None:
        n: Node | None = node
        while n is not None:
            n.prot -= 1
            if n.prot != 0:
                break
            self.protected_bytes -= n.size
            if n.children == 0:
                self._candidate(n, True)
            n = n.parent

    # ------------------------------------------------------------------ hooks

    def _admit(self, node: Node) -> None:
        pass

    _admit.moves_no_priority = True  # type: ignore[attr-defined]  # admitting a block moves no other block's priority

    def _hit(self, node: Node) -> None:
        pass

    def _candidate(self, node: Node, yes: bool) -> None:
        pass

    def _choose(self) -> Node:
        raise NotImplementedError(f"{type(self).__name__} must override _choose() (or derive from PriorityPolicy and define priority())")

    def _forget(self, node: Node) -> None:
        pass

    # ------------------------------------------------------------------ checks

    def check(self) -> None:
        """Verify every invariant (for tests): sizes, children, prefix closure, pins."""
        used = 0
        prot = 0
        children: dict[Hashable, int] = {k: 0 for k in self.nodes}
        for k, n in self.nodes.items():
            used += n.size
            if n.parent is not None:
                assert self.nodes.get(n.parent.key) is n.parent, f"{k!r}: parent not resident (prefix closure broken)"
                children[n.parent.key] += 1
        for k, n in self.nodes.items():
            assert n.children == children[k], f"{k!r}: children {n.children} != {children[k]}"
            want = (1 if n.pins > 0 else 0) + sum(1 for c in self.nodes.values() if c.parent is n and c.prot > 0)
            assert n.prot == want, f"{k!r}: prot {n.prot} != {want}"
            if n.prot > 0:
                prot += n.size
        assert used == self.used_bytes <= self.capacity_bytes, (used, self.used_bytes, self.capacity_bytes)
        assert prot == self.protected_bytes, (prot, self.protected_bytes)


class PriorityPolicy(EvictionPolicy):
    """Evict the candidate with the lowest ``priority(node)`` (a tuple).

    A heap of candidates with lazy invalidation: a node's entry is re-pushed
    whenever its priority may have changed, and stale entries are skipped.
    """

    def __init__(self, capacity_bytes: int, *, clock: Clock | None = None) -> None:
        super().__init__(capacity_bytes, clock=clock)
        self._heap: list[tuple[Any, ...]] = []  # entries end (..., seq, version, node)
        self._n_candidates = 0
        # a block inserted pinned skips being a candidate for an instant (a push, then its invalidation: nothing but a
        # stale heap entry) — exact only while on_insert, pin and _candidate are this base's own
        cls = type(self)
        self._fused_pinned_insert = (cls.on_insert is EvictionPolicy.on_insert and cls.pin is EvictionPolicy.pin
                                     and cls._candidate is PriorityPolicy._candidate)
        # place_pinned's eviction loop inline, while victims, admit and the pinned insert are this base's own
        self._fused_place = (self._fused_pinned_insert and cls.victims is EvictionPolicy.victims and cls.admit is EvictionPolicy.admit
                             and cls.insert_pinned is PriorityPolicy.insert_pinned and cls._remove is EvictionPolicy._remove)
        # the base's _choose returns the node whose entry tops the heap: an inline eviction loop that removes it can
        # pop that entry at once instead of meeting it again as a stale one
        self._pop_chosen = cls._choose is PriorityPolicy._choose
        self._forgets = cls._forget is not EvictionPolicy._forget  # the inline eviction loop skips the base's no-op
        # a parent that becomes a candidate while more room is still wanted, and whose entry sorts before the heap's
        # top, is the very next victim: the loop takes it without the push and pop — while _push pushes _entry's entry
        self._direct_parent = self._pop_chosen and getattr(cls._push, "pushes_its_entry", False)
        self._fused_unpin = (cls.unpin is EvictionPolicy.unpin and cls._prot_down is EvictionPolicy._prot_down
                             and cls._candidate is PriorityPolicy._candidate)
        # place_pinned_chain with every call inline, while the calls it stands for are this base's own
        self._fused_chain = (self._fused_place and cls.place_pinned is PriorityPolicy.place_pinned and cls._new_node is EvictionPolicy._new_node
                             and cls._prot_up is EvictionPolicy._prot_up)
        # and it makes room for the rest of the run at once, while admitting a block moves no other block's priority
        # (the victims are then the same, in the same order: see place_pinned_chain)
        self._batch_chain = self._fused_chain and getattr(cls._admit, "moves_no_priority", False)

    def place_pinned(self, key: Hashable, size: int, parent: Hashable | None = None) -> bool:
        if not self._fused_place or type(size) is not int or size < 0:
            return super().place_pinned(key, size, parent)
        if parent is not None:
            p = self.nodes.get(parent)
            if p is not None and p.prot == 0:  # an unprotected parent is held while room is made: the base does that
                return super().place_pinned(key, size, parent)
        self._incoming = key
        if not self._evict_to(self.capacity_bytes - size):
            return False  # pinned blocks leave no room: nothing evicted
        self.insert_pinned(key, size, parent)
        return True

    def _evict_to(self, limit: int) -> bool:
        """``victims``' loop, inline for the fused paths: evict until at most ``limit`` bytes are used; False, evicting
        nothing, when pinned blocks make that impossible."""
        used = self.used_bytes
        if used <= limit:
            return True
        if used - limit > used - self.protected_bytes:
            return False
        nodes = self.nodes
        heap_pop = self._pop_chosen
        pop = heapq.heappop
        forget = self._forget if self._forgets else None
        direct = self._direct_parent
        nxt: Node | None = None
        while self.used_bytes > limit:
            if nxt is not None:  # the parent taken directly below: it has no heap entry to pop
                node, nxt = nxt, None
            elif heap_pop:  # the base's _choose, inline: the top live entry, whose node is popped at once (it goes stale now)
                heap = self._heap  # read again each time: a push below may compact it into a new list
                while heap:
                    entry = heap[0]
                    node = entry[-1]
                    if entry[-2] == node.version and node.children == 0 and node.prot == 0 and nodes.get(node.key) is node:
                        break
                    pop(heap)
                else:
                    raise CapacityError("no eviction candidate")  # unreachable: the freeable bytes were checked above
                pop(heap)
            else:
                node = self._choose()
            # _remove(node), inline: _candidate(node, False), then its parent may become a candidate
            self._n_candidates -= 1
            node.version += 1
            del nodes[node.key]
            self.used_bytes -= node.size
            p = node.parent
            if p is not None:
                p.children -= 1
                if p.children == 0 and p.prot == 0:
                    self._n_candidates += 1
                    if direct and self.used_bytes > limit:
                        # pushed, it would be popped next if its entry sorts before the top one (live or stale): take it
                        entry = self._entry(p)
                        heap = self._heap
                        if not heap or entry < heap[0]:
                            nxt = p
                        else:
                            heapq.heappush(heap, entry)
                            if len(heap) > 4 * self._n_candidates + 64:
                                self._compact()
                    else:
                        self._push(p)
            if forget is not None:
                forget(node)
            self.evictions += 1
        return True

    def place_pinned_chain(self, keys: Sequence[Hashable], start: int, end: int, size: int) -> int:
        """The base's chain of ``place_pinned`` calls with every call inline — victims, ``_new_node`` and the pinned
        insert — while they are this base's own (``_fused_place``): the same steps in the same order, one frame per
        chain instead of five per block (the simulator's hottest loop: a request caching the blocks it computed)."""
        if not self._fused_chain or type(size) is not int or size <= 0:
            return super().place_pinned_chain(keys, start, end, size)
        nodes = self.nodes
        limit = self.capacity_bytes - size
        evict_to, admit = self._evict_to, self._admit
        seq, now_s = self._seq, self.clock.now_s
        batch = self._batch_chain
        for j in range(start, end):
            key = keys[j]
            if key in nodes:
                return j
            parent = keys[j - 1] if j else None
            if parent is not None:
                p = nodes.get(parent)
                if p is None:
                    return j
                if p.prot == 0:  # the run's first parent, unprotected: held while room is made, by the base's place_pinned
                    if not EvictionPolicy.place_pinned(self, key, size, parent):
                        return j
                    continue
            else:
                p = None
            self._incoming = key
            if self.used_bytes > limit:  # victims(size, key)
                if batch:
                    batch = False
                    # Room for the m blocks that pins leave room for, at once: block by block, the i-th evicts the
                    # shortest run of victims after which used + (i+1)·size fits, and the victims' order does not depend
                    # on the pinned blocks inserted between (their parents are protected, their admission moves no
                    # priority), so the m-th leaves exactly the victims used + m·size needs. Only over new, distinct keys
                    m = min(end - j, (self.capacity_bytes - self.protected_bytes) // size)
                    if m > 1 and len(set(keys[j:j + m])) == m and not any(k in nodes for k in keys[j + 1:j + m]):
                        evict_to(self.capacity_bytes - m * size)
                if self.used_bytes > limit and not evict_to(limit):
                    return j  # pinned blocks leave no room: nothing evicted
            # insert_pinned(key, size, parent), with _new_node inline. The parent p is protected (prot ≥ 1): never a
            # victim above, not a candidate now (nothing to invalidate), and its _prot_up stops at its own count
            node = Node(key, size, p, next(seq), now_s())
            nodes[key] = node
            self.used_bytes += size
            self.inserts += 1
            if p is not None:
                p.children += 1
            admit(node)
            node.pins = 1
            node.prot = 1
            self.protected_bytes += size
            if p is not None:
                p.prot += 1  # _prot_up(p): already ≥ 1, so it goes no further up
        return end

    def unpin_all(self, keys: Iterable[Hashable]) -> None:
        """The base's ``unpin`` of each key with ``_prot_down`` and ``_candidate`` inline, while all three are the base's."""
        if not self._fused_unpin:
            super().unpin_all(keys)
            return
        nodes = self.nodes
        push = self._push
        for key in keys:
            node = nodes.get(key)
            if node is None or node.pins == 0:
                raise ConfigError("key", f"{key!r} is not pinned")
            node.pins -= 1
            if node.pins:
                continue
            n: Node | None = node
            while n is not None:  # _prot_down(node)
                n.prot -= 1
                if n.prot != 0:
                    break
                self.protected_bytes -= n.size
                if n.children == 0:
                    self._n_candidates += 1  # _candidate(n, True)
                    push(n)
                n = n.parent

    def insert_pinned(self, key: Hashable, size: int, parent: Hashable | None = None) -> None:
        if not self._fused_pinned_insert:
            super().insert_pinned(key, size, parent)
            return
        node = self._new_node(key, size, parent)
        node.pins = 1
        node.prot = 1
        self.protected_bytes += size
        if node.parent is not None:
            self._prot_up(node.parent)

    def priority(self, node: Node) -> tuple:
        raise NotImplementedError(f"{type(self).__name__} must define priority(node) -> tuple (lowest is evicted first)")

    def _push(self, node: Node) -> None:
        node.version += 1
        heapq.heappush(self._heap, (self.priority(node), node.seq, node.version, node))
        if len(self._heap) > 4 * self._n_candidates + 64:
            self._compact()

    _push.pushes_its_entry = True  # type: ignore[attr-defined]  # what _entry returns: the eviction loop relies on it

    def _entry(self, node: Node) -> tuple[Any, ...]:
        """The heap entry :meth:`_push` would push for ``node`` now, its version bumped as a push bumps it."""
        node.version += 1
        return (self.priority(node), node.seq, node.version, node)

    def _compact(self) -> None:
        """Drop the stale entries (a node re-pushed, no longer a candidate, or gone) once they outnumber the live ones."""
        self._heap = [e for e in self._heap if e[-2] == e[-1].version and e[-1].key in self.nodes and e[-1].is_candidate]
        heapq.heapify(self._heap)

    def _candidate(self, node: Node, yes: bool) -> None:
        if yes:
            self._n_candidates += 1
            self._push(node)
        else:
            self._n_candidates -= 1
            node.version += 1  # invalidates its heap entry

    def _hit(self, node: Node) -> None:
        if node.is_candidate:
            self._push(node)

    def _choose(self) -> Node:
        heap = self._heap
        nodes = self.nodes
        while heap:
            entry = heap[0]
            version: int = entry[-2]  # an entry ends (..., seq, version, node): see _push
            node: Node = entry[-1]
            if version == node.version and node.children == 0 and node.prot == 0 and nodes.get(node.key) is node:
                return node
            heapq.heappop(heap)
        raise CapacityError("no eviction candidate")  # unreachable: victims() checks freeable bytes first

    def _peek_order(self) -> Iterator[Node]:
        """The heap's live entries in priority order, lazily (k smallest of a binary heap in O(k log k)), untouched."""
        heap = self._heap
        frontier = [(heap[0], 0)] if heap else []
        while frontier:
            entry, i = heapq.heappop(frontier)
            version: int = entry[-2]
            node: Node = entry[-1]
            if version == node.version and node.is_candidate and self.nodes.get(node.key) is node:
                yield node
            for c in (2 * i + 1, 2 * i + 2):
                if c < len(heap):
                    heapq.heappush(frontier, (heap[c], c))


def serve(policy: EvictionPolicy, keys: list[Hashable], sizes: list[int] | None = None, victims: list[Hashable] | None = None,
          *, lenient: bool = False) -> int:
    """One request through ``policy``, as a prefix cache serves it; returns the resident prefix's length in blocks.

    The leading run of resident keys is accessed (root first) and pinned; the rest is inserted root first, each
    under the one before it, until the policy declines one (``admit``) or nothing more can be evicted
    (``CapacityError``) — nothing after it can be cached without its parent; then the request's pins are released.
    Evicted keys are appended to ``victims`` when it is given. ``sizes``: bytes per key (default 1). A key that is
    already resident after the run (not a prefix chain: a trace error) raises ``ConfigError``; with ``lenient`` it
    ends the request instead (adaptive's mini-simulations, fed in whatever order an engine uses the cache)."""
    nodes = policy.nodes
    n = len(keys)
    j = 0
    while j < n and keys[j] in nodes:
        policy.on_access(keys[j])
        policy.pin(keys[j])
        j += 1
    run = j
    while j < n:
        key = keys[j]
        if lenient and key in nodes:
            break
        size = 1 if sizes is None else sizes[j]
        parent = keys[j - 1] if j else None
        if not policy.admit(key, size, parent):
            break
        try:
            v = policy.victims(size, incoming=key)
        except CapacityError:
            break
        if victims is not None:
            victims.extend(v)
        policy.on_insert(key, size, parent)
        policy.pin(key)
        j += 1
    for key in keys[:j]:
        policy.unpin(key)
    return run
