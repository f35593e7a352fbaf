"""The in-process directory: the default, and the reference the Redis backend must agree with."""

from __future__ import annotations

import functools
import heapq
import itertools
import secrets
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from ..clock import WallClock
from ..errors import ConfigError
from ..protocols import Clock
from .base import (
    MAX_HOLDERS_PER_KEY,
    Entry,
    Lease,
    TenantIndex,
    check_entries,
    check_holder,
    check_keys,
    check_lease,
    check_max_holders,
    check_tenant,
    check_ttl,
)


_F = TypeVar("_F", bound=Callable[..., Any])


def _locked(method: _F) -> _F:
    @functools.wraps(method)
    def call(self: InMemoryDirectory, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return method(self, *args, **kwargs)

    return call  # type: ignore[return-value]


class InMemoryDirectory:
    """Per-tenant tables of key → {holder: Entry}, least recently used first.

    ``max_keys_per_tenant`` bounds memory: publishing past it evicts the least
    recently used keys that no lease protects (the directory's own eviction).
    Expired entries are dropped when touched. ``clock`` defaults to Unix time
    (:class:`~kvpolicy.clock.WallClock`), the clock Redis keeps, so an entry's
    ``expires_at_s`` means the same here as on :class:`RedisDirectory`.

    Safe to share between threads (``kvpolicy ingest-events --ranks N`` feeds one from N): each call holds the
    directory's lock — without it, a publish beside a ``clear_holder`` raised ``KeyError`` or "dictionary changed
    size during iteration".
    """

    def __init__(self, *, max_keys_per_tenant: int = 1_000_000, max_leases_per_tenant: int = 100_000, clock: Clock | None = None,
                 max_holders_per_key: int = MAX_HOLDERS_PER_KEY) -> None:
        if isinstance(max_keys_per_tenant, bool) or not isinstance(max_keys_per_tenant, int) or max_keys_per_tenant <= 0:
            raise ConfigError("max_keys_per_tenant", f"must be a positive int, got {max_keys_per_tenant!r}")
        if isinstance(max_leases_per_tenant, bool) or not isinstance(max_leases_per_tenant, int) or max_leases_per_tenant <= 0:
            raise ConfigError("max_leases_per_tenant", f"must be a positive int, got {max_leases_per_tenant!r}")
        self.max_keys_per_tenant = max_keys_per_tenant
        #: leases one tenant holds at once; past it that tenant's lease is refused (counted in ``leases_refused``) and
        #: protects no key — other tenants' leases are untouched (one global bound let a tenant deny every other's)
        self.max_leases_per_tenant = max_leases_per_tenant
        self.leases_refused = 0
        #: live holders one key may have; a new holder past it is refused (expired ones make room first), counted here
        self.max_holders_per_key = check_max_holders(max_holders_per_key)
        self.holders_refused = 0
        self.clock = clock or WallClock()
        self._t: dict[str, OrderedDict[bytes, dict[str, Entry]]] = {}
        #: per tenant: leases per key, the live leases by id, and their expiries as a heap (released ones stay in the
        #: heap until they surface or the heap is rebuilt): every lease call, ``leased`` and ``evict`` touch one tenant's
        #: leases and only those that expired — never a scan of all (3-10 ms a call under the lock at 100,000)
        self._leases: dict[str, dict[bytes, int]] = {}
        self._active: dict[str, dict[str, Lease]] = {}
        self._expiry: dict[str, list[tuple[float, str]]] = {}
        self.evicted_by_capacity = 0
        self._lock = threading.RLock()

    def _table(self, tenant: str) -> OrderedDict[bytes, dict[str, Entry]]:
        """The tenant's table, made on its first publish."""
        return self._t.setdefault(check_tenant(tenant), OrderedDict())

    def _read(self, tenant: str) -> OrderedDict[bytes, dict[str, Entry]]:
        """The tenant's table to read (an empty one, not stored, for a tenant that never published: a read of
        300,000 unknown tenants allocated 63 MiB)."""
        return self._t.get(check_tenant(tenant)) or OrderedDict()

    @staticmethod
    def _alive(e: Entry, now: float) -> bool:
        return e.expires_at_s is None or e.expires_at_s > now

    @classmethod
    def _live(cls, table: OrderedDict[bytes, dict[str, Entry]], key: bytes, now: float) -> dict[str, Entry] | None:
        """The key's live holders (None if none). Reading never removes anything: an expired key keeps
        its place in the LRU until the eviction walk, ``evict`` or ``clear_holder`` meets it — as on Redis."""
        holders = table.get(key)
        if holders is None:
            return None
        live = {h: e for h, e in holders.items() if cls._alive(e, now)}
        return live or None

    def _expire_leases(self, tenant: str, now: float) -> None:
        """Drop ``tenant``'s leases that expired by ``now``: heap pops, O(log n) each."""
        heap = self._expiry.get(tenant)
        if not heap:
            return
        active = self._active[tenant]
        while heap and heap[0][0] <= now:
            _, lid = heapq.heappop(heap)
            lease = active.pop(lid, None)
            if lease is not None:
                self._drop_lease(lease)

    def _drop_lease(self, lease: Lease) -> None:
        counts = self._leases.get(lease.tenant, {})
        for k in lease.keys:
            c = counts.get(k, 0) - 1
            if c <= 0:
                counts.pop(k, None)
            else:
                counts[k] = c

    @_locked
    def leased(self, tenant: str, key: bytes) -> bool:
        self._expire_leases(tenant, self.clock.now_s())
        return self._leases.get(tenant, {}).get(key, 0) > 0

    # ------------------------------------------------------------------ API

    @_locked
    def publish(self, tenant: str, entries: Sequence[Entry]) -> int:
        table = self._table(tenant)
        entries = check_entries(entries)
        written: list[Entry] = []
        now_s: float | None = None
        for e in entries:
            holders = table.get(e.key)
            if holders is None:
                holders = table[e.key] = {}
            if e.holder not in holders and len(holders) >= self.max_holders_per_key:
                now_s = self.clock.now_s() if now_s is None else now_s
                for h in [h for h, x in holders.items() if not self._alive(x, now_s)]:  # expired holders make room first
                    del holders[h]
                if len(holders) >= self.max_holders_per_key:
                    self.holders_refused += 1
                    continue
            holders[e.holder] = e
            written.append(e)
        for e in reversed(written):  # a chain's head ends most recent: capacity eviction takes leaves first
            table.move_to_end(e.key)
        excess = len(table) - self.max_keys_per_tenant
        if excess > 0:  # walk from the least recently used end: expired keys go for free, leased ones stay
            now = self.clock.now_s()
            self._expire_leases(tenant, now)
            leased = self._leases.get(tenant, {})
            for k in list(itertools.islice(table.keys(), len(table))):
                if excess <= 0:
                    break
                if self._live(table, k, now) is None:
                    del table[k]
                    excess -= 1
                    continue
                if leased.get(k, 0) > 0:
                    continue
                del table[k]
                excess -= 1
                self.evicted_by_capacity += 1
        return len(written)

    @_locked
    def match_prefix(self, tenant: str, keys: Sequence[bytes]) -> int:
        ks = check_keys(keys)
        table = self._read(tenant)
        now = self.clock.now_s()
        n = 0
        for k in ks:
            if self._live(table, k, now) is None:
                break
            n += 1
        for k in reversed(ks[:n]):  # touched tail first: the head of a matched chain is the last to go
            table.move_to_end(k)
        return n

    @_locked
    def lookup(self, tenant: str, keys: Sequence[bytes]) -> list[list[Entry]]:
        ks = check_keys(keys)
        table = self._read(tenant)
        now = self.clock.now_s()
        out = []
        for k in ks:
            h = self._live(table, k, now)
            out.append(sorted(h.values(), key=lambda e: e.holder) if h else [])
        return out

    @_locked
    def evict(self, tenant: str, keys: Sequence[bytes], holder: str | None = None, force: bool = False) -> int:
        ks = check_keys(keys)
        if holder is not None:
            check_holder(holder)  # an int matched no entry and evicted nothing, without a word
        table = self._read(tenant)
        now = self.clock.now_s()
        if not force:
            self._expire_leases(tenant, now)
        leased = self._leases.get(tenant, {})
        n = 0
        for k in ks:
            holders = table.get(k)
            if holders is None or (not force and leased.get(k, 0) > 0):
                continue
            if holder is None:
                n += self._live(table, k, now) is not None  # an expired key is not there to evict
                del table[k]
                continue
            e = holders.pop(holder, None)
            if e is not None and self._alive(e, now):
                n += 1
            if self._live(table, k, now) is None:
                del table[k]
        return n

    @_locked
    def clear_holder(self, tenant: str, holder: str) -> int:
        check_holder(holder)
        table = self._read(tenant)
        now = self.clock.now_s()
        n = 0
        for k in list(table):
            e = table[k].pop(holder, None)
            if e is not None and self._alive(e, now):
                n += 1
            if self._live(table, k, now) is None:
                del table[k]
        return n

    @_locked
    def lease(self, tenant: str, keys: Sequence[bytes], ttl_s: float) -> Lease:
        ks = check_keys(keys)
        check_tenant(tenant)
        ttl_s = check_ttl(ttl_s)
        now = self.clock.now_s()
        active = self._active.setdefault(tenant, {})
        heap = self._expiry.setdefault(tenant, [])
        if len(active) >= self.max_leases_per_tenant:
            self._expire_leases(tenant, now)
        if len(active) >= self.max_leases_per_tenant:  # refused: counted, and a lease that protects nothing
            self.leases_refused += 1
            return Lease(f"mem-refused-{secrets.token_hex(16)}", tenant, (), now + ttl_s)
        # unguessable: a counter let anyone release another tenant's lease by naming its id
        lease = Lease(f"mem-{secrets.token_hex(16)}", tenant, tuple(ks), now + ttl_s)
        counts = self._leases.setdefault(tenant, {})
        for k in ks:
            counts[k] = counts.get(k, 0) + 1
        active[lease.lease_id] = lease
        if len(heap) > 2 * len(active) + 64:  # released leases' entries: rebuilt, so the heap stays O(live leases)
            heap[:] = [(x.expires_at_s, lid) for lid, x in active.items() if lid != lease.lease_id]
            heapq.heapify(heap)
        heapq.heappush(heap, (lease.expires_at_s, lease.lease_id))
        return lease

    @_locked
    def release(self, lease: Lease) -> None:
        active = self._active.get(check_lease(lease).tenant, {})
        held = active.get(lease.lease_id)
        if held is not None and held == lease:  # only the Lease lease() returned: its id, tenant, keys and expiry
            del active[lease.lease_id]
            self._drop_lease(held)

    @_locked
    def keys(self, tenant: str) -> list[bytes]:
        table = self._read(tenant)
        now = self.clock.now_s()
        return sorted(k for k in list(table) if self._live(table, k, now) is not None)

    @_locked
    def count(self, tenant: str) -> int:
        return len(self.keys(tenant))

    def index(self, tenant: str) -> TenantIndex:
        return TenantIndex(self, tenant)
