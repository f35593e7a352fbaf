"""The Redis directory on a real Redis Cluster (issue #48): 3 masters with a replica each, started on loopback by the
``redis_cluster`` fixture. The spread layout (``key_groups`` > 1) against the in-memory reference, on one server and on
the cluster; one tenant's keys over the shards; tenant ACLs on every node; a master killed under traffic."""

import threading
import time
import uuid

import pytest

from kvpolicy.directory import Entry, InMemoryDirectory
from kvpolicy.directory.redis import RedisDirectory, balanced_tags, tenant_acl_rules
from kvpolicy.errors import ConfigError
from kvpolicy.testing import contract_test
from kvpolicy.testing.contracts import DirectoryContract


def _prefix():
    return f"c{uuid.uuid4().hex[:10]}"


def cluster_dir(c, **kw):
    return RedisDirectory(url=c.url, cluster=True, prefix=kw.pop("prefix", _prefix()), **kw)


def shard_shares(c, tenant_keys_pattern="*"):
    """Keys per master (DBSIZE), as shares of the total."""
    counts = {p: int(c.cli(p, "dbsize").strip() or 0) for p in c.master_ports()}
    total = sum(counts.values())
    return {p: n / total for p, n in counts.items()}, total


# ------------------------------------------------------------------------------------------------ the layout itself


def test_balanced_tags_cover_the_slots_in_order():
    from redis.crc import key_slot

    tags = balanced_tags(64)
    assert len(set(tags)) == 64 and not any(ch in t for t in tags for ch in "{}")
    for g, t in enumerate(tags):
        assert g * 256 <= key_slot(t.encode()) < (g + 1) * 256


@pytest.mark.parametrize("bad", [0, -1, 1025, 2.0, True, "8"])
def test_key_groups_out_of_range_are_refused_by_name(redis_url, bad):
    with pytest.raises(ConfigError, match="key_groups"):
        RedisDirectory(url=redis_url, key_groups=bad)


def test_each_group_holds_its_share_of_the_bound(redis_url):
    """max_keys_per_tenant 64 over 8 groups: each group keeps at most 8 (its oldest go); the tenant at most 64."""
    d = RedisDirectory(url=redis_url, prefix=_prefix(), key_groups=8, max_keys_per_tenant=64)
    keys = [uuid.UUID(int=i).bytes for i in range(400)]
    for lo in range(0, 400, 20):
        d.publish("t", [Entry(k, "h", 1) for k in keys[lo:lo + 20]])
    kept = d.keys("t")
    per_group = {}
    for k in kept:
        per_group[d._group(k)] = per_group.get(d._group(k), 0) + 1
    assert max(per_group.values()) <= d.group_max_keys == 8 and len(kept) <= 64
    assert len(kept) >= 56, "every group is full: 400 keys spread over 8 groups"
    assert d.evicted_by_capacity == 400 - len(kept)
    newest = keys[-20:]
    assert sum(d.match_prefix("t", [k]) for k in newest) >= 15, "the newest survive their groups' LRU"


# ------------------------------------------------------------------------------------------------ the contract


class _SpreadSingle(DirectoryContract):
    url = None
    EXACT_BOUND = False

    def make_directory(self, max_keys):
        return RedisDirectory(url=self.url, prefix=_prefix(), max_keys_per_tenant=max_keys, key_groups=4)


class _SpreadCluster(DirectoryContract):
    cluster = None
    EXACT_BOUND = False

    def make_directory(self, max_keys):
        return cluster_dir(self.cluster, max_keys_per_tenant=max_keys, key_groups=16)


class _OneSlotCluster(DirectoryContract):
    """The default layout on a cluster: a tenant in one slot, the bound exact."""

    cluster = None

    def make_directory(self, max_keys):
        return cluster_dir(self.cluster, max_keys_per_tenant=max_keys)


@pytest.fixture
def _wire(redis_url, redis_cluster):
    _SpreadSingle.url = redis_url
    _SpreadCluster.cluster = redis_cluster
    _OneSlotCluster.cluster = redis_cluster
    yield


@pytest.mark.usefixtures("_wire")
class TestSpreadOnOneServer(contract_test(_SpreadSingle, max_examples=10)):
    pass


@pytest.mark.usefixtures("_wire")
class TestSpreadOnTheCluster(contract_test(_SpreadCluster, max_examples=10)):
    pass


@pytest.mark.usefixtures("_wire")
class TestOneSlotTenantOnTheCluster(contract_test(_OneSlotCluster, max_examples=8)):
    pass


def test_a_match_is_one_round_trip_per_node_in_parallel(redis_cluster, monkeypatch):
    """40 chained keys over 64 groups: one pipeline per master, each executed once."""
    d = cluster_dir(redis_cluster, key_groups=64)
    chain = [uuid.UUID(int=7_000 + i).bytes for i in range(40)]
    d.publish("t", [Entry(k, "h", 1) for k in chain])
    import redis.client

    executed = []
    orig = redis.client.Pipeline.execute

    def counting(self, *a, **kw):
        executed.append(len(self.command_stack))
        return orig(self, *a, **kw)

    monkeypatch.setattr(redis.client.Pipeline, "execute", counting)
    assert d.match_prefix("t", chain) == 40
    assert 1 < len(executed) <= 3, f"{executed}: one pipeline per master"
    assert executed == [1] * len(executed), f"{executed}: each master's groups in one script (allow-cross-slot-keys)"
    executed.clear()
    d.node_scripts = False  # a script per group, as for a server without script flags
    assert d.match_prefix("t", chain) == 40
    assert 1 < len(executed) <= 3 and sum(executed) > len(executed), f"{executed}: one script per group"


class _SpreadPerGroup(DirectoryContract):
    """The spread layout's match with one script per group (what a server without script flags gets)."""

    url = None
    EXACT_BOUND = False

    def make_directory(self, max_keys):
        d = RedisDirectory(url=self.url, prefix=_prefix(), max_keys_per_tenant=max_keys, key_groups=4)
        d.node_scripts = False
        return d


@pytest.fixture
def _wire_per_group(redis_url):
    _SpreadPerGroup.url = redis_url
    yield


@pytest.mark.usefixtures("_wire_per_group")
class TestSpreadPerGroupOnOneServer(contract_test(_SpreadPerGroup, max_examples=10)):
    pass


def test_a_server_that_refuses_the_node_script_is_asked_per_group_from_then_on(redis_url, monkeypatch):
    """Redis before 7.0 does not know script flags: it answers the per-node script with an error about its shebang.
    The match is asked again one script per group, gives the right answer, and the directory stays on that path."""
    import redis.exceptions

    d = RedisDirectory(url=redis_url, prefix=_prefix(), key_groups=8)
    chain = [uuid.UUID(int=9_000 + i).bytes for i in range(12)]
    d.publish("t", [Entry(k, "h", 1) for k in chain[:9]])
    batch = d._batch
    calls = []

    def old_server(cmds):
        calls.append([c[2][0] for c in cmds])
        if any(sha == d._match_node.sha for sha in calls[-1]):
            return [redis.exceptions.ResponseError("Unexpected engine in script shebang: flags")] * len(cmds)
        return batch(cmds)

    monkeypatch.setattr(d, "_batch", old_server)
    assert d.match_prefix("t", chain) == 9 and d.node_scripts is False
    assert d.match_prefix("t", chain[:5]) == 5
    assert [all(sha == d._match_each.sha for sha in c) for c in calls] == [False, True, True]


def test_expiry_and_leases_on_the_cluster(redis_cluster):
    d = cluster_dir(redis_cluster, key_groups=16)
    ref = InMemoryDirectory()
    now = time.time()
    chain = [uuid.UUID(int=9_000 + i).bytes for i in range(12)]
    for dd in (d, ref):
        dd.publish("t", [Entry(k, "a", 1) for k in chain[:6]] + [Entry(k, "a", 1, expires_at_s=now + 0.6) for k in chain[6:]])
    assert d.match_prefix("t", chain) == ref.match_prefix("t", chain) == 12
    lease = d.lease("t", chain[:4], ttl_s=30.0)
    assert d.evict("t", chain[:6]) == 2, "the 4 leased keys stay"
    time.sleep(0.8)
    assert d.match_prefix("t", chain) == 4, "the leased head is there; the expired tail is gone"
    d.release(lease)
    assert d.evict("t", chain[:4]) == 4 and d.match_prefix("t", chain) == 0
    assert d.errors == 0


# ------------------------------------------------------------------------------------------------ spreading


def test_one_large_tenant_spreads_evenly_over_the_three_shards(redis_cluster):
    """9,000 keys of one tenant: the default layout puts them all on one master; 256 groups put each master within
    ±10 % of a third."""
    for p in redis_cluster.master_ports():
        redis_cluster.cli(p, "flushall")
    keys = [uuid.UUID(int=50_000 + i).bytes for i in range(9_000)]
    one = cluster_dir(redis_cluster)
    one.publish("big", [Entry(k, "h", 1) for k in keys])
    shares, _ = shard_shares(redis_cluster)
    assert max(shares.values()) > 0.99, f"{shares}: a tenant in one slot lives on one shard"
    for p in redis_cluster.master_ports():
        redis_cluster.cli(p, "flushall")
    spread = cluster_dir(redis_cluster, key_groups=256)
    for lo in range(0, len(keys), 1000):
        spread.publish("big", [Entry(k, "h", 1) for k in keys[lo:lo + 1000]])
    shares, total = shard_shares(redis_cluster)
    assert total >= 9_000 and len(shares) == 3
    for p, sh in shares.items():
        assert abs(sh - 1 / 3) <= 0.1 / 3, f"master {p} holds {sh:.1%} of the keys"
    assert spread.match_prefix("big", keys[:500]) == 500


# ------------------------------------------------------------------------------------------------ tenants


def test_a_tenant_acl_confines_a_connection_on_every_node(redis_cluster):
    owner = cluster_dir(redis_cluster, prefix="kvp", key_groups=16)
    shas = owner.load_scripts()
    for p in redis_cluster.ports:  # replicas too: a promoted replica serves tenants, who cannot load scripts
        assert redis_cluster.cli(p, "script", "exists", *shas).split() == ["1"] * len(shas), p
    for p in redis_cluster.master_ports() + [q for q in redis_cluster.ports if q not in redis_cluster.master_ports()]:
        redis_cluster.cli(p, "acl", "setuser", "tenant-acme", "reset", "on", ">acme-password-0123456789",
                          *tenant_acl_rules("acme", "kvp", spread=True, cluster=True))
    url = redis_cluster.url.replace("redis://", "redis://tenant-acme:acme-password-0123456789@")
    acme = RedisDirectory(url=url, cluster=True, prefix="kvp", key_groups=16)
    chain = [uuid.UUID(int=70_000 + i).bytes for i in range(20)]
    assert acme.publish("acme", [Entry(k, "h", 1) for k in chain]) == 20
    assert acme.match_prefix("acme", chain) == 20 and owner.match_prefix("acme", chain) == 20
    owner.publish("other", [Entry(k, "h", 1) for k in chain])
    assert acme.match_prefix("other", chain) == 0 and acme.publish("other", [Entry(chain[0], "x", 1)]) == 0
    assert acme.denied > 0 and acme.errors >= acme.denied, "refused by the ACL, answered as misses, counted"
    assert owner.lookup("other", chain[:1])[0][0].holder == "h", "nothing of the other tenant changed"


# ------------------------------------------------------------------------------------------------ failover


def test_a_master_killed_under_traffic_returns_nothing_wrong_and_counts_the_misses(redis_cluster):
    """Two writers publish chains and match them back while a master is killed; its replica is promoted. No match ever
    answers more than was published for its chain; the failures are counted as errors (misses); afterwards every shard
    serves again."""
    d = cluster_dir(redis_cluster, key_groups=64, socket_timeout_s=0.5)
    stop = threading.Event()
    wrong: list[str] = []
    done = {"matches": 0}

    def writer(w):
        i = 0
        while not stop.is_set():
            chain = [uuid.UUID(int=(w << 40) + i * 100 + j).bytes for j in range(8)]
            n_pub = d.publish("t", [Entry(k, f"h{w}", 1) for k in chain])
            got = d.match_prefix("t", chain)
            if got > 8:
                wrong.append(f"matched {got} of 8")
            never = [uuid.UUID(int=(w << 40) + i * 100 + 50 + j).bytes for j in range(4)]
            if d.match_prefix("t", never):
                wrong.append("matched a chain never published")
            done["matches"] += 1
            del n_pub
            i += 1

    threads = [threading.Thread(target=writer, args=(w,)) for w in (1, 2)]
    for t in threads:
        t.start()
    try:
        time.sleep(1.0)
        victim = redis_cluster.master_ports()[0]
        before = d.errors
        redis_cluster.kill(victim)
        deadline = time.time() + 30
        while time.time() < deadline:  # until its replica is a master with slots (a "fail?" master is not counted)
            masters = redis_cluster.master_ports()
            if victim not in masters and len(masters) == 3:
                break
            time.sleep(0.2)
        redis_cluster.wait_ok()
        time.sleep(1.5)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
    assert not wrong, wrong[:5]
    assert d.errors > before, "the dead master's calls were misses, counted"
    assert victim not in redis_cluster.master_ports() and len(redis_cluster.master_ports()) == 3, "its replica took over"
    fresh = [uuid.UUID(int=(9 << 40) + j).bytes for j in range(64)]
    assert d.publish("t", [Entry(k, "h", 1) for k in fresh]) == 64
    assert d.match_prefix("t", fresh) == 64, "every shard serves again after the failover"
    assert done["matches"] > 10
