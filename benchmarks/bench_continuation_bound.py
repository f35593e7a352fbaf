"""How much of the LRU → Belady gap is knowing which session continues?

Issue #20 asks an online policy to close ≥ 30 % of the gap. On the synthetic presets a session's number of turns is
geometric and its think time exponential: whether it continues is not in its past. This benchmark measures what
*knowing it* would be worth: ``continuation-oracle`` is LRU told, for every block, whether the request that last used
it has a later request in the same session (the trace's session labels) — blocks of finished sessions go first (LRU
among them), then LRU. It knows *whether*, not *when*. Beside it: LRU, kvpolicy's ``adaptive`` and Belady, token hit
ratio under the prefix rule, at 1/64 and 1/16 of the distinct blocks (the capacities where the gaps are).

    python benchmarks/bench_continuation_bound.py [--presets chat,agent,mixed] [--seed 101]

If the continuation oracle closes much more of the gap than ``adaptive`` does, the rest of the gap is information an
online policy does not have on these traces (the generator draws it at random), not a better priority function.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from _common import add_check_flag, print_table, report_targets, write_json

from kvpolicy.clock import ManualClock
from kvpolicy.errors import CapacityError
from kvpolicy.eviction import LRUPolicy
from kvpolicy.eviction.base import Node
from kvpolicy.eviction.kernels import replay_kernel
from kvpolicy.traces import generate, preset


class ContinuationOracleLRU(LRUPolicy):
    """LRU, except that blocks last used by a request whose session has no later request go first."""

    name = "continuation-oracle"

    def __init__(self, capacity_bytes: int, continues: np.ndarray) -> None:
        super().__init__(capacity_bytes, clock=ManualClock())
        self.continues = continues
        self.request = 0

    def _admit(self, node: Node) -> None:
        node.data = bool(self.continues[self.request])

    def _hit(self, node: Node) -> None:
        node.data = bool(self.continues[self.request])
        super()._hit(node)

    def priority(self, node: Node) -> tuple:
        return (1 if node.data else 0, node.t_access, -node.depth)


def replay_with_request(trace, policy: ContinuationOracleLRU) -> int:
    """The reference replay semantics (kvpolicy.eviction.replay), telling the policy which request is running."""
    hits = 0
    offsets, ids, matchable, arrival = trace.block_offsets.tolist(), trace.block_ids.tolist(), trace.matchable_blocks.tolist(), trace.arrival_s.tolist()
    for r in range(len(trace)):
        policy.clock._now_s = arrival[r] + r * 1e-9
        policy.request = r
        s, e = offsets[r], offsets[r + 1]
        j = s
        while j < e and ids[j] in policy.nodes:
            policy.on_access(ids[j])
            policy.pin(ids[j])
            j += 1
        hits += min(j - s, matchable[r])
        pinned = ids[s:j]
        while j < e:
            try:
                policy.victims(1, incoming=ids[j])
            except CapacityError:
                break
            policy.on_insert(ids[j], 1, ids[j - 1] if j > s else None)
            policy.pin(ids[j])
            pinned.append(ids[j])
            j += 1
        for k in pinned:
            policy.unpin(k)
    return hits


def session_continues(trace) -> np.ndarray:
    """Per request: does its session have a later request?"""
    out = np.zeros(len(trace), dtype=bool)
    last: dict[int, int] = {}
    for r, sess in enumerate(trace.session.tolist()):
        if sess in last:
            out[last[sess]] = True
        last[sess] = r
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="chat,agent,mixed")
    ap.add_argument("--seed", type=int, default=101)
    ap.add_argument("--json", default=None)
    add_check_flag(ap)
    args = ap.parse_args(argv)
    rows, out = [], []
    for name in args.presets.split(","):
        trace = generate(preset(name, seed=args.seed))
        cont = session_continues(trace)
        distinct = int(np.unique(trace.block_ids).size)
        tok = trace.block_size_tokens / max(int(trace.input_tokens.sum()), 1)
        for cap in (distinct // 64, distinct // 16):
            pts = {p: 100 * replay_kernel(trace, p, cap).hit_blocks * tok for p in ("lru", "adaptive", "belady")}
            pts["continuation-oracle"] = 100 * replay_with_request(trace, ContinuationOracleLRU(cap, cont)) * tok
            gap = pts["belady"] - pts["lru"]
            closed = {p: (pts[p] - pts["lru"]) / gap if gap > 0 else float("nan") for p in pts}
            rows.append([f"{name} seed {args.seed}", f"{cap:,}", f"{pts['lru']:.2f}", f"{pts['adaptive']:.2f} ({closed['adaptive']:+.0%})",
                         f"{pts['continuation-oracle']:.2f} ({closed['continuation-oracle']:+.0%})", f"{pts['belady']:.2f}"])
            out.append({"preset": name, "seed": args.seed, "capacity_blocks": cap, "token_hit_points": pts, "gap_closed": closed})
            print(f"  {name} @ {cap:,} done", file=sys.stderr)
    print("token hit ratio (%), [share of the LRU -> Belady gap closed]\n")
    print_table(["trace", "capacity", "lru", "adaptive", "continuation-oracle", "belady"], rows)
    print(f"\nwrote {write_json('bench_continuation_bound', {'runs': out}, args.json)}")
    # correctness: Belady bounds every policy here, the oracle-told LRU included
    ok = all(max(v for k, v in r["token_hit_points"].items() if k != "belady") <= r["token_hit_points"]["belady"] + 1e-9 for r in out)
    return report_targets({"belady bounds every policy": ok}, args.check)


if __name__ == "__main__":
    sys.exit(main())
