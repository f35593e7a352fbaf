"""Publish policies on the Mooncake conversation trace, beside the oracle.

8 replicas, round-robin routing, the pool ``kvpolicy compare`` gives the trace (a quarter of its distinct blocks, LRU;
the oracle Belady): ``bytes_written`` and ``reread_bytes`` (re-reads served: read from the pool by another replica)
for every publish policy and for the oracle that writes exactly what another replica needs. Target:
``reuse-aware`` dominates ``threshold-2`` (no more bytes written for at least as many bytes re-read); its distance to
the oracle is reported, and the goal lines of structure-aware, reuse-aware and dueling.

    python benchmarks/bench_publish.py [--replicas 8] [--infinite-pool] [--judge-second-half] [--json OUT]
"""

from __future__ import annotations

import argparse
import sys

from _common import add_check_flag, report_targets, write_json
from bench_reuse import TRACE

from kvpolicy.publish_sim import publish_bench, render
from kvpolicy.traces import read_mooncake


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_check_flag(ap)
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--infinite-pool", action="store_true", help="judge in an infinite pool (issue #20) instead of compare's")
    ap.add_argument("--judge-second-half", action="store_true", help="learn on the first half, count the second")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not TRACE.exists():
        print(f"skipped: {TRACE} not found")
        return 1 if args.check else 0
    tr = read_mooncake(TRACE)
    # the pool kvpolicy compare gives the trace (issue #44: a write pays for what it evicts); --infinite-pool: issue #20's
    res = publish_bench(tr, ["all", "never", "threshold-2", "threshold-3", "boundary", "reuse-aware", "structure-aware", "dueling"],
                        replicas=args.replicas, bytes_per_token=131072, pool_capacity_blocks=None if args.infinite_pool else "compare",
                        judge_from_request=len(tr) // 2 if args.judge_second_half else 0)
    print(render(res))
    runs = {r["policy"]: r for r in res["runs"]}
    ra, t2, orc = runs["reuse-aware"], runs["threshold-2"], runs["oracle"]
    dominates = ra["bytes_written"] <= t2["bytes_written"] and ra["reread_bytes"] >= t2["reread_bytes"]
    print(f"\nreuse-aware vs threshold-2: written {ra['bytes_written'] / t2['bytes_written']:.3f}x, re-read {ra['reread_bytes'] / t2['reread_bytes']:.3f}x "
          f"-> {'dominates' if dominates else 'does NOT dominate'}")
    print(f"reuse-aware vs oracle: written {ra['bytes_written'] / orc['bytes_written']:.3f}x, re-read {ra['reread_bytes'] / orc['reread_bytes']:.1%} of the oracle's")
    res["dominates_threshold_2"] = dominates
    rc = report_targets({"reuse-aware dominates threshold-2 (writes no more, re-reads no less)": dominates,
                         "every policy's re-read <= the oracle's": all(r["reread_bytes"] <= orc["reread_bytes"] for r in res["runs"])}, args.check)
    print(f"wrote {write_json('bench_publish', res, args.json)}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
