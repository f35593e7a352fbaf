"""A kvpolicy eviction policy as vLLM's CPU-offloading ``CachePolicy``.

vLLM 0.33's CPU offloading manager (``vllm/v1/kv_offload/cpu/manager.py``) keeps
its chunks in a pluggable ``CachePolicy`` (``vllm/v1/kv_offload/cpu/policies/base.py``)
resolved by name, or loaded out of tree::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"cpu_bytes_to_use": 8000000000,
        "eviction_policy": "KVPolicyReuseDistance",
        "cache_policy_module_path": "kvpolicy.integrations.vllm_offload"}}'

:class:`KVPolicyReuseDistance` (and :class:`KVPolicyAdaptive`, :class:`KVPolicyLRB`, :class:`KVPolicyGDSF`,
:class:`KVPolicyLRU`) answer the policy's calls with a kvpolicy eviction policy: ``insert`` /
``touch`` / ``on_request_finished`` feed it, ``mark_evictable`` /
``mark_non_evictable`` (a chunk's transfer count going to / from 0) pin and unpin,
and ``evict(n, protected)`` takes the n lowest-priority evictable chunks outside
``protected`` — atomically: ``None`` and no change when n cannot be met.
Chunks are flat here (the offloading manager gives no parent links), so the
prefix-closure of kvpolicy's resident tree does not apply.

**Publishing behind** ``prepare_store``: :class:`KVPolicyOffloadingSpec` (a
``CPUOffloadingSpec``, loaded with ``"spec_name": "KVPolicyOffloadingSpec",
"spec_module_path": "kvpolicy.integrations.vllm_offload"``) gives the manager a
``prepare_store`` that offers the CPU tier only the leading blocks of each
request that a kvpolicy publish filter allows (``"kvpolicy_publish"``: any
``make_filter`` spec, default ``threshold-2``); the rest is not stored.

The base classes are vLLM's when vLLM is importable, ``object`` otherwise (so
the module imports, and is tested, without vLLM).
"""

from __future__ import annotations

import bisect
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Any

from .._mix import key_bits
from ..clock import ManualClock, MonotonicClock
from ..errors import ConfigError
from ..eviction.base import EvictionPolicy
from ..eviction.hit_density import AdaptivePolicy
from ..eviction.learned import LearnedRelaxedBeladyPolicy
from ..eviction.policies import GDSFPolicy, LRUPolicy
from ..eviction.reuse_distance import ReuseDistancePolicy
from ..protocols import Clock

try:  # pragma: no cover - depends on the environment
    from vllm.v1.kv_offload.cpu.policies.base import CachePolicy as _Base  # type: ignore[import-not-found]
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec as _SpecBase  # type: ignore[import-not-found]
except ImportError:  # vLLM absent: the same methods on a plain base
    _Base = object  # type: ignore[assignment,misc]
    _SpecBase = object  # type: ignore[assignment,misc]

_UNIT = 1  # every chunk weighs one unit of the policy's capacity
#: requests whose handed-over chunks are remembered while they run (far above a scheduler's batch)
_MAX_RUNNING_REQUESTS = 4096


class _KVPolicyCachePolicy(_Base):  # type: ignore[misc,valid-type]
    """The CachePolicy methods over a kvpolicy EvictionPolicy (subclasses choose which).

    **A request's chunks leave tail first** (issue #60). vLLM looks a prefix up only to its first miss, so a head
    evicted before its tail leaves the tail in memory, never to be hit. The manager gives each chunk its token position
    in the request (``ReqContext.get_offload_key_position``); the chunk before it in the same request is its parent, and
    a chunk with a resident child is never a candidate (it carries one more pin while it has children), so every
    policy chooses among the chains' tails — as kvpolicy's prefix-aware eviction does in any engine that gives parent
    links. A chain's parent is the same chunk whichever request stores it (keys are chained), and survives across the
    scheduler steps that store a request (a chunked prefill, then decode): per step, kvpolicy's policies evicted a
    two-step request [1, 0, 3, 2] where vLLM's LRU evicts [3, 2, 1, 0], and GDSF took the head first after a full reuse.
    Within a step a request's chunks still reach the policy tail first (ties among tails, recency)."""

    def make_policy(self, capacity: int) -> EvictionPolicy:  # pragma: no cover - overridden
        raise ConfigError("policy", "a subclass chooses the kvpolicy policy")

    def __init__(self, cache_capacity: int) -> None:
        if isinstance(cache_capacity, bool) or not isinstance(cache_capacity, int) or cache_capacity <= 0:
            raise ConfigError("cache_capacity", f"must be a positive int (chunks), got {cache_capacity!r}")
        self.cache_capacity = cache_capacity
        # room for every chunk the manager may hold plus the ones it inserts before evicting
        self.policy = self.make_policy(2 * cache_capacity + 64)
        # the manager gives no timestamps: time is logical, one tick per insert or use (vLLM's LRU ranks the same way)
        self._clock = ManualClock()
        self.policy.clock = self._clock
        self.chunks: dict[Hashable, Any] = {}
        self._evictable: set[Hashable] = set()
        # a batch's inserts (key -> position), held until the batch ends so that they reach the policy tail first
        self._staged: dict[Hashable, int] = {}
        # the chains: a resident chunk's parent (the chunk before it in a request), and each chunk's resident children
        self._parent: dict[Hashable, Hashable] = {}
        self._children: dict[Hashable, set[Hashable]] = {}
        # per running request, the chunks it named by position (insert, touch, access), and those positions sorted: where
        # a parent is found (the nearest position before a chunk's, in O(log n))
        self._seen: dict[Any, tuple[dict[int, Hashable], list[int]]] = {}

    # ---------------------------------------------------------------- lookups and inserts

    def get(self, key: Hashable) -> Any:
        return self.chunks.get(key)

    @staticmethod
    def _position(key: Hashable, req_context: Any) -> int | None:
        pos = getattr(req_context, "get_offload_key_position", None)
        p = pos(key) if pos is not None else None
        return p if isinstance(p, int) and not isinstance(p, bool) else None

    def _tail_first(self, keys: Iterable[Hashable], req_context: Any) -> list[Hashable]:
        """A request's keys, its prefix's tail first and its head last — the order in which they reach the policy, so
        that the head is the most recent. vLLM 0.33's own LRU ranks the same way ((request, -position)). Without
        positions, the order given (head to tail, as vLLM passes them) reversed."""
        ks = list(keys)
        pos = [self._position(k, req_context) for k in ks]
        if all(p is not None for p in pos):
            return [k for _, k in sorted(zip(pos, ks), key=lambda x: -x[0])]  # type: ignore[operator]
        return ks[::-1]

    def _note(self, keys: Iterable[Hashable], req_context: Any) -> tuple[dict[int, Hashable], list[int]] | None:
        """Remember the positions a running request gives its chunks; its map and sorted positions (None without a
        request id)."""
        r = getattr(req_context, "req_id", None)
        if r is None:
            return None
        seen = self._seen.get(r)
        if seen is None:
            seen = self._seen[r] = ({}, [])
            while len(self._seen) > _MAX_RUNNING_REQUESTS:  # a request never finished (never told): forget the oldest
                del self._seen[next(iter(self._seen))]
        at, order = seen
        for k in keys:
            p = self._position(k, req_context)
            if p is not None:
                if p not in at:
                    bisect.insort(order, p)
                at[p] = k
        return seen

    def insert(self, key: Hashable, chunk: Any, req_context: Any = None) -> None:
        """A new chunk, not evictable until its ref count reaches 0 (``mark_evictable``), under its parent (the resident
        chunk before it in the request). The manager inserts a request's chunks head to tail, one call each: chunks with
        a position are held until the batch ends (the next call of another kind) and then reach the policy tail first."""
        if key in self.chunks:
            self.chunks[key] = chunk
            return
        self.chunks[key] = chunk
        p = self._position(key, req_context)
        seen = self._note([key], req_context)
        if seen is not None and p is not None:
            at, order = seen
            i = bisect.bisect_left(order, p)
            parent = at[order[i - 1]] if i else None
            if parent is not None and parent in self.chunks and parent != key:
                self._link(key, parent)
        if p is None:
            self._flush()
            self._add(key)
        else:
            self._staged[key] = p

    def _link(self, key: Hashable, parent: Hashable) -> None:
        self._parent[key] = parent
        kids = self._children.setdefault(parent, set())
        kids.add(key)
        if len(kids) == 1 and parent in self.policy.nodes:  # it now has a resident child: not a candidate
            self.policy.pin(parent)

    def _unlink(self, key: Hashable) -> None:
        """``key`` leaves: its parent loses a child (and its extra pin with its last), its children become roots."""
        parent = self._parent.pop(key, None)
        if parent is not None:
            kids = self._children.get(parent)
            if kids is not None:
                kids.discard(key)
                if not kids:
                    del self._children[parent]
                    if parent in self.policy.nodes:
                        self.policy.unpin(parent)
        for child in self._children.pop(key, ()):
            self._parent.pop(child, None)

    def _add(self, key: Hashable) -> None:
        self._clock.advance(1.0)
        self.policy.on_insert(key, _UNIT)
        self.policy.pin(key)  # being stored: not evictable until mark_evictable
        if self._children.get(key):  # a child was linked while it was held: its extra pin now
            self.policy.pin(key)

    def _flush(self) -> None:
        if self._staged:
            staged, self._staged = self._staged, {}
            for key in sorted(staged, key=lambda k: -staged[k]):
                self._add(key)

    def remove(self, key: Hashable) -> None:
        if key not in self.chunks:
            return
        self._flush()
        del self.chunks[key]
        self._evictable.discard(key)
        self._unlink(key)
        node = self.policy.nodes.get(key)
        if node is not None:
            while node.pins:
                self.policy.unpin(key)
            self.policy.on_remove(key)

    def clear(self) -> None:
        self._flush()
        for key in list(self.chunks):
            self.remove(key)
        self._seen.clear()

    # ---------------------------------------------------------------- accesses

    def touch(self, keys: Iterable[Hashable], req_context: Any = None) -> None:
        """A use of a request's chunks: each is a hit, the prefix's head the most recent (:meth:`_tail_first`)."""
        self._flush()
        keys = list(keys)
        self._note(keys, req_context)
        for k in self._tail_first(keys, req_context):
            if k in self.policy.nodes:
                self._clock.advance(1.0)
                self.policy.on_access(k)

    def on_store_miss(self, keys: Iterable[Hashable], req_context: Any = None) -> None:
        return  # a store miss is not a use of a resident chunk

    def on_request_access(self, keys: Iterable[Hashable], req_context: Any = None) -> None:
        self._note(keys, req_context)  # where the request's later chunks find their parents

    def on_request_finished(self, key_groups: Sequence[Sequence[Hashable]], insertion_only_keys: set[Hashable], reused_keys: set[Hashable],
                            req_context: Any = None) -> None:
        """Only real reuse is a hit: chunks the request merely created were counted by ``insert``. Across the KV-cache
        groups, one head-to-tail order by position (as vLLM orders them), then the tail first."""
        self.touch([k for group in key_groups for k in group if k in reused_keys], req_context)
        self._seen.pop(getattr(req_context, "req_id", None), None)

    # ---------------------------------------------------------------- eviction

    def mark_evictable(self, key: Hashable) -> None:
        self._flush()
        if key in self.chunks and key not in self._evictable:
            self._evictable.add(key)
            self.policy.unpin(key)

    def mark_non_evictable(self, key: Hashable) -> None:
        self._flush()
        if key in self._evictable:
            self._evictable.discard(key)
            self.policy.pin(key)

    def _evictable_closure(self, protected: set[Hashable]) -> int:
        """How many chunks could leave, tails first: evictable and unprotected, and no resident descendant busy or
        protected (an ancestor of such a chunk stays). Walks up from each blocked chunk: O(resident chunks)."""
        blocked: set[Hashable] = set()
        for b in [k for k in self.chunks if k not in self._evictable] + [k for k in protected if k in self.chunks]:
            x = self._parent.get(b)
            while x is not None and x not in blocked:
                blocked.add(x)
                x = self._parent.get(x)
        return sum(1 for k in self._evictable if k not in protected and k not in blocked)

    def evict(self, n: int, protected: set[Hashable]) -> list[tuple[Hashable, Any]] | None:
        """The n lowest-priority evictable chunks outside ``protected``, tails before their heads; None (and no change)
        if n cannot be met."""
        self._flush()
        if n <= 0:
            return []
        # in an order that does not depend on the process's string hashing (``protected`` is a set): a policy that
        # samples its candidates (adaptive) keeps them in an array that pinning reorders
        shield = sorted((k for k in protected if k in self._evictable), key=key_bits)
        if len(self._evictable) - len(shield) < n:
            return None
        # tails enough now (the internal chunks carry a pin): no walk; else count what rounds of tails could free
        if self._children and self.policy.freeable_bytes - len(shield) < n and self._evictable_closure(protected) < n:
            return None  # a head whose tail is busy or protected stays
        pol = self.policy
        out: list[tuple[Hashable, Any]] = []
        for k in shield:
            pol.pin(k)
        try:
            while len(out) < n:  # a round takes the candidates there are (tails); their heads are candidates next
                want = min(n - len(out), pol.freeable_bytes)
                if want <= 0:  # pragma: no cover - guarded by the closure count above
                    break
                # ask for exactly ``want`` units beyond what is free: victims() frees the lowest-priority candidates
                victims = pol.victims(pol.capacity_bytes - pol.used_bytes + want)[:want]
                if not victims:  # pragma: no cover - a policy that frees nothing it could
                    break
                for k in victims:
                    self._evictable.discard(k)
                    self._unlink(k)
                    out.append((k, self.chunks.pop(k)))
        finally:
            for k in shield:
                pol.unpin(k)
        return out


class KVPolicyReuseDistance(_KVPolicyCachePolicy):
    """kvpolicy's reuse-distance eviction for vLLM's CPU offloading tier."""

    def make_policy(self, capacity: int) -> EvictionPolicy:
        return ReuseDistancePolicy(capacity)


class KVPolicyAdaptive(_KVPolicyCachePolicy):
    """kvpolicy's adaptive eviction (hit density, LRU and LFU experts; docs/eviction/hit-density.md) for vLLM's
    CPU offloading tier. Its clock is the manager's logical one (a tick per insert or use), so ages are in ticks."""

    def make_policy(self, capacity: int) -> EvictionPolicy:
        return AdaptivePolicy(capacity)


class KVPolicyLRB(_KVPolicyCachePolicy):
    """kvpolicy's learned relaxed Belady (docs/eviction/learned.md) for vLLM's CPU offloading tier. Chunks are flat
    here, so its chain features (depth, turns, the root's hits) are those of a root; ages, hits and gaps are in the
    manager's logical ticks, as for :class:`KVPolicyAdaptive`."""

    def make_policy(self, capacity: int) -> EvictionPolicy:
        return LearnedRelaxedBeladyPolicy(capacity)


class KVPolicyGDSF(_KVPolicyCachePolicy):
    """Greedy-dual-size-frequency for vLLM's CPU offloading tier."""

    def make_policy(self, capacity: int) -> EvictionPolicy:
        return GDSFPolicy(capacity)


class KVPolicyLRU(_KVPolicyCachePolicy):
    """kvpolicy's LRU (the reference the others are tested against)."""

    def make_policy(self, capacity: int) -> EvictionPolicy:
        return LRUPolicy(capacity)


def filtered_prepare_store(prepare_store: Any, publish_filter: Any, block_size_tokens: int, *, clock: Clock | None = None,
                           resident: Any = None) -> Any:
    """Wrap a manager's ``prepare_store(keys, req_context)`` so only the leading keys a kvpolicy
    publish filter allows are offered as new stores (in the request's order when ``req_context`` gives positions); when
    it allows none, the manager is asked to store no new keys. ``block_size_tokens``: tokens per offload key (a chunk).
    Each call is stamped with ``clock`` (default: monotonic seconds): the filter's windows and decay run on it.

    ``resident(key, req_context) -> bool``: whether the tier already holds the key (the manager's ``lookup``). Such keys
    are always passed on, wherever the filter's cut falls: vLLM's manager records them as this request's reuse (the
    eviction policy's hits) and protects them from the eviction this call may make — cut, a chunk the request had just
    reused could be evicted to make room for its own new chunks."""
    from ..publish import PublishRequest

    counter = [0]
    clk = clock or MonotonicClock()

    def wrapped(keys: Any, req_context: Any = None) -> Any:
        ks = list(keys)
        pos = getattr(req_context, "get_offload_key_position", None)
        if pos is not None:
            known = {k: pos(k) for k in ks}
            if all(v is not None for v in known.values()):
                ks.sort(key=known.__getitem__)
        counter[0] += 1
        rid = getattr(req_context, "req_id", None) or ("offload", counter[0])
        req = PublishRequest(request_id=rid, num_tokens=len(ks) * block_size_tokens, block_size_tokens=block_size_tokens, time_s=clk.now_s())
        publish_filter.observe(req, ks)
        n = publish_filter.publishable(req, ks)
        offered = ks[:n] if resident is None else [k for i, k in enumerate(ks) if i < n or resident(k, req_context)]
        # nothing allowed is still an answer from the manager (vLLM's CPU manager: an empty store), never None:
        # the scheduler reads None as a failed allocation — counted, logged, and the same chunks offered again
        return prepare_store(offered, req_context)

    return wrapped


def offload_key_tokens(spec: Any) -> int:
    """Tokens one offload key covers: vLLM 0.33's spec keys a chunk of ``blocks_per_chunk`` blocks of
    ``tokens_per_block`` tokens (the first KV-cache group's); older specs give ``offloaded_block_size`` or
    ``block_size``; 16 when the spec says nothing."""
    per_block = getattr(spec, "tokens_per_block", None)
    if isinstance(per_block, (tuple, list)) and per_block:
        per_block = per_block[0]
    chunk = getattr(spec, "blocks_per_chunk", None)
    if isinstance(per_block, int) and per_block > 0:
        return per_block * (chunk if isinstance(chunk, int) and chunk > 0 else 1)
    for name in ("offloaded_block_size", "block_size"):
        v = getattr(spec, name, None)
        if isinstance(v, int) and v > 0:
            return v
    return 16


#: the offloading spec's kvpolicy keys beside ``kvpolicy_publish``: what ``reuse-aware`` weighs a write against
OFFLOAD_DEFAULTS = {"kvpolicy_bytes_per_token": 131072, "kvpolicy_prefill_tokens_per_s": 20000.0}


def offload_publish_filter(extra_config: Any, key_tokens: int = 16) -> Any:
    """The publish filter named by ``kv_connector_extra_config["kvpolicy_publish"]`` (default ``threshold-2``), for
    offload keys of ``key_tokens`` tokens. ``reuse-aware`` weighs a write against a recompute: a chunk's bytes are
    ``kvpolicy_bytes_per_token`` × ``key_tokens``, its recompute ``key_tokens`` / ``kvpolicy_prefill_tokens_per_s``
    (defaults 131072 and 20000). ``kvpolicy_pool_blocks``: the CPU tier's size in offload keys, the ghost pools of
    ``dueling`` (unbounded without it). Anything else than a valid spec string is an error naming that key."""
    from ._settings import spec_filter

    where = "kv_connector_extra_config.kvpolicy_publish"
    extra = {} if extra_config is None else extra_config
    if not isinstance(extra, Mapping):
        raise ConfigError("kv_connector_extra_config", f"must be an object, got {type(extra).__name__}")
    known = ("kvpolicy_publish", "kvpolicy_pool_blocks", *OFFLOAD_DEFAULTS)
    typos = sorted(str(k) for k in extra if str(k).startswith("kvpolicy_") and k not in known)
    if typos:  # vLLM's own keys share this object; a misspelt kvpolicy one would leave its default in force without a word
        raise ConfigError(f"kv_connector_extra_config.{typos[0]}", f"is not a kvpolicy setting of the offloading spec; the settings: {', '.join(known)}")
    spec = extra.get("kvpolicy_publish", "threshold-2")
    if not isinstance(spec, str):
        raise ConfigError(where, f"must be a publish filter spec such as 'threshold-2', got {spec!r}")
    bpt = extra.get("kvpolicy_bytes_per_token", OFFLOAD_DEFAULTS["kvpolicy_bytes_per_token"])
    if isinstance(bpt, bool) or not isinstance(bpt, int) or bpt <= 0:
        raise ConfigError("kv_connector_extra_config.kvpolicy_bytes_per_token", f"must be a positive int, got {bpt!r}")
    tps = extra.get("kvpolicy_prefill_tokens_per_s", OFFLOAD_DEFAULTS["kvpolicy_prefill_tokens_per_s"])
    if isinstance(tps, bool) or not isinstance(tps, (int, float)) or not 0 < tps < float("inf"):
        raise ConfigError("kv_connector_extra_config.kvpolicy_prefill_tokens_per_s", f"must be a finite positive number, got {tps!r}")
    pool = extra.get("kvpolicy_pool_blocks")  # the CPU tier's size in offload keys: dueling's ghost pools (None: unbounded)
    if pool is not None and (isinstance(pool, bool) or not isinstance(pool, int) or pool <= 0):
        raise ConfigError("kv_connector_extra_config.kvpolicy_pool_blocks", f"must be a positive int (offload keys the tier holds), got {pool!r}")
    return spec_filter(spec, where, block_bytes=bpt * key_tokens, block_s=key_tokens / tps, pool_capacity_blocks=pool)


def _resident_in(manager: Any) -> Any:
    """``resident`` for :func:`filtered_prepare_store`: the manager's ``lookup`` finds the key (ready or being stored)."""

    def resident(key: Any, req_context: Any) -> bool:
        return getattr(manager.lookup(key, req_context), "name", None) in ("HIT", "HIT_PENDING")

    return resident


class KVPolicyOffloadingSpec(_SpecBase):  # type: ignore[misc,valid-type]
    """vLLM's CPU offloading spec whose manager offers only what kvpolicy's publish filter allows."""

    def get_manager(self) -> Any:  # pragma: no cover - needs vLLM
        manager = super().get_manager()
        if not getattr(manager, "_kvpolicy_wrapped", False):
            block = offload_key_tokens(self)
            f = offload_publish_filter(getattr(self, "extra_config", None), block)
            manager.prepare_store = filtered_prepare_store(manager.prepare_store, f, block, resident=_resident_in(manager))
            manager._kvpolicy_wrapped = True
        return manager
