"""`kvpolicy compare`'s grid on local processes (issue #48): wall time at --jobs 1 and --jobs N, side by side, with the
same report, and the scaling the per-job times predict for more workers.

    python benchmarks/bench_sweep.py                       # the conversation trace, every view, every set (~4 min on 2 cores)
    python benchmarks/bench_sweep.py --preset mixed --jobs 2
    python benchmarks/bench_sweep.py --ray local           # the same grid on a local Ray cluster as well

Each (scenario, policy set) run is timed in the sequential pass. Predicted wall time at W workers, from those times:
max(longest run, Σ runs / W) + the measured start-up of the pool (greedy longest-first assignment is within 4/3 of
that bound; the sweep hands jobs out in grid order, so the prediction is a lower bound).
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys
import time
from typing import Any

from _common import print_table, write_json
from bench_reuse import TRACE

from kvpolicy.publish_sim import DEFAULT_PREFILL
from kvpolicy.sim import compare, default_cluster
from kvpolicy.sweep import Sweep, default_jobs
from kvpolicy.traces import generate, preset, read_mooncake

BPT = 131072


def greedy_makespan(times: list[float], workers: int) -> float:
    """Wall time of handing jobs, in order, to the first free of ``workers`` (what a process pool does)."""
    free = [0.0] * workers
    for t in times:
        heapq.heapreplace(free, free[0] + t)
    return max(free)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default=None, help="a synthetic preset instead of the conversation trace")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--jobs", type=int, default=default_jobs())
    ap.add_argument("--ray", default=None, help="also run the grid on Ray at this address ('local' starts one)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    trace = generate(preset(args.preset, block_size_tokens=256, seed=args.seed)) if args.preset else read_mooncake(TRACE)
    cl = default_cluster(trace, bytes_per_token=BPT, prefill=DEFAULT_PREFILL)

    # the sequential pass, each job timed (the job function wrapped in this process only)
    cm = sys.modules["kvpolicy.sim.compare"]  # the module (kvpolicy.sim.compare the attribute is the function)

    per_job: list[tuple[str, float]] = []
    orig = cm._run_job

    def timed(grid: Any, spec: Any) -> Any:
        t0 = time.perf_counter()
        res = orig(grid, spec)
        per_job.append((f"{spec[0]} / {spec[1].name}", time.perf_counter() - t0))
        return res

    cm._run_job = timed
    t0 = time.perf_counter()
    seq, _ = compare(trace, cl, seed=args.seed)
    wall_seq = time.perf_counter() - t0
    cm._run_job = orig

    rows = [["sequential (--jobs 1)", f"{wall_seq:.1f}", "1.00x", "-"]]
    out: dict[str, Any] = {"trace": trace.source, "requests": len(trace), "jobs": args.jobs, "wall_sequential_s": wall_seq,
                           "per_job_s": dict(per_job)}
    t0 = time.perf_counter()
    par, _ = compare(trace, cl, seed=args.seed, sweep=Sweep(jobs=args.jobs))
    wall_par = time.perf_counter() - t0
    same = json.dumps(par, sort_keys=True, default=str) == json.dumps(seq, sort_keys=True, default=str)
    rows.append([f"--jobs {args.jobs}", f"{wall_par:.1f}", f"{wall_seq / wall_par:.2f}x", "identical" if same else "DIFFERENT"])
    out.update(wall_parallel_s=wall_par, speedup=wall_seq / wall_par, identical=same)
    if args.ray:
        t0 = time.perf_counter()
        rr, _ = compare(trace, cl, seed=args.seed, sweep=Sweep(jobs=args.jobs, ray_address=args.ray))
        wall_ray = time.perf_counter() - t0
        same_r = json.dumps(rr, sort_keys=True, default=str) == json.dumps(seq, sort_keys=True, default=str)
        rows.append([f"--ray {args.ray}", f"{wall_ray:.1f}", f"{wall_seq / wall_ray:.2f}x", "identical" if same_r else "DIFFERENT"])
        out.update(wall_ray_s=wall_ray, ray_identical=same_r)
    print(f"{trace.source}: {len(trace):,} requests, {len(per_job)} runs (scenario x policy set)\n")
    print_table(["run", "wall s", "speed-up", "report"], rows)

    times = [t for _, t in per_job]
    total, longest = sum(times), max(times)
    overhead = max(wall_par - greedy_makespan(times, args.jobs), 0.0)
    print(f"\nper run: total {total:.1f} s, longest {longest:.1f} s ({max(per_job, key=lambda x: x[1])[0]}); "
          f"pool start-up and transfer overhead at --jobs {args.jobs}: {overhead:.1f} s")
    pred = []
    for w in (1, 2, 4, 8, 16, 32):
        m = greedy_makespan(times, w) + (overhead if w > 1 else 0.0)
        pred.append([w, f"{m:.1f}", f"{wall_seq / m:.2f}x", f"{max(longest, total / w):.1f}"])
    print("\nexpected scaling from the per-run times (in grid order, as the pool hands them out):")
    print_table(["workers", "predicted wall s", "speed-up", "bound max(longest, total/W) s"], pred)
    out["predicted"] = {str(r[0]): float(r[1]) for r in pred}
    path = write_json("sweep", out, args.json)
    print(f"\nwrote {path}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
