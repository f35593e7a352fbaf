"""Learned relaxed Belady (lrb, :mod:`kvpolicy.eviction.learned`) against hit density, adaptive, LRU and Belady.

Issue #20's first "direction worth measuring". ``lrb`` ranks the same 16 sampled leaves as hit density by the
probability, from an online logistic model, that the block is used again within a horizon H (H = ``--horizon`` ×
the mean eviction age). Per point: the token hit ratio, the share of the LRU -> Belady gap closed, and the model's
calibration: on the window of its last fit (mean prediction against positive rate: equal at the optimum; ``--check``
fails past 0.02, a diverged fit) and out of sample (its predictions at the decisions against what then happened).

The defaults run the tuning seeds 1-2 (pass ``--seeds 101,202`` for the reporting ones). Nothing is chosen on the
conversation trace.

    python benchmarks/bench_learned_eviction.py [--presets chat,agent] [--seeds 1,2] [--trace FILE] [--horizon 1]
    kvpolicy evict-bench FILE --policies lrb,adaptive [--judge-second-half]

lrb replays through its kernel (``replay_kernel(trace, "lrb", ...)``, victim for victim the online policy's): seconds
a point.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from kvpolicy.eviction.kernels import replay_kernel
from kvpolicy.traces import generate, preset, read_trace

from _common import add_check_flag, print_table, report_targets, write_json


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="chat,agent", help="synthetic presets ('' for none)")
    ap.add_argument("--trace", default=None, help="a Mooncake-format trace file to add (e.g. data/mooncake_conversation_trace.jsonl.gz)")
    ap.add_argument("--seeds", default="1,2")
    ap.add_argument("--fractions", default="64,16", help="capacities as 1/N of the distinct blocks")
    ap.add_argument("--horizon", type=float, default=1.0, help="H as a multiple of the mean eviction age")
    ap.add_argument("--json", default=None)
    add_check_flag(ap)
    args = ap.parse_args(argv)
    rows, out = [], []
    runs = [(f"{name} seed {seed}", name, seed) for name in args.presets.split(",") if name for seed in (int(x) for x in args.seeds.split(","))]
    if args.trace:
        runs.append((Path(args.trace).name, args.trace, None))
    for label, name, seed in runs:
        trace = read_trace(name) if seed is None else generate(preset(name, seed=seed))
        distinct = int(np.unique(trace.block_ids).size)
        for frac in (int(f) for f in args.fractions.split(",")):
            cap = distinct // frac
            pts = {p: 100 * replay_kernel(trace, p, cap).token_hit_ratio() for p in ("lru", "hit-density", "adaptive", "belady")}
            lrb = replay_kernel(trace, "lrb", cap, horizon=args.horizon)
            pts["lrb"] = 100 * lrb.token_hit_ratio()
            m = lrb.stats
            gap = pts["belady"] - pts["lru"]
            closed = {p: (v - pts["lru"]) / gap if gap > 0 else float("nan") for p, v in pts.items()}
            mean_p, rate = m["window_mean_prediction"], m["window_positive_rate"]
            oos_p, oos_rate, oos_n = m["out_of_sample_mean_prediction"], m["out_of_sample_positive_rate"], m["out_of_sample_labels"]
            rows.append([label, f"1/{frac} ({cap:,})", f"{pts['lru']:.2f}"]
                        + [f"{pts[p]:.2f} ({closed[p]:+.0%})" for p in ("hit-density", "adaptive", "lrb")]
                        + [f"{pts['belady']:.2f}", f"{mean_p:.3f} / {rate:.3f}", f"{oos_p:.3f} / {oos_rate:.3f}"])
            out.append({"trace": label, "preset": name if seed is not None else None, "seed": seed, "capacity_blocks": cap, "token_hit_points": pts, "gap_closed": closed,
                        "labels": m["labels"], "fits": m["fits"], "window_mean_prediction": mean_p, "window_positive_rate": rate,
                        "out_of_sample_mean_prediction": oos_p, "out_of_sample_positive_rate": oos_rate, "out_of_sample_labels": oos_n})
            print("  " + "  ".join(rows[-1]), file=sys.stderr, flush=True)
    print("token hit ratio (%), [share of the LRU -> Belady gap closed]\n")
    print_table(["trace", "capacity", "lru", "hit-density", "adaptive", "lrb", "belady", "lrb fit: mean P / rate", "out of sample: mean P / rate"], rows)
    print(f"\nwrote {write_json('bench_learned_eviction', {'runs': out, 'horizon': args.horizon}, args.json)}")
    ok_bound = all(max(v for k, v in r["token_hit_points"].items() if k != "belady") <= r["token_hit_points"]["belady"] + 1e-9 for r in out)
    ok_fit = all(abs(r["window_mean_prediction"] - r["window_positive_rate"]) < 0.02 for r in out)
    return report_targets({"belady bounds every policy": ok_bound, "each last fit is calibrated on its window (within 0.02)": ok_fit}, args.check)


if __name__ == "__main__":
    sys.exit(main())
