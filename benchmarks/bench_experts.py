"""How ``adaptive``'s judge picks its expert, against what each expert does when it alone evicts.

For each trace and capacity: the best of LRU/ARC/S3-FIFO; adaptive (token hit ratio, who executed its evictions,
and each expert's mini-simulation hit ratio — what the judge saw); and each expert pinned
(``AdaptivePolicy(expert=...)``): the hit ratio it gets alone. The judge is right where adaptive lands on or near
the best expert alone; "regret" is that expert's points minus adaptive's.

    python benchmarks/bench_experts.py                          # mixed seeds 1, 101, 202 and the conversation trace
    python benchmarks/bench_experts.py --presets rag --seeds 202 --fractions 64 --no-trace --judge-second-half
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from _common import add_check_flag, print_table, report_targets, write_json

from kvpolicy.eviction.hit_density import AdaptivePolicy
from kvpolicy.eviction.kernels import replay_kernel
from kvpolicy.traces import generate, preset, read_trace

ROOT = Path(__file__).resolve().parents[1]
EXPERTS = AdaptivePolicy.EXPERTS


def point(trace, cap: int, k: int) -> dict:
    r0 = int(trace.block_offsets[k])
    tokens = max(int(trace.input_tokens[k:].sum()), 1)

    def pts(r) -> float:
        return 100 * int(r.hits[r0:].sum()) * trace.block_size_tokens / tokens

    classic = {p: pts(replay_kernel(trace, p, cap)) for p in ("lru", "arc", "s3fifo")}
    best = max(classic, key=classic.get)
    free = replay_kernel(trace, "adaptive", cap)
    pinned = {q: replay_kernel(trace, "adaptive", cap, expert=q) for q in EXPERTS}
    alone = replay_kernel(trace, "hit-density", cap)
    alone_pts = {q: pts(r) for q, r in pinned.items()}
    return {"pinned_density_is_hit_density": bool(np.array_equal(alone.victims, pinned["hit-density"].victims)), "capacity_blocks": cap,
            "best_classic": best, "best_classic_points": classic[best], "adaptive_points": pts(free),
            "evictions_by_expert": free.stats["evictions_by_expert"], "mini_sim_hit_ratio": free.stats["mini_sim_hit_ratio"],
            "alone_points": alone_pts, "regret_points": max(alone_pts.values()) - pts(free)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="mixed")
    ap.add_argument("--seeds", default="1,101,202")
    ap.add_argument("--fractions", default="64,16", help="capacities as 1/N of the distinct blocks (default 64,16)")
    ap.add_argument("--trace", default=str(ROOT / "data" / "mooncake_conversation_trace.jsonl.gz"))
    ap.add_argument("--no-trace", action="store_true")
    ap.add_argument("--judge-second-half", action="store_true", help="score only the second half's requests")
    ap.add_argument("--json", default=None)
    add_check_flag(ap)
    args = ap.parse_args(argv)
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s]
        fractions = [int(f) for f in args.fractions.split(",") if f]
    except ValueError:
        ap.error("--seeds and --fractions take comma-separated integers")
    if any(f <= 0 for f in fractions):
        ap.error("--fractions: positive integers")
    jobs = [] if args.no_trace else [("conversation (Mooncake)", lambda: read_trace(args.trace))]
    jobs += [(f"{p} seed {s}", lambda p=p, s=s: generate(preset(p, seed=s))) for p in args.presets.split(",") if p for s in seeds]
    rows, out = [], []
    for label, load in jobs:
        trace = load()
        k = len(trace) // 2 if args.judge_second_half else 0
        distinct = max(int(np.unique(trace.block_ids).size), 1)
        for f in fractions:
            res = point(trace, max(distinct // f, 1), k)
            res["trace"] = label + (", 2nd half" if k else "")
            out.append(res)
            ev = res["evictions_by_expert"]
            n = max(sum(ev.values()), 1)
            seen = res["mini_sim_hit_ratio"]
            row = [res["trace"], f"{res['capacity_blocks']:,} (1/{f})", f"{res['best_classic']} {res['best_classic_points']:.2f}",
                   f"{res['adaptive_points']:.2f}", "/".join(f"{100 * ev[q] / n:.0f}" for q in EXPERTS), "/".join(f"{100 * seen[q]:.1f}" for q in EXPERTS)]
            row += [f"{res['alone_points'][q]:.2f}" for q in EXPERTS] + [f"{res['regret_points']:+.2f}"]
            rows.append(row)
            print(f"  {res['trace']} 1/{f} done", file=sys.stderr, flush=True)
    print("token hit ratio (%); who evicted: share of adaptive's evictions by hit-density/lru/lfu; mini-simulations: their block hit "
          "ratio on the sampled keys (%); alone: each expert pinned; regret: the best expert alone minus adaptive\n")
    print_table(["trace", "capacity", "best classic", "adaptive", "who evicted %", "mini-simulations %", "alone hit-density", "alone lru",
                 "alone lfu", "regret"], rows)
    print(f"\nwrote {write_json('bench_experts', {'points': out}, args.json)}")
    # correctness: pinned to hit density, adaptive only watches — hit density's own victims, at every point
    return report_targets({"pinned hit-density evicts what hit-density does": all(p["pinned_density_is_hit_density"] for p in out)}, args.check)


if __name__ == "__main__":
    sys.exit(main())
