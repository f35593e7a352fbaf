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

**Redis Cluster: the spread layout** (``key_groups`` = G > 1, issue #48). Above, a tenant is one slot: on a cluster
it lives on one shard however large it grows. With G groups a key goes to group ``blake2b(key) mod G``, and group g's
keys carry the hash tag ``{T_g}`` — G tags chosen once so that tag g hashes into the g-th G-th of the 16,384 slots, so
the groups (and every tenant's keys, evenly) follow the cluster's own slot split::

    {T_g}:p:t:b:<key hex>   {T_g}:p:t:lru   {T_g}:p:t:clock   {T_g}:p:t:lease:<key hex>

Each group keeps its own LRU and clock and bounds itself to ``ceil(max_keys_per_tenant / G)`` keys. A match sends one
script per node — every group of the match that node holds, in one call (Redis 7's ``allow-cross-slot-keys``: keys of
several slots, all local) —, the nodes in parallel: one round trip, and as many script calls as nodes the chain's keys
fall on, not as groups (a server without script flags is asked one script per group instead). Why not a
tag per chain root: on the Mooncake conversation trace all 12,031 requests share their first block (a system
prompt), so a root tag would put the whole tenant in one slot again; a key's own hash spreads any trace. The price:
a match touches (in its group's LRU) every live key it asked about, also those past the first miss; the bound is
per group, not exact per tenant.

Failure handling: every call catches connection errors and timeouts — a match
answers 0 (a miss), a publish answers 0 (nothing published), an evict 0 — and
counts them in :attr:`RedisDirectory.errors`; redis-py reconnects on the next
call and reloads the scripts after a server restart. Nothing stale can be served
from the client side: it keeps no cache. import 
"""

from __future__ import annotations

import hashlib
import re
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

from ..errors import ConfigError
from .base import (
    MAX_HOLDERS_PER_KEY,
    MAX_KEYS_PER_CALL,
    Entry,
    Lease,
    MalformedEntry,
    TenantIndex,
    check_entries,
    check_holder,
    check_keys,
    check_lease,
    check_max_holders,
    check_tenant,
    check_ttl,
)
from .redis_scripts import _CLEAR_HOLDER, _EVICT, _LEASE, _MATCH, _MATCH_EACH, _MATCH_NODE, _PUBLISH, _RELEASE


def tenant_acl_rules(tenant: str, prefix: str = "kvp", *, spread: bool = False, cluster: bool = False) -> list[str]:
    """The Redis ACL rules (after ``ACL SETUSER <user> reset on ><password>``) that confine a connection to one
    tenant's keys and to the commands the directory uses: reading and writing ``{prefix:tenant}:*``, running the
    scripts already loaded (``EVALSHA``; the operator loads kvpolicy's with :meth:`RedisDirectory.load_scripts`),
    ``TIME`` (the expiry clock) and ``PING``. ``spread``: for a directory with ``key_groups`` > 1 (its keys'
    tenant follows the hash tag). ``cluster``: also the read-only ``CLUSTER SLOTS/SHARDS/NODES`` and ``COMMAND`` a cluster client learns
    the slot map from (set the user on every node, replicas included: a promoted replica serves the tenant next). Nothing in ``@scripting`` besides ``EVALSHA``: no ``SCRIPT LOAD`` (a
    tenant's own ``while true do end`` blocked every tenant), no ``EVAL``, no ``FUNCTION FLUSH/DELETE/LOAD`` (in
    ``@write``, not ``@dangerous``: they deleted every tenant's libraries), no ``SCRIPT KILL/FLUSH``; no other
    tenant's keys, no ``FLUSHALL``/``KEYS``/``SCAN``/``CONFIG`` or anything else in ``@dangerous``."""
    _check_prefix(prefix)
    # the spread layout (key_groups > 1): the tenant's keys are {tag}:prefix:tenant:..., and a tenant name has no ':'
    keys = f"~{{*}}:{prefix}:{check_tenant(tenant)}:*" if spread else f"~{{{prefix}:{check_tenant(tenant)}}}:*"
    # the client learns the slot map, and (COMMAND) where each command keeps its keys
    topology = ["+cluster|slots", "+cluster|shards", "+cluster|nodes", "+command"] if cluster else []
    return ["resetkeys", keys, "resetchannels", "-@all", "+@read", "+@write", "-@scripting",
            "+evalsha", "+time", "+ping", "-@dangerous", "-scan", "-randomkey", "-dbsize", *topology]


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


#: the most groups the spread layout takes (finding G balanced tags costs ~G² CRC16s: 1,024 is ~0.3 s, once per directory)
MAX_KEY_GROUPS = 1024


_SLOTS = 16384


def balanced_tags(groups: int) -> list[str]:
    """``groups`` hash tags, the g-th hashing (Redis Cluster CRC16) into the g-th ``groups``-th of the slots: the groups
    spread over a cluster's shards as its slots do, whatever their number."""
    from redis.crc import key_slot

    tags = []
    for g in range(groups):
        lo, hi = g * _SLOTS // groups, (g + 1) * _SLOTS // groups
        n = 0
        while not lo <= key_slot(f"{g}.{n}".encode()) < hi:
            n += 1
        tags.append(f"{g}.{n}")
    return tags


class RedisDirectory:
    def __init__(self, client: Any = None, *, url: str | None = None, prefix: str = "kvp", max_keys_per_tenant: int = 1_000_000,
                 socket_timeout_s: float = 1.0, max_holders_per_key: int = MAX_HOLDERS_PER_KEY, cluster: bool = False,
                 key_groups: int = 1) -> None:
        redis = _redis()
        if isinstance(key_groups, bool) or not isinstance(key_groups, int) or not 1 <= key_groups <= MAX_KEY_GROUPS:
            raise ConfigError("key_groups", f"must be an int in [1, {MAX_KEY_GROUPS}] (1: a tenant in one slot), got {key_groups!r}")
        if client is None:
            if not url:
                raise ConfigError("url", "give a redis client or a redis:// URL")
            if cluster:  # any node's address: the client learns the others (and follows failovers) from the cluster itself
                client = redis.cluster.RedisCluster.from_url(url, socket_timeout=socket_timeout_s, socket_connect_timeout=socket_timeout_s)
            else:
                client = redis.Redis.from_url(url, socket_timeout=socket_timeout_s, socket_connect_timeout=socket_timeout_s)
        _check_prefix(prefix)
        #: groups of the spread layout (1: the tenant-in-one-slot layout)
        self.key_groups = key_groups
        self._tags = balanced_tags(key_groups) if key_groups > 1 else []
        self._is_cluster = isinstance(client, redis.cluster.RedisCluster)
        self._threads: Any = None  # the nodes' pipelines run in parallel on these (made on first need)
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
        self._match_each = client.register_script(_MATCH_EACH)
        self._publish = client.register_script(_PUBLISH)
        self._evict = client.register_script(_EVICT)
        self._lease = client.register_script(_LEASE)
        self._release = client.register_script(_RELEASE)
        self._clear = client.register_script(_CLEAR_HOLDER)
        self._match_node = client.register_script(_MATCH_NODE)
        self._scripts = (self._match, self._publish, self._evict, self._lease, self._release, self._clear, self._match_each,
                         self._match_node)
        #: the spread layout's match sends one script per node (all its groups: Redis >= 7.0's allow-cross-slot-keys);
        #: False after a server refused that script (an older Redis): one script per group from then on
        self.node_scripts = True
        self.errors = 0
        #: the failures in ``errors`` by kind: the exception's class (``ConnectionError``, ``ReadOnlyError``, ...), or the
        #: reply's code for a generic error reply (``BUSY``, ``ERR``, ...)
        self.error_kinds: dict[str, int] = {}
        #: calls Redis refused for lack of permission (an ACL confining this connection to another tenant); also in ``errors``
        self.denied = 0
        self.evicted_by_capacity = 0
        #: stored values that were not entries (written past kvpolicy's scripts), read as misses
        self.malformed = 0

    # ------------------------------------------------------------------ names

    def _base(self, tenant: str) -> str:
        return f"{{{self.prefix}:{check_tenant(tenant)}}}:"

    # ------------------------------------------------------------------ the spread layout (key_groups > 1)

    def _group(self, key: bytes) -> int:
        return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big") % self.key_groups

    def _gbase(self, tenant: str, g: int) -> str:
        return f"{{{self._tags[g]}}}:{self.prefix}:{tenant}:"

    def _group_calls(self, tenant: str, keys: Sequence[bytes]) -> Iterator[tuple[str, list[int]]]:
        """Per script call: the group's key prefix and the positions of ``keys`` it takes (in their order, at most
        MAX_KEYS_PER_CALL of a group per call)."""
        by: dict[int, list[int]] = {}
        for i, k in enumerate(keys):
            by.setdefault(self._group(k), []).append(i)
        for g, idx in by.items():
            base = self._gbase(tenant, g)
            for lo in range(0, len(idx), MAX_KEYS_PER_CALL):
                yield base, idx[lo:lo + MAX_KEYS_PER_CALL]

    @property
    def group_max_keys(self) -> int:
        """The spread layout's bound per group: ceil(max_keys_per_tenant / key_groups)."""
        return -(-self.max_keys_per_tenant // self.key_groups)

    def _batch(self, cmds: list[tuple[str, str, tuple[Any, ...]]]) -> list[Any]:
        """Run (routing key, command, args) in one pipeline per node, the nodes in parallel; the replies in order, an
        exception in place of each command that failed (counted in ``errors``). A node that has lost kvpolicy's scripts
        (a restart, a promoted replica) gets them again and its commands are retried once; a connection error or a
        MOVED reply (a failover, a reshard) makes the client re-learn the cluster's map for the next call."""
        if not cmds:
            return []
        nodes: dict[Any, list[int]] = {}
        conns: dict[Any, Any] = {}
        if self._is_cluster:
            for i, (route, _, _) in enumerate(cmds):
                try:
                    node = self.r.get_node_from_key(route)
                except self._errors_types as e:  # no node owns the slot right now (a failover in progress)
                    nodes.setdefault(("error", e), []).append(i)
                    continue
                nodes.setdefault(node.name, []).append(i)
                conns[node.name] = self.r.get_redis_connection(node)
        else:
            nodes[None] = list(range(len(cmds)))
            conns[None] = self.r
        out: list[Any] = [None] * len(cmds)

        def run(name: Any) -> list[Any]:
            idx = nodes[name]
            if isinstance(name, tuple):
                return [name[1]] * len(idx)
            conn = conns[name]
            for attempt in range(2):
                try:
                    pipe = conn.pipeline(transaction=False)
                    for i in idx:
                        _, cmd, args = cmds[i]
                        getattr(pipe, cmd)(*args)
                    got = pipe.execute(raise_on_error=False)
                except self._errors_types as e:
                    return [e] * len(idx)
                if attempt == 0 and any(type(r).__name__ == "NoScriptError" for r in got):
                    try:
                        for sc in self._scripts:
                            conn.script_load(sc.script)
                    except self._errors_types as e:
                        return [e] * len(idx)
                    continue
                break
            return list(got)

        if len(nodes) == 1:
            results = {name: run(name) for name in nodes}
        else:
            if self._threads is None:
                from concurrent.futures import ThreadPoolExecutor

                self._threads = ThreadPoolExecutor(max_workers=16, thread_name_prefix="kvpolicy-redis")
            futs = {name: self._threads.submit(run, name) for name in nodes}
            results = {name: f.result() for name, f in futs.items()}
        stale = False
        for name, idx in nodes.items():
            for i, r in zip(idx, results[name]):
                if isinstance(r, Exception):
                    self._count(r)
                    if isinstance(r, self._denied_types):
                        self.denied += 1
                    else:
                        stale = True
                out[i] = r
        if stale and self._is_cluster:
            try:
                self.r.nodes_manager.initialize()
            except Exception:  # noqa: BLE001 - the cluster is still moving: the next call tries again
                pass
        return out

    def _eval(self, script: Any, keys: list[str], args: list[Any]) -> tuple[str, str, tuple[Any, ...]]:
        return (keys[0], "evalsha", (script.sha, len(keys), *keys, *args))

    def _spread_publish(self, tenant: str, entries: Sequence[Entry]) -> int:
        cmds = []
        for base, part in self._group_calls(tenant, [e.key for e in entries]):
            keys = [base + "lru", base + "clock"]
            args: list[Any] = [self.group_max_keys, base + "lease:", self.max_holders_per_key]
            for i in part:
                e = entries[i]
                h = e.key.hex()
                keys.append(base + "b:" + h)
                args += [h, e.holder, e.pack(), "" if e.expires_at_s is None else str(int(e.expires_at_s * 1000))]
            cmds.append(self._eval(self._publish, keys, args))
        written = 0
        for res in self._batch(cmds):
            if isinstance(res, Exception):
                continue
            written += int(res[0])
            self.evicted_by_capacity += int(res[1])
            self.holders_refused += int(res[2])
        return written

    def _node_of(self, route: str) -> Any:
        """The node that serves ``route``'s slot (None on one server, or while no node owns it)."""
        if not self._is_cluster:
            return None
        try:
            return self.r.get_node_from_key(route).name
        except self._errors_types:
            return None

    def _spread_live(self, tenant: str, ks: list[bytes]) -> list[bool]:
        """Per key: live (some holder unexpired) — every node asked once, in one round trip (its groups in one script);
        a failed call's keys are not."""
        if self.node_scripts:
            by_node: dict[Any, list[tuple[str, list[int]]]] = {}
            for base, part in self._group_calls(tenant, ks):
                by_node.setdefault(self._node_of(base + "lru"), []).append((base, part))
            cmds, where = [], []
            for calls in by_node.values():
                start = 0
                while start < len(calls):  # at most MAX_KEYS_PER_CALL keys a call (a group's part is within it)
                    end, size = start, 0
                    while end < len(calls) and (end == start or size + len(calls[end][1]) <= MAX_KEYS_PER_CALL):
                        size += len(calls[end][1])
                        end += 1
                    names: list[str] = []
                    counts: list[int] = []
                    positions: list[int] = []
                    for base, part in calls[start:end]:
                        names += [base + "lru", base + "clock"]
                        for i in part:
                            h = ks[i].hex()
                            names += [base + "b:" + h, h]
                        counts.append(len(part))
                        positions += part
                    cmds.append(self._eval(self._match_node, [calls[start][0] + "lru"], [len(counts), *counts, *names]))
                    where.append(positions)
                    start = end
            results = self._batch(cmds)
            if not any(isinstance(r, Exception) and "shebang" in str(r).lower() for r in results):
                return self._live_flags(len(ks), where, results)
            self.node_scripts = False  # a server without script flags (Redis < 7.0): a script per group from now on
        cmds, where = [], []
        for base, part in self._group_calls(tenant, ks):
            hexes = [ks[i].hex() for i in part]
            cmds.append(self._eval(self._match_each, [base + "lru", base + "clock"] + [base + "b:" + h for h in hexes], hexes))
            where.append(part)
        return self._live_flags(len(ks), where, self._batch(cmds))

    @staticmethod
    def _live_flags(n: int, where: list[list[int]], results: list[Any]) -> list[bool]:
        """Per key of n: live, from each call's 1/0 replies for the key positions it asked about (a failed call's keys
        are not)."""
        live = [False] * n
        for part, res in zip(where, results):
            if isinstance(res, Exception):
                continue
            for i, flag in zip(part, res):
                live[i] = int(flag) == 1
        return live

    def _name(self, tenant: str, key: bytes, kind: str) -> str:
        """The Redis name of ``key``'s entry (``kind`` "b:") or lease ("lease:"), in either layout."""
        base = self._gbase(check_tenant(tenant), self._group(key)) if self.key_groups > 1 else self._base(tenant)
        return base + kind + key.hex()

    def _batched_lookup(self, tenant: str, ks: list[bytes]) -> list[list[Entry]]:
        names = [self._name(tenant, k, "b:") for k in ks]
        # each key's holders, and the TIME of the node that holds its slot (expiry is judged on the server's clock, as
        # match does): one TIME per hash tag (a group, or the tenant), routed with the first of its keys
        tags = {n[:n.index("}") + 1]: n for n in reversed(names)}
        cmds: list[tuple[str, str, tuple[Any, ...]]] = [(n, "hgetall", (n,)) for n in names]
        cmds += [(n, "time", ()) for n in tags.values()]
        raw = self._batch(cmds)
        times = dict(zip(tags, raw[len(names):]))
        out: list[list[Entry]] = []
        for j, k in enumerate(ks):
            h, t = raw[j], times[names[j][:names[j].index("}") + 1]]
            if isinstance(h, Exception) or isinstance(t, Exception):
                out.append([])
                continue
            out.append(self._live_entries(k, h, float(t[0]) + float(t[1]) / 1e6))
        return out

    def _live_entries(self, key: bytes, holders: dict[bytes, bytes], now: float) -> list[Entry]:
        """A key's live entries by holder, from its hash. A value that is not an entry (a tenant's own ACL user can
        write any bytes there: a non-UTF-8 holder, a value of one field) is a miss for that holder, counted in
        :attr:`malformed` — never an exception out of a read."""
        out = []
        for holder, v in holders.items():
            try:
                e = Entry.unpack(key, holder, v)
            except MalformedEntry:
                self.malformed += 1
                continue
            if e.expires_at_s is None or e.expires_at_s > now:
                out.append(e)
        out.sort(key=lambda e: e.holder)
        return out

    def _spread_match(self, tenant: str, ks: list[bytes]) -> int:
        live = self._spread_live(tenant, ks)
        return live.index(False) if False in live else len(live)

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
        if self.key_groups > 1:
            return self._spread_publish(check_tenant(tenant), entries)
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
        if self.key_groups > 1:
            return self._spread_match(tenant, list(ks))
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
        n = 0
        for k in check_keys(keys):
            if not self._call(lambda k=k: self.r.exists(self._name(tenant, k, "b:")), 0):
                break
            n += 1
        return n

    def lookup(self, tenant: str, keys: Sequence[bytes]) -> list[list[Entry]]:
        ks = check_keys(keys)
        base = self._base(tenant)
        if self.key_groups > 1 or self._is_cluster:  # a cluster pipelines per node (redis-py blocks TIME in its own pipelines)
            return self._batched_lookup(tenant, list(ks))

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
            out.append(self._live_entries(k, h, now))
        return out

    def evict(self, tenant: str, keys: Sequence[bytes], holder: str | None = None, force: bool = False) -> int:
        ks = check_keys(keys)
        if holder is not None:
            check_holder(holder)  # an int matched no entry and evicted nothing, without a word
        base = self._base(tenant)
        if not ks:
            return 0
        if self.key_groups > 1:
            cmds = []
            for gb, part in self._group_calls(tenant, ks):
                hexes = [ks[i].hex() for i in part]
                cmds.append(self._eval(self._evict, [gb + "lru"] + [gb + "b:" + h for h in hexes],
                                       ["1" if force else "0", holder or "", gb + "lease:"] + hexes))
            return sum(int(r) for r in self._batch(cmds) if not isinstance(r, Exception))
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
        # a page of at most MAX_KEYS_PER_CALL keys a call, each LRU walked by score until its last page (every group's
        # next page in one round trip); a failed call ends that LRU's walk (counted in errors)
        lrus = {self._gbase(tenant, g) + "lru": "" for g in range(self.key_groups)} if self.key_groups > 1 else {base + "lru": ""}
        n = 0
        while lrus:
            names = list(lrus)
            if self.key_groups > 1:
                got = self._batch([self._eval(self._clear, [lru], [holder, lrus[lru]]) for lru in names])
            else:
                got = [self._call(lambda: self._clear(keys=names, args=[holder, lrus[names[0]]]), None)]
            for lru, r in zip(names, got):
                if not isinstance(r, list) or len(r) != 2:
                    del lrus[lru]
                    continue
                n += int(r[0])
                cursor = r[1].decode() if isinstance(r[1], bytes) else str(r[1])
                if cursor:
                    lrus[lru] = cursor
                else:
                    del lrus[lru]
        return n

    def lease(self, tenant: str, keys: Sequence[bytes], ttl_s: float) -> Lease:
        ks = check_keys(keys)
        base = self._base(tenant)
        ttl_s = check_ttl(ttl_s)
        names = [base + "lease:" + k.hex() for k in ks]
        lease_id = f"redis-{uuid.uuid4().hex}"
        now = None
        if self.key_groups > 1:
            cmds = [self._eval(self._lease, [gb + "lease:" + ks[i].hex() for i in part], [int(ttl_s * 1000), lease_id])
                    for gb, part in self._group_calls(tenant, ks)]
            for got in self._batch(cmds):
                if now is None and isinstance(got, list) and len(got) == 3:
                    now = float(got[1]) + float(got[2]) / 1e6
            if now is None:
                now = self._server_now()
            return Lease(lease_id, tenant, tuple(ks), now + ttl_s)
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
        if self._is_cluster:  # every node, replicas included: a promoted replica must already have them (tenants cannot load)
            # from CLUSTER NODES: CLUSTER SLOTS (the client's map) leaves out replicas that have not replicated a byte yet
            redis = _redis()
            kw = dict(self.r.nodes_manager.connection_kwargs)
            shas: list[str] = []
            for addr, info in self.r.cluster_nodes().items():
                if "fail" in str(info.get("flags", "")):
                    continue
                host, port = addr.rsplit(":", 1)
                conn = redis.Redis(**{**kw, "host": host, "port": int(port.split("@")[0])})
                try:
                    shas = [str(conn.script_load(sc.script)) for sc in self._scripts]
                finally:
                    conn.close()
            return shas
        return [str(self.r.script_load(sc.script)) for sc in self._scripts]

    def _server_now(self) -> float:
        """The server's TIME in seconds; the client's clock when Redis does not answer."""
        t = self._call(lambda: self.r.time(), None)
        return float(t[0]) + float(t[1]) / 1e6 if t else time.time()

    def release(self, lease: Lease) -> None:
        base = self._base(check_lease(lease).tenant)
        if self.key_groups > 1:
            self._batch([self._eval(self._release, [gb + "lease:" + lease.keys[i].hex() for i in part], [lease.lease_id])
                         for gb, part in self._group_calls(lease.tenant, lease.keys)])
            return
        names = [base + "lease:" + k.hex() for k in lease.keys]
        for lo in range(0, len(names), MAX_KEYS_PER_CALL):
            part = names[lo:lo + MAX_KEYS_PER_CALL]
            self._call(lambda: self._release(keys=part, args=[lease.lease_id]), 0)

    def leased(self, tenant: str, key: bytes) -> bool:
        return bool(self._call(lambda: self.r.exists(self._name(tenant, key, "lease:")), 0))

    def keys(self, tenant: str) -> list[bytes]:
        base = self._base(tenant)
        if self.key_groups > 1:
            lrus = self._batch([(self._gbase(tenant, g) + "lru", "zrange", (self._gbase(tenant, g) + "lru", 0, -1))
                                for g in range(self.key_groups)])
            cand = [bytes.fromhex(h.decode()) for r in lrus if not isinstance(r, Exception) for h in r]
            there = self._batch([(self._name(tenant, k, "b:"), "exists", (self._name(tenant, k, "b:"),)) for k in cand])
            return sorted(k for k, e in zip(cand, there) if not isinstance(e, Exception) and int(e))

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
