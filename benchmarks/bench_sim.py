"""Cluster simulator: speed against trace time, and the four load views on real and synthetic traces.

1. Speed — the whole Mooncake conversation trace (12,031 requests, ~59 minutes)
   on 8 replicas with the kvpolicy policy set, timed against the trace's own
   duration (target ≥ 500× trace time); recompute-only (no pool, no filter, no
   controller) beside it as the floor of the machinery's cost.
2. Every scenario × every policy set on the Mooncake trace (target: all 24 runs
   in under 3 minutes) and on the ``mixed`` synthetic preset at 256-token blocks,
   with the product targets checked per run (kvpolicy p95 ≤ recompute-only and
   < vllm-like in degraded and scale-out; ≥ 90 % of the best baseline's GPU
   seconds saved in steady with fewer bytes written; the oracle's p95 bounds).

    python benchmarks/bench_sim.py [--skip-mixed] [--json OUT]
"""

from __future__ import annotations

import argparse
import sys
import time

from _common import write_json
from bench_reuse import TRACE

from kvpolicy.publish_sim import DEFAULT_PREFILL
from kvpolicy.sim import Prepared, Simulator, compare, default_cluster, policy_set, render
from kvpolicy.traces import generate, preset, read_mooncake

BPT = 131072  # Llama-3-8B: 64 MiB per 512-token block


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--skip-mixed", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not TRACE.exists():
        print(f"skipped: {TRACE} not found")
        return 0
    trace = read_mooncake(TRACE)
    cl = default_cluster(trace, bytes_per_token=BPT, prefill=DEFAULT_PREFILL)
    prep = Prepared(trace)
    duration = float(trace.arrival_s[-1] - trace.arrival_s[0])
    speed = {}
    for name in ("recompute-only", "kvpolicy"):
        t0 = time.perf_counter()
        Simulator(prep, cl, policy_set(name)).run()
        wall = time.perf_counter() - t0
        speed[name] = {"wall_s": wall, "trace_s": duration, "x_trace_time": duration / wall}
    print(f"speed: Mooncake trace ({len(trace):,} requests, {duration:,.0f} s of traffic), 8 replicas, steady")
    for name, s in speed.items():
        print(f"  {name:>15}: {s['wall_s']:.2f} s  = {s['x_trace_time']:,.0f}x trace time"
              + ("   (target >= 500x)" if name == "kvpolicy" else ""))
    out = {"speed": speed}
    for label, tr in [("mooncake", trace)] + ([] if args.skip_mixed else [("mixed-256", generate(preset("mixed", block_size_tokens=256)))]):
        c = cl if label == "mooncake" else default_cluster(tr, bytes_per_token=BPT, prefill=DEFAULT_PREFILL)
        t0 = time.perf_counter()
        report, _ = compare(tr, c)
        wall = time.perf_counter() - t0
        report["wall_s"] = wall
        out[label] = report
        print(f"\n### {label}: all scenarios x policy sets in {wall:.1f} s" + ("   (target < 180 s)" if label == "mooncake" else ""))
        print(render(report))
    path = write_json("sim", out, args.json)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
