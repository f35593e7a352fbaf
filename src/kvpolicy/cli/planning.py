"""Planning commands: ``plan-warmup`` (what a new replica loads) and ``diagnose`` (why a run missed)."""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

from ..errors import ConfigError
from .._io import json_loads, read_text, strict_json
from ._common import MAX_CLI_INT, _bytes_per_token, _prefill_model, _write_report


class _HotFields:
    """One entry of HOT.json, read strictly: a wrong type or range is an error naming the file, entry and field — not a
    value quietly rounded (``tokens: 100.5``), a bool taken for 1, or an OverflowError from ``int(inf)``."""

    def __init__(self, src: str, i: int, item: dict[str, Any]) -> None:
        self.src, self.i, self.item = src, i, item

    def _bad(self, name: str, want: str, v: Any) -> ConfigError:
        return ConfigError("HOT.json", f"{self.src}: prefixes[{self.i}].{name} must be {want}, got {v!r}")

    def integer(self, name: str, low: int, high: int) -> int:
        v = self.item[name]
        if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
            raise self._bad(name, f"an integer in [{low}, {high}]", v)
        return v

    def number(self, name: str) -> float:
        v = self.item[name]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise self._bad(name, "a finite number >= 0", v)
        return float(v)

    def key(self, name: str, v: Any = None, j: int | None = None) -> str | int:
        v = self.item[name] if j is None else v
        if isinstance(v, bool) or not isinstance(v, (str, int)):
            raise self._bad(name if j is None else f"{name}[{j}]", "a string or an integer", v)
        return v


def _load_hot(args: argparse.Namespace, bpt: int) -> list[Any]:
    from ..traces import detect_format, generate, preset, read_trace
    from ..warmup import HotPrefix, hot_prefixes_from_trace

    prefill = _prefill_model(args, bpt)
    src = args.source
    if src and src.endswith(".json"):
        try:
            data = json_loads(read_text(src, "HOT.json"))
        except json.JSONDecodeError as exc:
            raise ConfigError("HOT.json", f"{src}:{exc.lineno}: not valid JSON ({exc.msg})") from None
        if not isinstance(data, dict) or not isinstance(data.get("prefixes"), list):
            raise ConfigError("HOT.json", f"{src}: expected an object with a 'prefixes' list")
        out = []
        for i, item in enumerate(data["prefixes"]):
            if not isinstance(item, dict) or "prefix" not in item or "access_count" not in item or not ("tokens" in item or "bytes" in item):
                raise ConfigError("HOT.json", f"{src}: prefixes[{i}] needs 'prefix', 'access_count' and 'tokens' or 'bytes'")
            field = _HotFields(src, i, item)
            prefix = field.key("prefix")
            count = field.integer("access_count", 0, 2**63 - 1)
            tokens = field.integer("tokens", 1, MAX_CLI_INT) if "tokens" in item else None
            size = field.integer("bytes", 1, 2**63 - 1) if "bytes" in item else tokens * bpt  # type: ignore[operator]
            if "recompute_s" in item:
                rec = field.number("recompute_s")
            elif tokens is not None:
                rec = float(prefill(tokens))
            else:
                raise ConfigError("HOT.json", f"{src}: prefixes[{i}] gives bytes without tokens: add 'recompute_s'")
            blocks = item.get("blocks", [])
            if not isinstance(blocks, list):
                raise ConfigError("HOT.json", f"{src}: prefixes[{i}].blocks must be a list of block ids, got {type(blocks).__name__}")
            out.append(HotPrefix(prefix=prefix, size_bytes=size, access_count=count, recompute_s=rec,
                                 blocks=tuple(field.key("blocks", b, j) for j, b in enumerate(blocks))))
        return out
    if src:
        detect_format(src)
        trace = read_trace(src, None, args.block_size)
    else:
        trace = generate(preset(args.preset, seed=args.seed))
    return hot_prefixes_from_trace(trace, bytes_per_token=bpt, recompute_s=prefill, min_access_count=args.min_access_count, max_prefixes=args.max_prefixes)


def _cmd_plan_warmup(args: argparse.Namespace) -> int:
    from ..warmup import WarmupConfig, plan_warmup

    bpt, model_note = _bytes_per_token(args)
    hot = _load_hot(args, bpt)
    cfg = WarmupConfig(replicas=args.replicas, window_s=args.window_s, bandwidth_bytes_per_s=args.bandwidth_gbps * 1e9 / 8,
                       current_load_bytes_per_s=args.current_load_gbps * 1e9 / 8, max_loads_per_replica=args.max_loads_per_replica,
                       max_loads_pool=args.max_loads_pool, min_access_count=args.min_access_count, readiness_share=args.readiness_share)
    plan = plan_warmup(hot, cfg)
    d = plan.to_dict()
    if args.json:
        print(strict_json(d, indent=2))
        return 0
    print(f"model            {model_note}")
    print(f"hot prefixes     {len(hot) - len(plan.cold)} planned (>= {cfg.min_access_count} requests), {len(plan.cold)} cold; hot set W = {plan.hot_bytes / 2**30:,.2f} GiB")
    print(f"bandwidth        need N x W / dt = {d['required_gbps']:,.2f} Gbit/s; available {d['available_gbps']:,.2f} Gbit/s")
    print(f"verdict          {plan.verdict}\n")
    print(f"{'replica':>8} {'loads':>6} {'GiB':>8} {'ready_at_s':>11} {'left to prefill':>16}")
    for r in range(cfg.replicas):
        loads = [x for x in plan.schedule if x.replica == r]
        ra = plan.ready_at_s[r]
        print(f"{r:>8} {len(loads):>6} {sum(x.bytes for x in loads) / 2**30:>8,.2f} {('-' if ra is None else f'{ra:.1f}'):>11} {len(plan.prefill[r]):>16}")
    print(f"\nready_at_s: when a replica holds {cfg.readiness_share:.0%} of the hot set's bytes (--readiness-share), seconds after it joins; "
          f"'-': the window's loads never get it there (it prefills the rest on first use, listed under 'left to prefill')")
    print("first loads      " + "; ".join(f"r{x.replica} {x.prefix} {x.start_s:.1f}-{x.end_s:.1f}s" for x in plan.schedule[:6]))
    return 0


# --------------------------------------------------------------------------- diagnose


def _cmd_diagnose(args: argparse.Namespace) -> int:
    from ..diagnose import diagnose, explain
    from ..traces import read_tokens_jsonl

    trace = read_tokens_jsonl(args.trace, args.block_size or 16, sort=args.sort, skip_bad_lines=args.skip_bad_lines)
    diag = diagnose(trace, min_shared=args.min_shared)
    if args.request is not None:
        ex = explain(trace, args.request, diag, capacity_blocks=args.capacity_blocks)
        _write_report(args.json, ex)
        print(f"request          {ex['request']} ({ex['input_tokens']:,} tokens; {ex['reusable_tokens_infinite_cache']:,} reusable with an infinite cache)")
        for reason in ex["reasons"]:
            print(f"  - {reason}")
        return 0
    d = diag.to_dict()
    _write_report(args.json, d)
    print(f"trace            {trace.source} ({len(trace):,} requests, {d['total_input_tokens']:,} input tokens)")
    print(f"lost hit tokens  {d['lost_hit_tokens']:,} to nondeterministic prompt assembly = {d['lost_share_of_input']:.1%} of input tokens, "
          f"{d['lost_share_of_ceiling_plus_lost']:.1%} of what an infinite cache could reuse with deterministic assembly")
    print(f"flagged          {d['flagged_requests']:,} requests share >= {args.min_shared:.0%} of their content with an earlier one, yet their prefix match breaks early\n")
    if d["patterns"]:
        print(f"{'kind':>14} {'position':>9} {'requests':>9} {'lost tokens':>12}   example")
        for p_ in d["patterns"][:10]:
            ex = p_["example"]
            print(f"{p_['kind']:>14} {p_['position_tokens']:>9,} {p_['requests']:>9,} {p_['lost_tokens']:>12,}   {ex['request']} vs {ex['earlier']}: "
                  f"tokens {ex['span_request'][0]}-{ex['span_request'][1]} vs {ex['span_earlier'][0]}-{ex['span_earlier'][1]}")
        print("\nworst offenders  " + ", ".join(f"{w['request_id']} ({w['lost_tokens']:,})" for w in d["worst"][:5]))
    else:
        print("no pattern: prompts that share content also share their prefixes")
    if args.json:
        print(f"\nwrote {args.json}")
    return 0
