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

``law-oracle`` is told more and less: not whether a session continues, but the **law** the generator draws it from —
each block's session, the chance its session continues (1 − 1/turns_mean of its kind), the think time's exponential
distribution and which blocks are the app's shared prefix (before the publish boundary) — and ranks sampled leaves
(64) by the hit density that law implies over a horizon H (P(next turn within H) / expected occupancy within H; shared
blocks last). ``+ decode`` is also told the decode delay of each block's last request (output tokens ×
``DECODE_S_PER_TOKEN``) before its next turn can come. Each is the best of H = think time / 2 and H = think time
(longer horizons and the policy's own mean eviction age did worse in every run tried). It is not a proof that no
online policy does better, but a policy that knows the law knows everything the past can tell about these sessions.
Chat and agent presets only: RAG's reuse is document popularity, another law.
"""

from __future__ import annotations

import argparse
import math
import sys

import numpy as np

from _common import add_check_flag, print_table, report_targets, write_json

from kvpolicy.clock import ManualClock
from kvpolicy.errors import CapacityError
from kvpolicy.eviction import LRUPolicy
from kvpolicy.eviction.base import Node
from kvpolicy.eviction.hit_density import HitDensityPolicy
from kvpolicy.eviction.kernels import replay_kernel
from kvpolicy.traces import generate, preset
from kvpolicy.traces.synthetic import DECODE_S_PER_TOKEN


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


class LawOracle(HitDensityPolicy):
    """Sampled leaves ranked by the hit density the generator's law gives each block (the module docstring)."""

    name = "law-oracle"

    def __init__(self, capacity_bytes: int, trace, spec, horizon_s: float, decode: bool, samples: int = 64) -> None:
        super().__init__(capacity_bytes, samples=samples, clock=ManualClock())
        self.request = 0
        self.p_continue = np.asarray([1.0 - 1.0 / spec.turns_mean.get(k, 1.0) for k in trace.class_names])[trace.request_class]
        self.t_s = trace.arrival_s + np.arange(len(trace)) * 1e-9  # as replay's clock reads
        decode_s = trace.output_tokens * DECODE_S_PER_TOKEN
        self.decode_s = decode_s if decode else np.full(len(trace), float(decode_s.mean()))
        self.think_s = spec.think_time_s
        self.horizon_s = horizon_s
        self.shared_blocks = trace.publish_boundary_tokens // trace.block_size_tokens
        self.last_request: dict = {}

    def _note(self, node: Node) -> None:
        r = self.request
        self.last_request[node.key] = -1 if node.depth < self.shared_blocks[r] else r

    def _admit(self, node: Node) -> None:
        super()._admit(node)
        self._note(node)

    def _hit(self, node: Node) -> None:
        super()._hit(node)
        self._note(node)

    def _forget(self, node: Node) -> None:
        super()._forget(node)
        del self.last_request[node.key]

    def rank(self, node: Node, now_s: float) -> float:
        r = self.last_request[node.key]
        if r < 0:
            return math.inf  # the app's shared prefix: read by every request of the app
        p, d, th, h = self.p_continue[r], self.decode_s[r], self.think_s, self.horizon_s
        e = now_s - self.t_s[r]
        if e <= d:
            still, wait = p, d - e  # the next turn cannot have come yet
        else:
            x = p * math.exp(-(e - d) / th)
            still, wait = x / (x + 1.0 - p), 0.0  # P(it continues | no turn for e − d of think time)
        if h <= wait:
            return 0.0
        within = 1.0 - math.exp(-(h - wait) / th)
        occupied = still * (wait + th * within) + (1.0 - still) * h  # expected seconds held within the horizon
        return still * within / occupied


def replay_with_request(trace, policy: ContinuationOracleLRU | LawOracle) -> int:
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
        spec = preset(name, seed=args.seed)
        trace = generate(spec)
        cont = session_continues(trace)
        with_law = "rag" not in {trace.class_names[c] for c in np.unique(trace.request_class)}
        distinct = int(np.unique(trace.block_ids).size)
        tok = trace.block_size_tokens / max(int(trace.input_tokens.sum()), 1)
        for cap in (distinct // 64, distinct // 16):
            pts = {p: 100 * replay_kernel(trace, p, cap).hit_blocks * tok for p in ("lru", "adaptive", "belady")}
            pts["continuation-oracle"] = 100 * replay_with_request(trace, ContinuationOracleLRU(cap, cont)) * tok
            if with_law:
                for label, decode in (("law-oracle", False), ("law-oracle+decode", True)):
                    pts[label] = max(100 * replay_with_request(trace, LawOracle(cap, trace, spec, h * spec.think_time_s, decode)) * tok
                                     for h in (0.5, 1.0))
            gap = pts["belady"] - pts["lru"]
            closed = {p: (pts[p] - pts["lru"]) / gap if gap > 0 else float("nan") for p in pts}
            cell = {p: f"{pts[p]:.2f} ({closed[p]:+.0%})" if p in pts else "n/a" for p in ("adaptive", "continuation-oracle", "law-oracle", "law-oracle+decode")}
            rows.append([f"{name} seed {args.seed}", f"{cap:,}", f"{pts['lru']:.2f}", cell["adaptive"], cell["continuation-oracle"],
                         cell["law-oracle"], cell["law-oracle+decode"], f"{pts['belady']:.2f}"])
            out.append({"preset": name, "seed": args.seed, "capacity_blocks": cap, "token_hit_points": pts, "gap_closed": closed})
            print(f"  {name} @ {cap:,} done", file=sys.stderr)
    print("token hit ratio (%), [share of the LRU -> Belady gap closed]\n")
    print_table(["trace", "capacity", "lru", "adaptive", "continuation-oracle", "law-oracle", "law-oracle + decode", "belady"], rows)
    print(f"\nwrote {write_json('bench_continuation_bound', {'runs': out}, args.json)}")
    # correctness: Belady bounds every policy here, the oracle-told LRU included
    ok = all(max(v for k, v in r["token_hit_points"].items() if k != "belady") <= r["token_hit_points"]["belady"] + 1e-9 for r in out)
    return report_targets({"belady bounds every policy": ok}, args.check)


if __name__ == "__main__":
    sys.exit(main())
