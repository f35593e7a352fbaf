"""kvpolicy beside itself with one rule swapped for an engine's, on the learning families (issue #58).

The held-out cells of ``bench_policy_goals.py`` judge a change; this script is where a change is chosen. It runs the
random trace families of :func:`bench_policy_goals.family_spec` (2101-2106 by default: the learning families, never
the held-out seeds 515 / 626 nor the conversation trace), every router and view asked, with:

* ``kvpolicy`` as it is;
* ``kv+thr2``: kvpolicy with SGLang's count-2 publishing in place of the dueling selector (what the selector's write
  budget falls back to) — or, with ``--variant FIELD=VALUE`` (repeatable), kvpolicy with those ``PolicySet`` fields
  changed instead (e.g. ``--variant republish_unhealthy=False``);
* ``sglang-p2p-like``: SGLang's rules with the same pulls from peers;
* ``recompute-only``: the denominator of "GPU seconds saved".

Each row prints every set's GPU seconds saved (% of recompute-only's), p95 TTFT and GiB written, and kvpolicy's gap to
the best of the other two.

    python benchmarks/bench_learning_ablation.py [--families 2101-2106] [--requests 2000] [--routers round-robin,kv-overlap]
                                                 [--views steady,spike,degraded] [--variant FIELD=VALUE ...] [--jobs 2] [--json OUT]
"""

from __future__ import annotations

import argparse
import ast
import sys
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import attrs
from _common import print_table, write_json
from bench_policy_goals import BPT, family_spec

from kvpolicy.errors import ConfigError
from kvpolicy.publish_sim import DEFAULT_PREFILL
from kvpolicy.sim import PRESETS, Prepared, Simulator, default_cluster
from kvpolicy.sim.scenarios import SCENARIOS, build
from kvpolicy.traces import generate

SETS = ("kvpolicy", "kv+thr2", "sglang-p2p-like", "recompute-only")


def _sets(variant: dict[str, Any]) -> dict[str, Any]:
    return {"kvpolicy": PRESETS["kvpolicy"], "kv+thr2": attrs.evolve(PRESETS["kvpolicy"], name="kv+thr2", **variant),
            "sglang-p2p-like": PRESETS["sglang-p2p-like"], "recompute-only": PRESETS["recompute-only"]}


def parse_variant(items: list[str]) -> dict[str, Any]:
    """``FIELD=VALUE`` pairs as PolicySet fields (VALUE a Python literal, else a string); none: count-2 publishing.
    An unknown field or a value the PolicySet refuses is a SystemExit naming it."""
    if not items:
        return {"publish": "threshold-2"}
    fields = {a.name for a in attrs.fields(type(PRESETS["kvpolicy"]))} - {"name"}
    out: dict[str, Any] = {}
    for item in items:
        field, eq, raw = item.partition("=")
        if not eq or field not in fields:
            raise SystemExit(f"--variant {item!r}: must be FIELD=VALUE with FIELD a PolicySet field ({', '.join(sorted(fields))})")
        try:
            out[field] = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            out[field] = raw
    try:
        attrs.evolve(PRESETS["kvpolicy"], **out)
    except ConfigError as err:
        raise SystemExit(f"--variant: {err}") from None
    return out


def _cell(job: tuple[int, int, str, str, dict[str, Any]]) -> dict[str, Any]:
    seed, n, router, view, variant = job
    trace = generate(family_spec(seed, n))
    cl = attrs.evolve(default_cluster(trace, bytes_per_token=BPT, prefill=DEFAULT_PREFILL), router=router)
    sc = build(view, trace, cl)
    prep = Prepared(sc.trace)
    rows = {name: Simulator(prep, sc.cluster, ps, events=sc.events, seed=seed).run().row() for name, ps in _sets(variant).items()}
    base = rows["recompute-only"]["gpu_prefill_s"]
    out: dict[str, Any] = {"family": seed, "router": router, "view": view}
    for name in SETS[:3]:
        r = rows[name]
        out[name] = {"gpu_saved_pct": 100.0 * (base - r["gpu_prefill_s"]) / base if base > 0 else 0.0, "ttft_p95_ms": r["ttft_p95_ms"],
                     "bytes_written": r["bytes_written"]}
    return out


def _seeds(spec: str) -> list[int]:
    try:
        if "-" in spec:
            a, b = (int(x) for x in spec.split("-", 1))
            return list(range(a, b + 1))
        return [int(x) for x in spec.split(",") if x]
    except ValueError:
        raise SystemExit(f"--families: {spec!r} is not a range A-B or a list of seeds") from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default="2101-2106", help="family seeds: a range A-B or a comma list")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--routers", default="round-robin,kv-overlap")
    ap.add_argument("--views", default="steady,spike,degraded")
    ap.add_argument("--variant", action="append", default=[], help="FIELD=VALUE: the compared set is kvpolicy with this PolicySet field "
                    "changed (repeatable); default publish=threshold-2")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    variant = parse_variant(args.variant)
    views = [v for v in args.views.split(",") if v]
    for v in views:
        if v not in SCENARIOS:
            raise SystemExit(f"--views: {v!r} is not one of {', '.join(SCENARIOS)}")
    if args.requests < 10:
        raise SystemExit(f"--requests: {args.requests} is too few (at least 10)")
    jobs = [(s, args.requests, r, v, variant) for s in _seeds(args.families) for r in args.routers.split(",") if r for v in views]
    try:
        with ProcessPoolExecutor(max(args.jobs, 1)) as ex:
            cells = list(ex.map(_cell, jobs))
    except ConfigError as err:
        raise SystemExit(f"--routers: {err}") from None
    table = []
    for c in cells:
        best_other = max(c["kv+thr2"]["gpu_saved_pct"], c["sglang-p2p-like"]["gpu_saved_pct"])
        row = [c["family"], c["router"], c["view"]]
        for name in SETS[:3]:
            r = c[name]
            row.append(f"{r['gpu_saved_pct']:.1f}% / {r['ttft_p95_ms']:.0f} ms / {r['bytes_written'] / 2**30:.0f} GiB")
        row.append(f"{c['kvpolicy']['gpu_saved_pct'] - best_other:+.1f}")
        table.append(row)
    label = "kv+" + ",".join(f"{k}={v}" for k, v in variant.items())
    print_table(["family", "router", "view", "kvpolicy", label, "sglang-p2p-like", "kvpolicy - best (pts)"], table)
    gaps = [c["kvpolicy"]["gpu_saved_pct"] - max(c["kv+thr2"]["gpu_saved_pct"], c["sglang-p2p-like"]["gpu_saved_pct"]) for c in cells]
    print(f"\ncells {len(cells)}; kvpolicy more than 1 point behind the better of the other two in {sum(g < -1 for g in gaps)}")
    path = write_json("learning_ablation", {"variant": {k: repr(v) for k, v in variant.items()}, "cells": cells}, args.json)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
