"""The directory's value objects and the checks every backend shares.

An :class:`Entry` says that ``holder`` (a storage node, a replica, an engine
pod) holds the block ``key`` of ``size_bytes`` in ``tier``, built under the
namespace whose digest is ``namespace_digest``, until ``expires_at_s`` (absolute
Unix time in seconds — the directory's clock, Redis's ``TIME``; None: no expiry). A key may have several
holders. A :class:`Lease` protects keys being loaded from the directory's own
eviction (and from ``evict`` without ``force``) until it is released or expires.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

import attrs

from .._validate import check_positive_number, non_negative_int
from ..errors import ConfigError

#: a tenant name; matched whole (``fullmatch``: ``$`` alone would let "acme\n" through, a newline in keys and logs)
TENANT_RE = re.compile(r"[A-Za-z0-9_.\-]{1,128}")


def check_tenant(tenant: Any) -> str:
    if not isinstance(tenant, str) or not TENANT_RE.fullmatch(tenant):
        raise ConfigError("tenant", f"must be 1..128 characters of [A-Za-z0-9_.-], got {tenant!r}")
    return tenant


#: a lease lasts at least a millisecond (Redis expires in whole ms: shorter would be a no-op there and held in memory)
MIN_LEASE_TTL_S = 0.001
#: ... and at most an hour: a lease guards one read while it is in flight, and a longer one pins its keys past any use
MAX_LEASE_TTL_S = 3600.0

#: holders one key may have at once (replicas, tiers): past it a new holder's publish is refused (expired holders make
#: room first) and counted — 200,000 holders on one key took 48 MiB in memory and a 6.5 s script on Redis
MAX_HOLDERS_PER_KEY = 64
#: the most ``max_holders_per_key`` may be (the Redis scripts enforce it too: a key's holders are read whole per match)
MAX_HOLDERS_LIMIT = 1024
#: the latest expiry an entry may carry (the year 5138): Redis keeps expiries in integer milliseconds, and a Lua number
#: past 1e14 ms prints as ``1e+17`` — a PEXPIREAT that failed after its HSET (1e14 s stored entries past every bound)
MAX_EXPIRES_AT_S = 1e11


#: keys one Redis script call carries: larger calls are split, so no call holds the server for long
MAX_KEYS_PER_CALL = 1000


def check_max_holders(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not 0 < v <= MAX_HOLDERS_LIMIT:
        raise ConfigError("max_holders_per_key", f"must be an int in [1, {MAX_HOLDERS_LIMIT}], got {v!r}")
    return v


def check_ttl(ttl_s: Any) -> float:
    """A lease's seconds, in [MIN_LEASE_TTL_S, MAX_LEASE_TTL_S]: the same lease on both backends, never one for ever."""
    check_positive_number("ttl_s", ttl_s)
    if not MIN_LEASE_TTL_S <= ttl_s <= MAX_LEASE_TTL_S:
        raise ConfigError("ttl_s", f"a lease lasts {MIN_LEASE_TTL_S * 1e3:g} ms to {MAX_LEASE_TTL_S:g} s, got {ttl_s!r}")
    return float(ttl_s)


def _is_name(v: Any) -> bool:
    """A holder or tier name: a non-empty string of at most 256 characters, no NUL."""
    return isinstance(v, str) and 1 <= len(v) <= 256 and "\x00" not in v


def check_holder(holder: Any) -> str:
    """A holder named in a call (evict, clear): what an Entry's holder may be."""
    if not _is_name(holder):
        raise ConfigError("holder", f"must be a non-empty string, got {holder!r}")
    return holder


def check_keys(keys: Any, field: str = "keys") -> list[bytes]:
    if isinstance(keys, (bytes, str)):
        raise ConfigError(field, "must be a sequence of keys, not one key")
    if not hasattr(keys, "__iter__"):
        raise ConfigError(field, f"must be a sequence of keys, got {type(keys).__name__}")
    out = []
    for i, k in enumerate(keys):
        if not isinstance(k, (bytes, bytearray)) or not 1 <= len(k) <= 64:
            raise ConfigError(field, f"key {i} must be 1..64 bytes, got {k!r:.40}")
        out.append(bytes(k))
    return out


def check_entries(entries: Any) -> list[Any]:
    """What publish() takes: a sequence of Entry objects (checked here, so every directory refuses the same input)."""
    if isinstance(entries, (bytes, str)) or not hasattr(entries, "__iter__"):
        raise ConfigError("entries", f"must be a sequence of kvpolicy.directory.Entry objects, got {type(entries).__name__}")
    out = list(entries)
    for e in out:
        if not isinstance(e, Entry):
            raise ConfigError("entries", f"must be kvpolicy.directory.Entry objects, got {type(e).__name__}")
    return out


def check_lease(lease: Any) -> Any:
    if not isinstance(lease, Lease):
        raise ConfigError("lease", f"must be the Lease a lease() call returned, got {type(lease).__name__}")
    return lease


def _key(inst: Any, a: attrs.Attribute, v: Any) -> None:
    if not isinstance(v, bytes) or not 1 <= len(v) <= 64:
        raise ConfigError(a.name, f"must be 1..64 bytes, got {v!r:.40}")


def _holder(inst: Any, a: attrs.Attribute, v: Any) -> None:
    if not _is_name(v):
        raise ConfigError(a.name, f"must be a non-empty string, got {v!r}")


def _tier(inst: Any, a: attrs.Attribute, v: Any) -> None:
    _holder(inst, a, v)
    if "|" in v:
        raise ConfigError(a.name, f"must not contain '|' (the stored value's separator), got {v!r}")


def _expiry(a: attrs.Attribute, v: Any) -> None:
    if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)):  # NaN compares false: never expired
        raise ConfigError(a.name, f"must be a finite time in seconds or None, got {v!r}")
    if v is not None and not 0 <= v <= MAX_EXPIRES_AT_S:
        raise ConfigError(a.name, f"must be a Unix time in [0, {MAX_EXPIRES_AT_S:g}] seconds (None: no expiry), got {v!r}")


class MalformedEntry(ConfigError):
    """A stored value that is not an :class:`Entry`: readers skip it as a miss and count it, never raise it."""


@attrs.frozen
class Entry:
    key: bytes = attrs.field(validator=_key)
    holder: str = attrs.field(validator=_holder)
    size_bytes: int = attrs.field(default=0, validator=non_negative_int)
    tier: str = attrs.field(default="pool", validator=_tier)
    namespace_digest: bytes = b""
    expires_at_s: float | None = attrs.field(default=None, validator=lambda i, a, v: _expiry(a, v))

    def pack(self) -> bytes:
        """Compact value for a backend: size|tier|digest-hex|expiry."""
        exp = "" if self.expires_at_s is None else repr(float(self.expires_at_s))
        return f"{self.size_bytes}|{self.tier}|{self.namespace_digest.hex()}|{exp}".encode()

    @classmethod
    def unpack(cls, key: bytes, holder: str | bytes, raw: bytes) -> Entry:
        """The entry a backend stored as ``raw`` (see :meth:`pack`) for ``holder``; a value or holder that is not one
        (a tenant's own ACL user can write any bytes into its hashes) raises :class:`MalformedEntry`."""
        try:
            name = holder.decode() if isinstance(holder, (bytes, bytearray)) else holder
            size, tier, digest, exp = raw.decode().split("|")
            return cls(key, name, int(size), tier, bytes.fromhex(digest), float(exp) if exp else None)
        except (ValueError, UnicodeDecodeError, ConfigError) as e:
            raise MalformedEntry("entry", f"malformed directory value {raw!r:.60} for holder {holder!r:.60}: {e}") from None


@attrs.frozen
class Lease:
    lease_id: str
    tenant: str
    keys: tuple[bytes, ...]
    expires_at_s: float


class TenantIndex:
    """One tenant's view of a directory as a :class:`~kvpolicy.protocols.BlockIndex`
    (plugs into :func:`kvpolicy.matching.match`)."""

    def __init__(self, directory: Any, tenant: str, name: str = "directory") -> None:
        self.directory = directory
        self.tenant = check_tenant(tenant)
        self.name = name

    def match_prefix(self, keys: Sequence[bytes]) -> int:
        return int(self.directory.match_prefix(self.tenant, keys))


class PeerIndex:
    """The blocks *other engines* hold in their own caches, as one remote tier of :func:`kvpolicy.matching.match` —
    the source of a pull (issue #44: publish on demand, ``kvpolicy.sim.PolicySet.pull_from_peers``).

    The directory knows what each engine holds from its KV events (:mod:`kvpolicy.integrations.vllm_events` publishes
    them as holder ``"{engine}/{tier}/g{group}"`` in ``tier``). :meth:`match_prefix` is the longest leading run of
    ``keys`` that **one** peer engine holds, each block in any of ``tiers`` (a run may go on from its GPU into its CPU
    tier), not counting the engine named ``exclude`` (the asking engine's own name: its own blocks are its local run),
    and :attr:`holder` names that engine (the first by name on a tie; None for an empty run) — the engine then asks
    that peer to send the run through the pool, which keeps it. One directory ``lookup`` per match."""

    def __init__(self, directory: Any, tenant: str, *, exclude: str, tiers: Sequence[str] = ("gpu", "cpu"), name: str = "peers") -> None:
        self.directory = directory
        self.tenant = check_tenant(tenant)
        self.exclude = check_holder(exclude)
        if isinstance(tiers, str) or not tiers or not all(_is_name(t) for t in tiers):
            raise ConfigError("tiers", f"must be a non-empty list of tier names, got {tiers!r}")
        self.tiers = frozenset(tiers)
        self.name = name
        self.holder: str | None = None

    def match_prefix(self, keys: Sequence[bytes]) -> int:
        self.holder = None
        if not keys:
            return 0
        held: set[str] | None = None
        n = 0
        tiers, me = self.tiers, self.exclude
        for entries in self.directory.lookup(self.tenant, keys):
            here = {engine for e in entries if e.tier in tiers and (engine := e.holder.partition("/")[0]) != me}
            both = here if held is None else held & here
            if not both:
                break
            held = both
            n += 1
        if held is not None:  # n > 0: the first key had a peer
            self.holder = min(held)
        return n


class TenantScopedDirectory:
    """One tenant's directory: the tenant is bound at construction, so code holding this object
    cannot name another tenant — list, match, evict or clear its entries. With ``namespace_digest``,
    it also refuses to publish entries built under another namespace and never returns them from
    ``lookup``. (On Redis, pair it with a per-tenant ACL user: the object scopes the code, the ACL the
    connection — see docs/security.md.)"""

    def __init__(self, directory: Any, tenant: str, namespace_digest: bytes | None = None) -> None:
        self._d = directory
        self.tenant = check_tenant(tenant)
        if namespace_digest is not None and (not isinstance(namespace_digest, bytes) or not namespace_digest):
            raise ConfigError("namespace_digest", f"must be non-empty bytes or None, got {namespace_digest!r}")
        self.namespace_digest = namespace_digest

    def publish(self, entries: Sequence[Entry]) -> int:
        entries = check_entries(entries)  # read once: a generator's second pass is empty, another iterable's may differ
        if self.namespace_digest is not None:
            for e in entries:
                if e.namespace_digest != self.namespace_digest:
                    raise ConfigError("namespace_digest", f"entry for {e.key.hex()[:12]}… was built under another namespace: refused")
        return int(self._d.publish(self.tenant, entries))

    def match_prefix(self, keys: Sequence[bytes]) -> int:
        return int(self._d.match_prefix(self.tenant, keys))

    def peers(self, *, exclude: str, tiers: Sequence[str] = ("gpu", "cpu")) -> PeerIndex:
        """This tenant's :class:`PeerIndex`: the run one engine other than ``exclude`` holds in its own cache."""
        return PeerIndex(self._d, self.tenant, exclude=exclude, tiers=tiers)

    def lookup(self, keys: Sequence[bytes]) -> list[list[Entry]]:
        rows = self._d.lookup(self.tenant, keys)
        if self.namespace_digest is None:
            return rows
        return [[e for e in row if e.namespace_digest == self.namespace_digest] for row in rows]

    def evict(self, keys: Sequence[bytes], holder: str | None = None, force: bool = False) -> int:
        return int(self._d.evict(self.tenant, keys, holder=holder, force=force))

    def lease(self, keys: Sequence[bytes], ttl_s: float) -> Lease:
        return self._d.lease(self.tenant, keys, ttl_s)

    def release(self, lease: Lease) -> None:
        if lease.tenant != self.tenant:
            raise ConfigError("lease", f"belongs to tenant {lease.tenant!r}, not {self.tenant!r}")
        self._d.release(lease)

    def clear_holder(self, holder: str) -> int:
        return int(self._d.clear_holder(self.tenant, holder))

    def keys(self) -> list[bytes]:
        return list(self._d.keys(self.tenant))

    def index(self) -> TenantIndex:
        return TenantIndex(self._d, self.tenant)
