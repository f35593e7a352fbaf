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

import math
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

from .._mix import key_bits
from ..clock import ManualClock
from ..errors import ConfigError
from ..eviction.base import PriorityPolicy
from ..eviction.hit_density import HitDensityPolicy
from ..eviction.learned import LearnedRelaxedBeladyPolicy


class _Mirror:
    __slots__ = ("token", "hits", "t_access", "priority")

    def __init__(self, token: int, hits: int, t_access: float) -> None:
        self.token = token
        self.hits = hits
        self.t_access = t_access
        self.priority: tuple | None = None  # the last one this strategy gave SGLang for the node


def _content(node: Any) -> Any:
    """A node's own tokens and namespace, hashable (SGLang's ``RadixKey``: token ids, LoRA key, salt, limit)."""
    key = getattr(node, "key", None)
    ids = getattr(key, "token_ids", None)
    if ids is not None:
        limit = getattr(key, "limit", None)
        toks = tuple(ids[:limit] if limit is not None else ids)
        return (getattr(key, "extra_key", None), getattr(key, "cache_salt", None), toks)
    try:
        return tuple(key) if key is not None else None
    except TypeError:
        return repr(key)


def _size(node: Any) -> int:
    value = getattr(node, "value", None)
    key = getattr(node, "key", None)
    n = len(value) if value is not None and hasattr(value, "__len__") else (len(key) if key is not None and hasattr(key, "__len__") else 1)
    return max(int(n), 1)


#: accesses replayed into the mirror per get_priority call, at most (hits beyond it are counted, not replayed)
MAX_REPLAYED_HITS = 64


class PriorityStrategy:
    """``get_priority(node)`` from a kvpolicy policy (lowest is evicted first), stateful across calls.

    ``policy``: a :class:`~kvpolicy.eviction.base.PriorityPolicy` (LRU, LFU, GDSF, reuse-distance, ...), or
    :class:`~kvpolicy.eviction.hit_density.HitDensityPolicy` / ``AdaptivePolicy``, which sample their victims inside
    kvpolicy but rank any block on request (``priority_of``): SGLang ranks every evictable leaf itself. Their learning
    needs the time of each event, so the mirror replays a node's hits at SGLang's ``last_access_time``, takes
    evictions when SGLang drops the node, and ranks at ``now_s()`` if given — it must read the clock SGLang stamps its
    nodes with — or else (the default) at the latest stamp seen on the nodes. That is the nodes' own clock whatever its
    units: ``RadixCache`` stamps ``time.monotonic()`` seconds, ``UnifiedRadixCache`` (what SGLang 0.5.23's server
    builds) a step counter (``get_and_increase_time_counter``) — a wall clock would put every node at the same age.
    ``lrb`` is refused: it learns from the outcomes of the evictions it picks, and here SGLang picks them."""

    def __init__(self, policy: PriorityPolicy | HitDensityPolicy, now_s: Callable[[], float] | None = None) -> None:
        if isinstance(policy, LearnedRelaxedBeladyPolicy):
            raise ConfigError("policy", "lrb learns from the evictions it picks, and under SGLang the radix cache picks them: its model "
                                        "would never be fit; use hit-density or adaptive")
        self._ranked = isinstance(policy, HitDensityPolicy)
        if not self._ranked and not isinstance(policy, PriorityPolicy):
            raise ConfigError("policy", "must be a kvpolicy PriorityPolicy (LRU, LFU, GDSF, reuse-distance, ...), hit-density or adaptive")
        if now_s is not None and not callable(now_s):
            raise ConfigError("now_s", f"must be a callable returning seconds on SGLang's clock, got {type(now_s).__name__}")
        self._now_s = now_s
        self._by_token: dict[Any, int] = {}  # ranked policies: content key -> id(TreeNode) holding it
        self._radix_root: Any = None  # a weak reference to SGLang's root node, once seen
        self._root_t = -math.inf  # its last stamp seen
        if policy.nodes:
            raise ConfigError("policy", "must be empty: the strategy mirrors SGLang's tree into it")
        if self._ranked:
            policy.requests_from_engine = True  # type: ignore[union-attr]  # requests are counted from the radix root's stamps
        self.policy = policy
        # the mirror never evicts by itself (SGLang does): its capacity is unbounded
        policy.capacity_bytes = 1 << 62
        self._clock = ManualClock()
        policy.clock = self._clock
        self._mirror: dict[int, _Mirror] = {}  # id(TreeNode) -> mirror (ids are reused only after the node is gone)
        # nodes SGLang dropped, (id, token), applied by the next get_priority: a TreeNode's finalizer runs whenever the
        # garbage collector frees it — in whatever thread allocated at that moment (SGLang's HiCache threads too),
        # possibly in the middle of this strategy's own update — so it only queues (deque.append is atomic)
        self._dropped: deque[tuple[int, int]] = deque()

    def _at(self, t: float) -> None:
        """The mirror's clock follows SGLang's timestamps (never backwards)."""
        if t > self._clock.now_s():
            self._clock.advance(t - self._clock.now_s())

    def _replay_at(self, t: float, fn: Callable[[], None]) -> None:
        """Run ``fn`` with the mirror's clock at ``t`` (a ranked policy: the event's own time, so what it learns from
        ages is not stretched by how late the mirror sees it); then the clock is back where it was, or at ``t``."""
        if not self._ranked:
            self._at(t)
            fn()
            return
        later = max(self._clock.now_s(), t)
        self._clock._now_s = t
        try:
            fn()
        finally:
            self._clock._now_s = later

    def _mirrored(self, node: Any) -> _Mirror | None:
        """The node's mirror, inserting it (and its ancestors) on first sight; None for the radix root."""
        if getattr(node, "parent", None) is None:
            return None  # the root holds no block
        m = self._mirror.get(id(node))
        if m is not None:
            return m
        parent = self._mirrored(node.parent)
        t_access = float(getattr(node, "last_access_time", 0.0))
        # the same content gets the same key again after SGLang drops it: hit density's ghosts find it, and ties are
        # broken by it rather than by the order SGLang shows its nodes. BLAKE2b of the repr, not hash(): hash(None) and
        # str hashes change from one process to the next (adaptive samples its mini-simulations' keys by their bits)
        token = key_bits(repr((parent.token if parent is not None else None, _content(node))))
        stale = self._by_token.get(token)
        if stale is not None:  # the dropped node that held it (its finalizer has not run yet), or a twin SGLang holds
            self._remove(stale, token)
        self._replay_at(float(getattr(node, "creation_time", t_access)),
                        lambda: self.policy.on_insert(token, _size(node), parent.token if parent is not None else None))
        m = _Mirror(token, int(getattr(node, "hit_count", 0)), t_access)
        self._mirror[id(node)] = m
        self._by_token[token] = id(node)
        if self._ranked:
            self.policy.nodes[token].data[1] = max(m.hits - 1, 0)  # hits before it was first seen (SGLang counts its insert)
        self._sync(node, m)
        weakref.finalize(node, self._gone, id(node), m.token)
        return m

    def _gone(self, node_id: int, token: int) -> None:
        """SGLang dropped the node (its finalizer, from any thread): queued for the next :meth:`get_priority`."""
        self._dropped.append((node_id, token))

    def _apply_dropped(self) -> None:
        """Forget the nodes dropped since the last call in the order SGLang evicted them — the lowest priority this
        strategy last gave first (its heap's order), then by key — not in the order Python freed them: ``evict`` frees
        its victims when it returns, in its set of leaves' order (the nodes' addresses), and hit density's ghosts remember
        the order they are forgotten in (the oldest leave the ghost window first)."""
        if not self._dropped:
            return
        dropped = []
        while self._dropped:
            node_id, token = self._dropped.popleft()
            m = self._mirror.get(node_id)
            asked = m is not None and m.token == token and m.priority is not None
            dropped.append(((0, m.priority) if asked else (1, ()), token, node_id))  # type: ignore[union-attr]
        dropped.sort(key=lambda d: d[:2])
        for _, token, node_id in dropped:
            self._remove(node_id, token)

    def _remove(self, node_id: int, token: int) -> None:
        """Remove a dropped node from the mirror (its descendants went first, or go now)."""
        m = self._mirror.get(node_id)
        if m is None or m.token != token:
            return
        del self._mirror[node_id]
        if self._by_token.get(token) == node_id:
            del self._by_token[token]
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
        if self._ranked and getattr(node, "parent", None) is not None:
            # a new request is begun before this node's uses since the last look are replayed, whichever leaf SGLang
            # asks first (it asks in its set's order, the nodes' addresses): those uses are the new request's
            self._requests_seen(node)
        m = self._mirrored(node)
        if m is None:
            return (float("inf"),)  # the root is never evicted
        # the node's uses since the last look, and its ancestors' up to the first that has none (a use of a node is a
        # use of its whole prefix, so above that one nothing changed through this branch): root first, each at its
        # own time — SGLang only asks about leaves, and an interior node's hits would otherwise wait until it is one
        chain = []
        x: Any = node
        mx: _Mirror | None = m
        while mx is not None and (int(getattr(x, "hit_count", 0)) > mx.hits or float(getattr(x, "last_access_time", 0.0)) > mx.t_access):
            chain.append((x, mx))
            x = x.parent
            mx = self._mirror.get(id(x)) if getattr(x, "parent", None) is not None else None
        for x, mx in reversed(chain):
            self._catch_up(x, mx)
        if self._ranked:
            # now: the clock given, or the radix root's stamp — SGLang stamps the root at every prefix match, so it is
            # the latest event on the tree's own clock (seconds in RadixCache, steps in UnifiedRadixCache)
            self._at(float(self._now_s()) if self._now_s is not None else self._root_t)
            # ties (LRU's and LFU's experts: nodes stamped at once) go by the content key, not by SGLang's address order
            m.priority = (*self.policy.priority_of(self.policy.nodes[m.token], self._clock.now_s()), m.token)  # type: ignore[union-attr]
        else:
            m.priority = (*self.policy.priority(self.policy.nodes[m.token]), m.token)  # type: ignore[union-attr]
        return m.priority

    def _catch_up(self, node: Any, m: _Mirror) -> None:
        """Replay one access per hit since the last look, at most MAX_REPLAYED_HITS: a hot node first seen at eviction
        time may carry millions, and this runs inside SGLang's eviction loop (the count itself is synced whole)."""
        hits = int(getattr(node, "hit_count", 0))
        t = float(getattr(node, "last_access_time", 0.0))

        def replay(n: int = min(max(hits - m.hits, 1), MAX_REPLAYED_HITS), token: Any = m.token) -> None:
            for _ in range(n):
                self.policy.on_access(token)
        self._replay_at(t, replay)
        m.hits, m.t_access = hits, t
        self._sync(node, m)

    def _requests_seen(self, node: Any) -> None:
        """SGLang stamps its radix root at every prefix match, one per request: a newer stamp than the last seen is
        one more request for the policy (``request_began``; several between two looks count once — under memory
        pressure SGLang evicts, and asks, at nearly every request)."""
        root = None if self._radix_root is None else self._radix_root()
        if root is None:
            while getattr(node, "parent", None) is not None:
                node = node.parent
            root = node
            self._radix_root = weakref.ref(root)
        t = float(getattr(root, "last_access_time", 0.0))
        if t > self._root_t:
            self._root_t = t
            self.policy.request_began()  # type: ignore[union-attr]

    def _sync(self, node: Any, m: _Mirror) -> None:
        """SGLang's own record wins: the first sight may come late (at eviction time), so the
        mirror takes the node's timestamps and hit count rather than the moment it was asked."""
        n = self.policy.nodes[m.token]
        n.t_access = m.t_access
        n.t_insert = float(getattr(node, "creation_time", n.t_insert if n.t_insert <= m.t_access else m.t_access))
        n.hits = max(m.hits - 1, 0)  # SGLang counts the insert (a node cached once has hit_count 1); kvpolicy, the uses after it
        if self._ranked:
            n.data[0] = m.t_access  # hit density's last use: SGLang's

def make_sglang_strategy(policy: PriorityPolicy | HitDensityPolicy, now_s: Callable[[], float] | None = None) -> Any:
    """A real ``sglang...EvictionStrategy`` subclass instance (needs SGLang installed). Hit density and adaptive rank
    at ``now_s()`` if given, by default at the latest stamp seen on SGLang's nodes (their own clock: seconds in
    ``RadixCache``, a step counter in ``UnifiedRadixCache``; see :class:`PriorityStrategy`)."""
    try:
        from sglang.srt.mem_cache.evict_policy import EvictionStrategy  # type: ignore[import-not-found]
    except ImportError:
        raise ConfigError("sglang", "SGLang is not installed; use PriorityStrategy directly") from None

    class KVPolicyStrategy(PriorityStrategy, EvictionStrategy):  # type: ignore[misc, valid-type]
        pass

    return KVPolicyStrategy(policy, now_s)


def ranked_factory(cls: type[HitDensityPolicy]) -> Callable[..., HitDensityPolicy]:
    """A factory for SGLang's ``--radix-eviction-policy-config``: ``capacity_tokens`` (the radix cache's size in tokens:
    hit density keeps its ghosts for that many evicted tokens, adaptive sizes its mini-simulations by it) is required;
    the policy's other knobs pass through, each checked by name."""
    from ..eviction.replay import check_options

    def make(**cfg: Any) -> HitDensityPolicy:
        cap = cfg.pop("capacity_tokens", None)
        if isinstance(cap, bool) or not isinstance(cap, int) or cap <= 0:
            raise ConfigError("capacity_tokens", f"{cls.name} needs the radix cache's size in tokens, a positive int: "
                                                 f"--radix-eviction-policy-config '{{\"capacity_tokens\": N}}' (got {cap!r})")
        check_options(cls, cls.name, cfg)
        return cls(cap, **cfg)

    return make


#: the policies that need the radix cache's size (``capacity_tokens`` in SGLang's policy config)
RANKED = ("hit-density", "adaptive")


def policy_factories() -> dict[str, Callable[..., PriorityPolicy | HitDensityPolicy]]:
    """What :func:`register` adds by default, name -> factory: kvpolicy's reuse-distance, gdsf, lru and lfu priority
    policies (their mirror never evicts by itself: built unbounded, so reuse-distance's ``C_effective`` is unbounded
    too), and hit-density and adaptive, which take ``capacity_tokens`` (:func:`ranked_factory`)."""
    from ..eviction.hit_density import AdaptivePolicy
    from ..eviction.policies import GDSFPolicy, LFUPolicy, LRUPolicy
    from ..eviction.reuse_distance import ReuseDistancePolicy

    big = 1 << 62
    return {"reuse-distance": lambda: ReuseDistancePolicy(big), "gdsf": lambda: GDSFPolicy(big), "lru": lambda: LRUPolicy(big),
            "lfu": lambda: LFUPolicy(big), "hit-density": ranked_factory(HitDensityPolicy), "adaptive": ranked_factory(AdaptivePolicy)}


def register(policies: dict[str, Callable[..., PriorityPolicy | HitDensityPolicy]] | None = None) -> list[str]:
    """Add ``kvpolicy-<name>`` eviction policies to SGLang's strategy registry and CLI choices
    (imports SGLang). Default: kvpolicy's reuse-distance, gdsf, lru and lfu priority policies, and hit-density and
    adaptive (these need ``--radix-eviction-policy-config '{"capacity_tokens": N}'``: :func:`ranked_factory`).
    A factory is called with SGLang's policy config as keyword arguments when one is given.
    Returns the names to pass to ``--radix-eviction-policy``. Calling it again changes nothing more."""
    try:
        from sglang.srt.arg_groups import choices as sg_choices  # type: ignore[import-not-found]
        from sglang.srt.mem_cache import utils as sg_utils  # type: ignore[import-not-found]
    except ImportError:
        raise ConfigError("sglang", "SGLang (0.5.x) is not importable here") from None
    policies = policies or policy_factories()
    names = []
    for name, make in policies.items():
        full = f"kvpolicy-{name}"
        sg_utils._EVICTION_POLICY_FACTORIES[full] = lambda _make=make, **_cfg: make_sglang_strategy(_make(**_cfg) if _cfg else _make())
        names.append(full)
    # again (a second register() call): SGLang's CLI would list each name twice
    listed = set(getattr(sg_choices, "RADIX_EVICTION_POLICY_CHOICES", ()))
    sg_choices.add_radix_eviction_policy_choices([n for n in names if n not in listed])
    return names
