"""Replaying a request-level trace through an online policy (the reference semantics).

For each request, in arrival order (the clock reads the arrival time):

1. TTL expiry runs (TTL only);
2. **lookup**: the leading run of resident blocks; those within the matchable
   range (not the block holding the last token) are **hits**; every block of the
   run is accessed (root first, same time) and pinned;
3. **insert** the rest, root first: a block the policy declines (``admit``) or for
   which ``victims`` raises ``CapacityError`` (all else pinned) ends insertion —
   nothing after it can be cached without its parent; each inserted block is pinned;
4. unpin the request's blocks.

The Numba kernels in :mod:`kvpolicy.eviction.kernels` implement exactly this and
are tested against it decision for decision.
"""

from __future__ import annotations

import inspect
from typing import Any

import attrs
import numpy as np

from ..clock import ManualClock
from ..protocols import Clock
from .._own import is_own, load_own
from ..errors import ConfigError
from ..traces.model import check_trace
from .base import EvictionPolicy, serve
from .policies import POLICIES, BeladyPolicy, TraceOracle, TTLPolicy
from .hit_density import AdaptivePolicy, HitDensityPolicy
from .learned import LearnedRelaxedBeladyPolicy
from .reuse_distance import ReuseDistancePolicy

ALL_POLICIES = ("lru", "fifo", "lfu", "ttl", "s3fifo", "sieve", "arc", "gdsf", "reuse-distance", "hit-density", "adaptive", "lrb", "belady", "belady-bypass")

_YOURS = "a class (or factory) called as NAME(capacity_bytes, clock=clock)"


def load_policy_factory(spec: str) -> Any:
    """The class (or factory) ``spec`` names (:func:`kvpolicy._own.load_own`); a failure names ``--policies``."""
    return load_own(spec, "--policies", _YOURS)


def check_policy_names(policies: Any) -> None:
    """Refuse an unknown name, and load each policy of the user's (so a typo fails before a trace is read)."""
    if isinstance(policies, str):  # "lru" would be read as the policies 'l', 'r', 'u'
        raise ConfigError("--policies", f"give a list of policy names, got the string {policies!r}")
    for p in policies:
        if is_own(p):
            load_policy_factory(p)
        elif p not in ALL_POLICIES:
            raise ConfigError("--policies", f"unknown policy {p!r}; known: {', '.join(ALL_POLICIES)}; or one of your own: MODULE:NAME or "
                              f"PATH.py:NAME, NAME {_YOURS}")


def _own_policy(spec: str, capacity_bytes: int, clock: Clock, kw: dict[str, Any]) -> EvictionPolicy:
    factory = load_policy_factory(spec)
    try:
        policy = factory(capacity_bytes, clock=clock, **kw)
    except TypeError as e:
        raise ConfigError("--policies", f"{spec!r}: calling it as {spec.rpartition(':')[2]}(capacity_bytes, clock=clock) raised TypeError: {e}") from None
    if not isinstance(policy, EvictionPolicy):
        raise ConfigError("--policies", f"{spec!r} built a {type(policy).__name__}, not a kvpolicy EvictionPolicy: subclass EvictionPolicy "
                          "or PriorityPolicy (docs/eviction.md)")
    return policy


def policy_options(cls: type) -> set[str]:
    """The keyword options ``cls(capacity, ...)`` takes: its ``__init__``'s named parameters, and its bases' where it
    passes ``**kw`` on."""
    names: set[str] = set()
    for k in cls.__mro__:
        init = k.__dict__.get("__init__")
        if init is None:
            continue
        params = list(inspect.signature(init).parameters.values())[2:]  # past self and the capacity
        names |= {q.name for q in params if q.kind in (q.KEYWORD_ONLY, q.POSITIONAL_OR_KEYWORD)}
        if not any(q.kind == q.VAR_KEYWORD for q in params):
            break
    return names


def check_options(cls: type, name: str, kw: dict[str, Any]) -> None:
    """A clear error naming an option ``name``'s policy does not take (not a TypeError from deep inside)."""
    allowed = policy_options(cls)
    for k in kw:
        if k not in allowed:
            raise ConfigError(k, f"the {name} policy takes no such option; its options: {', '.join(sorted(allowed)) or 'none'}")


def make_policy(name: str, capacity_bytes: int, *, trace: Any = None, clock: Clock | None = None, **kw: Any) -> EvictionPolicy:
    if not isinstance(name, str):
        raise ConfigError("policy", f"must be a policy name ({', '.join(ALL_POLICIES)}), got {type(name).__name__}")
    clock = clock or ManualClock()
    if is_own(name):
        return _own_policy(name, capacity_bytes, clock, kw)
    cls = {"reuse-distance": ReuseDistancePolicy, "hit-density": HitDensityPolicy, "adaptive": AdaptivePolicy, "lrb": LearnedRelaxedBeladyPolicy,
           "belady": BeladyPolicy,
           "belady-bypass": BeladyPolicy}.get(name) or POLICIES.get(name)
    if cls is not None:
        check_options(cls, name, kw)
    if name == "reuse-distance":
        return ReuseDistancePolicy(capacity_bytes, clock=clock, **kw)
    if name == "hit-density":
        return HitDensityPolicy(capacity_bytes, clock=clock, **kw)
    if name == "adaptive":
        return AdaptivePolicy(capacity_bytes, clock=clock, **kw)
    if name == "lrb":
        return LearnedRelaxedBeladyPolicy(capacity_bytes, clock=clock, **kw)
    if name in ("belady", "belady-bypass"):
        oracle = kw.pop("oracle", None)
        if oracle is None and trace is not None:
            oracle = TraceOracle(trace)
        return BeladyPolicy(capacity_bytes, oracle=oracle, bypass=name == "belady-bypass", clock=clock, **kw)
    cls = POLICIES.get(name)
    if cls is None:
        raise ConfigError("policy", f"unknown policy {name!r}; known: {ALL_POLICIES}")
    return cls(capacity_bytes, clock=clock, **kw)


@attrs.frozen(eq=False)
class ReplayResult:
    policy: str
    capacity_blocks: int
    hits: np.ndarray  # per block reference: counted as a hit
    victims: Any  # evicted keys in order: a list (online) or an int64 array (kernels)
    block_size_tokens: int
    total_input_tokens: int
    #: what the policy learned, where it says (adaptive: the evictions each expert executed, each mini-simulation's hit ratio)
    stats: dict = attrs.field(factory=dict)

    @property
    def hit_blocks(self) -> int:
        return int(self.hits.sum())

    def block_hit_ratio(self) -> float:
        return self.hit_blocks / max(self.hits.size, 1)

    def token_hit_ratio(self) -> float:
        return self.hit_blocks * self.block_size_tokens / max(self.total_input_tokens, 1)


def replay(trace: Any, policy: EvictionPolicy | str, capacity_blocks: int | None = None, *, record_victims: bool = False, **kw: Any) -> ReplayResult:
    """Feed every request of ``trace`` to ``policy`` (blocks of unit size)."""
    check_trace(trace)
    if isinstance(policy, str):
        if capacity_blocks is None:
            raise ConfigError("capacity_blocks", "required when the policy is given by name")
        policy = make_policy(policy, capacity_blocks, trace=trace, **kw)
    capacity_blocks = policy.capacity_bytes
    clock = policy.clock
    if not isinstance(clock, ManualClock):
        raise ConfigError("clock", "replay drives the policy's clock: give it a ManualClock")
    oracle = policy.oracle if isinstance(policy, BeladyPolicy) and isinstance(policy.oracle, TraceOracle) else None
    is_ttl = isinstance(policy, TTLPolicy)
    hits = np.zeros(trace.block_ids.size, dtype=bool)
    victims: list[Any] = []
    offsets = trace.block_offsets.tolist()
    ids = trace.block_ids.tolist()
    matchable = trace.matchable_blocks.tolist()
    arrival = trace.arrival_s.tolist()
    for r in range(len(trace)):
        clock._now_s = arrival[r] + r * 1e-9  # same time within a request, strictly increasing across requests
        if oracle is not None:
            oracle.now = r
        if is_ttl:
            policy.expire()  # type: ignore[attr-defined]
        s, e = offsets[r], offsets[r + 1]
        m = min(serve(policy, ids[s:e], victims=victims if record_victims else None), matchable[r])
        if m:
            hits[s : s + m] = True
    stats = policy.stats() if isinstance(policy, (AdaptivePolicy, LearnedRelaxedBeladyPolicy)) else {}
    return ReplayResult(policy.name, capacity_blocks, hits, victims, trace.block_size_tokens, trace.total_input_tokens, stats)
