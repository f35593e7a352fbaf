"""Issue #58's goals, every view and router, on traces nothing was tuned on: kvpolicy against the engines' own rules
given the same mechanisms (the ``-p2p-like`` sets pull from peers as kvpolicy does).

    python benchmarks/bench_policy_goals.py                 # conversation trace (2nd half) + 4 presets x seeds 515,626, 4 views, 2 routers
    python benchmarks/bench_policy_goals.py --seeds 515 --presets chat --skip-mooncake --routers kv-overlap --jobs 2
    python benchmarks/bench_policy_goals.py --families 1001-1008 --presets "" --skip-mooncake   # random trace families

Traces: the Mooncake conversation trace, judged on its second half after learning on the first (every policy set
runs the whole trace; only requests from the midpoint on are counted), and the ``chat``, ``rag``, ``agent`` and
``mixed`` presets (256-token blocks) at seeds no default was chosen on (exploration used seed 1 and the conversation
trace's first half). Physics: Llama-3-8B geometry (131,072 bytes/token), the order-of-magnitude prefill model, the
default cluster of docs/sim.md, with each router of ``--routers`` (round-robin; kv-overlap, what Dynamo's KV router
and llm-d's precise prefix-cache scorer do; least-loaded). Every view of ``kvpolicy compare`` (steady, scale-out,
spike, degraded).

``--families A-B``: trace families nothing was tuned on — for each seed, a :class:`SyntheticSpec` whose knobs are
drawn from that seed (:func:`family_spec`: block size, arrival rate and bursts, documents and their Zipf exponent,
tenants, apps, system-prompt and tool lengths, the mix of chat / rag / agent and their turns, think time), 3,000
requests each.

The goals, per trace x router x view (each printed with its margin), against the baselines vllm-like, sglang-like,
lmcache-like, sglang-p2p-like, lmcache-p2p-like and llm-d-like (every set on the column's router: llm-d-like's own,
kv-overlap, is the kv-overlap column):
  * kvpolicy's p95 TTFT <= 1.02 x the best baseline's;
  * kvpolicy's GPU seconds saved >= the best baseline's - 1 point (of recompute-only's GPU seconds);
  * kvpolicy writes no more bytes than sglang-p2p-like;
  * the set the ledger ranks first by E[benefit] saves within 2 points of the most any set saves, with a p95 within
    5 % of the best (a miss where no set meets both bars says so: no ranking could pass there);
  * steady only: kvpolicy saves >= 80 % of the (pulling) oracle's GPU seconds;
and, for reference, issue #44's "no baseline dominates kvpolicy on (GPU s saved, bytes written)".
"""

from __future__ import annotations

import argparse
import sys

import attrs

import numpy as np
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from _common import add_check_flag, report_targets, write_json
from bench_reuse import TRACE

from kvpolicy.publish_sim import DEFAULT_PREFILL
from kvpolicy.sim import POLICY_SETS, PRESETS, compare, default_cluster
from kvpolicy.traces import SyntheticSpec, generate, preset, read_mooncake

BPT = 131072
BASELINES = ("vllm-like", "sglang-like", "lmcache-like", "sglang-p2p-like", "lmcache-p2p-like", "llm-d-like")
GOALS = ("p95 <= 1.02 best", "GPU >= best - 1 pt", "bytes <= sglang-p2p", "ledger's first is right", "not dominated",
         ">= 80% of oracle GPU")


def goals(report: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (view, goal): ok and the margin, from a compare() report."""
    by = {(r["scenario"], r["policy"]): r for r in report["runs"]}
    out = []
    for s in report["scenarios"]:
        kv = by[(s, "kvpolicy")]
        base = [by[(s, b)] for b in BASELINES]
        rows = [r for (ss, p), r in by.items() if ss == s and p != "oracle"]

        def add(goal: str, ok: bool | None, detail: str) -> None:
            out.append({"scenario": s, "goal": goal, "ok": ok, "detail": detail})

        best = min(base, key=lambda r: r["ttft_p95_ms"])
        add("p95 <= 1.02 best", kv["ttft_p95_ms"] <= 1.02 * best["ttft_p95_ms"],
            f"{kv['ttft_p95_ms']:,.0f} vs {best['ttft_p95_ms']:,.0f} ms ({best['policy']}, "
            f"{(kv['ttft_p95_ms'] / best['ttft_p95_ms'] - 1) * 100:+.1f} %)")
        top = max(base, key=lambda r: r["gpu_saved_share"] or 0.0)
        ks, ts = kv["gpu_saved_share"] or 0.0, top["gpu_saved_share"] or 0.0
        add("GPU >= best - 1 pt", ks >= ts - 0.01, f"{ks:.1%} vs {ts:.1%} ({top['policy']}, {(ks - ts) * 100:+.1f} pts)")
        sg = by[(s, "sglang-p2p-like")]
        add("bytes <= sglang-p2p", kv["bytes_written"] <= sg["bytes_written"],
            f"{kv['bytes_written'] / 2**30:,.0f} vs {sg['bytes_written'] / 2**30:,.0f} GiB")
        ranked = [r for r in rows if r["e_benefit_s_per_s"] is not None]
        if ranked:
            first = max(ranked, key=lambda r: r["e_benefit_s_per_s"])
            most = max(r["gpu_saved_share"] or 0.0 for r in rows)
            fastest = min(r["ttft_p95_ms"] for r in rows)
            fs = first["gpu_saved_share"] or 0.0

            def meets(r: dict[str, Any], most: float = most, fastest: float = fastest) -> bool:
                return (r["gpu_saved_share"] or 0.0) >= most - 0.02 and r["ttft_p95_ms"] <= 1.05 * fastest

            meet = [r["policy"] for r in rows if meets(r)]
            add("ledger's first is right", meets(first),
                f"{first['policy']}: {fs:.1%} vs the most {most:.1%}, p95 {first['ttft_p95_ms'] / fastest - 1:+.1%} over the best"
                + ("" if meet else "; no set meets both"))
        else:
            add("ledger's first is right", None, "no set's E[benefit] is known")
        dom = [b for b in base if b["gpu_saved_s"] >= kv["gpu_saved_s"] and b["bytes_written"] <= kv["bytes_written"]
               and (b["gpu_saved_s"] > kv["gpu_saved_s"] or b["bytes_written"] < kv["bytes_written"])]
        add("not dominated", not dom, ", ".join(f"{b['policy']} {b['gpu_saved_s'] - kv['gpu_saved_s']:+,.0f} GPU s, "
                                                 f"{(b['bytes_written'] - kv['bytes_written']) / 2**30:+,.0f} GiB" for b in dom) or "-")
        if s == "steady":
            orc = by[(s, "oracle")]
            share = kv["gpu_saved_s"] / orc["gpu_saved_s"] if orc["gpu_saved_s"] > 0 else None
            add(">= 80% of oracle GPU", None if share is None else share >= 0.8, "-" if share is None else f"{share:.0%}")
    return out


def family_spec(seed: int, n_requests: int = 3000) -> SyntheticSpec:
    """A random trace family: every knob of the generator drawn from ``seed`` (ranges around the presets', wide enough
    that no preset is the one that comes out)."""
    rng = np.random.default_rng([44, seed])
    mix = rng.dirichlet(np.ones(3))
    lo_sys = int(rng.integers(100, 2000))
    lo_doc = int(rng.integers(100, 1500))
    return SyntheticSpec(
        n_requests=n_requests, block_size_tokens=int(rng.choice([64, 128, 256, 512])),
        mix=tuple((k, float(w)) for k, w in zip(("chat", "rag", "agent"), mix)), rate_per_s=float(rng.uniform(0.5, 6.0)),
        burst_every_s=float(rng.uniform(60, 900)), burst_factor=float(rng.uniform(1.5, 6.0)), n_tenants=int(rng.integers(1, 12)),
        apps_per_kind=int(rng.integers(1, 12)), system_prompt_tokens=(lo_sys, lo_sys + int(rng.integers(100, 4000))),
        n_docs=int(rng.integers(50, 5000)), doc_zipf=float(rng.uniform(1.05, 1.8)), doc_tokens=(lo_doc, lo_doc + int(rng.integers(100, 3000))),
        turns_mean={"chat": float(rng.uniform(1, 8)), "rag": float(rng.uniform(1, 4)), "agent": float(rng.uniform(2, 14))},
        think_time_s=float(rng.uniform(2, 120)), seed=seed)


def _job(spec: tuple[str, str, int, str]) -> dict[str, Any]:
    kind, name, seed, router = spec
    if kind == "family":
        fam = family_spec(seed)
        trace = generate(fam)
        k = 0
        label = f"family {seed} (B={fam.block_size_tokens})"
    elif kind == "mooncake":
        trace = read_mooncake(TRACE)
        k = len(trace) // 2
        label = "conversation, 2nd half"
    else:
        trace = generate(preset(name, block_size_tokens=256, seed=seed))
        k = 0
        label = f"{name} seed {seed}"
    cl = attrs.evolve(default_cluster(trace, bytes_per_token=BPT, prefill=DEFAULT_PREFILL), router=router)
    # like with like: every set on this column's router — llm-d-like's own (kv-overlap) would judge a router, not a rule;
    # in the kv-overlap column it runs its own
    sets = [attrs.evolve(PRESETS[n], router=None) if PRESETS[n].router is not None else n for n in POLICY_SETS]
    t0 = time.perf_counter()
    report, _ = compare(trace, cl, seed=seed, judge_from_request=k, policies=sets)
    return {"trace": label, "router": router, "wall_s": time.perf_counter() - t0, "goals": goals(report), "report": report}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_check_flag(ap)
    ap.add_argument("--presets", default="chat,rag,agent,mixed")
    ap.add_argument("--seeds", default="515,626", help="seeds nothing was tuned on")
    ap.add_argument("--skip-mooncake", action="store_true")
    ap.add_argument("--families", default="", help="seed range A-B of random trace families (family_spec), e.g. 1001-1008")
    ap.add_argument("--routers", default="round-robin,kv-overlap", help="comma-separated routers (round-robin, kv-overlap, least-loaded, ...)")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    traces: list[tuple[str, str, int]] = []
    if not args.skip_mooncake:
        if not TRACE.exists():
            print(f"the Mooncake trace is not at {TRACE}", file=sys.stderr)
            return 1
        traces.append(("mooncake", "conversation", 0))
    seeds = [int(x) for x in args.seeds.split(",") if x]
    traces += [("preset", p, s) for p in args.presets.split(",") if p for s in seeds]
    if args.families:
        a, _, b = args.families.partition("-")
        traces += [("family", "family", s) for s in range(int(a), int(b or a) + 1)]
    specs = [(*t, r) for t in traces for r in args.routers.split(",") if r]
    t0 = time.perf_counter()
    with ProcessPoolExecutor(max_workers=max(args.jobs, 1)) as ex:
        results = list(ex.map(_job, specs))
    names = list(GOALS)
    print("| trace | router | view | " + " | ".join(names) + " |")
    print("|---|---|---|" + "---|" * len(names))
    tally = {n: [0, 0] for n in names}
    targets = {}
    for res in results:
        views = dict.fromkeys(g["scenario"] for g in res["goals"])
        for v in views:
            cells = []
            for n in names:
                g = next((x for x in res["goals"] if x["scenario"] == v and x["goal"] == n), None)
                if g is None:
                    cells.append("")
                    continue
                mark = "n/a" if g["ok"] is None else ("✓" if g["ok"] else "✗")
                cells.append(f"{mark} {g['detail']}")
                if g["ok"] is not None:
                    tally[n][0] += g["ok"]
                    tally[n][1] += 1
                    targets[f"{res['trace']} / {res['router']} / {v}: {n}"] = g["ok"]
            print(f"| {res['trace']} | {res['router']} | {v} | " + " | ".join(cells) + " |")
    print("\nmet / judged: " + "; ".join(f"{n} {a}/{b}" for n, (a, b) in tally.items()))
    # a view where no set saves within 2 points of the most at a p95 within 5 % of the best: no ranking could pass there
    none_meet = sum(g["goal"] == "ledger's first is right" and g["detail"].endswith("no set meets both") for r in results for g in r["goals"])
    print(f"the ledger's first: {none_meet} of its misses are views where no set meets both bars")
    print(f"{len(results)} traces in {time.perf_counter() - t0:.0f} s")
    for res in results:
        for d in res["report"].get("dominance", []):
            print(f"  {res['trace']} ({res['router']}): {d['line']}")
    rc = report_targets(targets, args.check)
    path = write_json("policy_goals", {"results": [{k: v for k, v in r.items() if k != "report"} for r in results],
                                       "tally": tally}, args.json)
    print(f"wrote {path}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
