"""kvpolicy's policies inside SGLang's radix-cache eviction loop, against SGLang's own LRU and LFU.

SGLang ranks every evictable leaf itself, through its strategy's ``get_priority(node)``, and sees only leaves at
eviction time; :class:`kvpolicy.integrations.sglang.PriorityStrategy` mirrors its tree into a kvpolicy policy from
what those calls show. This replays traces through :func:`kvpolicy.testing.radix.radix_replay` (SGLang 0.5.x's
``evict`` loop, one node per block; ``--merge-runs``: SGLang's own tree shape, a node per run of blocks, split where a
request diverges inside it) with: SGLang's ``LRUStrategy`` and ``LFUStrategy`` (their priority functions),
and ``PriorityStrategy`` over kvpolicy's hit-density, adaptive and reuse-distance. Beside them, hit density as
kvpolicy runs it itself (the kernel: every reference seen, in order) and Belady. Per point: block hits, and the share
of the SGLang-LRU -> Belady gap closed.

The defaults are the reporting seeds 101, 202 and the conversation trace; nothing here has a knob to tune.

    python benchmarks/bench_sglang_strategy.py [--presets chat,agent,mixed,rag] [--seeds 101,202] [--no-trace] [--merge-runs]
    python benchmarks/bench_sglang_strategy.py --presets "" --trace my_trace.jsonl --merge-runs   # your own trace only
    python benchmarks/bench_sglang_strategy.py --sglang-wheel wheels/sglang-0.5.23-*.whl          # through SGLang's own RadixCache
"""

from __future__ import annotations

import argparse
import sys
import zipfile
from pathlib import Path

import numpy as np

from kvpolicy.errors import ConfigError, KVPolicyError
from kvpolicy.eviction.kernels import replay_kernel
from kvpolicy.integrations.sglang_bench import compare_strategies
from kvpolicy.traces import generate, preset, read_trace

from _common import add_check_flag, print_table, report_targets, write_json

TRACE = Path(__file__).resolve().parents[1] / "data" / "mooncake_conversation_trace.jsonl.gz"
MIRRORED = ("hit-density", "adaptive", "reuse-distance")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="chat,agent,mixed,rag")
    ap.add_argument("--seeds", default="101,202")
    ap.add_argument("--fractions", default="64,16", help="capacities as 1/N of the distinct blocks")
    ap.add_argument("--no-trace", action="store_true", help="skip the conversation trace")
    ap.add_argument("--trace", default=None, help="a trace of your own (any format kvpolicy reads) in place of the conversation trace")
    ap.add_argument("--merge-runs", action="store_true",
                    help="SGLang's own tree shape: a node holds a run of blocks and splits where a request diverges inside it")
    ap.add_argument("--sglang-wheel", default=None,
                    help="an SGLang 0.5.x wheel: replay through SGLang's own RadixCache, read out of it (SGLang's tree shape)")
    ap.add_argument("--json", default=None)
    add_check_flag(ap)
    args = ap.parse_args(argv)
    real = _sglang_radix(args.sglang_wheel) if args.sglang_wheel else None
    runs = [(f"{p} seed {s}", lambda p=p, s=s: generate(preset(p, seed=s))) for p in args.presets.split(",") if p
            for s in (int(x) for x in args.seeds.split(","))]
    if args.trace:
        runs.append((Path(args.trace).name, lambda: read_trace(args.trace)))
    elif not args.no_trace and TRACE.exists():
        runs.append(("conversation (Mooncake)", lambda: read_trace(str(TRACE))))
    names = ["sglang-lru", "sglang-lfu", *(f"kvpolicy {n}" for n in MIRRORED), "hit-density kernel", "belady"]
    strategies = ["sglang-lru", "sglang-lfu", *(f"kvpolicy-{n}" for n in MIRRORED)]
    rows, out = [], []
    for label, make in runs:
        trace = make()
        distinct = int(np.unique(trace.block_ids).size)
        fracs = [int(f) for f in args.fractions.split(",")]
        caps = [max(distinct // f, 1) for f in fracs]
        res = compare_strategies(trace, caps, strategies, sglang_modules=real, merge_runs=args.merge_runs)["results"]
        for frac, cap in zip(fracs, caps):
            hits = {r["strategy"].replace("kvpolicy-", "kvpolicy "): r["hit_blocks"] for r in res if r["capacity_blocks"] == cap}
            hits["hit-density kernel"] = replay_kernel(trace, "hit-density", cap).hit_blocks
            hits = {n: hits[n] for n in names}
            lru, bel = hits["sglang-lru"], hits["belady"]
            gap = {n: (h - lru) / (bel - lru) if bel > lru else float("nan") for n, h in hits.items()}
            rows.append([label, f"1/{frac} ({cap:,})"] + [f"{hits[n]:,}" if n in ("sglang-lru", "belady") else
                                                           f"{hits[n]:,} ({gap[n]:+.0%})" if gap[n] == gap[n] else f"{hits[n]:,} (no gap)"
                                                           for n in names])
            out.append({"trace": label, "capacity_blocks": cap, "block_refs": int(trace.block_ids.size), "hits": hits, "gap_closed": gap})
            print("  " + "  ".join(rows[-1]), file=sys.stderr, flush=True)
    shape = ("SGLang's own RadixCache, read out of " + Path(args.sglang_wheel).name if real is not None else
             "a node per run of blocks, split where a request diverges (SGLang's)" if args.merge_runs else "a node per block")
    print(f"block hits under SGLang's eviction loop, {shape} (share of the SGLang-LRU -> Belady gap closed)\n")
    print_table(["trace", "capacity", *names], rows)
    print(f"\nwrote {write_json('bench_sglang_strategy', {'runs': out, 'merge_runs': args.merge_runs, 'sglang_wheel': args.sglang_wheel}, args.json)}")
    bound = all(max(v for k, v in r["hits"].items() if k != "belady") <= r["hits"]["belady"] for r in out)
    return report_targets({"belady bounds every strategy": bound}, args.check)


def _sglang_radix(wheel: str) -> tuple:
    """SGLang's ``radix_cache``, ``base_prefix_cache`` and ``evict_policy`` modules read out of ``wheel``
    (tools/check_engine_bases.py: the tree code is SGLang's; GPU kernels, metrics and pools are stubbed)."""
    if not Path(wheel).is_file():
        raise ConfigError("--sglang-wheel", f"{wheel} is not a file (pip download sglang==0.5.23 --no-deps -d wheels/)")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    from check_engine_bases import load_sglang_radix

    try:
        return load_sglang_radix(wheel)
    except (KeyError, OSError, zipfile.BadZipFile) as e:
        raise ConfigError("--sglang-wheel", f"{wheel}: not an SGLang 0.5.x wheel with mem_cache/radix_cache.py ({e})") from None


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KVPolicyError as e:  # a bad --trace, say: one line, not a traceback
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
