"""How fast can ``lrb`` replay if learning were free? Its inference alone, against issue #20's 5M accesses/s floor.

``lrb`` (:mod:`kvpolicy.eviction.learned`) computes, at every eviction, the features of each of its 16 sampled leaves
and their logit. This measures that inference alone — the compiled ``lrb_features`` and ``lrb_logit`` the kernel
calls, on 16 candidates drawn uniformly from state arrays the size of the cache — and turns it into a ceiling: with
``e`` evictions per access on the floor's stream (``benchmarks/bench_eviction.py``: 10M one-block requests over ~1M
ids, capacity 1/10 of them), no learner, however cheap, replays faster than 1 / (e × inference time per eviction).

Side by side on the same stream: the ``lrb`` kernel as it is (inference and its Newton refits), and hit density's
kernel — the same 16 samples, each ranked by a table lookup instead of a feature vector.

    python benchmarks/bench_lrb_floor.py [--accesses 10000000] [--ids 1000000] [--repeats 3]

The candidates' state is drawn at random (ages up to a few horizons, small counts): a logarithm costs the same
whatever its argument, and the state is laid out as the kernel's, as large as the real cache's, so the memory
traffic is the same too.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import numba as nb
import numpy as np

from _common import add_check_flag, add_stream_args, print_table, report_targets, timings, write_json
from bench_eviction import flat
from bench_reuse import skewed_stream

from kvpolicy._mix import splitmix64_next
from kvpolicy.eviction.kernels import replay_kernel
from kvpolicy.eviction.learned import N_FEATURES, lrb_features, lrb_logit
from kvpolicy.traces import first_appearance_ids

FLOOR = 5e6  # issue #20: replay stays >= 5M accesses/s
SAMPLES = 16  # lrb's (and hit density's) default candidates per eviction


@nb.njit(cache=True)
def _inference(n_evictions, samples, score, state, W, lf, li, w, h_s):  # pragma: no cover
    """``n_evictions`` decisions of lrb's inference: ``samples`` candidates each, the lowest logit kept (``score``
    False: the draws and one state fetch each, the oldest kept — what hit density's ranking costs besides its lookup).

    The state is laid out as the kernel's: 16 floats a block (last use at 0, hits at 8, child inserts at 9), 2 more
    floats (last gap, insert time), 6 ints (turn at 0, root at 1, depth at 3) — four cache lines a candidate with its
    root's hits, as in ``kvpolicy.eviction.kernels._lrb_features``."""
    x = np.zeros(N_FEATURES)
    cap = lf.size // 2
    st = np.uint64(state)
    acc = 0.0
    for i in range(n_evictions):
        now_s = 1000.0 + i * 1e-3
        best = 1e300
        for _ in range(samples):
            st += np.uint64(0x9E3779B97F4A7C15)
            z = st
            z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
            z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
            z = z ^ (z >> np.uint64(31))
            v = int(z % np.uint64(cap))
            if score:
                lrb_features(x, W[16 * v], W[16 * v + 8], W[16 * v + 9], li[6 * v + 3], lf[2 * v], li[6 * v], lf[2 * v + 1],
                             W[16 * li[6 * v + 1] + 8], now_s, h_s)
                logit = lrb_logit(x, w)
            else:
                logit = W[16 * v]
            if logit < best:
                best = logit
        acc += best
    return acc


def inference_ns(cap: int, n_evictions: int, repeats: int, seed: int, score: bool = True) -> list[float]:
    """Nanoseconds per eviction of lrb's inference alone (``score`` False: the draws alone), one value per timed run."""
    rng = np.random.default_rng(seed)
    h_s = 40.0
    W = np.zeros(16 * cap)
    W[0::16] = 1000.0 - rng.exponential(h_s, cap)  # last use
    W[8::16] = rng.integers(0, 8, cap)  # hits
    W[9::16] = rng.integers(0, 3, cap)  # child inserts
    lf = np.empty(2 * cap)
    lf[0::2] = rng.exponential(h_s, cap)  # last inter-use gap
    lf[1::2] = W[0::16] - rng.exponential(h_s, cap)  # insert time
    li = np.zeros(6 * cap, dtype=np.int64)
    li[0::6] = rng.integers(0, 12, cap)  # turn
    li[1::6] = np.arange(cap)  # root: on the one-block stream every block is its own
    li[3::6] = rng.integers(0, 64, cap)  # depth
    args = (W, lf, li, rng.normal(size=N_FEATURES), h_s)
    state = splitmix64_next(seed)[1]
    _inference(1000, SAMPLES, score, state, *args)  # compile / load from cache
    return [t / n_evictions * 1e9 for t in timings(lambda: _inference(n_evictions, SAMPLES, score, state, *args), repeats=repeats, warmup=0)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_check_flag(ap)
    add_stream_args(ap)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    ids = first_appearance_ids(skewed_stream(args.accesses, args.ids, args.seed))
    tr = flat(ids)
    cap = (int(ids.max()) + 1) // 10
    small = flat(first_appearance_ids(skewed_stream(2000, 1000, args.seed)))
    rows, res = [], {"accesses": args.accesses, "capacity_blocks": cap}
    evictions = 0
    for p in ("hit-density", "lrb"):
        replay_kernel(small, p, 100)  # compile / load from cache
        r = replay_kernel(tr, p, cap)
        if p == "lrb":
            evictions = np.asarray(r.victims).size
        # lrb's kernel takes about a minute a run, 25x under the floor: one run (its noise cannot matter)
        ts = timings(lambda p=p: replay_kernel(tr, p, cap), repeats=args.repeats if p != "lrb" else 1, warmup=0)
        rate = args.accesses / statistics.median(ts)
        rows.append([f"{p} kernel (as it is)", f"{rate / 1e6:.2f}", f"{rate / FLOOR:.2f}x", f"{min(ts):.2f}-{max(ts):.2f} s"])
        res[p] = {"accesses_per_s": rate, "runs_s": ts}
    per_access = evictions / args.accesses
    ns = inference_ns(cap, 1_000_000, args.repeats, args.seed)
    draw_ns = inference_ns(cap, 1_000_000, args.repeats, args.seed, score=False)
    ceiling = 1e9 / (statistics.median(ns) * per_access)
    rows.append(["lrb inference alone, learning free (ceiling)", f"{ceiling / 1e6:.2f}", f"{ceiling / FLOOR:.2f}x",
                 f"{min(ns):.0f}-{max(ns):.0f} ns / eviction"])
    res["inference_ns_per_eviction"] = ns
    res["draws_ns_per_eviction"] = draw_ns
    res["evictions_per_access"] = per_access
    res["ceiling_accesses_per_s"] = ceiling

    print(f"{args.accesses:,} one-block requests over {int(ids.max()) + 1:,} ids, capacity {cap:,} blocks; "
          f"lrb evicts {per_access:.3f} times an access, ranking {SAMPLES} candidates each time\n")
    print_table(["replay", "M acc/s", "/ 5M floor", "runs"], rows)
    print(f"\nlrb's inference: {statistics.median(ns):.0f} ns per eviction, {statistics.median(ns) / SAMPLES:.0f} ns a candidate "
          f"({statistics.median(draw_ns):.0f} ns of it the {SAMPLES} draws and a state fetch each) "
          f"— the floor allows {1e9 / FLOOR / per_access:.0f} ns an eviction, {1e9 / FLOOR / per_access / SAMPLES:.1f} ns a candidate")
    write_json("bench_lrb_floor", res, args.json)
    # the ceiling is what the floor asks of lrb's design, not of its code: reported, never a CI target
    return report_targets({"lrb inference ceiling >= 5M acc/s": ceiling >= FLOOR, "lrb kernel >= 5M acc/s": res["lrb"]["accesses_per_s"] >= FLOOR},
                          args.check)


if __name__ == "__main__":
    sys.exit(main())
