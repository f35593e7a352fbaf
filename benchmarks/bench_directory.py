"""Directory: Redis match_prefix in one round trip vs per-key lookups; vLLM KV events ingested per second.

1. ``match_prefix`` of a 64-block chain held in Redis: the Lua script (one
   EVALSHA round trip) against the naive client loop of one EXISTS per key, on a
   real redis-server over loopback; median of many calls, and the ratio.
2. vLLM ``KVEventBatch`` payloads (msgpack; 16 BlockStored events of 4 blocks ×
   16 tokens each, chained, plus their BlockRemoved) decoded, keyed and applied to
   the in-memory and the Redis directory: events and blocks per second.

3. ``--cluster`` (issue #48): a Redis Cluster of 3 masters (+3 replicas) on loopback beside one redis-server: match
   latency (16-block chains), match throughput from ``--clients`` processes for ``--seconds`` each (1 node, default
   layout, against 3 shards, spread layout), and the share of keys on each master — one tenant of 30,000 keys and 100
   tenants of 300 — for the default layout (a tenant in one slot) and the spread one (``--key-groups``, 256). Each
   server's CPU per match is what it spent less its idle rate; "serial" is the same with one client asking one match at
   a time (``--calls`` of them), so that the servers' own cost is seen without the other processes on the cores.

Uses KVPOLICY_REDIS_URL if set, else starts a private redis-server.

    python benchmarks/bench_directory.py [--calls 2000] [--json OUT]
    python benchmarks/bench_directory.py --cluster [--clients 2] [--seconds 5]
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid

from _common import add_check_flag, report_targets, best_of, write_json

from kvpolicy.directory import Entry, InMemoryDirectory, RedisDirectory
from kvpolicy.integrations.vllm_events import BlockRemoved, BlockStored, KVEventIngestor, encode_batch
from kvpolicy.keys import BlockHasher, Namespace


def _server() -> tuple[str, subprocess.Popen | None]:
    url = os.environ.get("KVPOLICY_REDIS_URL")
    if url:
        return url, None
    if shutil.which("redis-server") is None:
        raise SystemExit("skipped: no redis-server (set KVPOLICY_REDIS_URL or install redis-server)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
            break
        except OSError:
            time.sleep(0.05)
    return f"redis://127.0.0.1:{port}/0", p


def _median_us(fn, calls: int) -> float:
    return best_of(fn, repeats=calls, warmup=50) * 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_check_flag(ap)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--json", default=None)
    ap.add_argument("--cluster", action="store_true", help="also measure a local 3-master Redis Cluster")
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--key-groups", type=int, default=256)
    args = ap.parse_args(argv)
    url, proc = _server()
    try:
        d = RedisDirectory(url=url, prefix=f"bench{uuid.uuid4().hex[:6]}")
        chain = [bytes([9, i]) * 8 for i in range(64)]
        d.publish("bench", [Entry(k, "node-0", 1 << 20) for k in chain])
        assert d.match_prefix("bench", chain) == 64 == d.match_prefix_per_key("bench", chain)
        lua = _median_us(lambda: d.match_prefix("bench", chain), args.calls)
        naive = _median_us(lambda: d.match_prefix_per_key("bench", chain), max(args.calls // 4, 100))
        print("match_prefix of a 64-block chain on redis-server (loopback)")
        print(f"  one round trip (Lua) : {lua:8.1f} us")
        print(f"  one EXISTS per key   : {naive:8.1f} us")
        print(f"  speedup              : {naive / lua:8.1f}x")

        B = 16
        ns = Namespace(model_id="m", model_revision="r", tokenizer_version="t", kv_dtype="bf16", block_size_tokens=B)
        hasher = BlockHasher(ns, "fast")
        batches = []
        seq = 0
        for b in range(200):
            events = []
            parent = None
            for e in range(16):
                hashes = [seq + i for i in range(4)]
                seq += 4
                toks = [(b * 7919 + e * 104729 + i) % 150000 for i in range(4 * B)]
                events.append(BlockStored(tuple(hashes), parent, tuple(toks), B, None, "GPU"))
                parent = hashes[-1]
            batches.append(encode_batch(float(b), events))
            batches.append(encode_batch(float(b) + 0.5, [BlockRemoved(tuple(range(seq - 8, seq)), "GPU")]))
        n_events = sum(17 for _ in range(200))
        res = {"match64_lua_us": lua, "match64_per_key_us": naive, "match64_speedup": naive / lua}
        print(f"\nvLLM KV events: {len(batches)} batches, {n_events:,} events, {200 * 16 * 4:,} blocks stored")
        for name, directory in (("in-memory", InMemoryDirectory()), ("redis", RedisDirectory(url=url, prefix=f"ev{uuid.uuid4().hex[:6]}"))):
            ing = KVEventIngestor(directory, "bench", hasher, holder="pod-0", bytes_per_token=131072)
            t0 = time.perf_counter()
            for p in batches:
                ing.ingest(p)
            dt = time.perf_counter() - t0
            assert ing.counts["stored_blocks"] == 200 * 16 * 4 and ing.counts["malformed_frames"] == 0
            print(f"  {name:>9}: {n_events / dt:10,.0f} events/s  {200 * 64 / dt:10,.0f} blocks/s")
            res[f"events_per_s_{name}"] = n_events / dt
            res[f"blocks_per_s_{name}"] = 200 * 64 / dt
        targets = {"one-round-trip match faster than one EXISTS per key": res["match64_speedup"] > 1.0}
        if args.cluster:
            targets.update(_cluster_section(url, args, res))
        rc = report_targets(targets, args.check)
        path = write_json("directory", res, args.json)
        print(f"\nwrote {path}")
    finally:
        if proc is not None:
            proc.kill()
    return rc


def _chains(n: int, seed: int) -> list[list[bytes]]:
    return [[uuid.UUID(int=(seed << 64) + c * 64 + j).bytes for j in range(16)] for c in range(n)]


def _redis_at(url: str):
    import redis

    return redis.Redis.from_url(url)


def _cpu_s(r) -> float:
    info = r.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def _match_loop(spec: tuple[str, bool, int, str, float, int]) -> int:
    """One client process: match its chains round-robin for ``seconds``; the number of matches."""
    url, cluster, groups, prefix, seconds, seed = spec
    d = RedisDirectory(url=url, cluster=cluster, key_groups=groups, prefix=prefix)
    chains = _chains(50, seed)
    end = time.perf_counter() + seconds
    n = 0
    while time.perf_counter() < end:
        assert d.match_prefix("bench", chains[n % 50]) == 16
        n += 1
    return n


def _shares(c, d_factory, tenants: int, keys_per_tenant: int) -> dict[int, float]:
    for p in c.master_ports():
        c.cli(p, "flushall")
    d = d_factory()
    for t in range(tenants):
        keys = [uuid.UUID(int=(t << 64) + i).bytes for i in range(keys_per_tenant)]
        for lo in range(0, len(keys), 1000):
            d.publish(f"t{t}", [Entry(k, "h", 1) for k in keys[lo:lo + 1000]])
    counts = {p: int(c.cli(p, "dbsize").strip() or 0) for p in c.master_ports()}
    total = sum(counts.values())
    return {p: n / total for p, n in counts.items()}


def _cluster_section(url: str, args: argparse.Namespace, res: dict) -> dict[str, bool]:
    import tempfile
    from concurrent.futures import ProcessPoolExecutor

    from kvpolicy.testing.redis_cluster import LocalRedisCluster

    c = LocalRedisCluster(tempfile.mkdtemp(prefix="kvp-cluster-"))
    c.start()
    try:
        G = args.key_groups
        setups = {"1 node, one slot per tenant": (url, False, 1), "1 node, spread": (url, False, G),
                  "3 shards, spread": (c.url, True, G)}
        print(f"\nRedis Cluster: 3 masters + 3 replicas on loopback; spread layout = {G} key groups")
        print(f"{'setup':>30} {'match16 us':>11} {'matches/s, ' + str(args.clients) + ' clients':>24} "
              f"{'busiest server CPU us':>22} {'server capacity/s':>22}")
        for name, (u, cl, g) in setups.items():
            prefix = f"b{uuid.uuid4().hex[:6]}"
            d = RedisDirectory(url=u, cluster=cl, key_groups=g, prefix=prefix)
            for seed in range(args.clients):
                for ch in _chains(50, seed):
                    d.publish("bench", [Entry(k, "h", 1) for k in ch])
            one = _chains(1, 0)[0]
            lat = _median_us(lambda: d.match_prefix("bench", one), args.calls)
            servers = [_redis_at(f"redis://127.0.0.1:{p}/0") for p in c.master_ports()] if cl else [_redis_at(u)]
            # each server's own background (a cluster's bus and replication pings, cron): its CPU over an idle window,
            # taken off what it spends under the load — else it is charged to the matches, more so the fewer there are
            idle0 = [_cpu_s(r) for r in servers]
            t_idle = time.perf_counter()
            time.sleep(min(args.seconds, 2.0))
            idle_rate = [(_cpu_s(r) - a) / (time.perf_counter() - t_idle) for r, a in zip(servers, idle0)]
            cpu0 = [_cpu_s(r) for r in servers]
            t0 = time.perf_counter()
            with ProcessPoolExecutor(args.clients) as ex:
                n = sum(ex.map(_match_loop, [(u, cl, g, prefix, args.seconds, s) for s in range(args.clients)]))
            elapsed = time.perf_counter() - t0
            # the busiest server's CPU per match, its background taken off
            busiest_us = max(max(_cpu_s(r) - a - rate * elapsed, 0.0) for r, a, rate in zip(servers, cpu0, idle_rate)) / n * 1e6
            rate = n / args.seconds
            # one client, one match at a time: each server's CPU per match with nothing else asking (its idle rate off)
            chains = _chains(50, 0)
            cpu0 = [_cpu_s(r) for r in servers]
            t0 = time.perf_counter()
            for i in range(args.calls):
                d.match_prefix("bench", chains[i % 50])
            elapsed = time.perf_counter() - t0
            serial_us = [max(_cpu_s(r) - a - rate_ * elapsed, 0.0) / args.calls * 1e6 for r, a, rate_ in zip(servers, cpu0, idle_rate)]
            print(f"{name:>30} {lat:11.1f} {rate:24,.0f} {busiest_us:22.1f} {1e6 / busiest_us:22,.0f}   serial, each server: "
                  + " ".join(f"{x:.1f}" for x in serial_us))
            res[f"cluster_{name}_serial_server_cpu_us_per_match"] = serial_us
            res[f"cluster_{name}_match16_us"] = lat
            res[f"cluster_{name}_matches_per_s"] = rate
            res[f"cluster_{name}_busiest_server_cpu_us_per_match"] = busiest_us
            res[f"cluster_{name}_server_capacity_matches_per_s"] = 1e6 / busiest_us
        print(f"\nshare of keys per master (ideal 33.3 %)")
        targets = {}
        for label, tenants, per in (("1 tenant x 30,000 keys", 1, 30_000), ("100 tenants x 300 keys", 100, 300)):
            for layout, g in (("one slot per tenant", 1), (f"spread, {G} groups", G)):
                sh = _shares(c, lambda g=g: RedisDirectory(url=c.url, cluster=True, key_groups=g, prefix="kvp"), tenants, per)
                vals = sorted(sh.values())
                print(f"  {label:>24}, {layout:>22}: " + "  ".join(f"{v:6.1%}" for v in vals))
                res[f"shares_{label}_{layout}"] = vals
            worst = max(abs(v - 1 / 3) * 3 for v in res[f"shares_{label}_spread, {G} groups"])
            targets[f"{label}: every shard within +-10 % of a third (spread)"] = worst <= 0.10
        r1 = res["cluster_1 node, one slot per tenant_matches_per_s"]
        r3 = res["cluster_3 shards, spread_matches_per_s"]
        s1 = res["cluster_1 node, spread_server_capacity_matches_per_s"]
        s3 = res["cluster_3 shards, spread_server_capacity_matches_per_s"]
        print(f"\nmatches/s measured, 3 shards over 1 node (one slot per tenant): {r3 / r1:.2f}x — every process shares this "
              f"machine's cores, so this is the clients' cost")
        print(f"server capacity (1 / the busiest server's CPU per match), 3 shards over 1 node (spread): {s3 / s1:.2f}x")
        res["cluster_throughput_ratio"] = r3 / r1
        res["cluster_server_capacity_ratio"] = s3 / s1
        targets["matches/s grow with shards (3 shards > 1 node)"] = r3 > r1
        targets["server capacity grows with shards (3 shards > 1 node, spread)"] = s3 > s1
        return targets
    finally:
        c.stop()


if __name__ == "__main__":
    sys.exit(main())
