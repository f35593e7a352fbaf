"""Directory: Redis match_prefix in one round trip vs per-key lookups; vLLM KV events ingested per second.

1. ``match_prefix`` of a 64-block chain held in Redis: the Lua script (one
   EVALSHA round trip) against the naive client loop of one EXISTS per key, on a
   real redis-server over loopback; median of many calls, and the ratio.
2. vLLM ``KVEventBatch`` payloads (msgpack; 16 BlockStored events of 4 blocks ×
   16 tokens each, chained, plus their BlockRemoved) decoded, keyed and applied to
   the in-memory and the Redis directory: events and blocks per second.

Uses KVPOLICY_REDIS_URL if set, else starts a private redis-server.

    python benchmarks/bench_directory.py [--calls 2000] [--json OUT]
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
        rc = report_targets({"one-round-trip match faster than one EXISTS per key": res["match64_speedup"] > 1.0}, args.check)
        path = write_json("directory", res, args.json)
        print(f"\nwrote {path}")
    finally:
        if proc is not None:
            proc.kill()
    return rc


if __name__ == "__main__":
    sys.exit(main())
