"""Stateful contracts a policy must honour — for kvpolicy's policies and yours.

Subclass a contract, give it one factory method, and run its ``TestCase`` under
pytest::

    class TestMyPolicy(EvictionPolicyContract):
        def make_policy(self, capacity_bytes, clock):
            return MyPolicy(capacity_bytes, clock=clock)
    TestMyPolicy = TestMyPolicy.TestCase

Every invariant has a name and a message that says what the policy did wrong;
Hypothesis shrinks the failing run to a short sequence of steps. The contracts
use only the public protocols and keep their own model of what must be true.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from ..admission.controller import AdmissionContext, LoadOutcome, LoadStatus
from ..clock import ManualClock
from ..errors import CapacityError
from ..matching import PrefixMatch
from ..publish import PublishRequest


class ContractViolation(AssertionError):
    """A policy broke a named invariant of its contract."""

    def __init__(self, invariant_name: str, message: str) -> None:
        self.invariant_name = invariant_name
        super().__init__(f"[{invariant_name}] {message}")


def _require(cond: bool, name: str, message: str) -> None:
    if not cond:
        raise ContractViolation(name, message)


# ----------------------------------------------------------------------------- eviction


class EvictionPolicyContract(RuleBasedStateMachine):
    """capacity, pins, prefix closure, counters — and it behaves like a dict that loses entries."""

    capacity_bytes = 12
    max_block_bytes = 3

    def make_policy(self, capacity_bytes: int, clock: ManualClock) -> Any:
        raise NotImplementedError("subclass EvictionPolicyContract and implement make_policy(capacity_bytes, clock)")

    def __init__(self) -> None:
        super().__init__()
        self.clock = ManualClock()
        self.policy = self.make_policy(self.capacity_bytes, self.clock)
        self.size: dict[int, int] = {}  # the machine's keys are ints (next_key)
        self.parent: dict[int, int | None] = {}
        self.pins: dict[int, int] = {}
        self.next_key = 0

    # the model -------------------------------------------------------------
    def _children(self, k: Hashable) -> int:
        return sum(1 for c, p in self.parent.items() if p == k)

    def _protected(self) -> set:
        prot: set = set()
        for k, n in self.pins.items():
            if n > 0:
                x: int | None = k
                while x is not None and x not in prot:
                    prot.add(x)
                    x = self.parent[x]
        return prot

    def _used(self) -> int:
        return sum(self.size.values())

    def _evicted(self, keys: list, before_pinned: set, label: str) -> None:
        for k in keys:
            _require(k in self.size, "dict-that-loses-entries", f"{label} returned {k!r}, which is not resident")
            _require(k not in before_pinned, "pinned-never-evicted", f"{label} evicted {k!r}, which is pinned or has a pinned descendant")
            _require(self._children(k) == 0, "prefix-closure", f"{label} evicted {k!r} while its child is still resident")
            del self.size[k]
            del self.parent[k]
            self.pins.pop(k, None)

    # rules -----------------------------------------------------------------
    @rule(data=st.data())
    def insert(self, data: Any) -> None:
        key = self.next_key
        self.next_key += 1
        parent = data.draw(st.sampled_from([None, *sorted(self.size)])) if self.size else None
        size = data.draw(st.integers(1, self.max_block_bytes))
        short = self._used() + size - self.capacity_bytes
        prot = self._protected()
        freeable = self._used() - sum(self.size[k] for k in prot)
        try:
            v = self.policy.victims(size)
        except CapacityError:
            _require(short > freeable, "capacity-error-only-when-impossible",
                     f"victims({size}) raised CapacityError though {freeable} bytes were freeable and {short} were needed")
            return
        _require(short <= freeable, "never-over-commit", f"victims({size}) returned though only {freeable} bytes were freeable and {short} needed")
        self._evicted(list(v), prot, f"victims({size})")
        _require(self._used() + size <= self.capacity_bytes, "capacity", f"victims({size}) freed too little: {self._used()} + {size} > {self.capacity_bytes}")
        if parent is not None and parent not in self.size:
            return
        self.policy.on_insert(key, size, parent)
        self.size[key] = size
        self.parent[key] = parent

    @precondition(lambda self: self.size)
    @rule(data=st.data(), dt=st.floats(0, 3))
    def access(self, data: Any, dt: float) -> None:
        self.clock.advance(dt)
        self.policy.on_access(data.draw(st.sampled_from(sorted(self.size))))

    @precondition(lambda self: self.size)
    @rule(data=st.data())
    def pin(self, data: Any) -> None:
        k = data.draw(st.sampled_from(sorted(self.size)))
        self.policy.pin(k)
        self.pins[k] = self.pins.get(k, 0) + 1

    @precondition(lambda self: any(n > 0 for n in self.pins.values()))
    @rule(data=st.data())
    def unpin(self, data: Any) -> None:
        k = data.draw(st.sampled_from(sorted(k for k, n in self.pins.items() if n > 0)))
        self.policy.unpin(k)
        self.pins[k] -= 1

    @rule(need=st.integers(1, 14))
    def make_room(self, need: int) -> None:
        short = self._used() + need - self.capacity_bytes
        prot = self._protected()
        freeable = self._used() - sum(self.size[k] for k in prot)
        before = dict(self.size)
        try:
            v = self.policy.victims(need)
        except CapacityError:
            _require(short > freeable, "capacity-error-only-when-impossible", f"victims({need}) raised with {freeable} freeable bytes for {short} needed")
            for k in before:
                _require(k in self.policy, "nothing-evicted-on-capacity-error", f"victims({need}) raised CapacityError after evicting {k!r}")
            return
        self._evicted(list(v), prot, f"victims({need})")
        _require(short <= 0 or self._used() + need <= self.capacity_bytes, "capacity", f"victims({need}) left {self._used()} used of {self.capacity_bytes}")

    @precondition(lambda self: any(self._children(k) == 0 and k not in self._protected() for k in self.size))
    @rule(data=st.data())
    def remove(self, data: Any) -> None:
        prot = self._protected()
        k = data.draw(st.sampled_from(sorted(k for k in self.size if self._children(k) == 0 and k not in prot)))
        self.policy.on_remove(k)
        del self.size[k]
        del self.parent[k]
        self.pins.pop(k, None)

    # invariants --------------------------------------------------------------
    @invariant()
    def resident_set_matches(self) -> None:
        for k in self.size:
            _require(k in self.policy, "dict-that-loses-entries", f"{k!r} should be resident: it was inserted and never evicted or removed")
        if hasattr(self.policy, "__len__"):
            _require(len(self.policy) == len(self.size), "counters", f"policy holds {len(self.policy)} blocks, expected {len(self.size)}")
        if hasattr(self.policy, "used_bytes"):
            _require(self.policy.used_bytes == self._used(), "counters", f"used_bytes {self.policy.used_bytes} != sum of resident sizes {self._used()}")
        _require(self._used() <= self.capacity_bytes, "capacity", f"{self._used()} bytes resident > capacity {self.capacity_bytes}")
        check = getattr(self.policy, "check", None)
        if callable(check):  # a policy's own consistency check, if it offers one (kvpolicy's do)
            try:
                check()
            except AssertionError as exc:
                raise ContractViolation("internal-consistency", str(exc)) from exc


# ----------------------------------------------------------------------------- publish


class PublishFilterContract(RuleBasedStateMachine):
    """tenancy boundary, distinct-request counting, determinism, full blocks only."""

    enforces_boundary = True
    block_size_tokens = 4

    def make_filter(self) -> Any:
        raise NotImplementedError("subclass PublishFilterContract and implement make_filter()")

    def __init__(self) -> None:
        super().__init__()
        self.once = self.make_filter()  # sees each request once
        self.noisy = self.make_filter()  # sees each request several times, block by block
        self.t = 0.0
        self.n = 0

    @rule(chain_len=st.integers(0, 6), base=st.integers(0, 3), tail=st.integers(0, 3), cls=st.sampled_from(["public", "shared", "private"]),
          boundary=st.integers(0, 40), repeats=st.integers(1, 3), dt=st.floats(0, 50))
    def request(self, chain_len: int, base: int, tail: int, cls: str, boundary: int, repeats: int, dt: float) -> None:
        B = self.block_size_tokens
        self.t += dt
        self.n += 1
        keys = [("chain", base, i) for i in range(chain_len)] + [("tail", self.n, i) for i in range(tail)]
        tokens = len(keys) * B + 1
        req = PublishRequest(request_id=self.n, num_tokens=tokens, block_size_tokens=B, time_s=self.t, data_class=cls,
                             boundary_tokens=min(boundary, tokens), reused_blocks=min(chain_len, 2))
        self.once.observe(req, keys)
        for _ in range(repeats):
            for j in range(1, len(keys) + 1):
                self.noisy.observe(req, keys[:j])
        a = self.once.publishable(req, keys)
        b = self.noisy.publishable(req, keys)
        _require(a == b, "distinct-request-counting", f"publishable {b} after repeated / block-by-block observe, {a} after one observe: a request was counted more than once")
        _require(0 <= a <= len(keys), "full-blocks-only", f"publishable {a} for {len(keys)} full blocks")
        if self.enforces_boundary:
            _require(req.boundary_tokens is None or a <= req.boundary_tokens // B, "tenancy-boundary", f"published {a} blocks past the boundary of {req.boundary_tokens} tokens")
            _require(cls != "private" or a == 0, "tenancy-boundary", f"published {a} blocks of a private data class")


# ----------------------------------------------------------------------------- admission


class AdmissionContract(RuleBasedStateMachine):
    """caps, never use a failed block, a load only when it wins — and a refusal only when its own
    numbers (or a guard rail that really binds) justify it: a controller that never loads fails."""

    max_loads_per_replica = 2
    max_loads_per_source = 3
    block_bytes = 1 << 21
    block_size_tokens = 16

    def make_controller(self, clock: ManualClock) -> Any:
        raise NotImplementedError("subclass AdmissionContract and implement make_controller(clock)")

    def __init__(self) -> None:
        super().__init__()
        self.clock = ManualClock()
        self.c = self.make_controller(self.clock)
        self.inflight: list[Any] = []

    @rule(replica=st.sampled_from(["r0", "r1", "r2"]), local=st.integers(0, 100), remote=st.integers(0, 600), active=st.integers(0, 8))
    def decide(self, replica: str, local: int, remote: int, active: int) -> None:
        B = self.block_size_tokens
        tokens = (local + remote + 5) * B + 1
        m = PrefixMatch(tokens, B, (tokens - 1) // B, local, (remote,), ("pool",), "miss")
        d = self.c.decide(m, AdmissionContext(block_bytes=self.block_bytes, replica=replica, active_decodes=active))
        if d.action == "load":
            _require(0 < d.load_blocks <= remote, "load-within-remote-run", f"loads {d.load_blocks} of {remote} remote blocks")
            margin = getattr(getattr(self.c, "config", None), "margin", 1.0)
            _require(d.t_remote_p95_s + d.interference_s < margin * d.t_recompute_p50_s, "load-only-when-it-wins",
                     f"loads although p95 remote {d.t_remote_p95_s:.4g}s + interference {d.interference_s:.4g}s >= {margin} x p50 recompute {d.t_recompute_p50_s:.4g}s")
            self.inflight.append(d)
        elif remote > 0:
            # a refusal must be justified: by its own numbers, or by a guard rail that really binds
            # (a controller that never loads fails here)
            busy_replica = sum(1 for x in self.inflight if x.replica == replica)
            if d.reason == "slower_than_recompute":
                margin = getattr(getattr(self.c, "config", None), "margin", 1.0)
                _require(d.t_remote_p95_s is not None and d.t_recompute_p50_s is not None, "refusal-has-its-numbers",
                         "refused as slower than recompute without the predicted terms that say so")
                _require(d.t_remote_p95_s + (d.interference_s or 0.0) >= margin * d.t_recompute_p50_s, "refuse-only-when-it-loses",
                         f"refused although p95 remote {d.t_remote_p95_s:.4g}s + interference {d.interference_s or 0.0:.4g}s < "
                         f"{margin} x p50 recompute {d.t_recompute_p50_s:.4g}s")
            elif d.reason == "replica_cap":
                _require(busy_replica >= self.max_loads_per_replica, "guard-rail-binds", f"replica_cap with {busy_replica} loads in flight")
            elif d.reason == "source_cap":
                _require(len(self.inflight) >= self.max_loads_per_source, "guard-rail-binds", f"source_cap with {len(self.inflight)} loads in flight")
        per_replica: dict[str, int] = {}
        for x in self.inflight:
            per_replica[x.replica] = per_replica.get(x.replica, 0) + 1
        _require(all(n <= self.max_loads_per_replica for n in per_replica.values()), "replica-cap", f"concurrent loads per replica {per_replica}")
        _require(len(self.inflight) <= self.max_loads_per_source, "source-cap", f"{len(self.inflight)} concurrent loads on one source")

    @precondition(lambda self: self.inflight)
    @rule(data=st.data(), status=st.sampled_from(["ok", "failed", "timeout"]))
    def finish(self, data: Any, status: LoadStatus) -> None:
        d = self.inflight.pop(data.draw(st.integers(0, len(self.inflight) - 1)))
        ok = data.draw(st.integers(0, d.load_blocks))
        r = self.c.record(LoadOutcome(d.load_id, status, ok, transfer_s=0.01))
        _require(r.usable_blocks <= ok, "never-use-a-failed-block", f"{r.usable_blocks} blocks usable after only {ok} loaded intact ({status})")


# ----------------------------------------------------------------------------- block index


class BlockIndexContract(RuleBasedStateMachine):
    """``match_prefix(keys)`` is the length of the leading run of present keys."""

    def make_index(self, keys: set) -> Any:
        raise NotImplementedError("subclass BlockIndexContract and implement make_index(keys) -> BlockIndex")

    def __init__(self) -> None:
        super().__init__()
        self.present: set = set()

    @rule(keys=st.sets(st.integers(0, 20), max_size=10))
    def populate(self, keys: set) -> None:
        self.present = {k.to_bytes(16, "little") for k in keys}

    @rule(chain=st.lists(st.integers(0, 20), max_size=10))
    def lookup(self, chain: list) -> None:
        keys = [k.to_bytes(16, "little") for k in chain]
        idx = self.make_index(set(self.present))
        got = idx.match_prefix(keys)
        want = 0
        while want < len(keys) and keys[want] in self.present:
            want += 1
        _require(got == want, "prefix-semantics", f"match_prefix returned {got}, the leading run of present keys is {want}")


class DirectoryContract(RuleBasedStateMachine):
    """A shared directory behaves like the in-memory reference: same answers to
    publish / match / evict / lease / release / clear_holder, same contents after
    every step, tenants never see each other (``make_directory(max_keys)`` must
    return an empty directory bounded to ``max_keys`` keys per tenant, on Unix time).

    The steps include what broke real backends: holders with their own expiry
    (already past, or an hour ahead) beside persistent ones — one holder's expiry
    never decides another's; a lease released twice — it never drops another
    reader's; chains longer than the bound — eviction takes leaves first, so a
    chain's head stays matchable; and the bound with leased keys — it holds over
    the unleased ones however far down the LRU they are."""

    MAX_KEYS = 6
    #: False for a directory whose bound is not exact per tenant (a Redis directory spread over key groups bounds each
    #: group): it is then compared unbounded — the reference and it are both built with a bound no step reaches
    EXACT_BOUND = True

    def make_directory(self, max_keys: int) -> Any:
        raise NotImplementedError("subclass DirectoryContract and implement make_directory(max_keys) -> Directory")

    def __init__(self) -> None:
        from ..directory import InMemoryDirectory

        super().__init__()
        bound = self.MAX_KEYS if self.EXACT_BOUND else 10**6
        self.ref = InMemoryDirectory(max_keys_per_tenant=bound)
        self.sut = self.make_directory(bound)
        self.leases: list[tuple[Any, Any]] = []
        self.released: list[tuple[Any, Any]] = []

    @staticmethod
    def _keys(start: int, n: int) -> list[bytes]:
        return [bytes([(7 * i + 3) % 10]) * 16 for i in range(start, start + n)]

    def _same(self, op: str, a: Any, b: Any) -> None:
        _require(a == b, f"{op}-agrees", f"{op}: reference answered {a!r}, this directory {b!r}")

    @rule(start=st.integers(0, 9), n=st.integers(1, 4), holder=st.sampled_from(["n1", "n2"]), tenant=st.sampled_from(["a", "b"]))
    def publish(self, start: int, n: int, holder: str, tenant: str) -> None:
        from ..directory import Entry

        ents = [Entry(k, holder, 64) for k in self._keys(start, n)]
        self._same("publish", self.ref.publish(tenant, ents), self.sut.publish(tenant, ents))
        self._bounded(tenant)

    @rule(start=st.integers(0, 9), n=st.integers(1, 6), tenant=st.sampled_from(["a", "b"]))
    def match(self, start: int, n: int, tenant: str) -> None:
        ks = self._keys(start, n)
        self._same("match_prefix", self.ref.match_prefix(tenant, ks), self.sut.match_prefix(tenant, ks))

    @rule(start=st.integers(0, 9), n=st.integers(1, 3), holder=st.sampled_from([None, "n1", "n2"]), force=st.booleans())
    def evict(self, start: int, n: int, holder: Any, force: bool) -> None:
        ks = self._keys(start, n)
        self._same("evict", self.ref.evict("a", ks, holder=holder, force=force), self.sut.evict("a", ks, holder=holder, force=force))

    @rule(start=st.integers(0, 9), n=st.integers(1, 3))
    def lease(self, start: int, n: int) -> None:
        ks = self._keys(start, n)
        self.leases.append((self.ref.lease("a", ks, 3600.0), self.sut.lease("a", ks, 3600.0)))

    @precondition(lambda self: bool(self.leases))
    @rule()
    def release(self) -> None:
        a, b = self.leases.pop(0)
        self.ref.release(a)
        self.sut.release(b)
        self.released.append((a, b))

    @precondition(lambda self: bool(self.released))
    @rule()
    def release_again(self) -> None:
        a, b = self.released[-1]
        self.ref.release(a)
        self.sut.release(b)

    @rule(start=st.integers(0, 9), n=st.integers(1, 4), holder=st.sampled_from(["n1", "n2", "n3"]), expired=st.booleans())
    def publish_expiring(self, start: int, n: int, holder: str, expired: bool) -> None:
        import time

        from ..directory import Entry

        at = time.time() + (-60.0 if expired else 3600.0)  # decided now, whatever the clock does during the step
        ents = [Entry(k, holder, 64, expires_at_s=at) for k in self._keys(start, n)]
        self._same("publish", self.ref.publish("a", ents), self.sut.publish("a", ents))
        self._bounded("a")

    @rule(n=st.integers(MAX_KEYS + 1, 2 * MAX_KEYS + 3), holder=st.sampled_from(["n1", "n2"]))
    def publish_long_chain(self, n: int, holder: str) -> None:
        from ..directory import Entry

        chain = self._chain(n)
        ents = [Entry(k, holder, 64) for k in chain]
        self._same("publish", self.ref.publish("a", ents), self.sut.publish("a", ents))
        self._bounded("a")
        got = self.sut.match_prefix("a", chain)
        self._same("match_prefix(long chain)", self.ref.match_prefix("a", chain), got)

    @staticmethod
    def _chain(n: int) -> list[bytes]:
        return [bytes([100 + i]) * 16 for i in range(n)]

    @rule(holder=st.sampled_from(["n1", "n2"]))
    def clear(self, holder: str) -> None:
        self._same("clear_holder", self.ref.clear_holder("a", holder), self.sut.clear_holder("a", holder))

    @invariant()
    def same_contents(self) -> None:
        for t in ("a", "b"):
            self._same(f"keys({t})", self.ref.keys(t), self.sut.keys(t))
        universe = self._keys(0, 10) + self._chain(2 * self.MAX_KEYS + 3)
        self._same("leased", [self.ref.leased("a", k) for k in universe], [self.sut.leased("a", k) for k in universe])
        self._same("holders", [[e.holder for e in es] for es in self.ref.lookup("a", universe)],
                   [[e.holder for e in es] for es in self.sut.lookup("a", universe)])

    def _bounded(self, tenant: str) -> None:
        """Right after a publish, the unleased keys fit the bound (a release may leave the excess until the next one)."""
        if not self.EXACT_BOUND:
            return
        keys = self.sut.keys(tenant)
        leased = sum(1 for k in keys if self.ref.leased(tenant, k))
        _require(len(keys) - leased <= self.MAX_KEYS, "bounded", f"{len(keys)} keys ({leased} leased) exceed the bound of {self.MAX_KEYS}")
