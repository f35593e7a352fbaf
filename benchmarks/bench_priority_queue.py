"""The candidate set of the pure-Python ``PriorityPolicy``: a heap with lazy deletion vs ``sortedcontainers.SortedList``.

Issue #19 asked for ``sortedcontainers`` where ordered sets are kept by hand, if it
is as fast or clearer. The one such set on a replay's path is ``PriorityPolicy``'s
candidate heap (LRU, LFU, TTL, GDSF, Belady and reuse-distance all sit on it).
This replays the same trace through each policy twice — the shipped heap, and a
subclass whose ``_push`` / ``_candidate`` / ``_choose`` keep a ``SortedList`` of
(priority, seq, key) with eager removal — checks the hits are identical, and
prints accesses/s of each and the ratio.

    python benchmarks/bench_priority_queue.py [--requests 3000] [--check]
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
from sortedcontainers import SortedList

from _common import add_check_flag, print_table, report_targets

from kvpolicy.clock import ManualClock
from kvpolicy.errors import CapacityError
from kvpolicy.eviction import replay
from kvpolicy.eviction.base import PriorityPolicy
from kvpolicy.eviction.policies import GDSFPolicy, LFUPolicy, LRUPolicy
from kvpolicy.eviction.reuse_distance import ReuseDistancePolicy
from kvpolicy.traces import generate, preset


def sorted_variant(cls: type[PriorityPolicy]) -> type[PriorityPolicy]:
    class Sorted(cls):  # type: ignore[misc, valid-type]
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self._sl = SortedList()
            self._entry: dict = {}

        def _push(self, node):
            old = self._entry.pop(node.key, None)
            if old is not None:
                self._sl.remove(old)
            e = (self.priority(node), node.seq, node.key)
            self._entry[node.key] = e
            self._sl.add(e)

        def _candidate(self, node, yes):
            if yes:
                self._push(node)
            else:
                old = self._entry.pop(node.key, None)
                if old is not None:
                    self._sl.remove(old)

        def _choose(self):
            if not self._sl:
                raise CapacityError("no eviction candidate")
            return self.nodes[self._sl[0][2]]

    Sorted.__name__ = f"Sorted{cls.__name__}"
    return Sorted


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=3)
    add_check_flag(ap)
    args = ap.parse_args(argv)
    trace = generate(preset("mixed", n_requests=args.requests, seed=args.seed))
    cap = max(64, int(np.unique(trace.block_ids).size) // 8)
    rows, checks = [], {}
    for cls in (LRUPolicy, LFUPolicy, GDSFPolicy, ReuseDistancePolicy):
        out = {}
        for label, k in (("heap", cls), ("SortedList", sorted_variant(cls))):
            best = float("inf")
            for _ in range(3):
                pol = k(cap, clock=ManualClock())
                t0 = time.perf_counter()
                res = replay(trace, pol)
                best = min(best, time.perf_counter() - t0)
            out[label] = (best, res.hits.copy())
        same = bool(np.array_equal(out["heap"][1], out["SortedList"][1]))
        checks[f"{cls.__name__} identical hits"] = same
        n = trace.block_ids.size
        rows.append([cls.__name__, f"{n / out['heap'][0] / 1e3:,.0f}", f"{n / out['SortedList'][0] / 1e3:,.0f}",
                     f"{out['heap'][0] / out['SortedList'][0]:.2f}x", "yes" if same else "NO"])
    print(f"{trace.block_ids.size:,} block accesses, capacity {cap:,} blocks (mixed preset, seed {args.seed}); best of 3\n")
    print_table(["policy", "heap k acc/s", "SortedList k acc/s", "SortedList speed vs heap", "same hits"], rows)
    return report_targets(checks, args.check)


if __name__ == "__main__":
    sys.exit(main())
