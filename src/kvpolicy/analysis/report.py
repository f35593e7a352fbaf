"""`kvpolicy analyze`: what a trace says before anyone buys a cache.

The verdict, in order (each threshold is a keyword argument of :func:`analyze`):

1. **no reuse worth chasing** — the infinite-cache ceiling is below
   ``min_ceiling`` (default 10 % of input tokens);
2. **enough local cache** — under the given routing at least ``local_share``
   (default 80 %) of the ceiling lands on the replica that already used it, and
   the LRU capacity reaching 90 % of the ceiling, split over the replicas, fits
   the per-replica local KV budget;
3. **prefix-affinity routing** — the given routing leaves reuse on other
   replicas, but routing by the first ``affinity_blocks`` blocks brings the local
   share to ``local_share`` with the busiest replica under ``max_imbalance``
   (default 1.5×) of the mean load and the per-replica capacity fits;
4. **a shared pool is worth a trial** — otherwise: a real share of reuse is
   cross-replica (or does not fit locally), and only a shared tier can serve it.
   The report gives the read/write byte flows at the worst 15-minute window.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from .._validate import check_probability
from ..errors import ConfigError
from ..traces.model import check_trace
from .capacity import EffectiveCapacity
from .mrc import PrefixMRC, default_capacities
from .replicas import ROUTINGS, Routing, replica_view
from .reuse import prefix_groups, reuse_summary
from .stack import request_stack_distances

VERDICTS = ("no reuse worth chasing", "enough local cache", "prefix-affinity routing", "a shared pool is worth a trial")


def analyze(
    trace: Any,
    *,
    bytes_per_token: int,
    capacities_blocks: list[int] | None = None,
    replicas: int = 8,
    routing: Routing = "round-robin",
    affinity_blocks: int = 4,
    local_capacity: EffectiveCapacity | None = None,
    min_ceiling: float = 0.10,
    local_share: float = 0.80,
    max_imbalance: float = 1.5,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Every number of the report, as a JSON-able dict."""
    check_trace(trace)
    if isinstance(bytes_per_token, bool) or not isinstance(bytes_per_token, int) or bytes_per_token <= 0:
        raise ConfigError("bytes_per_token", f"must be a positive int, got {bytes_per_token!r}")
    if routing not in ROUTINGS:
        raise ConfigError("routing", f"must be one of {ROUTINGS}, got {routing!r}")
    # the verdict's thresholds: a NaN one failed every comparison and picked a verdict without a word
    check_probability("min_ceiling", min_ceiling)
    check_probability("local_share", local_share)
    if isinstance(max_imbalance, bool) or not isinstance(max_imbalance, (int, float)) or not 1 <= max_imbalance < math.inf:
        raise ConfigError("max_imbalance", f"must be a finite ratio >= 1 (busiest replica over the mean), got {max_imbalance!r}")
    if capacities_blocks:
        for c in capacities_blocks:  # np.asarray(..., int64) below would cut 1.5 to 1
            if isinstance(c, bool) or not isinstance(c, (int, np.integer)) or c <= 0:
                raise ConfigError("capacities_blocks", f"each must be a positive int (blocks), got {c!r}")
    step = progress or (lambda _msg: None)
    B = trace.block_size_tokens
    block_bytes = bytes_per_token * B
    if local_capacity is None:
        local_capacity = EffectiveCapacity.from_fractions(32 * 2**30, active_decode=0.25, reserved=0.05, fragmentation=0.05)
    local_blocks = local_capacity.effective_blocks(block_bytes)

    step("stack distances")
    distances = request_stack_distances(trace.block_offsets, trace.block_ids)
    step("miss-ratio curve")
    mrc = PrefixMRC.from_trace(trace)
    n_distinct = int(np.unique(trace.block_ids).size) if trace.block_ids.size else 0
    caps = np.asarray(capacities_blocks, dtype=np.int64) if capacities_blocks else default_capacities(max(n_distinct, 16))
    if caps.size and caps.min() <= 0:
        raise ConfigError("capacities_blocks", "capacities must be positive")
    summary = trace.summary()
    summary["input_bytes"] = summary["input_tokens"] * bytes_per_token
    ceiling_blocks = mrc.ceiling_blocks
    needed = {f"{int(f * 100)}": mrc.capacity_for(f) if ceiling_blocks else 0 for f in (0.5, 0.8, 0.9, 0.99)}

    step("reuse distances")
    reuse = reuse_summary(trace, bytes_per_token, distances)
    groups = prefix_groups(trace, bytes_per_token, depth_blocks=min(affinity_blocks, 2), top=5, distances=distances)

    step("replica views")
    views = {}
    for r in dict.fromkeys([routing, "prefix-affinity"]):
        views[r] = replica_view(trace, replicas, r, bytes_per_token=bytes_per_token, affinity_blocks=affinity_blocks, seed=seed).to_dict()

    report: dict[str, Any] = {
        "source": trace.source,
        **summary,
        "bytes_per_token": bytes_per_token,
        "block_bytes": block_bytes,
        "compulsory_blocks": mrc.compulsory_blocks,
        "ceiling_token_hit_ratio": mrc.ceiling_token_hit_ratio,
        "ceiling_hit_tokens": ceiling_blocks * B,
        "ceiling_hit_bytes": ceiling_blocks * block_bytes,
        "mrc": mrc.table(caps),
        "capacity_for_ceiling_share_blocks": needed,
        "capacity_for_ceiling_share_bytes": {k: v * block_bytes for k, v in needed.items()},
        "local_capacity": {**local_capacity.to_dict(), "effective_blocks": local_blocks},
        "reuse_distance_bytes": reuse["reuse_distance_bytes"],
        "reuse_distance_blocks": reuse["reuse_distance_blocks"],
        "reuse_time_s": reuse["reuse_time_s"],
        "rereferences": reuse["rereferences"],
        "top_prefix_groups": groups,
        "replicas": replicas,
        "routing": routing,
        "replica_views": views,
    }
    report["verdict"], report["verdict_reasons"] = _verdict(report, local_blocks, min_ceiling, local_share, max_imbalance)
    return report


def _verdict(r: dict[str, Any], local_blocks: int, min_ceiling: float, local_share: float, max_imbalance: float) -> tuple[str, list[str]]:
    ceiling = r["ceiling_token_hit_ratio"]
    if ceiling < min_ceiling:
        return VERDICTS[0], [f"an infinite cache would avoid only {ceiling:.1%} of prefill tokens (< {min_ceiling:.0%})"]
    need90 = r["capacity_for_ceiling_share_blocks"]["90"]
    per_replica = -(-need90 // max(r["replicas"], 1))
    fits = per_replica <= local_blocks
    fit_txt = (
        f"90% of the ceiling needs {need90:,} blocks of LRU ({_gib(need90 * r['block_bytes'])}); "
        f"split over {r['replicas']} replicas that is {per_replica:,} each against {local_blocks:,} effective local blocks"
    )
    given = r["replica_views"][r["routing"]]
    aff = r["replica_views"]["prefix-affinity"]
    reasons = [
        f"ceiling: {ceiling:.1%} of input tokens are reusable with an infinite cache",
        f"{r['routing']}: {given['local_share_of_ceiling']:.1%} of that reuse lands on the same replica, {given['cross_share_of_ceiling']:.1%} on another",
        fit_txt + (" (fits)" if fits else " (does not fit)"),
    ]
    if given["local_share_of_ceiling"] >= local_share and fits:
        return VERDICTS[1], reasons
    reasons.append(
        f"prefix-affinity on the first blocks: {aff['local_share_of_ceiling']:.1%} local, busiest replica at {aff['load_imbalance']:.2f}x the mean load"
    )
    if aff["local_share_of_ceiling"] >= local_share and aff["load_imbalance"] <= max_imbalance and fits:
        return VERDICTS[2], reasons
    flows = given["flows"]
    reasons.append(
        f"a shared pool would read {_rate(flows['read_peak_bytes_per_s'])} {_window(flows['window_s'], flows['duration_s'])}; "
        f"publishing everything writes {_rate(flows['write_all_peak_bytes_per_s'])}, publishing only what is re-read {_rate(flows['write_reread_peak_bytes_per_s'])}"
    )
    return VERDICTS[3], reasons


def _window(window_s: float, duration_s: float) -> str:
    """Where a peak rate was measured, in words: a trace shorter than the window is its own window."""
    if window_s >= duration_s:
        return f"over the whole trace ({_seconds(duration_s)})"
    return f"at the worst {_seconds(window_s)} window"


def _seconds(s: float) -> str:
    if s >= 60 and s % 60 == 0:
        return f"{s / 60:.0f}-minute"
    return f"{s:.3g} s" if s >= 1 else f"{s * 1e3:.3g} ms"


def _gib(n: float) -> str:
    return f"{n / 2**30:,.1f} GiB"


def _rate(bps: float) -> str:
    return f"{bps * 8 / 1e9:,.2f} Gbit/s"


def render(r: dict[str, Any]) -> str:
    B = r["block_size_tokens"]
    lines = [
        f"trace            {r['source']}",
        f"workload         {r['requests']:,} requests over {r['duration_s'] / 60:,.1f} min; {r['input_tokens']:,} input tokens "
        f"({_gib(r['input_bytes'])} of KV at {r['bytes_per_token']:,} B/token); {r['block_refs']:,} full-block refs of {B} tokens, "
        f"{r['distinct_blocks']:,} distinct",
        f"ceiling          {r['ceiling_token_hit_ratio']:.1%} of input tokens reusable with an infinite cache "
        f"({r['ceiling_hit_tokens']:,} tokens, {_gib(r['ceiling_hit_bytes'])}); compulsory misses {r['compulsory_blocks']:,} blocks",
    ]
    rd = r["reuse_distance_bytes"]
    rt = r["reuse_time_s"]
    if rd["p50"] is not None:
        lines.append(
            f"reuse distance   p50 {_gib(rd['p50'])}  p90 {_gib(rd['p90'])}  p99 {_gib(rd['p99'])} of distinct KV between two uses;"
            f" reuse time p50 {rt['p50']:.0f} s  p90 {rt['p90']:.0f} s  p99 {rt['p99']:.0f} s"
        )
    lines += ["", "LRU under the prefix rule (token hit ratio = share of prefill avoided)", f"{'capacity_blocks':>16} {'capacity':>12} {'token_hit':>10} {'block_hit':>10} {'of ceiling':>11}"]
    ceiling = max(r["ceiling_token_hit_ratio"], 1e-300)
    for row in r["mrc"]:
        lines.append(
            f"{row['capacity_blocks']:>16,} {_gib(row['capacity_blocks'] * r['block_bytes']):>12} {row['token_hit_ratio']:>10.1%} "
            f"{row['block_hit_ratio']:>10.1%} {row['token_hit_ratio'] / ceiling:>11.1%}"
        )
    need = r["capacity_for_ceiling_share_blocks"]
    lines.append("capacity for     " + "  ".join(f"{k}% of ceiling: {v:,} blocks ({_gib(v * r['block_bytes'])})" for k, v in need.items()))
    lc = r["local_capacity"]
    lines.append(
        f"local KV budget  C_effective = {_gib(lc['physical_bytes'])} - {_gib(lc['active_decode_bytes'])} decode - {_gib(lc['reserved_bytes'])} reserved"
        f" - {_gib(lc['fragmentation_bytes'])} fragmentation = {_gib(lc['effective_bytes'])} = {lc['effective_blocks']:,} blocks per replica"
    )
    lines += ["", f"{r['replicas']} replicas: where reuse lands (infinite caches)", f"{'routing':>16} {'local':>8} {'cross':>8} {'imbalance':>10} {'read@peak':>12} {'write all@peak':>15} {'write reread@peak':>18}"]
    for name, v in r["replica_views"].items():
        f = v["flows"]
        lines.append(
            f"{name:>16} {v['local_share_of_ceiling']:>8.1%} {v['cross_share_of_ceiling']:>8.1%} {v['load_imbalance']:>9.2f}x "
            f"{_rate(f['read_peak_bytes_per_s']):>12} {_rate(f['write_all_peak_bytes_per_s']):>15} {_rate(f['write_reread_peak_bytes_per_s']):>18}"
        )
    lines += ["", f"verdict          {r['verdict']}"] + [f"  - {x}" for x in r["verdict_reasons"]]
    return "\n".join(lines)
