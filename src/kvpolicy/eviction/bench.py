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
from ..errors import ConfigError
from .kernels import KERNEL_POLICIES, replay_kernel
from .replay import ALL_POLICIES, replay


def compare(trace: Any, policies: list[str], capacities_blocks: list[int], *, bytes_per_token: int | None = None,
            progress: Any = None) -> dict[str, Any]:
    bad = [p for p in policies if p not in ALL_POLICIES]
    if bad:
        raise ConfigError("--policies", f"unknown policy {bad[0]!r}; known: {', '.join(ALL_POLICIES)}")
    if not capacities_blocks or min(capacities_blocks) <= 0:
        raise ConfigError("--capacities-blocks", "give one or more positive capacities")
    step = progress or (lambda _m: None)
    ceiling = PrefixMRC.from_trace(trace).ceiling_blocks
    names = list(dict.fromkeys([*policies, "lru", "belady"]))
    refs = max(trace.block_ids.size, 1)
    B = trace.block_size_tokens
    total_tokens = max(trace.total_input_tokens, 1)
    results = []
    for cap in capacities_blocks:
        hits = {}
        for name in names:
            step(f"{name} @ {cap:,} blocks")
            r = replay_kernel(trace, name, cap) if name in KERNEL_POLICIES else replay(trace, name, cap)
            hits[name] = r.hit_blocks
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
    return {"source": trace.source, "block_refs": int(trace.block_ids.size), "block_size_tokens": B, "results": results}


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
    return "\n".join(lines)
