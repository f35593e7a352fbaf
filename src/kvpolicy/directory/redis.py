"""The directory on Redis (or Valkey): shared by every process, one round trip per match.

Layout, for tenant ``t`` under prefix ``p`` (default ``kvp``) — every key carries
the hash tag ``{p:t}``, so one tenant's keys share a Redis Cluster slot and the
scripts below stay single-slot::

    {p:t}:b:<key hex>      hash   holder -> "size|tier|namespace digest hex|expiry"
    {p:t}:lru              zset   key hex -> last-touch counter (the directory's own LRU; one tick per key, the chain's head
                                  newest, so capacity eviction takes a chain's leaves first)
    {p:t}:clock            string the counter
    {p:t}:lease:<key hex>  set    the ids of the live leases on the key (expires with the longest; a double release is a no-op)

``match_prefix`` is one ``EVALSHA``: the script walks the chain and stops at the
first key with no live holder, touching what it matched. ``publish`` is one
``EVALSHA`` that also enforces ``max_keys_per_tenant`` by evicting the least
recently touched keys no lease protects. Expiry: an entry with ``expires_at_s``
makes its hash expire (Redis ``PEXPIREAT`` on the directory clock = Unix time).

Failure handling: every call catches connection errors and timeouts — a match
answers 0 (a miss), a publish answers 0 (nothing published), an evict 0 — and
counts them in :attr:`RedisDirectory.errors`; redis-py reconnects on the next
call and reloads the scripts after a server restart. Nothing stale can be served
from the client side: it keeps no cache.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Sequence
from typing import Any

from ..errors import ConfigError
from .base import (
    MAX_HOLDERS_PER_KEY,
    MAX_KEYS_PER_CALL,
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

# A holder's value ends in its own expiry (absolute seconds; '' = none): the entry is live while that is ahead.
# A hash lives as long as its longest-lived holder — persistent if any holder is, else until the latest expiry —
# recomputed after every change to its holders, so removing the long-lived one never leaves expired ones behind.
_HOLDERS = """
local function expiry(v)
  local e = string.match(v, '|([^|]*)$')
  if e == nil or e == '' then return nil end
  return tonumber(e)
end
local function live_value(v, now)
  local e = expiry(v)
  return e == nil or e > now
end
local function live(key, now)
  for _, v in ipairs(redis.call('HVALS', key)) do
    if live_value(v, now) then return true end
  end
  return false
end
local function now_s()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1e6
end
local function reset_expiry(key)
  local vals = redis.call('HVALS', key)
  if #vals == 0 then return end
  local latest = 0
  for _, v in ipairs(vals) do
    local e = expiry(v)
    if e == nil then
      redis.call('PERSIST', key)
      return
    end
    local ms = math.floor(e * 1000)
    if ms > latest then latest = ms end
  end
  redis.call('PEXPIREAT', key, latest)
end
"""

_MATCH = _HOLDERS + """
local n = 0
local now = now_s()
for i = 3, #KEYS do
  if not live(KEYS[i], now) then break end
  n = n + 1
end
if n > 0 then
  local tick = redis.call('INCRBY', KEYS[2], n)
  for i = 1, n do redis.call('ZADD', KEYS[1], tick - i + 1, ARGV[i]) end
end
return n
"""

# KEYS: lru, clock, then one hash per entry
# ARGV: max_keys, lease_prefix, max_holders, then per entry: hex, holder, value, expire_at_ms ('' = none)
_PUBLISH = _HOLDERS + """
local tick = redis.call('INCRBY', KEYS[2], #KEYS - 2)
local n = 0
local refused = 0
local maxh = tonumber(ARGV[3])
local now = now_s()
for i = 3, #KEYS do
  local j = (i - 3) * 4 + 4
  local hex, holder, value, exp = ARGV[j], ARGV[j + 1], ARGV[j + 2], ARGV[j + 3]
  local room = redis.call('HEXISTS', KEYS[i], holder) == 1 or redis.call('HLEN', KEYS[i]) < maxh
  if not room then  -- full of holders: the expired ones make room first (at most maxh values read)
    local all = redis.call('HGETALL', KEYS[i])
    for k = 1, #all, 2 do
      if not live_value(all[k + 1], now) then redis.call('HDEL', KEYS[i], all[k]) end
    end
    room = redis.call('HLEN', KEYS[i]) < maxh
  end
  if room then
    redis.call('HSET', KEYS[i], holder, value)
    reset_expiry(KEYS[i])
    redis.call('ZADD', KEYS[1], tick - (i - 3), hex)
    n = n + 1
  else
    refused = refused + 1
  end
end
local maxk = tonumber(ARGV[1])
local excess = redis.call('ZCARD', KEYS[1]) - maxk
local evicted = 0
if excess > 0 then
  -- walk the LRU from its oldest end in windows, past leased keys, until the bound holds or nothing is left
  local base = string.sub(KEYS[1], 1, -4)
  local start = 0
  while excess > 0 do
    local cands = redis.call('ZRANGE', KEYS[1], start, start + excess + 63)
    if #cands == 0 then break end
    local kept = 0
    for _, hex in ipairs(cands) do
      if excess <= 0 then break end
      local b = base .. 'b:' .. hex
      if redis.call('EXISTS', b) == 0 then
        redis.call('ZREM', KEYS[1], hex)
        excess = excess - 1
      elseif redis.call('EXISTS', ARGV[2] .. hex) == 0 then
        redis.call('DEL', b)
        redis.call('ZREM', KEYS[1], hex)
        excess = excess - 1
        evicted = evicted + 1
      else
        kept = kept + 1
      end
    end
    start = start + kept
  end
end
return {n, evicted, refused}
"""

# KEYS: lru, then one hash per key; ARGV: force ('1'/'0'), holder ('' = all), lease_prefix, then hex per key
_EVICT = _HOLDERS + """
local n = 0
local now = now_s()
for i = 2, #KEYS do
  local hex = ARGV[i + 2]
  if ARGV[1] == '1' or redis.call('EXISTS', ARGV[3] .. hex) == 0 then
    if ARGV[2] == '' then
      if live(KEYS[i], now) then n = n + 1 end
      redis.call('DEL', KEYS[i])
      redis.call('ZREM', KEYS[1], hex)
    else
      local v = redis.call('HGET', KEYS[i], ARGV[2])
      if v then
        if live_value(v, now) then n = n + 1 end
        redis.call('HDEL', KEYS[i], ARGV[2])
        reset_expiry(KEYS[i])
      end
      if redis.call('EXISTS', KEYS[i]) == 0 then redis.call('ZREM', KEYS[1], hex) end
    end
  end
end
return n
"""

# a key's leases are a set of lease ids (expiring with the longest): releasing one twice is a no-op
_LEASE = """
local t = redis.call('TIME')
for i = 1, #KEYS do
  redis.call('SADD', KEYS[i], ARGV[2])
  if redis.call('PTTL', KEYS[i]) < tonumber(ARGV[1]) then redis.call('PEXPIRE', KEYS[i], ARGV[1]) end
end
return {#KEYS, t[1], t[2]}
"""

_RELEASE = """
for i = 1, #KEYS do
  redis.call('SREM', KEYS[i], ARGV[1])
  if redis.call('SCARD', KEYS[i]) == 0 then redis.call('DEL', KEYS[i]) end
end
return #KEYS
"""

_CLEAR_HOLDER = _HOLDERS + """
local n = 0
local now = now_s()
local cursor = '0'
local base = string.sub(KEYS[1], 1, -4)
repeat
  local r = redis.call('ZSCAN', KEYS[1], cursor, 'COUNT', 512)
  cursor = r[1]
  local items = r[2]
  for i = 1, #items, 2 do
    local b = base .. 'b:' .. items[i]
    local v = redis.call('HGET', b, ARGV[1])
    if v then
      if live_value(v, now) then n = n + 1 end
      redis.call('HDEL', b, ARGV[1])
      reset_expiry(b)
    end
    if redis.call('EXISTS', b) == 0 then redis.call('ZREM', KEYS[1], items[i]) end
  end
until cursor == '0'
return n
"""


def tenant_acl_rules(tenant: str, prefix: str = "kvp") -> list[str]:
    """The Redis ACL rules (after ``ACL SETUSER <user> reset on ><password>``) that confine a connection to one
    tenant's keys and to the commands the directory uses: reading and writing ``{prefix:tenant}:*``, running the
    scripts already loaded (``EVALSHA``; the operator loads kvpolicy's with :meth:`RedisDirectory.load_scripts`),
    ``TIME`` (the expiry clock) and ``PING``. Nothing in ``@scripting`` besides ``EVALSHA``: no ``SCRIPT LOAD`` (a
    tenant's own ``while true do end`` blocked every tenant), no ``EVAL``, no ``FUNCTION FLUSH/DELETE/LOAD`` (in
    ``@write``, not ``@dangerous``: they deleted every tenant's libraries), no ``SCRIPT KILL/FLUSH``; no other
    tenant's keys, no ``FLUSHALL``/``KEYS``/``SCAN``/``CONFIG`` or anything else in ``@dangerous``."""
    _check_prefix(prefix)
    return ["resetkeys", f"~{{{prefix}:{check_tenant(tenant)}}}:*", "resetchannels", "-@all", "+@read", "+@write", "-@scripting",
            "+evalsha", "+time", "+ping", "-@dangerous", "-scan", "-randomkey", "-dbsize"]


def _check_prefix(prefix: Any) -> str:
    """A key prefix: no braces (the hash tag) and no glob characters — ``prefix="k*"`` made an ACL key pattern
    ``~{k*:acme}:*`` that also matched ``{kvp:acme}``'s keys."""
    if not isinstance(prefix, str) or not prefix or any(c in prefix for c in "{}*?[]\\"):
        raise ConfigError("prefix", f"must be a non-empty string without braces or glob characters (*?[]\\), got {prefix!r}")
    return prefix


def _redis() -> Any:
    try:
        import redis
    except ImportError:
        raise ConfigError("redis", "the Redis directory needs redis-py: pip install 'kvpolicy[redis]'") from None
    return redis


#: an error reply's code: its first word, or the first after "caused error: " in a pipeline's message
_ERROR_CODE = re.compile(r"(?:^|caused error: )([A-Z][A-Z_]{1,31})\b")


class RedisDirectory:
    def __init__(self, client: Any = None, *, url: str | None = None, prefix: str = "kvp", max_keys_per_tenant: int = 1_000_000,
                 socket_timeout_s: float = 1.0, max_holders_per_key: int = MAX_HOLDERS_PER_KEY) -> None:
        redis = _redis()
        if client is None:
            if not url:
                raise ConfigError("url", "give a redis client or a redis:// URL")
            client = redis.Redis.from_url(url, socket_timeout=socket_timeout_s, socket_connect_timeout=socket_timeout_s)
        _check_prefix(prefix)
        if isinstance(max_keys_per_tenant, bool) or not isinstance(max_keys_per_tenant, int) or max_keys_per_tenant <= 0:
            raise ConfigError("max_keys_per_tenant", f"must be a positive int, got {max_keys_per_tenant!r}")
        self.r = client
        self.prefix = prefix
        self.max_keys_per_tenant = max_keys_per_tenant
        self.max_holders_per_key = check_max_holders(max_holders_per_key)
        #: publishes refused because their key already had max_holders_per_key live holders
        self.holders_refused = 0
        # every Redis failure — an outage, a timeout, a full server (maxmemory with noeviction), a failover that left a
        # read-only replica (READONLY), a script holding the server (BUSY), any other error reply — is answered as a
        # miss and counted by kind (error_kinds), never raised: the caller (an engine, the ingest-events sidecar) goes on
        self._errors_types = (redis.exceptions.RedisError,)
        # a connection confined by ACL to one tenant that names another: refused by Redis, answered as a miss, counted
        self._denied_types = (redis.exceptions.NoPermissionError,)
        self._match = client.register_script(_MATCH)
        self._publish = client.register_script(_PUBLISH)
        self._evict = client.register_script(_EVICT)
        self._lease = client.register_script(_LEASE)
        self._release = client.register_script(_RELEASE)
        self._clear = client.register_script(_CLEAR_HOLDER)
        self._scripts = (self._match, self._publish, self._evict, self._lease, self._release, self._clear)
        self.errors = 0
        #: the failures in ``errors`` by kind: the exception's class (``ConnectionError``, ``ReadOnlyError``, ...), or the
        #: reply's code for a generic error reply (``BUSY``, ``ERR``, ...)
        self.error_kinds: dict[str, int] = {}
        #: calls Redis refused for lack of permission (an ACL confining this connection to another tenant); also in ``errors``
        self.denied = 0
        self.evicted_by_capacity = 0

    # ------------------------------------------------------------------ names

    def _base(self, tenant: str) -> str:
        return f"{{{self.prefix}:{check_tenant(tenant)}}}:"

    def _call(self, fn: Any, default: Any) -> Any:
        try:
            return fn()
        except self._denied_types as e:
            self.denied += 1
            self._count(e)
            return default
        except self._errors_types as e:
            self._count(e)
            return default

    def _count(self, e: Exception) -> None:
        self.errors += 1
        kind = type(e).__name__
        if kind == "ResponseError":  # a generic error reply: its code says which ("BUSY Redis is busy running a script"; in a
            # pipeline "Command # 1 (...) of pipeline caused error: BUSY ...")
            m = _ERROR_CODE.search(str(e))
            kind = m.group(1) if m else kind
        self.error_kinds[kind] = self.error_kinds.get(kind, 0) + 1

    # ------------------------------------------------------------------ API

    def publish(self, tenant: str, entries: Sequence[Entry]) -> int:
        base = self._base(tenant)
        entries = check_entries(entries)  # None was "nothing to publish" here and a TypeError in memory
        if not entries:
            return 0
        written = 0
        for lo in range(0, len(entries), MAX_KEYS_PER_CALL):  # one script call never holds the server for long
            keys = [base + "lru", base + "clock"]
            args: list[Any] = [self.max_keys_per_tenant, base + "lease:", self.max_holders_per_key]
            for e in entries[lo:lo + MAX_KEYS_PER_CALL]:
                h = e.key.hex()
                keys.append(base + "b:" + h)
                exp = "" if e.expires_at_s is None else str(int(e.expires_at_s * 1000))
                args += [h, e.holder, e.pack(), exp]
            res = self._call(lambda: self._publish(keys=keys, args=args), None)
            if res is None:  # counted in errors; what earlier calls wrote stays written, and is reported
                continue
            written += int(res[0])
            self.evicted_by_capacity += int(res[1])
            self.holders_refused += int(res[2])
        return written

    def match_prefix(self, tenant: str, keys: Sequence[bytes]) -> int:
        ks = check_keys(keys)
        base = self._base(tenant)
        if not ks:
            return 0
        n = 0
        for lo in range(0, len(ks), MAX_KEYS_PER_CALL):  # the leading run, a bounded call at a time
            hexes = [k.hex() for k in ks[lo:lo + MAX_KEYS_PER_CALL]]
            names = [base + "lru", base + "clock"] + [base + "b:" + h for h in hexes]
            got = int(self._call(lambda: self._match(keys=names, args=hexes), 0))
            n += got
            if got < len(hexes):
                break
        return n

    def match_prefix_per_key(self, tenant: str, keys: Sequence[bytes]) -> int:
        """The naive way — one EXISTS round trip per key (for the benchmark's baseline)."""
        base = self._base(tenant)
        n = 0
        for k in check_keys(keys):
            if not self._call(lambda k=k: self.r.exists(base + "b:" + k.hex()), 0):
                break
            n += 1
        return n

    def lookup(self, tenant: str, keys: Sequence[bytes]) -> list[list[Entry]]:
        ks = check_keys(keys)
        base = self._base(tenant)

        def go() -> list[Any]:
            pipe = self.r.pipeline(transaction=False)
            for k in ks:
                pipe.hgetall(base + "b:" + k.hex())
            pipe.time()  # the server's clock, as the match script's: a client's own clock hours off would disagree with match
            return pipe.execute()

        raw = self._call(go, None)
        if raw is None:
            return [[] for _ in ks]
        out = []
        sec, usec = raw[-1]
        now = float(sec) + float(usec) / 1e6
        for k, h in zip(ks, raw[:-1]):
            entries = (Entry.unpack(k, holder.decode(), v) for holder, v in h.items())
            out.append(sorted((e for e in entries if e.expires_at_s is None or e.expires_at_s > now), key=lambda e: e.holder))
        return out

    def evict(self, tenant: str, keys: Sequence[bytes], holder: str | None = None, force: bool = False) -> int:
        ks = check_keys(keys)
        if holder is not None:
            check_holder(holder)  # an int matched no entry and evicted nothing, without a word
        base = self._base(tenant)
        if not ks:
            return 0
        n = 0
        for lo in range(0, len(ks), MAX_KEYS_PER_CALL):
            hexes = [k.hex() for k in ks[lo:lo + MAX_KEYS_PER_CALL]]
            names = [base + "lru"] + [base + "b:" + h for h in hexes]
            args = ["1" if force else "0", holder or "", base + "lease:"] + hexes
            n += int(self._call(lambda: self._evict(keys=names, args=args), 0))
        return n

    def clear_holder(self, tenant: str, holder: str) -> int:
        check_holder(holder)
        base = self._base(tenant)
        return int(self._call(lambda: self._clear(keys=[base + "lru"], args=[holder]), 0))

    def lease(self, tenant: str, keys: Sequence[bytes], ttl_s: float) -> Lease:
        ks = check_keys(keys)
        base = self._base(tenant)
        ttl_s = check_ttl(ttl_s)
        names = [base + "lease:" + k.hex() for k in ks]
        lease_id = f"redis-{uuid.uuid4().hex}"
        now = None
        for lo in range(0, len(names), MAX_KEYS_PER_CALL):
            part = names[lo:lo + MAX_KEYS_PER_CALL]
            got = self._call(lambda: self._lease(keys=part, args=[int(ttl_s * 1000), lease_id]), None)
            if now is None and isinstance(got, list) and len(got) == 3:
                now = float(got[1]) + float(got[2]) / 1e6  # the server's clock, which expires the lease
        if now is None:  # no keys, or Redis did not answer (counted): the client's clock is all there is
            now = self._server_now()
        return Lease(lease_id, tenant, tuple(ks), now + ttl_s)

    def load_scripts(self) -> list[str]:
        """Load kvpolicy's scripts into the server's script cache (``SCRIPT LOAD``) and return their SHA1s. Run it from
        the operator's connection: tenants confined by :func:`tenant_acl_rules` may only ``EVALSHA`` scripts already
        loaded, so run it again after a Redis restart or ``SCRIPT FLUSH`` (until then tenants' calls are misses,
        counted in ``errors``). Raises the Redis error: loading is the operator's step, not a serving path."""
        return [str(self.r.script_load(sc.script)) for sc in self._scripts]

    def _server_now(self) -> float:
        """The server's TIME in seconds; the client's clock when Redis does not answer."""
        t = self._call(lambda: self.r.time(), None)
        return float(t[0]) + float(t[1]) / 1e6 if t else time.time()

    def release(self, lease: Lease) -> None:
        base = self._base(check_lease(lease).tenant)
        names = [base + "lease:" + k.hex() for k in lease.keys]
        for lo in range(0, len(names), MAX_KEYS_PER_CALL):
            part = names[lo:lo + MAX_KEYS_PER_CALL]
            self._call(lambda: self._release(keys=part, args=[lease.lease_id]), 0)

    def leased(self, tenant: str, key: bytes) -> bool:
        return bool(self._call(lambda: self.r.exists(self._base(tenant) + "lease:" + key.hex()), 0))

    def keys(self, tenant: str) -> list[bytes]:
        base = self._base(tenant)

        def go() -> list[bytes]:
            out = []
            for h in self.r.zscan_iter(base + "lru", count=1024):
                hexkey = h[0].decode()
                if self.r.exists(base + "b:" + hexkey):
                    out.append(bytes.fromhex(hexkey))
            return sorted(out)

        return self._call(go, [])

    def count(self, tenant: str) -> int:
        return len(self.keys(tenant))

    def index(self, tenant: str) -> TenantIndex:
        return TenantIndex(self, tenant)

    def ping(self) -> bool:
        return bool(self._call(lambda: self.r.ping(), False))
