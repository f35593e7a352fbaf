"""Which eviction strategy to run in SGLang, on your trace: every strategy through SGLang's radix-cache eviction loop.

``kvpolicy sglang-bench TRACE`` (or :func:`compare_strategies`) replays a trace through SGLang 0.5.x's eviction loop
at a few capacities with SGLang's own ``LRUStrategy`` and ``LFUStrategy`` and the kvpolicy strategies
:func:`kvpolicy.integrations.sglang.register` adds (``kvpolicy-<name>``), beside Belady: block hits, the token hit
ratio and the share of the SGLang-LRU → Belady gap each closes. By default the loop is kvpolicy's stand-in with
SGLang's own tree shape (:func:`kvpolicy.testing.radix.radix_replay` with ``merge_runs=True``: a node per run of
pages, split where a request diverges — it hits exactly what SGLang 0.5.23's ``RadixCache`` hits under priorities
that never tie, ``tools/check_engine_bases.py``); ``own_sglang`` replays through SGLang's own ``RadixCache`` instead
(an installed SGLang, or its modules passed in).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..errors import ConfigError
from ..traces.model import check_trace

#: the strategies compared by default: SGLang's own, then kvpolicy's as ``register()`` names them
DEFAULT_STRATEGIES = ("sglang-lru", "sglang-lfu", "kvpolicy-hit-density", "kvpolicy-adaptive", "kvpolicy-reuse-distance")
SGLANG_OWN = ("sglang-lru", "sglang-lfu")
#: kvpolicy's policies SGLang can run (what ``register()`` adds); ranked ones are sized by the capacity
KVPOLICY = ("kvpolicy-hit-density", "kvpolicy-adaptive", "kvpolicy-reuse-distance", "kvpolicy-gdsf", "kvpolicy-lru", "kvpolicy-lfu")


def _reader(clock: list[float]) -> Callable[[], float]:
    """The replay's clock as a strategy reads it: the current request's arrival."""
    return lambda: clock[0]


def check_strategies(names: list[str]) -> None:
    """Every name one this bench knows: ``sglang-lru``, ``sglang-lfu`` or a ``kvpolicy-<name>`` of ``register()``."""
    known = (*SGLANG_OWN, *KVPOLICY)
    if not names:
        raise ConfigError("--strategies", f"give one or more of {', '.join(known)}")
    for n in names:
        if n not in known:
            raise ConfigError("--strategies", f"unknown strategy {n!r}; known: {', '.join(known)}")


def _kvpolicy_policy(name: str, capacity_blocks: int) -> Any:
    """The policy ``--radix-eviction-policy kvpolicy-<name>`` runs: :func:`~kvpolicy.integrations.sglang.register`'s own
    factory, with ``capacity_tokens`` for the ranked ones (the cache's size, one token per block here)."""
    from .sglang import RANKED, policy_factories

    short = name.removeprefix("kvpolicy-")
    make = policy_factories()[short]
    return make(capacity_tokens=capacity_blocks) if short in RANKED else make()


def compare_strategies(trace: Any, capacities_blocks: list[int], strategies: list[str] | tuple[str, ...] = DEFAULT_STRATEGIES, *,
                       own_sglang: bool = False, sglang_modules: tuple[Any, Any, Any] | None = None, merge_runs: bool = True,
                       progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Every strategy at every capacity (blocks: one token per block, SGLang's page size 1) through SGLang's eviction
    loop, with SGLang's LRU (the baseline of the gap) and Belady beside them. ``own_sglang``: SGLang's own
    ``RadixCache`` — ``sglang_modules`` (its ``radix_cache``, ``base_prefix_cache`` and ``evict_policy`` modules), or
    an installed SGLang; else kvpolicy's stand-in with SGLang's tree shape (``merge_runs=False``: one node per
    block instead)."""
    from ..eviction.bench import check_capacities
    from ..eviction.kernels import replay_kernel
    from ..testing.radix import radix_replay, sglang_lfu, sglang_lru, sglang_radix_replay
    from .sglang import PriorityStrategy

    check_trace(trace)
    check_strategies(list(strategies))
    check_capacities(capacities_blocks)
    if own_sglang and sglang_modules is None:
        try:
            from sglang.srt.mem_cache import base_prefix_cache, evict_policy, radix_cache  # type: ignore[import-not-found]
        except ImportError:
            raise ConfigError("--sglang-own", "SGLang is not importable here (pip install sglang, or run "
                                              "benchmarks/bench_sglang_strategy.py --sglang-wheel WHEEL)") from None
        sglang_modules = (radix_cache, base_prefix_cache, evict_policy)
    step = progress or (lambda _m: None)
    names = list(dict.fromkeys(["sglang-lru", *strategies]))
    refs = max(int(trace.block_ids.size), 1)
    B = trace.block_size_tokens
    total_tokens = max(int(trace.input_tokens.sum()), 1)
    results = []
    for cap in (int(c) for c in capacities_blocks):
        hits: dict[str, int] = {}
        for name in names:
            step(f"{name} @ {cap:,} blocks")
            clock: list[float] = [0.0]
            if name in SGLANG_OWN:
                if sglang_modules is not None:
                    evict = sglang_modules[2]
                    strategy = evict.LRUStrategy() if name == "sglang-lru" else evict.LFUStrategy()
                else:
                    strategy = sglang_lru if name == "sglang-lru" else sglang_lfu
            else:
                strategy = PriorityStrategy(_kvpolicy_policy(name, cap), now_s=_reader(clock))
            if sglang_modules is not None:
                got = sglang_radix_replay(trace, strategy, cap, clock, radix=sglang_modules[0], params=sglang_modules[1])
            else:
                got = radix_replay(trace, getattr(strategy, "get_priority", strategy), cap, clock=clock, merge_runs=merge_runs)
            hits[name] = int(got.sum())
        step(f"belady @ {cap:,} blocks")
        bel = replay_kernel(trace, "belady", cap).hit_blocks
        lru = hits["sglang-lru"]
        for name, h in [*hits.items(), ("belady", bel)]:
            results.append({"strategy": name, "capacity_blocks": cap, "hit_blocks": h, "block_hit_ratio": h / refs,
                            "token_hit_ratio": h * B / total_tokens, "gap_closed": (h - lru) / (bel - lru) if bel > lru else None})
    res_pick = pick(results)
    loop = ("SGLang's own RadixCache" if sglang_modules is not None else
            "kvpolicy's stand-in of SGLang's loop, " + ("SGLang's tree shape" if merge_runs else "one node per block"))
    return {"source": trace.source, "loop": loop, "block_refs": refs, "block_size_tokens": B, "results": results, "pick": res_pick}


def pick(results: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The strategy whose worst capacity does best (max-min of the share of the SGLang-LRU → Belady gap; ties: the
    larger mean): what to run when losing to SGLang's default at any size matters more than the best case. None when
    no capacity has a gap. SGLang's LRU itself is a candidate (0 everywhere): the pick is never below it."""
    caps = sorted({r["capacity_blocks"] for r in results if r["gap_closed"] is not None and r["strategy"] != "belady"})
    if not caps:
        return None
    gaps: dict[str, list[float]] = {}
    for r in results:
        if r["strategy"] != "belady" and r["capacity_blocks"] in caps:
            gaps.setdefault(r["strategy"], []).append(r["gap_closed"] if r["gap_closed"] is not None else 0.0)
    scored = [(min(g), sum(g) / len(g), name) for name, g in gaps.items() if len(g) == len(caps)]
    worst, mean, name = max(scored, key=lambda x: (x[0], x[1]))
    return {"strategy": name, "worst_gap_closed": worst, "mean_gap_closed": mean}


def render(res: dict[str, Any]) -> str:
    """The comparison as a table, one row per capacity and strategy, and what to read from it."""
    lines = [f"{res['source']}: eviction in SGLang ({res['loop']}), {res['block_refs']:,} block references",
             "", f"{'capacity (blocks)':>17}  {'strategy':<24} {'block hits':>12} {'token hit ratio':>16} {'gap closed':>11}"]
    for r in res["results"]:
        gap = "—" if r["gap_closed"] is None or r["strategy"] in ("sglang-lru", "belady") else f"{r['gap_closed']:+.0%}"
        lines.append(f"{r['capacity_blocks']:>17,}  {r['strategy']:<24} {r['hit_blocks']:>12,} {r['token_hit_ratio']:>16.2%} {gap:>11}")
    p = res.get("pick")
    if p is not None:
        note = "; nothing beat SGLang's LRU at every capacity" if p["strategy"] == "sglang-lru" else ""
        lines += ["", f"on this trace: {p['strategy']} — its worst capacity {p['worst_gap_closed']:+.0%} of the gap, "
                      f"{p['mean_gap_closed']:+.0%} on average (the best worst case{note})"]
    lines += ["", "gap closed: the share of the SGLang-LRU -> Belady gap in block hits (negative: below SGLang's default).",
              "Switch one on: kvpolicy.integrations.sglang.register(), then --radix-eviction-policy kvpolicy-<name>; hit-density and "
              "adaptive also take --radix-eviction-policy-config '{\"capacity_tokens\": N}', the radix cache's size in tokens "
              "(docs/integrations.md)."]
    return "\n".join(lines)
