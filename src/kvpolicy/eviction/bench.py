"""Trace-driven comparison of eviction policies, with the bounds always shown.

Read the trace once, feed every policy at every capacity (the Numba kernel where
one exists, the online object otherwise — they make the same decisions), and put
Belady (the offline bound) and the infinite cache (the ceiling) beside them, the
way Caffeine's simulator does. ``gap_closed`` is the share of the LRU → Belady gap
a policy closes: ``(hits − LRU) / (Belady − LRU)``.
"""

from __future__ import annotations

from typing import Any

from ..analysis import PrefixMRC
from .._validate import check_split
from ..errors import ConfigError
from .kernels import KERNEL_POLICIES, replay_kernel
from .replay import ALL_POLICIES, replay


def compare(trace: Any, policies: list[str], capacities_blocks: list[int], *, bytes_per_token: int | None = None,
            progress: Any = None, judge_from_request: int = 0) -> dict[str, Any]:
    """Every policy at every capacity beside LRU, ARC, S3-FIFO, Belady and the infinite cache.

    ``judge_from_request`` = k > 0 is a held-out split: every policy runs over the whole trace (its online
    learning and its cache warm up on requests < k) but only the references of requests >= k are scored."""
    bad = [p for p in policies if p not in ALL_POLICIES]
    if bad:
        raise ConfigError("--policies", f"unknown policy {bad[0]!r}; known: {', '.join(ALL_POLICIES)}")
    if not capacities_blocks or min(capacities_blocks) <= 0:
        raise ConfigError("--capacities-blocks", "give one or more positive capacities")
    step = progress or (lambda _m: None)
    n_req = len(trace)
    k = check_split(judge_from_request, n_req)
    r0 = int(trace.block_offsets[k])
    if k == 0:
        ceiling = PrefixMRC.from_trace(trace).ceiling_blocks
    else:  # the infinite cache over the whole trace, scored on the judged part
        import numpy as np

        distinct = max(int(np.unique(trace.block_ids).size), 1)
        ceiling = int(replay_kernel(trace, "lru", distinct).hits[r0:].sum())
    names = list(dict.fromkeys([*policies, *GOAL_CLASSICS, "belady"]))
    refs = max(trace.block_ids.size - r0, 1)
    B = trace.block_size_tokens
    total_tokens = max(int(trace.input_tokens[k:].sum()), 1)
    results = []
    for cap in capacities_blocks:
        hits = {}
        for name in names:
            step(f"{name} @ {cap:,} blocks")
            r = replay_kernel(trace, name, cap) if name in KERNEL_POLICIES else replay(trace, name, cap)
            hits[name] = int(r.hits[r0:].sum())
        lru, bel = hits["lru"], hits["belady"]
        for name in names:
            h = hits[name]
            row = {
                "policy": name,
                "capacity_blocks": cap,
                "hit_blocks": h,
                "block_hit_ratio": h / refs,
                "token_hit_ratio": h * B / total_tokens,
                "gap_closed": (h - lru) / (bel - lru) if bel > lru else None,
                "engine": "kernel" if name in KERNEL_POLICIES else "online",
            }
            if bytes_per_token:
                row["hit_bytes"] = h * B * bytes_per_token
                row["byte_hit_ratio"] = row["token_hit_ratio"]  # bytes ∝ tokens for one model
            results.append(row)
        results.append({"policy": "infinite", "capacity_blocks": cap, "hit_blocks": ceiling, "block_hit_ratio": ceiling / refs,
                        "token_hit_ratio": ceiling * B / total_tokens, "gap_closed": None, "engine": "bound"})
    source = trace.source if k == 0 else f"{trace.source} — judged on requests {k:,}..{n_req - 1:,} (learned on the first {k:,})"
    res = {"source": source, "block_refs": refs, "block_size_tokens": B, "judge_from_request": k, "results": results}
    res["goals"] = eviction_goals(res, [p for p in GOAL_POLICIES if p in names])
    return res


#: the classics a kvpolicy eviction policy must not fall behind, and the policies judged against the goals (issue #20)
GOAL_CLASSICS = ("lru", "arc", "s3fifo")
GOAL_POLICIES = ("adaptive", "hit-density", "reuse-distance")
#: issue #20: close >= 30 % of the LRU -> Belady gap where that gap is >= 5 points; never > 1 point below the best classic
GOAL_MIN_GAP_POINTS = 5.0
GOAL_GAP_CLOSED = 0.30
GOAL_MAX_DEFICIT_POINTS = 1.0


def eviction_goals(res: dict[str, Any], policies: list[str]) -> list[dict[str, Any]]:
    """Per policy and capacity: the LRU -> Belady gap (token-hit points), the share closed, the best classic and the deficit to it,
    each goal PASS / MISS (``None`` where the gap goal does not apply: a gap under 5 points)."""
    by = {(r["policy"], r["capacity_blocks"]): r for r in res["results"]}
    out = []
    for p in policies:
        for cap in sorted({r["capacity_blocks"] for r in res["results"]}):
            pts = {name: 100 * by[(name, cap)]["token_hit_ratio"] for name in (*GOAL_CLASSICS, "belady", p) if (name, cap) in by}
            gap = pts["belady"] - pts["lru"]
            closed = (pts[p] - pts["lru"]) / gap if gap > 0 else None
            best = max(GOAL_CLASSICS, key=lambda n: pts[n])
            deficit = pts[best] - pts[p]
            out.append({"policy": p, "capacity_blocks": cap, "gap_points": gap, "gap_closed": closed, "best_classic": best,
                        "best_classic_points": pts[best], "policy_points": pts[p], "deficit_points": deficit,
                        "gap_goal": None if gap < GOAL_MIN_GAP_POINTS else bool(closed is not None and closed >= GOAL_GAP_CLOSED),
                        "classic_goal": bool(deficit <= GOAL_MAX_DEFICIT_POINTS)})
    return out


#: LRU→Belady gaps narrower than this share of block references are shown as "[no gap]", not
#: as a percentage of it (half a point of hit ratio; below it the ratio is noise).
MIN_GAP_SHARE = 0.005


def render(res: dict[str, Any]) -> str:
    caps = sorted({r["capacity_blocks"] for r in res["results"]})
    pols = list(dict.fromkeys(r["policy"] for r in res["results"]))
    by = {(r["policy"], r["capacity_blocks"]): r for r in res["results"]}
    lines = [f"trace            {res['source']}  ({res['block_refs']:,} full-block references of {res['block_size_tokens']} tokens)", "",
             "token hit ratio under the prefix rule (share of prefill avoided); [gap closed LRU -> Belady; "
             f"'no gap' where Belady beats LRU by under {MIN_GAP_SHARE:.1%} of references]", ""]
    head = f"{'policy':>16}" + "".join(f"{c:>22,}" for c in caps)
    lines.append(head)
    for p in pols:
        cells = []
        for c in caps:
            r = by[(p, c)]
            g = r["gap_closed"]
            span = by[("belady", c)]["block_hit_ratio"] - by[("lru", c)]["block_hit_ratio"] if ("belady", c) in by and ("lru", c) in by else 0.0
            if g is None or p in ("lru", "belady", "infinite"):
                gtxt = ""
            elif span < MIN_GAP_SHARE:  # a share of a near-empty gap is noise: -1159% of 0.01 points says nothing
                gtxt = " [no gap]"
            else:
                gtxt = f" [{g:+.0%}]"
            cells.append(f"{r['token_hit_ratio']:>14.2%}{gtxt:>8}")
        label = {"belady": "belady (bound)", "infinite": "infinite cache"}.get(p, p)
        lines.append(f"{label:>16}" + "".join(f"{x:>22}" for x in cells))
    if res.get("goals"):
        lines += ["", f"goals (issue #20): close >= {GOAL_GAP_CLOSED:.0%} of the LRU -> Belady gap where it is >= {GOAL_MIN_GAP_POINTS:.0f} points; "
                      f"never more than {GOAL_MAX_DEFICIT_POINTS:.0f} point below the best of {'/'.join(GOAL_CLASSICS)}"]
        for g in res["goals"]:
            gap = (f"n/a (gap under {GOAL_MIN_GAP_POINTS:.0f} points)" if g["gap_goal"] is None else
                   f"{'PASS' if g['gap_goal'] else 'MISS'} closed {g['gap_closed']:+.0%} of {g['gap_points']:.1f} points")
            cls = (f"{'PASS' if g['classic_goal'] else 'MISS'} {g['policy_points']:.2f}% vs {g['best_classic']} {g['best_classic_points']:.2f}% "
                   f"({-g['deficit_points']:+.2f} points)")
            lines.append(f"  {g['policy']} @ {g['capacity_blocks']:,} blocks: gap {gap}; best classic {cls}")
    return "\n".join(lines)
