"""SGLang: a kvpolicy eviction policy as an ``EvictionStrategy``.

SGLang's radix cache asks ``strategy.get_priority(node)`` and evicts the lowest
(``sglang/srt/mem_cache/evict_policy.py``). :class:`PriorityStrategy` answers
with a kvpolicy :class:`~kvpolicy.eviction.base.PriorityPolicy` that **keeps its
state across calls**: it mirrors the radix tree it is asked about — a ``TreeNode``
seen for the first time is inserted under its parent, a node whose
``hit_count`` grew or whose ``last_access_time`` moved is a hit, and a node SGLang
drops (garbage-collected) is removed — so reuse-distance learns reuse distances
and GDSF's inflation rises with what was evicted, as they do inside kvpolicy.
The fields SGLang keeps map onto kvpolicy's ``Node``: ``last_access_time`` →
``t_access``, ``hit_count`` → hits, ``creation_time`` → ``t_insert``, the
``parent`` chain → depth, ``value``/``key`` length → size. Nothing from SGLang is
imported here.

Switching it on in SGLang 0.5.x (:func:`register`, which imports SGLang): the
strategy registry is a closed dict (``sglang/srt/mem_cache/utils.py``
``_EVICTION_POLICY_FACTORIES``) and the CLI's choices a list
(``sglang/srt/arg_groups/choices.py`` ``add_radix_eviction_policy_choices``);
``register`` adds ``kvpolicy-<policy>`` to both. Only the Python tree core asks a
strategy — the default Rust core does not — so the server also needs
``SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python``. See docs/integrations.md.
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

from ..clock import ManualClock
from ..errors import ConfigError
from ..eviction.base import PriorityPolicy


class _Mirror:
    __slots__ = ("token", "hits", "t_access")

    def __init__(self, token: int, hits: int, t_access: float) -> None:
        self.token = token
        self.hits = hits
        self.t_access = t_access


def _size(node: Any) -> int:
    value = getattr(node, "value", None)
    key = getattr(node, "key", None)
    n = len(value) if value is not None and hasattr(value, "__len__") else (len(key) if key is not None and hasattr(key, "__len__") else 1)
    return max(int(n), 1)


#: accesses replayed into the mirror per get_priority call, at most (hits beyond it are counted, not replayed)
MAX_REPLAYED_HITS = 64


class PriorityStrategy:
    """``get_priority(node)`` from a kvpolicy priority policy (lowest is evicted first), stateful across calls."""

    def __init__(self, policy: PriorityPolicy) -> None:
        if not isinstance(policy, PriorityPolicy):
            raise ConfigError("policy", "must be a kvpolicy PriorityPolicy (LRU, LFU, GDSF, reuse-distance, ...)")
        if policy.nodes:
            raise ConfigError("policy", "must be empty: the strategy mirrors SGLang's tree into it")
        self.policy = policy
        # the mirror never evicts by itself (SGLang does): its capacity is unbounded
        policy.capacity_bytes = 1 << 62
        self._clock = ManualClock()
        policy.clock = self._clock
        self._mirror: dict[int, _Mirror] = {}  # id(TreeNode) -> mirror (ids are reused only after the node is gone)
        self._tokens = 0
        # nodes SGLang dropped, (id, token), applied by the next get_priority: a TreeNode's finalizer runs whenever the
        # garbage collector frees it — in whatever thread allocated at that moment (SGLang's HiCache threads too),
        # possibly in the middle of this strategy's own update — so it only queues (deque.append is atomic)
        self._dropped: deque[tuple[int, int]] = deque()

    def _at(self, t: float) -> None:
        """The mirror's clock follows SGLang's timestamps (never backwards)."""
        if t > self._clock.now_s():
            self._clock.advance(t - self._clock.now_s())

    def _mirrored(self, node: Any) -> _Mirror | None:
        """The node's mirror, inserting it (and its ancestors) on first sight; None for the radix root."""
        if getattr(node, "parent", None) is None:
            return None  # the root holds no block
        m = self._mirror.get(id(node))
        if m is not None:
            return m
        parent = self._mirrored(node.parent)
        self._tokens += 1
        t_access = float(getattr(node, "last_access_time", 0.0))
        self._at(float(getattr(node, "creation_time", t_access)))
        self.policy.on_insert(self._tokens, _size(node), parent.token if parent is not None else None)
        m = _Mirror(self._tokens, int(getattr(node, "hit_count", 0)), t_access)
        self._mirror[id(node)] = m
        self._sync(node, m)
        weakref.finalize(node, self._gone, id(node), m.token)
        return m

    def _gone(self, node_id: int, token: int) -> None:
        """SGLang dropped the node (its finalizer, from any thread): queued for the next :meth:`get_priority`."""
        self._dropped.append((node_id, token))

    def _apply_dropped(self) -> None:
        while self._dropped:
            self._remove(*self._dropped.popleft())

    def _remove(self, node_id: int, token: int) -> None:
        """Remove a dropped node from the mirror (its descendants went first, or go now)."""
        m = self._mirror.get(node_id)
        if m is None or m.token != token:
            return
        del self._mirror[node_id]
        pol = self.policy
        if token not in pol.nodes:
            return
        stack = [pol.nodes[token]]
        order = []
        while stack:  # remove any mirrored descendants first: the mirror stays prefix-closed
            n = stack.pop()
            order.append(n)
            if n.children:
                stack.extend(c for c in pol.nodes.values() if c.parent is n)
        for n in reversed(order):
            while n.pins:
                pol.unpin(n.key)
            pol.on_remove(n.key)

    def get_priority(self, node: Any, now_time: float | None = None) -> tuple:
        self._apply_dropped()  # before the lookup: a dropped node's id may already belong to a new one
        m = self._mirrored(node)
        if m is None:
            return (float("inf"),)  # the root is never evicted
        hits = int(getattr(node, "hit_count", 0))
        t = float(getattr(node, "last_access_time", 0.0))
        if hits > m.hits or t > m.t_access:
            self._at(t)
            # one access per hit since the last look, at most MAX_REPLAYED_HITS: a hot node first seen at eviction time may
            # carry millions, and this runs inside SGLang's eviction loop (the count itself is synced below, whole)
            for _ in range(min(max(hits - m.hits, 1), MAX_REPLAYED_HITS)):
                self.policy.on_access(m.token)
            m.hits, m.t_access = hits, t
            self._sync(node, m)
        return self.policy.priority(self.policy.nodes[m.token])

    def _sync(self, node: Any, m: _Mirror) -> None:
        """SGLang's own record wins: the first sight may come late (at eviction time), so the
        mirror takes the node's timestamps and hit count rather than the moment it was asked."""
        n = self.policy.nodes[m.token]
        n.t_access = m.t_access
        n.t_insert = float(getattr(node, "creation_time", n.t_insert if n.t_insert <= m.t_access else m.t_access))
        n.hits = m.hits


def make_sglang_strategy(policy: PriorityPolicy) -> Any:
    """A real ``sglang...EvictionStrategy`` subclass instance (needs SGLang installed)."""
    try:
        from sglang.srt.mem_cache.evict_policy import EvictionStrategy  # type: ignore[import-not-found]
    except ImportError:
        raise ConfigError("sglang", "SGLang is not installed; use PriorityStrategy directly") from None

    class KVPolicyStrategy(PriorityStrategy, EvictionStrategy):  # type: ignore[misc, valid-type]
        pass

    return KVPolicyStrategy(policy)


def register(policies: dict[str, Callable[[], PriorityPolicy]] | None = None) -> list[str]:
    """Add ``kvpolicy-<name>`` eviction policies to SGLang's strategy registry and CLI choices
    (imports SGLang). Default: kvpolicy's reuse-distance, gdsf, lru and lfu priority policies.
    Returns the names to pass to ``--radix-eviction-policy``. Calling it again changes nothing more."""
    try:
        from sglang.srt.arg_groups import choices as sg_choices  # type: ignore[import-not-found]
        from sglang.srt.mem_cache import utils as sg_utils  # type: ignore[import-not-found]
    except ImportError:
        raise ConfigError("sglang", "SGLang (0.5.x) is not importable here") from None
    from ..eviction.policies import GDSFPolicy, LFUPolicy, LRUPolicy
    from ..eviction.reuse_distance import ReuseDistancePolicy

    big = 1 << 62
    policies = policies or {"reuse-distance": lambda: ReuseDistancePolicy(big), "gdsf": lambda: GDSFPolicy(big),
                            "lru": lambda: LRUPolicy(big), "lfu": lambda: LFUPolicy(big)}
    names = []
    for name, make in policies.items():
        full = f"kvpolicy-{name}"
        sg_utils._EVICTION_POLICY_FACTORIES[full] = lambda _make=make, **_cfg: make_sglang_strategy(_make())
        names.append(full)
    # again (a second register() call): SGLang's CLI would list each name twice
    listed = set(getattr(sg_choices, "RADIX_EVICTION_POLICY_CHOICES", ()))
    sg_choices.add_radix_eviction_policy_choices([n for n in names if n not in listed])
    return names
