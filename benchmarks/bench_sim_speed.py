"""Simulator speed (issue #48): trace time per wall second, today's code against a baseline commit run side by side,
with every decision compared, and the cost curve over 1x, 4x and 16x the trace.

1. Side by side: the Mooncake conversation trace (12,031 requests, ~59 minutes of traffic) on 8 replicas with the
   kvpolicy policy set, in ``steady``, timed by this checkout's code and by ``--baseline-ref``'s (default d197e89, the
   code before the simulator was split into rooms and made faster). Each timed run is a fresh process (the trace read,
   one warm-up run on its first 500 requests, then the run), the versions alternating for ``--rounds`` rounds: the
   best of each version's runs is its speed (this machine's other tenants only ever slow a run down). This checkout
   runs twice a round: with the publish selector the baseline had (``dueling-gpu-s``) and no pulls, whose reports (every figure of
   the row, every request's TTFT, prefill seconds, queueing and route) must be identical to the baseline's — the same
   decisions, faster — and with today's kvpolicy set (``dueling``, issue #44's second round, and pulls from peers, its
   third), the speed the target is judged on.
2. The cost curve: the same run on time-shifted copies of the trace (copy k arrives k trace-spans later, its block ids
   renumbered so each copy is new traffic, as a longer day would be), at 1x, 4x and 16x, on the same cluster, each
   point a fresh process, ``--curve-rounds`` rounds, the best of each. Linear means wall = a + b x copies: the seconds
   each further copy costs (from 4x to 16x) within 25 % of what they cost from 1x to 4x. (The wall per copy is printed
   too: a cold simulation's first copy is cheaper than the ones after it, with its filters and pools still empty.)

    python benchmarks/bench_sim_speed.py [--baseline-ref d197e89] [--rounds 3] [--copies 1,4,16] [--curve-rounds 2]
                                         [--skip-baseline] [--json OUT] [--check]

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
from pathlib import Path
from typing import Any

import numpy as np
from _common import add_check_flag, print_table, report_targets, write_json
from bench_reuse import TRACE

ROOT = Path(__file__).resolve().parent.parent
BPT = 131072  # Llama-3-8B: 64 MiB per 512-token block
TARGET_X = 1000.0
AS_BASELINE = "this checkout, the baseline's publish selector (dueling-gpu-s)"

# one timed run in a fresh process: the trace read (and copied ``copies`` times), one warm-up run on its first 500
# requests (imports, Numba's cache), then the run; its wall time and report
CHILD = r"""
import json, sys, time
sys.path.insert(0, %r)
from kvpolicy.publish_sim import DEFAULT_PREFILL
from kvpolicy.sim import Prepared, Simulator, default_cluster, policy_set
from kvpolicy.traces import read_mooncake
import kvpolicy
trace_path, copies, out, publish = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
tr = read_mooncake(trace_path)
cl = default_cluster(tr, bytes_per_token=%d, prefill=DEFAULT_PREFILL)
ps = policy_set("kvpolicy")
if publish:  # the baseline's set: its publish selector, and no pulls from peers (issue #44's third round)
    import attrs
    ps = attrs.evolve(ps, publish=publish, pull_from_peers=False, pull_path="relay")
Simulator(Prepared(tr.head(500)), cl, ps, seed=0).run()
if copies > 1:  # the baseline's children run only the trace itself
    from bench_sim_speed import shifted_copies
big = shifted_copies(tr, copies) if copies > 1 else tr
prep = Prepared(big)
t0 = time.perf_counter()
res = Simulator(prep, cl, ps, seed=0).run()
wall = time.perf_counter() - t0
row = res.row()
row.pop("bytes_pulled", None)  # a field added after the baseline (0 without pulls): not in the baseline's report
report = {"row": row, "ttft_s": res.ttft_s.tolist(), "prefill_s": res.prefill_s.tolist(), "queue_s": res.queue_s.tolist(),
          "routes": res.routes.tolist(), "node_bytes_out": list(res.node_bytes_out)} if copies == 1 else None
json.dump({"wall_s": wall, "trace_s": float(big.arrival_s[-1] - big.arrival_s[0]), "requests": len(big), "code": kvpolicy.__file__,
           "report": report}, open(out, "w"))
""" % (str(Path(__file__).resolve().parent), BPT)


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


def _child(src: Path, copies: int, out: Path, publish: str = "") -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(src))
    subprocess.run([sys.executable, "-P", "-c", CHILD, str(TRACE), str(copies), str(out), publish], check=True, env=env, cwd=str(out.parent))
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
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--copies", default="1,4,16")
    ap.add_argument("--curve-rounds", type=int, default=2)
    ap.add_argument("--skip-baseline", action="store_true")
    ap.add_argument("--same-set", action="store_true",
                    help="every version runs its own kvpolicy set, and this checkout's reports must equal the baseline's: for a "
                         "baseline whose decisions are today's (a refactor's parent), where d197e89's selector no longer reproduces them")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not TRACE.exists():
        print(f"{TRACE} not found")
        return 1
    if args.rounds < 1 or args.curve_rounds < 1:
        raise SystemExit("--rounds and --curve-rounds must be at least 1")
    copies = [int(x) for x in args.copies.split(",") if x]
    out: dict[str, Any] = {}
    targets: dict[str, bool] = {}
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        # (name, src, publish override): today's set, today's code with the baseline's publish selector, the baseline
        versions = [("this checkout", ROOT / "src", "")]
        if not args.skip_baseline:
            versions += ([] if args.same_set else [(AS_BASELINE, ROOT / "src", "dueling-gpu-s")]) + [
                (f"baseline {args.baseline_ref}", _baseline_src(args.baseline_ref, d), "")]
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in versions}
        n = 0
        for _ in range(args.rounds):  # the versions alternating, each run a fresh process
            for name, src, publish in versions:
                runs[name].append(_child(src, 1, d / f"{n}.json", publish))
                n += 1
        curve_runs: dict[int, list[float]] = {c: [] for c in copies}
        curve_meta: dict[int, dict[str, Any]] = {}
        for _ in range(args.curve_rounds):
            for c in copies:
                r = _child(ROOT / "src", c, d / f"{n}.json")
                n += 1
                curve_runs[c].append(r["wall_s"])
                curve_meta[c] = r
    span = runs["this checkout"][0]["trace_s"]
    rows = []
    for name, rs in runs.items():
        walls = [r["wall_s"] for r in rs]
        best = min(walls)
        rows.append([name, f"{best:.2f}", f"{span / best:,.0f}x", " ".join(f"{w:.2f}" for w in walls)])
        out[name] = {"walls_s": walls, "best_s": best, "x_trace_time": span / best}
    out["trace_s"] = span
    out["requests"] = runs["this checkout"][0]["requests"]
    print(f"kvpolicy set, steady, Mooncake conversation trace ({out['requests']:,} requests, {span:,.0f} s of traffic), 8 replicas"
          f" (each run a fresh process, the versions alternating, {args.rounds} rounds):")
    print_table(["code", "best wall s", "trace time", "runs s"], rows)
    mine = out["this checkout"]
    targets[f">= {TARGET_X:,.0f}x trace time"] = mine["x_trace_time"] >= TARGET_X
    if len(runs) == 3 or (args.same_set and len(runs) == 2):
        base = f"baseline {args.baseline_ref}"
        like = "this checkout" if args.same_set else AS_BASELINE
        reports = [json.dumps(r["report"], sort_keys=True) for name in (like, base) for r in runs[name]]
        same = len(set(reports)) == 1
        speedup = out[base]["best_s"] / out[like]["best_s"]
        out["speedup"] = speedup
        out["identical_reports"] = same
        own = out[base]["best_s"] / mine["best_s"]
        out["speedup_own_sets"] = own
        print(f"\nspeed-up over {args.baseline_ref}, each code's own kvpolicy set: {own:.2f}x")
        if not args.same_set:
            print(f"speed-up over {args.baseline_ref} with the publish selector dueling-gpu-s and no pulls: {speedup:.2f}x — the same "
                  f"decisions only if the reports are identical (every figure, every request, every run): {same}")
        else:
            print(f"reports identical to {args.baseline_ref}'s (every figure, every request, every run): {same}")
        targets["reports identical to the baseline's"] = same
    if copies:
        curve = []
        for c in copies:
            best = min(curve_runs[c])
            m = curve_meta[c]
            curve.append({"copies": c, "requests": m["requests"], "trace_s": m["trace_s"], "walls_s": curve_runs[c], "wall_s": best,
                          "wall_per_copy_s": best / c, "x_trace_time": m["trace_s"] / best})
        print(f"\ncost curve (time-shifted copies, new block ids per copy; each point a fresh process, best of {args.curve_rounds}):")
        print_table(["copies", "requests", "trace s", "wall s", "wall per copy s", "trace time"],
                    [[c["copies"], f"{c['requests']:,}", f"{c['trace_s']:,.0f}", f"{c['wall_s']:.1f}", f"{c['wall_per_copy_s']:.2f}",
                      f"{c['x_trace_time']:,.0f}x"] for c in curve])
        growth = curve[-1]["wall_per_copy_s"] / curve[0]["wall_per_copy_s"]
        print(f"wall per copy at {curve[-1]['copies']}x over at {curve[0]['copies']}x: {growth:.2f}")
        out["curve"] = curve
        out["per_copy_growth"] = growth
        if len(curve) >= 3:
            # linear: wall = a + b x copies, so each further copy costs the same b. The first copy of a cold
            # simulation is cheaper than the ones after it (empty filters and pools, nothing yet at its capacity),
            # which the per-copy average carries into every point as a constant a; the slope between successive
            # points does not
            slopes = [(q["wall_s"] - p["wall_s"]) / (q["copies"] - p["copies"]) for p, q in zip(curve, curve[1:])]
            ratio = slopes[-1] / slopes[0]
            print("seconds per further copy: " + ", ".join(f"{p['copies']}x -> {q['copies']}x {m:.2f}" for p, q, m in zip(curve, curve[1:], slopes))
                  + f"; last over first {ratio:.2f} (a = {curve[0]['wall_s'] - slopes[0] * curve[0]['copies']:+.2f} s)")
            out["slopes_s_per_copy"] = slopes
            out["slope_growth"] = ratio
            targets["linear cost curve (each further copy's cost within 25 %)"] = 0.75 <= ratio <= 1.25
    rc = report_targets(targets, args.check)
    print(f"\nwrote {write_json('sim_speed', out, args.json)}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
