"""SGLang's radix-cache eviction loop, as a stand-in: replay a trace through any SGLang ``EvictionStrategy``.

SGLang (0.5.x, ``sglang/srt/mem_cache/radix_cache.py``) asks its strategy ``get_priority(node)`` for every evictable
leaf at each ``evict(num_tokens)`` call, heapifies, pops the lowest until enough is freed and pushes a parent that has
just become an evictable leaf. This module runs that loop on a request-level trace without SGLang, so a strategy — one
of SGLang's own priority functions, or kvpolicy's :class:`~kvpolicy.integrations.sglang.PriorityStrategy` — can be
measured and tested on the same footing. Per request, at its arrival time:

1. **match**: the leading run of resident blocks; every node on it gets ``last_access_time`` = now (SGLang's
   ``_match_prefix_helper``); those within the matchable range are hits; the run is locked (``lock_ref``);
2. **evict** what the rest needs beyond the capacity (one ``evict`` call; evictable = a leaf with ``lock_ref`` 0);
3. **insert** the rest, root first, as far as room allows; a matched node's ``hit_count`` grows by one and a new node
   starts at one (SGLang's ``_insert_helper``); then the request's nodes are unlocked.

By default one node per block. SGLang merges a run of pages into one node — a leaf is a whole unshared suffix — and
splits a node where a request diverges or stops inside it: ``merge_runs=True`` replays that shape (a node's key is its
run of block ids; eviction frees a whole leaf run).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import ConfigError
from ..traces.model import check_trace


class RadixNode:
    """The fields of SGLang's ``TreeNode`` a strategy reads."""

    __slots__ = ("parent", "children", "key", "value", "last_access_time", "creation_time", "hit_count", "lock_ref", "__weakref__")

    def __init__(self, parent: RadixNode | None, now_s: float) -> None:
        self.parent = parent
        self.children: dict[int, RadixNode] = {}
        self.key: tuple[int, ...] = (0,)  # one block (its id once inserted: a stable identity for the same content)
        self.value: tuple[int, ...] = (0,)
        self.last_access_time = now_s
        self.creation_time = now_s
        self.hit_count = 0
        self.lock_ref = 0


def radix_replay(trace: Any, get_priority: Callable[[RadixNode], Any], capacity_blocks: int,
                 clock: list[float] | None = None, *, merge_runs: bool = False, leaf_order_seed: int | None = None) -> np.ndarray:
    """Per block reference of ``trace``: whether it was a hit, with ``get_priority`` ranking the evictions (lowest
    first). ``clock``, a one-item list, is set to each request's arrival time before it runs (what a strategy that
    reads the time sees; SGLang's timestamps are ``time.monotonic()``). ``merge_runs``: SGLang's own tree shape instead
    of one node per block — a node holds a run of blocks (``key``: their ids; a new request's unshared rest is one
    node), a request that diverges or stops inside a node splits it there (:func:`_split`, as SGLang's
    ``_match_prefix_helper`` and ``_insert_helper`` do: a node's key and parent change under a strategy that remembers
    them), and an eviction frees a whole leaf run. One node per block is the same loop with every run one block long.

    ``leaf_order_seed``: SGLang keeps its evictable leaves in a ``set`` of nodes, so the order it asks for their
    priorities — and the order of heap ties — is the nodes' memory addresses, different from one process to the next.
    Given a seed, each ``evict`` asks in a shuffled order and breaks ties by it (default: the order the leaves became
    evictable). A strategy whose decisions must not depend on that order is replayed at several seeds."""
    check_trace(trace)
    if isinstance(capacity_blocks, bool) or not isinstance(capacity_blocks, (int, np.integer)) or capacity_blocks < 1:
        raise ConfigError("capacity_blocks", f"must be a positive int, got {capacity_blocks!r}")
    if not isinstance(merge_runs, bool):
        raise ConfigError("merge_runs", f"must be true or false, got {merge_runs!r}")
    if leaf_order_seed is not None and (isinstance(leaf_order_seed, bool) or not isinstance(leaf_order_seed, (int, np.integer))):
        raise ConfigError("leaf_order_seed", f"must be an int or None, got {leaf_order_seed!r}")
    shuffle = None if leaf_order_seed is None else np.random.default_rng(leaf_order_seed).permutation
    root = RadixNode(None, 0.0)
    root.key = root.value = ()
    root.lock_ref = 1  # never evicted
    leaves: dict[RadixNode, None] = {}  # the evictable leaves (SGLang's ``evictable_leaves``), in the order they became so
    used = 0
    seq = itertools.count()  # heap ties: the first pushed first (SGLang's tuples would compare nodes by access time)
    hits = np.zeros(trace.block_ids.size, dtype=bool)
    offsets, ids = trace.block_offsets.tolist(), trace.block_ids.tolist()
    matchable, arrival = trace.matchable_blocks.tolist(), trace.arrival_s.tolist()
    for r in range(len(trace)):
        now = arrival[r] + r * 1e-9
        if clock is not None:
            clock[0] = now
        s, e = offsets[r], offsets[r + 1]
        node, path, i = root, [], s
        root.last_access_time = now
        while i < e:
            child = node.children.get(ids[i])
            if child is None:
                break
            child.last_access_time = now
            k, key = 0, child.key
            while k < len(key) and i + k < e and key[k] == ids[i + k]:
                k += 1
            if k < len(key):  # stops or diverges inside the node: split it there (the next lookup then finds nothing)
                child = _split(child, k, now)
            path.append(child)
            node = child
            i += k
        m = i - s
        hits[s : s + min(m, matchable[r])] = True
        for n in path:
            n.lock_ref += 1
            leaves.pop(n, None)
        need = used + (e - i) - capacity_blocks
        if need > 0:
            asked = list(leaves)
            if shuffle is not None:
                asked = [asked[j] for j in shuffle(len(asked))]
            heap = [(get_priority(x), next(seq), x) for x in asked]
            heapq.heapify(heap)
            while need > 0 and heap:
                _, _, x = heapq.heappop(heap)
                del leaves[x]
                parent = x.parent
                assert parent is not None  # a leaf in the heap is in the tree: the root is never one
                del parent.children[x.key[0]]  # a child is held under its first block
                x.parent = None
                used -= len(x.key)  # a whole leaf run is freed (SGLang's ``evict`` counts ``len(x.value)``)
                need -= len(x.key)
                if parent is not root and not parent.children and parent.lock_ref == 0:
                    leaves[parent] = None
                    heapq.heappush(heap, (get_priority(parent), next(seq), parent))
                del x
            # SGLang's ``evict`` holds every leaf it asked about in a list until it returns: the evicted nodes are freed
            # then, in that list's order (a strategy that learns from the drops sees them in it)
            del heap, asked
        room = capacity_blocks - used
        for n in path:
            n.hit_count += 1
        rest = ids[i : min(e, i + max(room, 0))]
        for run in ([tuple(rest)] if merge_runs and rest else [(b,) for b in rest]):  # one node for the rest, or one per block
            leaves.pop(node, None)
            child = RadixNode(node, now)
            child.key = child.value = run
            child.hit_count = 1
            node.children[run[0]] = child
            node = child
            used += len(run)
        for n in path:
            n.lock_ref -= 1
        if node is not root and not node.children and node.lock_ref == 0:  # the chain's deepest node: a leaf again
            leaves[node] = None
    return hits


def _split(child: RadixNode, k: int, now_s: float) -> RadixNode:
    """SGLang's ``_split_node``: a new node takes the first ``k`` blocks of ``child`` (its hit count and locks too)
    and becomes ``child``'s parent; ``child`` keeps the rest, and stays the same object."""
    new = RadixNode(child.parent, now_s)
    new.hit_count, new.lock_ref = child.hit_count, child.lock_ref
    new.key = new.value = child.key[:k]
    child.key = child.value = child.key[k:]
    new.children = {child.key[0]: child}
    assert new.parent is not None  # the root is never split: it holds no block
    new.parent.children[new.key[0]] = new
    child.parent = new
    return new


def sglang_lru(node: RadixNode) -> float:
    """SGLang's ``LRUStrategy``: the last access time."""
    return node.last_access_time


def sglang_lfu(node: RadixNode) -> tuple[int, float]:
    """SGLang's ``LFUStrategy``: the hit count, then the last access time."""
    return (node.hit_count, node.last_access_time)


def sglang_radix_replay(trace: Any, strategy: Any, capacity_tokens: int, clock: list[float] | None = None, *, radix: Any = None,
                        params: Any = None, value: Callable[[list[int]], Any] | None = None,
                        stamp: Callable[[], float] | None = None) -> np.ndarray:
    """Per block reference of ``trace``: whether it was a hit in **SGLang's own** ``RadixCache`` (page size 1, one
    token per block), its eviction ranked by ``strategy`` (an ``EvictionStrategy``: SGLang's, or kvpolicy's from
    :func:`kvpolicy.integrations.sglang.make_sglang_strategy`). The request flow :func:`radix_replay` stands in for:
    ``match_prefix``, ``inc_lock_ref`` on the matched node, ``evict`` what the rest needs beyond the capacity,
    ``insert`` as much of the rest as fits, ``dec_lock_ref``. SGLang stamps nodes with ``time.monotonic()``; here the
    radix module's clock is each request's arrival time for the replay (put back after), and ``clock``, a one-item
    list, is set to it too (a strategy that reads the time: ``make_sglang_strategy(policy, now_s=lambda: clock[0])``).

    ``radix`` / ``params``: SGLang's ``sglang.srt.mem_cache.radix_cache`` and ``base_prefix_cache`` modules (default:
    imported from an installed SGLang — ``tools/check_engine_bases.py`` passes ones read out of the wheel).
    ``value``: a request's token indices as the tree stores them (default ``torch.tensor(ids, dtype=torch.int64)``).
    ``stamp``: the tree's clock instead of the arrival times — e.g. ``UnifiedRadixCache``'s step counter
    (``get_and_increase_time_counter``: one more at every stamp)."""
    import time as _time
    import types
    from array import array

    check_trace(trace)
    if isinstance(capacity_tokens, bool) or not isinstance(capacity_tokens, (int, np.integer)) or capacity_tokens < 1:
        raise ConfigError("capacity_tokens", f"must be a positive int, got {capacity_tokens!r}")
    if not callable(getattr(strategy, "get_priority", None)):
        raise ConfigError("strategy", f"must be an SGLang EvictionStrategy (a get_priority(node) method), got {type(strategy).__name__}")
    try:
        if radix is None:
            from sglang.srt.mem_cache import radix_cache as radix  # type: ignore[import-not-found,no-redef]
        if params is None:
            from sglang.srt.mem_cache import base_prefix_cache as params  # type: ignore[import-not-found,no-redef]
    except ImportError:
        raise ConfigError("sglang", "SGLang is not importable here: pass radix= and params= (tools/check_engine_bases.py reads "
                                    "them out of the wheel)") from None
    if value is None:
        import torch  # type: ignore[import-not-found]

        def value(ids: list[int]) -> Any:
            return torch.tensor(ids, dtype=torch.int64)

    class _Allocator:  # the KV pool: nothing to free in a replay
        device = "cpu"

        def free_segment(self, indices: Any, start_pos: int = 0) -> None:
            pass

        def free(self, indices: Any) -> None:
            pass

    now = clock if clock is not None else [0.0]
    saved = radix.time
    radix.time = types.SimpleNamespace(monotonic=stamp or (lambda: now[0]), perf_counter=_time.perf_counter, time=_time.time)
    try:
        tree = radix.RadixCache.create_simulated(mock_allocator=_Allocator())
        tree.eviction_strategy = strategy
        hits = np.zeros(trace.block_ids.size, dtype=bool)
        offsets, ids = trace.block_offsets.tolist(), trace.block_ids.tolist()
        matchable, arrival = trace.matchable_blocks.tolist(), trace.arrival_s.tolist()
        for r in range(len(trace)):
            now[0] = arrival[r] + r * 1e-9  # as radix_replay: distinct, increasing stamps
            s, e = offsets[r], offsets[r + 1]
            key = radix.RadixKey(token_ids=array("q", ids[s:e]))
            m = tree.match_prefix(params.MatchPrefixParams(key=key))
            got = int(m.device_prefix_len)
            hits[s : s + min(got, matchable[r])] = True
            node = m.last_device_node
            tree.inc_lock_ref(node)
            need = (e - s) - got
            used = tree.evictable_size() + tree.protected_size()
            if used + need > capacity_tokens:
                tree.evict(params.EvictParams(num_tokens=used + need - capacity_tokens))
            room = capacity_tokens - (tree.evictable_size() + tree.protected_size())
            end = got + min(need, max(room, 0))
            if end > 0:  # the matched nodes' hit counts grow by one here, whether or not anything new fits
                tree.insert(params.InsertParams(key=key[:end], value=value(ids[s : s + end])))
            tree.dec_lock_ref(node)
    finally:
        radix.time = saved
    return hits
