"""Reuse analytics speed, side by side with baselines in the same run.

* exact stack distances on ≥ 10M accesses over ~1M distinct ids (target ≥ 8M
  accesses/s, id remap reported separately);
* the exact all-capacity LRU curve vs a plain ``OrderedDict`` LRU loop at four
  capacities (hit counts must agree; ratio printed);
* SHARDS at R = 0.01 vs exact (target ≥ 20× faster, mean absolute MRC error ≤ 0.01),
  on this stream and on a ≥ 1M-access prefix-cache block stream from the
  ``mixed`` generator; the error is printed on two capacity grids — 100 evenly
  spaced capacities up to the distinct ids (the SHARDS paper's convention) and
  the log-spaced grid of ``default_capacities`` (which includes capacities below
  1/R blocks, where a rate-R sample cannot resolve distances);
* reading a Mooncake JSONL file with 10M block references.

    python benchmarks/bench_reuse.py [--accesses 10000000] [--ids 1000000] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np
from _common import add_check_flag, add_stream_args, report_targets, print_table, write_json

from kvpolicy.analysis import default_capacities, hits_at, lru_hit_ratio_curve, mean_absolute_error, shards, stack_distances
from kvpolicy.traces import first_appearance_ids, generate, preset, read_mooncake

TRACE = Path(__file__).resolve().parent.parent / "data" / "mooncake_conversation_trace.jsonl.gz"  # shipped with the repo


def skewed_stream(n: int, m: int, seed: int) -> np.ndarray:
    """Power-law popularity over m ids (P(rank < x) = (x/m)^(1/3)), labels shuffled."""
    rng = np.random.default_rng(seed)
    rank = np.minimum((m * rng.random(n) ** 3).astype(np.int64), m - 1)
    return rng.permutation(m)[rank] * 7919 + 13  # sparse, non-dense raw ids


def ordered_dict_hits(ids: np.ndarray, capacity: int) -> int:
    cache: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for x in ids.tolist():
        if x in cache:
            hits += 1
            cache.move_to_end(x)
        else:
            cache[x] = None
            if len(cache) > capacity:
                cache.popitem(last=False)
    return hits


def timed(fn, repeats=1):
    """fn's result and its best wall time over ``repeats`` runs (a 30 ms kernel timed once on a shared 2-core
    machine varies by 2x: best-of-3 for the kernels whose ratio is a target)."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return out, best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_check_flag(ap)
    add_stream_args(ap)
    ap.add_argument("--skip-ordered-dict", action="store_true", help="skip the slow OrderedDict baseline")
    ap.add_argument("--skip-reader", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    res: dict = {"accesses": args.accesses}

    raw = skewed_stream(args.accesses, args.ids, args.seed)
    # warm up every kernel on a small input (Numba compiles on first call)
    small = first_appearance_ids(raw[:10000])
    stack_distances(small)
    shards(small, rate=0.5)
    shards(small, s_max=100)

    ids, t_remap = timed(lambda: first_appearance_ids(raw))
    distinct = int(ids.max()) + 1
    d, t_exact = timed(lambda: stack_distances(ids), 3)
    caps = default_capacities(distinct)
    exact_curve, t_curve = timed(lambda: lru_hit_ratio_curve(d, caps))
    res.update(distinct_ids=distinct, remap_s=t_remap, exact_stack_s=t_exact, exact_curve_s=t_curve, exact_accesses_per_s=args.accesses / t_exact)
    print(f"{args.accesses:,} accesses over {distinct:,} distinct ids\n")
    rows = [
        ["id remap (first appearance)", f"{t_remap:.3f}", f"{args.accesses / t_remap / 1e6:.1f}"],
        ["exact stack distances", f"{t_exact:.3f}", f"{args.accesses / t_exact / 1e6:.1f}"],
        [f"all-capacity curve ({caps.size} capacities) from them", f"{t_curve:.3f}", ""],
    ]
    print_table(["step", "seconds", "M accesses/s"], rows)

    four = np.asarray([distinct // 64, distinct // 16, distinct // 4, distinct // 2], dtype=np.int64)
    exact_hits = hits_at(d, four)
    if not args.skip_ordered_dict:
        od_rows = []
        od_total = 0.0
        res["ordered_dict"] = []
        for cap, eh in zip(four.tolist(), exact_hits.tolist()):
            h, t = timed(lambda cap=cap: ordered_dict_hits(ids, cap))
            od_total += t
            assert h == int(eh), f"OrderedDict LRU disagrees at capacity {cap}: {h} vs {int(eh)}"
            od_rows.append([f"{cap:,}", f"{h / args.accesses:.4f}", f"{t:.2f}"])
            res["ordered_dict"].append({"capacity": cap, "hit_ratio": h / args.accesses, "seconds": t})
        exact_all = t_exact + t_curve
        print("\nOrderedDict LRU loop at four capacities (hit counts equal the exact curve's)\n")
        print_table(["capacity", "hit ratio", "seconds"], od_rows)
        print(f"\nexact curve, every capacity: {exact_all:.2f} s; OrderedDict, four capacities: {od_total:.2f} s -> {od_total / exact_all:.1f}x")
        res["ordered_dict_vs_exact_ratio"] = od_total / exact_all

    prefix_stream = generate(preset("mixed", n_requests=10_000, seed=args.seed)).block_ids
    streams = {"skewed ids": (ids, d, t_exact), "prefix blocks (mixed)": (prefix_stream, None, None)}
    sh_rows = []
    res["shards"] = []
    for sname, (sids, sd, st) in streams.items():
        if sd is None:
            sd, st = timed(lambda sids=sids: stack_distances(sids), 3)
        m = int(sids.max()) + 1
        grids = {"linear": np.linspace(m / 100, m, 100).astype(np.int64), "log": default_capacities(m)}
        exact = {g: lru_hit_ratio_curve(sd, c) for g, c in grids.items()}
        for label, kw in (("fixed-rate R=0.01", {"rate": 0.01}), ("fixed-rate R=0.1", {"rate": 0.1}), ("fixed-size s_max=8192", {"s_max": 8192})):
            r, t = timed(lambda kw=kw, sids=sids: shards(sids, seed=args.seed, **kw), 3)
            mae = {g: mean_absolute_error(r.hit_ratio(c), exact[g]) for g, c in grids.items()}
            sh_rows.append([sname, f"{sids.size:,}", label, f"{t:.3f}", f"{st / t:.1f}x", f"{mae['linear']:.4f}", f"{mae['log']:.4f}", f"{r.sampled_accesses:,}"])
            res["shards"].append({"stream": sname, "accesses": int(sids.size), "variant": label, "seconds": t, "exact_seconds": st, "speedup_vs_exact": st / t, "mae_linear_grid": mae["linear"], "mae_log_grid": mae["log"], "sampled_accesses": r.sampled_accesses})
    print("\nSHARDS vs exact stack distances; MRC mean absolute error on 100 evenly spaced capacities (linear) and the log grid\n")
    print_table(["stream", "accesses", "variant", "seconds", "speedup", "MAE linear", "MAE log", "sampled"], sh_rows)

    if TRACE.exists():
        tr = read_mooncake(TRACE)
        flat = tr.block_ids
        fd = stack_distances(flat)
        fcaps = default_capacities(int(flat.max()) + 1)
        fex = lru_hit_ratio_curve(fd, fcaps)
        maes = {R: mean_absolute_error(shards(flat, rate=R).hit_ratio(fcaps), fex) for R in (0.01, 0.1)}
        res["mooncake_shards_mae"] = maes
        print(f"\nMooncake trace, {flat.size:,} block accesses (log grid): SHARDS MAE R=0.01 {maes[0.01]:.4f}, R=0.1 {maes[0.1]:.4f}")

    if not args.skip_reader:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "big.jsonl"
            per = 200
            n_req = args.accesses // per
            with open(path, "w") as f:
                # chained, as the reader requires: request i replays conversation c = (a skewed id) — the same
                # 200 ids in the same order every time, so an id always follows the same id
                conv = ids[:n_req] % max(n_req // 4, 1)
                base = conv[:, None] * per + np.arange(per)
                for i in range(n_req):
                    f.write(json.dumps({"timestamp": i, "input_length": per * 512, "output_length": 1, "hash_ids": base[i].tolist()}) + "\n")
            size = path.stat().st_size
            tr, t = timed(lambda: read_mooncake(path))
            res.update(reader_refs=int(tr.block_ids.size), reader_s=t, reader_mb=size / 1e6)
            print(f"\nread_mooncake: {tr.block_ids.size:,} block refs ({size / 1e6:.0f} MB) in {t:.2f} s ({tr.block_ids.size / t / 1e6:.1f} M refs/s)")

    res["targets"] = {
        "exact >= 8M accesses/s": res["exact_accesses_per_s"] >= 8e6,
        "SHARDS R=0.01 >= 20x": res["shards"][0]["speedup_vs_exact"] >= 20,
        "SHARDS R=0.01 MAE <= 0.01 (linear grid, both streams)": all(r["mae_linear_grid"] <= 0.01 for r in res["shards"] if r["variant"] == "fixed-rate R=0.01"),
        "SHARDS R=0.01 MAE <= 0.01 (log grid, both streams)": all(r["mae_log_grid"] <= 0.01 for r in res["shards"] if r["variant"] == "fixed-rate R=0.01"),
    }
    rc = report_targets(res["targets"], args.check)
    print(f"wrote {write_json('bench_reuse', res, args.json)}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
