"""Simulator speed (issue #48): trace time per wall second, today's code against a baseline commit run side by side,
with every decision compared, and the cost curve over 1x, 4x and 16x the trace.

1. Side by side: the Mooncake conversation trace (12,031 requests, ~59 minutes of traffic) on 8 replicas with the
   kvpolicy policy set, in ``steady``, timed by this checkout's code and by ``--baseline-ref``'s (default d197e89, the
   code before the simulator was split into rooms and made faster), each in its own process, alternating, best of
   ``--repeats`` runs. The two runs' reports (every figure of the row, every request's TTFT, prefill seconds, queueing
   and route) must be identical.
2. The cost curve: the same run on time-shifted copies of the trace (copy k arrives k trace-spans later, its block ids
   renumbered so each copy is new traffic, as a longer day would be), at 1x, 4x and 16x, on the same cluster. Linear
   means the wall time per copy at 16x is within 25 % of the one at 1x.

    python benchmarks/bench_sim_speed.py [--baseline-ref d197e89] [--repeats 3] [--copies 1,4,16] [--skip-baseline] [--json OUT] [--check]

Targets: >= 1,000x trace time for this checkout's code; the reports identical to the baseline's; the curve linear.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from _common import add_check_flag, print_table, report_targets, write_json
from bench_reuse import TRACE

ROOT = Path(__file__).resolve().parent.parent
BPT = 131072  # Llama-3-8B: 64 MiB per 512-token block
TARGET_X = 1000.0

# one process per code version: the trace read once, one warm-up run, then ``repeats`` timed runs; the last run's report
CHILD = r"""
import json, sys, time
from kvpolicy.publish_sim import DEFAULT_PREFILL
from kvpolicy.sim import Prepared, Simulator, default_cluster, policy_set
from kvpolicy.traces import read_mooncake
import kvpolicy
trace_path, repeats, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
tr = read_mooncake(trace_path)
cl = default_cluster(tr, bytes_per_token=%d, prefill=DEFAULT_PREFILL)
prep = Prepared(tr)
walls = []
for r in range(repeats + 1):
    t0 = time.perf_counter()
    res = Simulator(prep, cl, policy_set("kvpolicy"), seed=0).run()
    if r:
        walls.append(time.perf_counter() - t0)
report = {"row": res.row(), "ttft_s": res.ttft_s.tolist(), "prefill_s": res.prefill_s.tolist(), "queue_s": res.queue_s.tolist(),
          "routes": res.routes.tolist(), "node_bytes_out": list(res.node_bytes_out)}
json.dump({"walls": walls, "code": kvpolicy.__file__, "report": report}, open(out, "w"))
""" % BPT


def _baseline_src(ref: str, into: Path) -> Path:
    """``ref``'s src/ tree, extracted with ``git archive`` (the checkout is untouched)."""
    try:
        blob = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", ref, "src"], check=True, capture_output=True).stdout
    except (OSError, subprocess.CalledProcessError) as err:
        msg = getattr(err, "stderr", b"") or str(err).encode()
        raise SystemExit(f"--baseline-ref {ref!r}: cannot read it from git ({msg.decode(errors='replace').strip()})") from None
    tar = into / "base.tar"
    tar.write_bytes(blob)
    with tarfile.open(tar) as t:
        t.extractall(into, filter="data")
    return into / "src"


def _child(src: Path, repeats: int, out: Path) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(src))
    subprocess.run([sys.executable, "-P", "-c", CHILD, str(TRACE), str(repeats), str(out)], check=True, env=env, cwd=str(out.parent))
    return json.loads(out.read_text())


def shifted_copies(trace: Any, copies: int) -> Any:
    """``copies`` time-shifted copies of ``trace``: copy k arrives k x (span + mean gap) later, with its block ids (and
    partial ids) offset so no copy shares a block with another."""
    import attrs

    if copies == 1:
        return trace
    n = len(trace)
    span = float(trace.arrival_s[-1] - trace.arrival_s[0])
    gap = span / max(n - 1, 1)
    nid = int(max(trace.block_ids.max(initial=-1), trace.partial_block_ids.max(initial=-1))) + 1
    off = trace.block_offsets
    part = trace.partial_block_ids
    return attrs.evolve(
        trace,
        arrival_s=np.concatenate([trace.arrival_s + k * (span + gap) for k in range(copies)]),
        input_tokens=np.tile(trace.input_tokens, copies), output_tokens=np.tile(trace.output_tokens, copies),
        block_offsets=np.concatenate([off[:-1] + k * off[-1] for k in range(copies)] + [np.array([copies * off[-1]])]),
        block_ids=np.concatenate([trace.block_ids + k * nid for k in range(copies)]),
        partial_block_ids=np.concatenate([np.where(part >= 0, part + k * nid, part) for k in range(copies)]),
        tenant=None if trace.tenant is None else np.tile(trace.tenant, copies),
        request_class=None if trace.request_class is None else np.tile(trace.request_class, copies),
        session=None if trace.session is None else np.tile(trace.session, copies),
        publish_boundary_tokens=None if trace.publish_boundary_tokens is None else np.tile(trace.publish_boundary_tokens, copies),
        token_offsets=None, tokens=None, request_ids=(),
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_check_flag(ap)
    ap.add_argument("--baseline-ref", default="d197e89")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--copies", default="1,4,16")
    ap.add_argument("--skip-baseline", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not TRACE.exists():
        print(f"{TRACE} not found")
        return 1
    from kvpolicy.publish_sim import DEFAULT_PREFILL
    from kvpolicy.sim import Prepared, Simulator, default_cluster, policy_set
    from kvpolicy.traces import read_mooncake

    tr = read_mooncake(TRACE)
    span = float(tr.arrival_s[-1] - tr.arrival_s[0])
    out: dict[str, Any] = {"trace_s": span, "requests": len(tr)}
    targets: dict[str, bool] = {}
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        versions = {"this checkout": ROOT / "src"}
        if not args.skip_baseline:
            versions[f"baseline {args.baseline_ref}"] = _baseline_src(args.baseline_ref, d)
        runs: dict[str, dict[str, Any]] = {}
        for name, src in versions.items():  # one process each, one after the other
            runs[name] = _child(src, args.repeats, d / f"{len(runs)}.json")
    rows = []
    for name, r in runs.items():
        best = min(r["walls"])
        rows.append([name, f"{best:.2f}", f"{span / best:,.0f}x", " ".join(f"{w:.2f}" for w in r["walls"])])
        out[name] = {"walls_s": r["walls"], "best_s": best, "x_trace_time": span / best}
    print(f"kvpolicy set, steady, Mooncake conversation trace ({len(tr):,} requests, {span:,.0f} s of traffic), 8 replicas:")
    print_table(["code", "best wall s", "trace time", "runs s"], rows)
    mine = out["this checkout"]
    targets[f">= {TARGET_X:,.0f}x trace time"] = mine["x_trace_time"] >= TARGET_X
    if len(runs) == 2:
        a, b = (r["report"] for r in runs.values())
        same = json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
        speedup = out[f"baseline {args.baseline_ref}"]["best_s"] / mine["best_s"]
        out["speedup"] = speedup
        out["identical_reports"] = same
        print(f"\nspeed-up over {args.baseline_ref}: {speedup:.2f}x; reports identical (every figure, every request): {same}")
        targets["reports identical to the baseline's"] = same

    cl = default_cluster(tr, bytes_per_token=BPT, prefill=DEFAULT_PREFILL)  # one cluster for every length
    curve = []
    for copies in [int(x) for x in args.copies.split(",") if x]:
        big = shifted_copies(tr, copies)
        prep = Prepared(big)
        t0 = time.perf_counter()
        Simulator(prep, cl, policy_set("kvpolicy"), seed=0).run()
        wall = time.perf_counter() - t0
        tspan = float(big.arrival_s[-1] - big.arrival_s[0])
        curve.append({"copies": copies, "requests": len(big), "trace_s": tspan, "wall_s": wall, "wall_per_copy_s": wall / copies,
                      "x_trace_time": tspan / wall})
    if curve:
        print("\ncost curve (time-shifted copies, new block ids per copy):")
        print_table(["copies", "requests", "trace s", "wall s", "wall per copy s", "trace time"],
                    [[c["copies"], f"{c['requests']:,}", f"{c['trace_s']:,.0f}", f"{c['wall_s']:.1f}", f"{c['wall_per_copy_s']:.2f}",
                      f"{c['x_trace_time']:,.0f}x"] for c in curve])
        growth = curve[-1]["wall_per_copy_s"] / curve[0]["wall_per_copy_s"]
        print(f"wall per copy at {curve[-1]['copies']}x over at {curve[0]['copies']}x: {growth:.2f}")
        out["curve"] = curve
        out["per_copy_growth"] = growth
        targets["linear cost curve (per-copy wall within 25 %)"] = 0.75 <= growth <= 1.25
    rc = report_targets(targets, args.check)
    print(f"\nwrote {write_json('sim_speed', out, args.json)}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
