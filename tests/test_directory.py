import multiprocessing as mp
import random
import time
import uuid

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpolicy.clock import ManualClock
from kvpolicy.directory import Entry, InMemoryDirectory
from kvpolicy.errors import ConfigError
from kvpolicy.matching import match

KEYS = [bytes([(7 * i + 5) % 12]) * 16 for i in range(12)]  # chain order is not byte order


def redis_dir(url, **kw):
    from kvpolicy.directory import RedisDirectory

    return RedisDirectory(url=url, prefix=f"t{uuid.uuid4().hex[:10]}", **kw)


@pytest.fixture(params=["memory", "redis"])
def directory_factory(request):
    if request.param == "memory":
        return lambda **kw: InMemoryDirectory(**kw)
    url = request.getfixturevalue("redis_url")
    return lambda **kw: redis_dir(url, **kw)


@pytest.fixture(params=["memory", "redis"])
def directory(request):
    if request.param == "memory":
        return InMemoryDirectory(max_keys_per_tenant=64)
    return redis_dir(request.getfixturevalue("redis_url"), max_keys_per_tenant=64)


def test_publish_match_lookup_evict(directory):
    d = directory
    assert d.publish("acme", [Entry(k, "node-1", 1024, "cpu", b"\x01" * 16) for k in KEYS[:5]]) == 5
    assert d.publish("acme", [Entry(KEYS[0], "node-2", 1024)]) == 1
    assert d.match_prefix("acme", KEYS) == 5
    assert d.match_prefix("acme", KEYS[1:]) == 4
    assert d.match_prefix("acme", [KEYS[7]] + KEYS[:3]) == 0, "prefix semantics: stop at the first missing key"
    got = d.lookup("acme", KEYS[:2] + [KEYS[9]])
    assert [e.holder for e in got[0]] == ["node-1", "node-2"]
    assert got[1] == [Entry(KEYS[1], "node-1", 1024, "cpu", b"\x01" * 16)]
    assert got[2] == []
    assert d.evict("acme", [KEYS[0]], holder="node-1") == 1
    assert d.match_prefix("acme", KEYS) == 5, "node-2 still holds block 0"
    assert d.evict("acme", [KEYS[2]]) == 1
    assert d.match_prefix("acme", KEYS) == 2
    assert d.clear_holder("acme", "node-1") == 3  # blocks 1, 3, 4
    assert d.keys("acme") == [KEYS[0]]
    # the matcher takes a tenant's view as a BlockIndex
    assert match(KEYS[:3], 3 * 16 + 1, None, d.index("acme"), block_size_tokens=16).remote_total_blocks == 1


def test_tenants_can_neither_list_nor_match_each_other(directory):
    d = directory
    d.publish("tenant-a", [Entry(k, "n", 1) for k in KEYS[:4]])
    assert d.match_prefix("tenant-b", KEYS[:4]) == 0
    assert d.lookup("tenant-b", KEYS[:4]) == [[], [], [], []]
    assert d.keys("tenant-b") == []
    assert d.evict("tenant-b", KEYS[:4], force=True) == 0
    assert d.match_prefix("tenant-a", KEYS[:4]) == 4
    for bad in ("", "a:b", "a b", "x" * 200, None, "tenant-a\n", "x" * 128 + "\n"):  # regex $ matched before a trailing newline
        with pytest.raises(ConfigError) as e:
            d.match_prefix(bad, KEYS[:1])
        assert e.value.field == "tenant"


def test_bounded_memory_never_evicts_leased_keys(directory):
    d = directory
    cap = d.max_keys_per_tenant
    lease = d.lease("t", [KEYS[0]], ttl_s=30)
    d.publish("t", [Entry(KEYS[0], "n", 1)])
    d.publish("t", [Entry(bytes([1, i % 256, i // 256]) * 5, "n", 1) for i in range(cap + 20)])
    assert d.count("t") <= cap
    assert d.evicted_by_capacity >= 20
    assert d.match_prefix("t", [KEYS[0]]) == 1, "a leased block survives the directory's own eviction"
    assert d.evict("t", [KEYS[0]]) == 0, "evict without force respects the lease"
    d.release(lease)
    assert d.evict("t", [KEYS[0]]) == 1


def test_bad_entries_and_keys_name_the_field(directory):
    with pytest.raises(ConfigError) as e:
        Entry(b"", "n")
    assert e.value.field == "key"
    with pytest.raises(ConfigError) as e:
        Entry(KEYS[0], "")
    assert e.value.field == "holder"
    with pytest.raises(ConfigError) as e:
        directory.match_prefix("t", KEYS[0])
    assert e.value.field == "keys"
    with pytest.raises(ConfigError) as e:
        directory.publish("t", [("not", "an", "entry")])
    assert e.value.field == "entries"
    # what is not a sequence at all: Redis took publish(None) for "nothing to publish" and memory raised TypeError
    for call, field in ((lambda: directory.publish("t", None), "entries"), (lambda: directory.match_prefix("t", None), "keys"),
                        (lambda: directory.evict("t", 5), "keys"), (lambda: directory.lease("t", None, 5.0), "keys"),
                        (lambda: directory.release(None), "lease")):
        with pytest.raises(ConfigError) as e:
            call()
        assert e.value.field == field


def test_expiry_memory():
    clock = ManualClock()
    d = InMemoryDirectory(clock=clock)
    d.publish("t", [Entry(KEYS[0], "n", 1, expires_at_s=10.0), Entry(KEYS[1], "n", 1)])
    assert d.match_prefix("t", KEYS[:2]) == 2
    clock.advance(11)
    assert d.match_prefix("t", KEYS[:2]) == 0
    assert d.keys("t") == [KEYS[1]]


def test_expiry_redis(redis_url):
    d = redis_dir(redis_url)
    d.publish("t", [Entry(KEYS[0], "n", 1, expires_at_s=time.time() + 0.15)])
    assert d.match_prefix("t", KEYS[:1]) == 1
    time.sleep(0.3)
    assert d.match_prefix("t", KEYS[:1]) == 0


@pytest.mark.parametrize("groups", [1, 4])
def test_an_expiry_in_the_future_keeps_a_block_live_in_either_layout(redis_url, groups):
    """An entry's expiry holds in both layouts (one LRU per tenant, and ``key_groups`` > 1, whose publish builds its own
    calls): a block that expires in a minute is matched now, one that expired a second ago is not. (The expiry rides
    in the packed value: the scripts' per-entry expire-at argument is only validated, so a mutant that sent it in the
    wrong unit is equivalent — written down as such.)"""
    d = redis_dir(redis_url, key_groups=groups)
    now = time.time()
    d.publish("t", [Entry(KEYS[0], "n", 1, expires_at_s=now + 60.0), Entry(KEYS[1], "n", 1, expires_at_s=now - 1.0)])
    assert d.match_prefix("t", KEYS[:1]) == 1
    assert d.match_prefix("t", KEYS[1:2]) == 0 and d.keys("t") == [KEYS[0]]


def test_a_lease_that_expired_protects_nothing_from_the_capacity_walk():
    """The capacity walk drops the tenant's expired leases before it skips leased keys: a key whose lease ran out is
    evicted as any other, least recently used first (a mutant that expired the leases of another tenant kept it)."""
    clock = ManualClock()
    d = InMemoryDirectory(clock=clock, max_keys_per_tenant=2)
    d.publish("t", [Entry(KEYS[0], "n", 1)])
    d.lease("t", [KEYS[0]], ttl_s=1.0)
    clock.advance(2.0)
    d.publish("t", [Entry(KEYS[1], "n", 1)])
    d.publish("t", [Entry(KEYS[2], "n", 1)])  # one over the bound: the oldest, KEYS[0], goes
    assert sorted(d.keys("t")) == sorted(KEYS[1:3]) and d.evicted_by_capacity == 1


def test_match_prefix_is_one_round_trip(redis_url):
    d = redis_dir(redis_url)
    chain = [bytes([7, i]) * 8 for i in range(64)]
    d.publish("t", [Entry(k, "n", 1) for k in chain])

    def calls():
        stats = d.r.info("commandstats")
        return {k: v["calls"] for k, v in stats.items()}

    before = calls()
    assert d.match_prefix("t", chain) == 64
    after = calls()
    delta = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
    delta.pop("cmdstat_info", None)
    # one client round trip (EVALSHA); what runs inside the script is server-side
    assert delta["cmdstat_evalsha"] == 1
    assert set(delta) <= {"cmdstat_evalsha", "cmdstat_hvals", "cmdstat_time", "cmdstat_zadd", "cmdstat_incrby"}
    assert d.match_prefix_per_key("t", chain) == 64


OPS = st.lists(st.tuples(st.sampled_from(["publish", "match", "evict", "evict_holder", "lease", "release", "clear"]),
                         st.integers(0, 11), st.integers(1, 6), st.sampled_from(["n1", "n2"]), st.booleans()), max_size=40)


@settings(max_examples=25, deadline=None)
@given(ops=OPS)
def test_redis_agrees_with_the_in_memory_reference(redis_url, ops):
    mem = InMemoryDirectory(max_keys_per_tenant=8)
    red = redis_dir(redis_url, max_keys_per_tenant=8)
    leases = []
    for op, start, n, holder, force in ops:
        ks = KEYS[start:start + n]
        if op == "publish":
            ents = [Entry(k, holder, 10) for k in ks]
            assert mem.publish("t", ents) == red.publish("t", ents)
        elif op == "match":
            assert mem.match_prefix("t", ks) == red.match_prefix("t", ks)
        elif op == "evict":
            assert mem.evict("t", ks, force=force) == red.evict("t", ks, force=force)
        elif op == "evict_holder":
            assert mem.evict("t", ks, holder=holder, force=force) == red.evict("t", ks, holder=holder, force=force)
        elif op == "lease":
            leases.append((mem.lease("t", ks, 60), red.lease("t", ks, 60)))
        elif op == "release" and leases:
            a, b = leases.pop(0)
            mem.release(a)
            red.release(b)
        elif op == "clear":
            assert mem.clear_holder("t", holder) == red.clear_holder("t", holder)
        assert mem.keys("t") == red.keys("t")
        assert mem.evicted_by_capacity == red.evicted_by_capacity


def _worker(url: str, prefix: str, wid: int, rounds: int, out: "mp.Queue") -> None:
    from kvpolicy.directory import Entry, RedisDirectory

    d = RedisDirectory(url=url, prefix=prefix)
    rng = random.Random(wid)
    published: set[bytes] = set()
    matched: list[bytes] = []
    for r in range(rounds):
        root = rng.randrange(20)  # shared roots: workers extend the same chains
        chain = [bytes([root, depth, 0, 0]) * 4 for depth in range(rng.randrange(1, 10))]
        if rng.random() < 0.6:
            d.publish("shared", [Entry(k, f"w{wid}", 64) for k in chain])
            published.update(chain)
        n = d.match_prefix("shared", chain)
        matched += chain[:n]
    out.put((wid, sorted(published), sorted(set(matched))))


def test_several_processes_publish_and_match_without_lost_or_phantom_entries(redis_url):
    prefix = f"mp{uuid.uuid4().hex[:8]}"
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(redis_url, prefix, w, 150, q)) for w in range(4)]
    for p in procs:
        p.start()
    results = [q.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    published = set().union(*(set(r[1]) for r in results))
    matched = set().union(*(set(r[2]) for r in results))
    assert matched <= published, "no phantom: nothing matched that nobody published"
    from kvpolicy.directory import RedisDirectory

    d = RedisDirectory(url=redis_url, prefix=prefix)
    assert set(d.keys("shared")) == published, "no lost entry: everything published is there"
    for k in published:
        holders = {e.holder for e in d.lookup("shared", [k])[0]}
        assert holders and all(h.startswith("w") for h in holders)


def test_restart_clients_reconnect_and_report_misses_meanwhile(redis_server):
    from kvpolicy.directory import RedisDirectory

    d = RedisDirectory(url=redis_server.url, socket_timeout_s=0.3)
    d.publish("t", [Entry(k, "n", 1) for k in KEYS[:4]])
    assert d.match_prefix("t", KEYS[:4]) == 4
    redis_server.stop()
    assert d.match_prefix("t", KEYS[:4]) == 0, "the server is down: a miss, not an exception"
    assert d.publish("t", [Entry(KEYS[5], "n", 1)]) == 0
    assert d.lookup("t", KEYS[:2]) == [[], []]
    assert d.leased("t", KEYS[0]) is False, "no answer is not a lease"
    assert d.errors >= 4
    redis_server.start()  # a fresh, empty server on the same port
    assert d.match_prefix("t", KEYS[:4]) == 0, "nothing stale is served after the restart"
    assert d.publish("t", [Entry(k, "n", 1) for k in KEYS[:2]]) == 2, "the client reconnects and reloads its scripts"
    assert d.match_prefix("t", KEYS[:4]) == 2


def test_every_redis_failure_is_a_counted_miss_read_only_busy_and_refused(redis_server):
    """docs/security.md: every Redis failure is answered as a miss and counted, never raised. A failover that turns
    the server into a read-only replica (READONLY), a script that holds the server (BUSY) and any other error reply
    raised out of publish / match_prefix / lookup / lease (issue #47: a ReadOnlyError killed the ingest-events
    worker). Each is counted by kind; once the server is writable again, everything works."""
    import threading

    import redis

    from kvpolicy.directory import RedisDirectory

    d = RedisDirectory(url=redis_server.url, socket_timeout_s=5.0)
    admin = redis.Redis.from_url(redis_server.url)
    assert d.publish("t", [Entry(k, "n", 1) for k in KEYS[:4]]) == 4
    admin.execute_command("REPLICAOF", "127.0.0.1", "1")  # a replica of nobody: read-only, its data kept
    try:
        assert d.publish("t", [Entry(KEYS[5], "n", 1)]) == 0
        assert d.match_prefix("t", KEYS[:4]) == 0  # the match script refreshes recency: a write, refused
        d.lease("t", KEYS[:2], ttl_s=10.0)  # the lease cannot be written: a counted failure, not an exception
        assert not d.leased("t", KEYS[0])
        assert d.errors == 3 and d.error_kinds == {"ReadOnlyError": 3}, d.error_kinds
    finally:
        admin.execute_command("REPLICAOF", "NO", "ONE")
    assert d.match_prefix("t", KEYS[:4]) == 4 and d.publish("t", [Entry(KEYS[5], "n", 1)]) == 1

    admin.config_set("busy-reply-threshold", 50)  # ms a script may run before others get BUSY
    hog = redis.Redis.from_url(redis_server.url)
    t = threading.Thread(target=lambda: _swallow(lambda: hog.eval("while true do end", 0)), daemon=True)
    t.start()
    time.sleep(0.3)
    try:
        before = d.errors
        assert d.match_prefix("t", KEYS[:4]) == 0
        assert d.lookup("t", KEYS[:2]) == [[], []]
        assert d.errors == before + 2 and d.error_kinds.get("BUSY", 0) == 2, d.error_kinds
    finally:
        admin.script_kill()
        t.join(timeout=5)
    assert d.match_prefix("t", KEYS[:4]) == 4


def _swallow(fn):
    try:
        fn()
    except Exception:  # the hog is killed: its own call fails, as it should
        pass


def test_a_lease_cannot_be_released_by_another_tenant_or_guessed():
    """Issue #47: attacker.release(Lease("mem-1", "attacker", (), 0)) released the victim's lease mem-1 — its keys
    could then be evicted under the reader, and the victim's own release did nothing. A lease id is unguessable, and
    only the Lease lease() returned releases it."""
    from kvpolicy.directory import Lease

    d = InMemoryDirectory()
    victim = d.lease("victim", KEYS[:2], ttl_s=60.0)
    assert d.leased("victim", KEYS[0])
    for forged in (Lease(victim.lease_id, "attacker", (), 0.0), Lease(victim.lease_id, "victim", (), 0.0),
                   Lease(victim.lease_id, "victim", KEYS[:1], victim.expires_at_s), Lease("mem-1", "victim", KEYS[:2], victim.expires_at_s)):
        d.release(forged)
        assert d.leased("victim", KEYS[0]) and d.leased("victim", KEYS[1]), forged
    ids = {d.lease("t", KEYS[:1], ttl_s=1.0).lease_id for _ in range(200)}
    assert len(ids) == 200 and all(len(i) >= 4 + 32 for i in ids), "128 random bits, not a counter"
    d.release(victim)
    assert not d.leased("victim", KEYS[0])


@pytest.mark.parametrize("ttl_s", [1e300, 3600.001, 1e-4, 0.0009])
def test_a_lease_ttl_is_bounded_and_means_the_same_on_both_backends(ttl_s):
    """A lease of 1e300 s pinned its keys for ever; one of 1e-4 s was a no-op on Redis (whole milliseconds) and held
    in memory. A lease lasts 1 ms to 1 h (MAX_LEASE_TTL_S), or it is an error naming ttl_s."""
    from kvpolicy.directory.base import MAX_LEASE_TTL_S

    assert MAX_LEASE_TTL_S == 3600.0
    with pytest.raises(ConfigError) as e:
        InMemoryDirectory().lease("t", KEYS[:1], ttl_s=ttl_s)
    assert e.value.field == "ttl_s"


def test_reading_an_unknown_tenant_allocates_nothing():
    """300,000 unknown tenants through match_prefix grew the directory by 63 MiB: a read made the tenant's table."""
    d = InMemoryDirectory()
    for i in range(2000):
        assert d.match_prefix(f"nobody-{i}", KEYS[:2]) == 0
        assert d.lookup(f"nobody-{i}", KEYS[:1]) == [[]]
        assert d.keys(f"nobody-{i}") == [] and d.count(f"nobody-{i}") == 0
        assert d.evict(f"nobody-{i}", KEYS[:1]) == 0 and d.clear_holder(f"nobody-{i}", "h") == 0
    assert d._t == {} and d._leases == {}


def test_active_leases_are_bounded_and_a_lease_past_the_bound_protects_nothing():
    """200,000 unreleased leases grew memory by 64 MiB. At max_leases_per_tenant (default 100,000) a new lease of that
    tenant is refused — counted, and returned holding no key (the reader then loads unprotected) — until one is
    released or expires."""
    clock = ManualClock()
    d = InMemoryDirectory(max_leases_per_tenant=3, clock=clock)
    held = [d.lease("t", KEYS[i:i + 1], ttl_s=10.0) for i in range(3)]
    extra = d.lease("t", KEYS[5:6], ttl_s=10.0)
    assert extra.keys == () and d.leases_refused == 1 and not d.leased("t", KEYS[5])
    assert extra.expires_at_s == clock.now_s() + 10.0  # a refused lease still says when it would have ended
    d.release(held[0])
    assert d.lease("t", KEYS[5:6], ttl_s=10.0).keys == (KEYS[5],)
    clock.advance(11.0)  # the rest expire: room again
    assert d.lease("t", KEYS[6:7], ttl_s=10.0).keys == (KEYS[6],)
    with pytest.raises(ConfigError) as e:
        InMemoryDirectory(max_leases_per_tenant=0)
    assert e.value.field == "max_leases_per_tenant"
    assert InMemoryDirectory().max_leases_per_tenant == 100_000


def test_one_tenant_filling_its_leases_denies_no_other_tenant_a_lease():
    """Round three: 100,000 leases of one tenant left every other tenant's lease empty (one global bound). The bound
    is per tenant: the flooder's own next lease is refused, everyone else's is granted and protects its keys."""
    clock = ManualClock()
    d = InMemoryDirectory(max_leases_per_tenant=50, max_keys_per_tenant=2, clock=clock)
    for i in range(60):
        d.lease("flood", [bytes([i % 256]) * 16], ttl_s=30.0)
    assert d.leases_refused == 10
    d.publish("victim", [Entry(KEYS[0], "r", 1), Entry(KEYS[1], "r", 1)])
    got = d.lease("victim", KEYS[:1], ttl_s=30.0)
    assert got.keys == (KEYS[0],) and d.leased("victim", KEYS[0]) and d.leases_refused == 10
    d.publish("victim", [Entry(KEYS[2], "r", 1), Entry(KEYS[3], "r", 1)])  # past the key bound: the leased key stays
    assert KEYS[0] in d.keys("victim") and d.evict("victim", KEYS[:1]) == 0


def test_lease_expiry_is_indexed_and_churn_keeps_it_small():
    """Leases expire by their own deadline, earliest first, whatever order they were taken in; a tenant's released
    leases do not pile up in the expiry index (it stays within twice the live leases plus a constant)."""
    clock = ManualClock()
    d = InMemoryDirectory(clock=clock)
    late = d.lease("t", KEYS[:1], ttl_s=20.0)
    early = d.lease("t", KEYS[1:2], ttl_s=5.0)
    clock.advance(6.0)
    assert not d.leased("t", KEYS[1]) and d.leased("t", KEYS[0])
    assert early.lease_id not in d._active["t"] and late.lease_id in d._active["t"]
    clock.advance(15.0)
    assert not d.leased("t", KEYS[0]) and d._active["t"] == {}
    for i in range(2000):
        d.release(d.lease("t", KEYS[i % 12:i % 12 + 1], ttl_s=60.0))
    assert len(d._expiry["t"]) <= 64 + 1 and d._leases["t"] == {}


def test_a_tenant_scoped_publish_reads_its_argument_once(directory):
    """A generator of 5 entries stored none (the namespace check used up its one pass); an iterable whose second pass
    differed got another namespace's entry past the check. publish reads its argument once."""
    from kvpolicy.directory import TenantScopedDirectory

    ns, other = b"n" * 16, b"o" * 16
    t = TenantScopedDirectory(directory, "gen", namespace_digest=ns)
    assert t.publish(Entry(k, "r", 1, namespace_digest=ns) for k in KEYS[:5]) == 5
    assert t.match_prefix(KEYS[:5]) == 5

    class Shifty:
        def __init__(self):
            self.passes = 0

        def __iter__(self):
            self.passes += 1
            digest = ns if self.passes == 1 else other
            return iter([Entry(KEYS[6], "r", 1, namespace_digest=digest)])

    shifty = Shifty()
    t.publish(shifty)
    assert shifty.passes == 1
    assert [e.namespace_digest for e in directory.lookup("gen", [KEYS[6]])[0]] == [ns]


def test_an_expiry_past_the_year_5000_is_refused_naming_the_field():
    """expires_at_s of 1e14 stored entries on Redis, reported 0 and escaped max_keys_per_tenant (its PEXPIREAT failed
    after the HSET). Entries carry expiries up to MAX_EXPIRES_AT_S (1e11 s) or None."""
    from kvpolicy.directory.base import MAX_EXPIRES_AT_S

    for bad in (1e14, MAX_EXPIRES_AT_S * 1.001, -1.0):
        with pytest.raises(ConfigError) as e:
            Entry(KEYS[0], "r", 1, expires_at_s=bad)
        assert e.value.field == "expires_at_s"
    assert Entry(KEYS[0], "r", 1, expires_at_s=MAX_EXPIRES_AT_S).expires_at_s == MAX_EXPIRES_AT_S


def test_a_malformed_stored_value_is_a_counted_miss_never_an_exception(redis_url):
    """A tenant's own ACL user can HSET anything into its hashes. A value of one field, an expiry that is no number,
    a non-UTF-8 holder: lookup, match, PeerIndex and the CLI's lookup read them as misses (counted in ``malformed``);
    the well-formed holder beside them is still found."""
    import redis as redis_lib

    from kvpolicy.directory import PeerIndex

    d = redis_dir(redis_url)
    raw = redis_lib.Redis.from_url(redis_url)
    d.publish("t", [Entry(KEYS[0], "good/gpu/g0", 1, "gpu")])
    name = d._name("t", KEYS[0], "b:")
    raw.hset(name, b"\xff\xfe/gpu/g0", b"1|gpu||")  # a holder that is not UTF-8
    raw.hset(name, "one-field/gpu/g0", b"garbage")
    raw.hset(name, "bad-exp/gpu/g0", b"1|gpu||soon")
    for k, v in ((KEYS[1], b"garbage"), (KEYS[2], b"1|gpu||1e+300"), (KEYS[3], b"\xff|\xfe||")):
        raw.hset(d._name("t", k, "b:"), "x/gpu/g0", v)
    rows = d.lookup("t", KEYS[:4])
    assert [[e.holder for e in r] for r in rows] == [["good/gpu/g0"], [], [], []]
    assert d.malformed == 6 and d.errors == 0
    assert d.match_prefix("t", KEYS[:4]) == 1  # the script reads the same values as no live holder
    assert d.match_prefix("t", KEYS[1:2]) == 0
    peers = PeerIndex(d, "t", exclude="me")
    assert peers.match_prefix(KEYS[:2]) == 1 and peers.holder == "good"


def test_redis_scripts_bound_their_own_work_whoever_calls_them(redis_url):
    """The split into 1,000-key calls lived only in kvpolicy's client: a tenant's own ACL user sent the publish script
    200k keys in one call (2.6 s of server time). Every script refuses more than MAX_KEYS_PER_CALL keys before it
    writes anything, checks every entry and expiry before its first write, caps holders per key whatever its caller
    says, and evicts at most a bounded number of keys per call."""
    import redis as redis_lib

    from kvpolicy.directory.base import MAX_KEYS_PER_CALL

    d = redis_dir(redis_url)
    raw = redis_lib.Redis.from_url(redis_url)
    base = d._base("t")
    n = MAX_KEYS_PER_CALL + 1
    hexes = [i.to_bytes(16, "big").hex() for i in range(n)]
    args = [10**9, base + "lease:", 64]
    for h in hexes:
        args += [h, "r", b"1|pool||", ""]
    for script, keys, argv in ((d._publish, [base + "lru", base + "clock"] + [base + "b:" + h for h in hexes], args),
                               (d._match, [base + "lru", base + "clock"] + [base + "b:" + h for h in hexes], hexes),
                               (d._match_each, [base + "lru", base + "clock"] + [base + "b:" + h for h in hexes], hexes),
                               (d._evict, [base + "lru"] + [base + "b:" + h for h in hexes], ["1", "", base + "lease:"] + hexes),
                               (d._lease, [base + "lease:" + h for h in hexes], [1000, "id"]),
                               (d._release, [base + "lease:" + h for h in hexes], ["id"])):
        with pytest.raises(redis_lib.exceptions.ResponseError, match="at most 1000 keys"):
            script(keys=keys, args=argv)
    assert raw.exists(base + "lru", base + "clock", *[base + "b:" + h for h in hexes[:5]]) == 0
    # an expiry Redis cannot take, in the second entry: the first is not written either
    two = [base + "lru", base + "clock", base + "b:" + hexes[0], base + "b:" + hexes[1]]
    with pytest.raises(redis_lib.exceptions.ResponseError, match="malformed expiry 2"):
        d._publish(keys=two, args=[10, base + "lease:", 64, hexes[0], "r", b"1|pool||", "", hexes[1], "r", b"1|pool||", str(10**17)])
    with pytest.raises(redis_lib.exceptions.ResponseError, match="malformed entry 1"):
        d._publish(keys=two[:3], args=[10, base + "lease:", 64, hexes[0], "r", b"1|pool||1e+300", ""])
    assert raw.exists(*two) == 0
    # holders per key: a caller naming 10^9 gets the scripts' own cap
    from kvpolicy.directory.base import MAX_HOLDERS_LIMIT

    key = [base + "lru", base + "clock", base + "b:" + hexes[0]]
    stored = sum(int(d._publish(keys=key, args=[10, base + "lease:", 10**9, hexes[0], f"h{i}", b"1|pool||", ""])[0])
                 for i in range(MAX_HOLDERS_LIMIT + 5))
    assert stored == MAX_HOLDERS_LIMIT == raw.hlen(base + "b:" + hexes[0])
    # the capacity walk: a caller's max_keys of 1 over 3,000 keys evicts a bounded number per call, and the bound holds
    # after enough calls
    d2 = redis_dir(redis_url, max_keys_per_tenant=10**6)
    many = [i.to_bytes(16, "big") for i in range(3000)]
    assert d2.publish("t", [Entry(k, "r", 1) for k in many]) == 3000
    b2 = d2._base("t")
    one = [b2 + "lru", b2 + "clock", b2 + "b:" + many[0].hex()]
    ev = [int(d2._publish(keys=one, args=[1, b2 + "lease:", 64, many[0].hex(), "r", b"1|pool||", ""])[1]) for _ in range(3)]
    assert ev[0] <= 2 * MAX_KEYS_PER_CALL + 64 and sum(ev) == 2999 and raw.zcard(b2 + "lru") == 1


def test_clear_holder_pages_through_a_large_tenant_and_reports_what_it_removed(redis_url):
    """clear_holder on a 300k-key tenant was one 6.1 s script: other tenants' matches failed BUSY meanwhile, and the
    client's own call timed out, returning 0 while the server removed everything. It is now a page of at most
    MAX_KEYS_PER_CALL keys per script call, walked by LRU score; the count is the whole removal, and a key touched
    between pages is met again, not skipped."""
    from kvpolicy.directory.base import MAX_KEYS_PER_CALL

    d = redis_dir(redis_url)
    many = [i.to_bytes(16, "big") for i in range(2 * MAX_KEYS_PER_CALL + 500)]
    for lo in range(0, len(many), 1000):
        d.publish("t", [Entry(k, "gone", 1) for k in many[lo:lo + 1000]] + [Entry(k, "stays", 1) for k in many[lo:lo + 1000:2]])
    base = d._base("t")
    first = d._clear(keys=[base + "lru"], args=["gone", ""])
    assert int(first[0]) == MAX_KEYS_PER_CALL and first[1]  # one page, and where the next starts
    d.match_prefix("t", many[:1])  # touched: moves to the newest end; the walk meets it again (removing twice is a no-op)
    calls = []
    real = d._clear
    d._clear = lambda keys, args: calls.append(args[1]) or real(keys=keys, args=args)
    # 2,000 keys left in the LRU: two full pages, and one that finds the end
    assert d.clear_holder("t", "gone") == len(many) - MAX_KEYS_PER_CALL and len(calls) == 3 and d.errors == 0
    assert sorted(d.keys("t")) == sorted(many[0::2])
    assert all([e.holder for e in row] == ["stays"] for row in d.lookup("t", many[0::2][:50]))
    g = redis_dir(redis_url, key_groups=4)
    g.publish("t", [Entry(k, "gone", 1) for k in many[:1500]])
    assert g.clear_holder("t", "gone") == 1500 and g.keys("t") == []


# the testing kit's contract, run on both backends (a third-party directory subclasses it the same way)
from kvpolicy.testing import DirectoryContract, contract_test  # noqa: E402


class _InMemoryContract(DirectoryContract):
    def make_directory(self, max_keys):
        return InMemoryDirectory(max_keys_per_tenant=max_keys)


TestInMemoryDirectoryContract = contract_test(_InMemoryContract, max_examples=20)


@pytest.fixture(autouse=False)
def _redis_for_contract(redis_url):
    _RedisContract.url = redis_url
    yield


class _RedisContract(DirectoryContract):
    url = None

    def make_directory(self, max_keys):
        return redis_dir(self.url, max_keys_per_tenant=max_keys)


@pytest.mark.usefixtures("_redis_for_contract")
class TestRedisDirectoryContract(contract_test(_RedisContract, max_examples=15)):
    pass


def test_capacity_eviction_takes_leaves_first_so_chains_stay_reachable(directory_factory):
    """150 chained keys under a bound of 100: the 100 kept are the chain's first 100, still matchable;
    a hot chain just matched keeps its head when a new chain arrives."""
    d = directory_factory(max_keys_per_tenant=100)
    chain = [bytes([1, i % 256, i // 256]) + bytes(13) for i in range(150)]
    d.publish("t", [Entry(k, "h", 1) for k in chain])
    assert d.match_prefix("t", chain) == 100
    hot = chain[:50]
    assert d.match_prefix("t", hot) == 50
    new = [bytes([2, i, 0]) + bytes(13) for i in range(50)]
    d.publish("t", [Entry(k, "h", 1) for k in new])
    assert d.match_prefix("t", hot) == 50, "the chain just matched keeps its head (its cold tail went)"
    assert d.match_prefix("t", new) == 50
    assert d.match_prefix("t", chain) == 50


def test_the_bound_holds_past_leased_keys_and_a_bad_tier_is_refused(directory_factory):
    d = directory_factory(max_keys_per_tenant=100)
    first = [bytes([3, i]) + bytes(14) for i in range(100)]
    d.publish("t", [Entry(k, "h", 1) for k in first])
    d.lease("t", first[:90], ttl_s=60.0)  # the 90 oldest are being loaded
    more = [bytes([4, i]) + bytes(14) for i in range(15)]
    d.publish("t", [Entry(k, "h", 1) for k in more])
    assert len(d.keys("t")) == 100, "the bound holds: unleased keys go, however far down the LRU they are"
    assert d.match_prefix("t", first[:90]) == 90, "no leased key was evicted"
    with pytest.raises(ConfigError, match="tier"):
        Entry(b"k" * 16, "h", 1, "gpu|cpu")


def test_a_full_redis_is_an_error_counted_never_raised(redis_url):
    import redis as redis_lib

    d = redis_dir(redis_url)
    r = redis_lib.Redis.from_url(redis_url)
    before = r.config_get("maxmemory")["maxmemory"], r.config_get("maxmemory-policy")["maxmemory-policy"]
    r.config_set("maxmemory-policy", "noeviction")
    r.config_set("maxmemory", 1)  # anything written now is refused with OOM
    try:
        assert d.publish("t", [Entry(b"k" * 16, "h", 1)]) == 0
        assert d.match_prefix("t", [b"k" * 16]) == 0
        assert d.errors >= 1
    finally:
        r.config_set("maxmemory", before[0])
        r.config_set("maxmemory-policy", before[1])


def test_releasing_a_lease_twice_never_drops_another_readers_lease(directory):
    d = directory
    k = bytes([9]) * 16
    d.publish("t", [Entry(k, "h", 1)])
    a = d.lease("t", [k], ttl_s=60.0)
    b = d.lease("t", [k], ttl_s=60.0)
    d.release(a)
    d.release(a)
    assert d.leased("t", k), "b still holds it"
    d.release(b)
    assert not d.leased("t", k)


def test_expiry_is_per_holder_on_redis_as_in_the_reference(redis_url):
    """One holder's expiry never removes another holder's live entry, and an expired holder never
    lingers because another holder is persistent."""
    d = redis_dir(redis_url)
    k, k2 = bytes([11]) * 16, bytes([12]) * 16
    d.publish("t", [Entry(k, "forever", 1)])
    d.publish("t", [Entry(k, "brief", 1, expires_at_s=time.time() + 0.1)])
    d.publish("t", [Entry(k2, "brief", 1, expires_at_s=time.time() + 0.1)])
    d.publish("t", [Entry(k2, "later", 1, expires_at_s=time.time() + 60)])
    time.sleep(0.25)
    assert [e.holder for e in d.lookup("t", [k])[0]] == ["forever"], "the persistent holder stays, the expired one is gone"
    assert [e.holder for e in d.lookup("t", [k2])[0]] == ["later"]
    assert d.match_prefix("t", [k, k2]) == 2
    only = bytes([13]) * 16
    d.publish("t", [Entry(only, "brief", 1, expires_at_s=time.time() + 0.1)])
    time.sleep(0.25)
    assert d.match_prefix("t", [only]) == 0 and d.lookup("t", [only]) == [[]]


def test_a_tenant_scoped_directory_cannot_reach_another_tenant(directory):
    from kvpolicy.directory import TenantScopedDirectory

    a = TenantScopedDirectory(directory, "tenant-a", namespace_digest=b"\x01" * 16)
    b = TenantScopedDirectory(directory, "tenant-b")
    k = bytes([21]) * 16
    a.publish([Entry(k, "h", 1, "gpu", b"\x01" * 16)])
    assert a.match_prefix([k]) == 1 and b.match_prefix([k]) == 0 and b.keys() == []
    assert b.evict([k], force=True) == 0 and b.clear_holder("h") == 0
    assert a.match_prefix([k]) == 1, "tenant b's calls never touched tenant a's entry"
    with pytest.raises(ConfigError, match="namespace"):
        a.publish([Entry(bytes([22]) * 16, "h", 1, "gpu", b"\x02" * 16)])
    lease = a.lease([k], ttl_s=30.0)
    with pytest.raises(ConfigError, match="lease"):
        b.release(lease)
    a.release(lease)


def test_a_per_tenant_redis_acl_user_reaches_only_its_own_tenant(redis_server):
    """The ACL from docs/security.md, applied with a real ACL SETUSER: tenant acme's connection works for acme
    and is refused by Redis itself for beta (answered as a miss, counted in ``denied``), and cannot list or flush."""
    import redis as redis_lib

    from kvpolicy.directory import RedisDirectory
    from kvpolicy.directory.redis import tenant_acl_rules

    admin = redis_lib.Redis.from_url(redis_server.url)
    admin.execute_command("ACL", "SETUSER", "tenant-acme", "reset", "on", ">acme-password-0123456789", *tenant_acl_rules("acme"))
    owner = RedisDirectory(url=redis_server.url, prefix="kvp")  # the operator's unconfined view
    admin.script_flush()
    owner.load_scripts()  # tenants may only EVALSHA what the operator loaded
    beta_keys = [bytes([50 + i]) * 16 for i in range(3)]
    owner.publish("beta", [Entry(k, "beta-replica", 1) for k in beta_keys])
    beta_before = sorted(admin.keys("{kvp:beta}:*"))

    acme = RedisDirectory(url=redis_server.url.replace("redis://", "redis://tenant-acme:acme-password-0123456789@"), prefix="kvp")
    mine = [bytes([60 + i]) * 16 for i in range(4)]
    assert acme.publish("acme", [Entry(k, "acme-replica", 1) for k in mine]) == 4
    assert acme.match_prefix("acme", mine) == 4 and acme.keys("acme") == sorted(mine)
    lease = acme.lease("acme", mine[:2], ttl_s=30.0)
    assert acme.leased("acme", mine[0])
    acme.release(lease)
    assert acme.evict("acme", mine[3:]) == 1 and acme.denied == 0 and acme.errors == 0

    # everything aimed at beta is refused by Redis: nothing read, nothing written, nothing removed
    assert acme.match_prefix("beta", beta_keys) == 0
    assert acme.lookup("beta", beta_keys) == [[], [], []]
    assert acme.keys("beta") == []
    assert acme.publish("beta", [Entry(bytes([70]) * 16, "intruder", 1)]) == 0
    assert acme.evict("beta", beta_keys, force=True) == 0
    assert acme.clear_holder("beta", "beta-replica") == 0
    acme.lease("beta", beta_keys, ttl_s=30.0)
    assert acme.denied == 7 and acme.errors == 7
    assert sorted(admin.keys("{kvp:beta}:*")) == beta_before
    assert owner.match_prefix("beta", beta_keys) == 3
    for cmd in (("FLUSHALL",), ("KEYS", "*"), ("SCAN", "0"), ("CONFIG", "GET", "maxmemory"), ("DBSIZE",)):
        with pytest.raises(redis_lib.exceptions.NoPermissionError):
            acme.r.execute_command(*cmd)


def test_a_tenant_runs_exactly_the_scripts_the_operator_loaded_and_cannot_touch_the_servers(redis_server):
    """FUNCTION FLUSH/DELETE/LOAD REPLACE are @write, not @dangerous: a tenant user deleted every tenant's libraries.
    With +script|load a tenant loaded `while true do end` and every tenant got BUSY until an admin's SCRIPT KILL.
    Now a tenant EVALSHAs only what the operator loaded (load_scripts); every server-wide scripting command is refused."""
    import redis as redis_lib

    from kvpolicy.directory import RedisDirectory
    from kvpolicy.directory.redis import tenant_acl_rules

    admin = redis_lib.Redis.from_url(redis_server.url)
    lib = "#!lua name=victimlib\nredis.register_function('victim', function() return 1 end)"
    admin.execute_command("FUNCTION", "LOAD", "REPLACE", lib)
    admin.execute_command("ACL", "SETUSER", "tenant-evil", "reset", "on", ">evil-password-0123456789", *tenant_acl_rules("evil"))
    admin.script_flush()
    owner = RedisDirectory(url=redis_server.url, prefix="kvp")
    evil_url = redis_server.url.replace("redis://", "redis://tenant-evil:evil-password-0123456789@")
    evil = RedisDirectory(url=evil_url, prefix="kvp")
    k = [bytes([90 + i]) * 16 for i in range(2)]
    assert evil.publish("evil", [Entry(x, "r", 1) for x in k]) == 0 and evil.errors == 1  # nothing loaded yet: a counted miss
    shas = owner.load_scripts()
    assert len(shas) == 8 and all(admin.script_exists(*shas))  # the spread layout's match-each and match-node among them
    assert evil.publish("evil", [Entry(x, "r", 1) for x in k]) == 2 and evil.match_prefix("evil", k) == 2
    raw = redis_lib.Redis.from_url(evil_url)
    spin = "while true do end"
    for cmd in (("FUNCTION", "FLUSH"), ("FUNCTION", "DELETE", "victimlib"), ("FUNCTION", "LOAD", "REPLACE", lib), ("SCRIPT", "LOAD", spin),
                ("SCRIPT", "FLUSH"), ("SCRIPT", "KILL"), ("EVAL", spin, "0"), ("FCALL", "victim", "0")):
        with pytest.raises(redis_lib.exceptions.NoPermissionError):
            raw.execute_command(*cmd)
    assert admin.execute_command("FCALL", "victim", "0") == 1  # the other tenant's library is still there
    assert all(admin.script_exists(*shas))
    for bad in ("k*", "k?", "k[a]", "a\\b"):
        with pytest.raises(ConfigError, match="glob"):
            tenant_acl_rules("evil", prefix=bad)
        with pytest.raises(ConfigError, match="glob"):
            RedisDirectory(url=redis_server.url, prefix=bad)


def test_the_security_page_shows_the_acl_the_code_builds():
    from pathlib import Path

    from kvpolicy.directory.redis import tenant_acl_rules

    page = (Path(__file__).resolve().parents[1] / "docs" / "security.md").read_text()
    assert " ".join(tenant_acl_rules("acme")) in page


def _faulty_writer(url: str, prefix: str, wid: int, run_s: float, out: "mp.Queue", ready: "mp.Queue") -> None:
    """Publish chain prefixes, evict chain suffixes, match and lease — through a Redis that dies mid-run.
    Records, per key, what this writer knows: 'yes' (publish acknowledged), 'maybe' (a publish or evict
    whose answer was lost), 'no' (evict acknowledged after the last publish). Says ``ready`` after its first
    operation, so the outage is timed from the writers' work, not from their start (a loaded machine imports slowly)."""
    from kvpolicy.directory import Entry, RedisDirectory

    d = RedisDirectory(url=url, prefix=prefix, socket_timeout_s=0.3)
    rng = random.Random(1000 + wid)
    chains = [[bytes([wid, c, j]) + bytes(13) for j in range(8)] for c in range(6)]
    state: dict[bytes, str] = {}
    ok_ops = failed_ops = 0
    end = time.monotonic() + run_s
    while time.monotonic() < end:
        chain = rng.choice(chains)
        before = d.errors
        x = rng.random()
        if x < 0.4:
            keys = chain[: rng.randint(1, 8)]
            got = d.publish("t", [Entry(k, f"w{wid}", 64) for k in keys])
            done = d.errors == before and got == len(keys)
            for k in keys:
                state[k] = "yes" if done else "maybe"
        elif x < 0.6:
            keys = chain[rng.randint(0, 7):]  # a suffix: what is left of a chain stays a prefix
            d.evict("t", keys, holder=f"w{wid}", force=True)
            done = d.errors == before
            for k in keys:
                state[k] = "no" if done else "maybe"
        elif x < 0.8:
            d.match_prefix("t", chain)
            done = d.errors == before
        else:
            lease = d.lease("t", chain[:3], ttl_s=2.0)
            d.release(lease)
            done = d.errors == before
        ok_ops += done
        failed_ops += not done
        if ok_ops + failed_ops == 1:
            ready.put(wid)
    out.put((wid, {k.hex(): v for k, v in state.items()}, ok_ops, failed_ops))


def test_killing_redis_under_four_writers_leaves_nothing_stale_or_phantom(redis_server):
    """Four processes publish, match, evict and lease while redis-server is killed and restarted empty.
    Afterwards: no writer raised; every entry a holder has is one it published and did not evict since
    (nothing phantom, nothing stale); each holder's part of each chain is still a prefix (every script
    applied whole or not at all); and the clients came back (work succeeded after the restart)."""
    from kvpolicy.directory import RedisDirectory

    prefix = f"kill{uuid.uuid4().hex[:8]}"
    ctx = mp.get_context("spawn")
    q, ready = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_faulty_writer, args=(redis_server.url, prefix, w, 4.0, q, ready)) for w in range(4)]
    for p in procs:
        p.start()
    for _ in procs:
        ready.get(timeout=120)  # every writer has connected and done its first operation: each runs ~4 s from its start
    time.sleep(0.3)
    redis_server.stop()  # SIGKILL, mid-run
    time.sleep(0.5)
    redis_server.start()  # empty (no persistence), same port
    results = [q.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0, "a writer raised"
    assert all(failed > 0 for _, _, _, failed in results), "the outage happened during every writer's run"
    assert all(ok > 0 for _, _, ok, _ in results)
    d = RedisDirectory(url=redis_server.url, prefix=prefix)
    present = 0
    for wid, state, _, _ in results:
        for c in range(6):
            chain = [bytes([wid, c, j]) + bytes(13) for j in range(8)]
            held = [any(e.holder == f"w{wid}" for e in es) for es in d.lookup("t", chain)]
            for k, h in zip(chain, held):
                if h:
                    assert state.get(k.hex()) in ("yes", "maybe"), f"w{wid} holds {k.hex()[:6]}, which it {state.get(k.hex(), 'never published')}"
            n = sum(held)
            assert held == [True] * n + [False] * (8 - n), f"w{wid} chain {c}: {held} is not a prefix"
            present += n
    assert present > 0, "the writers published again after the restart"
    assert d.errors == 0



def test_lease_ttl_holder_and_expiry_are_checked(directory):
    """A lease of inf seconds pinned its keys for ever in memory and was an OverflowError on Redis (int(inf * 1000));
    "5" was a TypeError; an int holder evicted nothing without a word; a NaN expiry never expires (NaN compares false)."""
    d = directory
    for bad in (float("inf"), "5", float("nan"), 0):
        with pytest.raises(ConfigError) as e:
            d.lease("t", [KEYS[0]], ttl_s=bad)
        assert e.value.field == "ttl_s"
    for call in (lambda: d.evict("t", [KEYS[0]], holder=5), lambda: d.clear_holder("t", "")):
        with pytest.raises(ConfigError) as e:
            call()
        assert e.value.field == "holder"
    with pytest.raises(ConfigError) as e:
        Entry(KEYS[0], "n", 1, expires_at_s=float("nan"))
    assert e.value.field == "expires_at_s"


def test_the_in_memory_directory_can_be_shared_between_threads():
    """`kvpolicy ingest-events --ranks N --directory memory` feeds one directory from N threads, and an engine may
    share one across its own. Without a lock a publish beside a clear_holder raised KeyError or "dictionary changed
    size during iteration" within a second."""
    from helpers import race

    d = InMemoryDirectory(max_keys_per_tenant=500)
    keys = [bytes([i % 256, i // 256]) * 8 for i in range(2000)]

    def publisher(holder):
        for i in range(2000):
            d.publish("t", [Entry(keys[(i * 7 + j) % 2000], holder) for j in range(8)])
            if i % 50 == 0:
                d.clear_holder("t", holder)

    def reader():
        for i in range(2000):
            d.match_prefix("t", keys[i % 1900:i % 1900 + 8])
            d.keys("t")
            d.evict("t", keys[i % 1990:i % 1990 + 4], holder="a")

    assert race(*[lambda h=h: publisher(h) for h in "abc"], reader) == []
    assert d.count("t") <= 500, "the capacity bound held"


@pytest.mark.parametrize("skew_s", [-3600.0, 7200.0])
def test_redis_lookup_and_leases_run_on_the_servers_clock_not_the_clients(redis_url, monkeypatch, skew_s):
    """A client an hour behind saw holders the server had expired; one two hours ahead saw an empty lookup while match
    (the server's TIME) counted the block. Both now read the server's clock, as the match script does."""
    import kvpolicy.directory.redis as redis_mod

    d = redis_dir(redis_url)
    now = time.time()
    d.publish("t", [Entry(KEYS[0], "live", 1, expires_at_s=now + 600), Entry(KEYS[0], "gone", 1, expires_at_s=now - 600)])
    real_time = time.time
    monkeypatch.setattr(redis_mod.time, "time", lambda: real_time() + skew_s)
    assert d.match_prefix("t", KEYS[:1]) == 1
    assert [e.holder for e in d.lookup("t", KEYS[:1])[0]] == ["live"]
    sec, usec = d.r.time()
    lease = d.lease("t", KEYS[:1], 30.0)
    server_now = float(sec) + float(usec) / 1e6
    assert 0 <= lease.expires_at_s - (server_now + 30.0) < 0.05  # the server's now (to the microsecond) + ttl
    sec, usec = d.r.time()
    assert 0 <= d._server_now() - (float(sec) + float(usec) / 1e6) < 0.01
    d.release(lease)


def test_a_key_holds_at_most_max_holders_and_expired_ones_make_room(directory_factory):
    """200,000 holders on one key took 48 MiB in memory and a 6.5 s script on Redis (which also answered 0, errors=1,
    having written everything). A new holder past the bound is refused, counted, and not reported as written."""
    d = directory_factory(max_holders_per_key=4)
    k = KEYS[0]
    now = time.time()
    assert d.publish("t", [Entry(k, f"h{i}", 1) for i in range(6)]) == 4
    assert d.holders_refused == 2
    assert [e.holder for e in d.lookup("t", [k])[0]] == ["h0", "h1", "h2", "h3"]
    assert d.publish("t", [Entry(k, "h0", 2)]) == 1  # an existing holder updates in place
    d2 = directory_factory(max_holders_per_key=2)
    d2.publish("t", [Entry(k, "old", 1, expires_at_s=now + 0.05), Entry(k, "live", 1)])
    time.sleep(0.1)
    assert d2.publish("t", [Entry(k, "new", 1)]) == 1  # the expired holder made room
    assert [e.holder for e in d2.lookup("t", [k])[0]] == ["live", "new"]
    with pytest.raises(ConfigError, match="max_holders_per_key"):
        directory_factory(max_holders_per_key=0)


def test_a_large_redis_call_is_split_and_reports_what_it_wrote(redis_url, monkeypatch):
    """A 10^6-key publish was one script that held Redis for seconds, timed out client-side and reported 0 written.
    Calls are now split at MAX_KEYS_PER_CALL keys; each part is short, and the count is the truth."""
    from kvpolicy.directory import redis as redis_mod

    d = redis_dir(redis_url)
    sizes = []
    publish = d._publish
    d._publish = lambda keys, args: sizes.append(len(keys) - 2) or publish(keys=keys, args=args)
    keys = [i.to_bytes(16, "big") for i in range(2 * redis_mod.MAX_KEYS_PER_CALL + 5)]
    assert d.publish("t", [Entry(x, "r", 1) for x in keys]) == len(keys) and d.errors == 0
    assert sizes == [redis_mod.MAX_KEYS_PER_CALL, redis_mod.MAX_KEYS_PER_CALL, 5]
    assert d.match_prefix("t", keys) == len(keys)
    assert d.match_prefix("t", keys[:1500] + [b"\xff" * 16] + keys[1500:]) == 1500
    lease = d.lease("t", keys, 30.0)
    assert d.leased("t", keys[-1])
    d.release(lease)
    assert not d.leased("t", keys[-1])
    assert d.evict("t", keys) == len(keys) and d.match_prefix("t", keys) == 0


def test_the_directorys_bounds_hold_at_their_edges(directory_factory):
    """Keys of 1 and 64 bytes, holders of 1 and 256 characters, leases of exactly 1 ms and 1 h are accepted; one step
    past each edge is refused, naming the field. A tier must be a name too."""
    d = directory_factory()
    assert d.publish("t", [Entry(b"k", "h" * 256, 1), Entry(b"K" * 64, "h", 1)]) == 2
    assert d.match_prefix("t", [b"k"]) == 1 and d.match_prefix("t", [b"K" * 64]) == 1
    for bad, field in ((lambda: Entry(b"", "h"), "key"), (lambda: Entry(b"x" * 65, "h"), "key"), (lambda: Entry(b"k", "h" * 257), "holder"),
                       (lambda: Entry(b"k", "h", 1, tier=""), "tier"), (lambda: Entry(b"k", "h", 1, tier=5), "tier"),
                       (lambda: d.match_prefix("t", [b""]), "key"), (lambda: d.match_prefix("t", [b"x" * 65]), "key"),
                       (lambda: d.lease("t", [b"k"], 0.000999), "ttl_s"), (lambda: d.lease("t", [b"k"], 3600.001), "ttl_s"),
                       (lambda: d.lease("a b", [b"k"], 1.0), "tenant")):
        with pytest.raises(ConfigError, match=field):
            bad()
    for ttl in (0.001, 3600.0):
        d.release(d.lease("t", [b"k"], ttl))


def test_an_expired_lease_protects_nothing_even_before_anything_else_is_called():
    """In memory a lease expires when its time comes: leased() says so at once, and evict() may take the key."""
    clock = ManualClock(100.0)
    d = InMemoryDirectory(clock=clock)
    d.publish("t", [Entry(KEYS[0], "h", 1, expires_at_s=105.0)])
    lease = d.lease("t", KEYS[:1], 1.0)
    assert d.leased("t", KEYS[0]) and d.evict("t", KEYS[:1]) == 0
    clock.advance(1.0)  # exactly at expiry: gone (a lease is live while its expiry is ahead)
    assert not d.leased("t", KEYS[0])
    d.lease("t", KEYS[:1], 1.0)
    clock.advance(2.0)
    assert d.evict("t", KEYS[:1]) == 1, "the expired lease no longer protects the key"
    d.publish("t", [Entry(KEYS[1], "h", 1, expires_at_s=clock.now_s())])  # an entry whose expiry is now is not live
    assert d.match_prefix("t", KEYS[1:2]) == 0
    assert lease.expires_at_s == 101.0


def test_a_tenant_scoped_directory_with_a_namespace_never_returns_anothers_entries():
    from kvpolicy.directory import TenantScopedDirectory

    raw = InMemoryDirectory()
    raw.publish("t", [Entry(KEYS[0], "mine", 1, namespace_digest=b"A" * 16), Entry(KEYS[0], "theirs", 1, namespace_digest=b"B" * 16)])
    scoped = TenantScopedDirectory(raw, "t", b"A" * 16)
    assert [e.holder for e in scoped.lookup(KEYS[:1])[0]] == ["mine"]
    assert [e.holder for e in TenantScopedDirectory(raw, "t").lookup(KEYS[:1])[0]] == ["mine", "theirs"]


@pytest.mark.parametrize("bad", [0, -1, True, "5", 1.5])
def test_redis_refuses_a_key_bound_that_is_not_a_positive_int(redis_url, bad):
    with pytest.raises(ConfigError, match="max_keys_per_tenant"):
        redis_dir(redis_url, max_keys_per_tenant=bad)


def test_a_peer_index_finds_the_longest_run_one_other_engine_holds_from_its_kv_events(directory):
    """Two engines' KV events (vLLM's wire format, through the ingestor) and the pool's own entry: pod-1 holds blocks
    0..3 on GPU, pod-2 holds 0..1 on GPU and 2 on CPU; the pool ("node-0") holds block 0. Asked by pod-3, the run one
    peer holds is pod-1's 4 blocks; asked by pod-1 itself, pod-2's 3 (its GPU run going on into its CPU tier); a pool
    holder is never a peer; and only the tiers asked for count."""
    from kvpolicy.directory import PeerIndex
    from kvpolicy.integrations.vllm_events import BlockStored, KVEventIngestor, encode_batch
    from kvpolicy.keys import BlockHasher, Namespace, vllm_block_hashes
    from kvpolicy.matching import InMemoryBlockIndex, match

    B = 16
    hasher = BlockHasher(Namespace(model_id="m", model_revision="r", tokenizer_version="t", kv_dtype="bf16", block_size_tokens=B), "fast")
    prompt = list(range(2000, 2000 + 4 * B + 5))
    raw = vllm_block_hashes(prompt, B, "sha256")

    def feed(holder, spans):
        ing = KVEventIngestor(directory, "acme", hasher, holder=holder, bytes_per_token=2048, verify_algo="sha256")
        for lo, hi, medium in spans:
            parent = raw[lo - 1] if lo else None
            ing.ingest(encode_batch(1.0, [BlockStored(tuple(raw[lo:hi]), parent, tuple(prompt[lo * B:hi * B]), B, None, medium)]))

    feed("pod-1", [(0, 4, "GPU")])
    feed("pod-2", [(0, 2, "GPU"), (2, 3, "CPU")])
    keys = list(hasher.hash_blocks(prompt))
    directory.publish("acme", [Entry(keys[0], "node-0", 1, "pool")])
    for asker, want, holder in (("pod-3", 4, "pod-1"), ("pod-1", 3, "pod-2"), ("pod-2", 4, "pod-1")):
        peers = PeerIndex(directory, "acme", exclude=asker)
        assert (peers.match_prefix(keys), peers.holder) == (want, holder), asker
    gpu_only = PeerIndex(directory, "acme", exclude="pod-1", tiers=("gpu",))
    assert (gpu_only.match_prefix(keys), gpu_only.holder) == (2, "pod-2")
    both = PeerIndex(directory, "acme", exclude="pod-9")
    assert (both.match_prefix(keys[:2]), both.holder) == (2, "pod-1"), "a tie goes to the first engine by name"
    assert (both.match_prefix([]), both.holder) == (0, None)
    # pod-4 holds blocks 0 and 2 but not 1: its run is 1 block, never 0, 2 counted past the gap
    directory.publish("acme", [Entry(keys[0], "pod-4/gpu/g0", 1, "gpu"), Entry(keys[2], "pod-4/gpu/g0", 1, "gpu")])
    only4 = PeerIndex(directory, "acme", exclude="pod-1")
    directory.evict("acme", keys[:4], holder="pod-2/gpu/g0")
    directory.evict("acme", keys[:4], holder="pod-2/cpu/g0")
    assert (only4.match_prefix(keys), only4.holder) == (1, "pod-4")
    assert PeerIndex(directory, "acme", exclude="pod-1", tiers=("disk",)).match_prefix(keys) == 0
    # as a remote tier of match(): pod-3's own cache holds block 0, the pool nothing more, a peer the next 3
    m = match(keys, len(prompt), InMemoryBlockIndex([keys[0]]), InMemoryBlockIndex([], name="pool"),
              PeerIndex(directory, "acme", exclude="pod-3"), block_size_tokens=B)
    assert (m.local_blocks, m.remote_blocks) == (1, (0, 3))
    with pytest.raises(ConfigError) as e:
        PeerIndex(directory, "acme", exclude="pod-3", tiers="gpu")
    assert e.value.field == "tiers"
    with pytest.raises(ConfigError) as e:
        PeerIndex(directory, "acme", exclude="")
    assert e.value.field == "holder"


def test_the_spread_layouts_match_is_split_per_node_at_the_call_bound(redis_url):
    """One script per node carries every group of the match that node holds, at most MAX_KEYS_PER_CALL keys a call: a
    2,005-key chain over 8 groups on one server is three calls of whole groups, none over the bound, every key asked
    once; the answer is the truth at any length."""
    from kvpolicy.directory import redis as redis_mod

    d = redis_dir(redis_url, key_groups=8)
    keys = [(10**6 + i).to_bytes(16, "big") for i in range(2 * redis_mod.MAX_KEYS_PER_CALL + 5)]
    assert d.publish("t", [Entry(x, "r", 1) for x in keys]) == len(keys)
    batch = d._batch
    calls = []

    def spy(cmds):
        for _, _, args in cmds:
            groups = int(args[3])  # sha, 1 declared key, the key; then ARGV: groups, its counts, names
            calls.append([int(x) for x in args[4:4 + groups]])
        return batch(cmds)

    d._batch = spy
    assert d.match_prefix("t", keys) == len(keys)
    sizes = [sum(c) for c in calls]
    assert len(calls) == 3 and max(sizes) <= redis_mod.MAX_KEYS_PER_CALL and sum(sizes) == len(keys), sizes
    assert d.match_prefix("t", keys[:1500] + [b"\xff" * 16] + keys[1500:]) == 1500


def test_a_failed_node_call_costs_only_its_own_keys_and_keeps_the_per_node_scripts(redis_url):
    """One of the per-node calls fails (a timeout, a node mid-failover): its keys answer "not held", every other call's
    keys keep their answer — and it is not taken for a server without script flags: the next
    match is one script per node again."""
    import redis.exceptions

    from kvpolicy.directory import redis as redis_mod

    d = redis_dir(redis_url, key_groups=8)
    keys = [(2 * 10**6 + i).to_bytes(16, "big") for i in range(2 * redis_mod.MAX_KEYS_PER_CALL + 5)]
    d.publish("t", [Entry(x, "r", 1) for x in keys])
    batch = d._batch
    d._batch = lambda cmds: [redis.exceptions.TimeoutError("slow node")] + batch(cmds[1:])
    live = d._spread_live("t", keys)
    assert 0 < sum(live) < len(keys), "only the failed call's keys are lost"
    assert d.node_scripts is True
    d._batch = batch
    assert d.match_prefix("t", keys) == len(keys) and d.node_scripts is True


def test_a_forced_evict_takes_leased_keys_in_the_spread_layout_too(redis_url):
    """evict(force=True) ignores leases, without force a leased key stays — in the spread layout as in one slot."""
    for groups in (1, 2, 4):
        d = redis_dir(redis_url, key_groups=groups)
        d.publish("t", [Entry(k, "r", 1) for k in KEYS[:6]])
        lease = d.lease("t", KEYS[:6], ttl_s=30.0)
        assert d.evict("t", KEYS[:6]) == 0 and d.match_prefix("t", KEYS[:6]) == 6, groups
        assert d.evict("t", KEYS[:6], force=True) == 6 and d.match_prefix("t", KEYS[:6]) == 0, groups
        d.release(lease)


def test_a_failed_part_of_a_large_publish_costs_only_its_own_keys(redis_url):
    """A publish split into 1,000-key calls: one call failing (counted in errors) loses its own keys only — the calls
    after it still write, and the count reports what was written."""
    import redis as redis_lib

    d = redis_dir(redis_url)
    many = [i.to_bytes(16, "big") for i in range(2500)]
    real, calls = d._publish, []

    def flaky(keys, args):
        calls.append(len(keys))
        if len(calls) == 2:
            raise redis_lib.exceptions.ConnectionError("dropped")
        return real(keys=keys, args=args)

    d._publish = flaky
    assert d.publish("t", [Entry(k, "r", 1) for k in many]) == 1500 and d.errors == 1 and len(calls) == 3
    assert d.match_prefix("t", many[2000:]) == 500 and d.match_prefix("t", many[1000:1001]) == 0


def test_a_read_keeps_a_key_recent_in_the_spread_layout(redis_url):
    """Issue #60: in the spread layout a match touches each live key it read in its group's LRU, so a key read after
    newer ones were written is the last of them to go when the group's bound is passed."""
    d = redis_dir(redis_url, key_groups=2, max_keys_per_tenant=8)  # a group holds ceil(8 / 2) = 4 keys
    same = [k for k in (bytes([i, 7]) * 8 for i in range(200)) if d._group(k) == 0][:5]
    for k in same[:4]:  # k0 oldest
        d.publish("t", [Entry(k, "r", 1)])
    assert d.match_prefix("t", same[:1]) == 1  # read: k0 is now the group's newest
    d.publish("t", [Entry(same[4], "r", 1)])  # past the bound: the least recent goes
    assert sorted(d.keys("t")) == sorted([same[0], same[2], same[3], same[4]]) and d.evicted_by_capacity == 1
