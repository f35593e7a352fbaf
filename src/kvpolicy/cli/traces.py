"""Trace commands: ``analyze``, ``breakeven``, ``evict-bench``, ``sglang-bench`` and ``publish-bench``."""

from __future__ import annotations

import argparse
import sys

from ..errors import ConfigError
from .._io import strict_json
from ._common import _bytes_per_token, _load_trace, _prefill_model, _print_report, _read_checked_profile, _second_half, _sweep, _write_report


def _cmd_analyze(args: argparse.Namespace) -> int:
    from ..analysis import EffectiveCapacity, analyze, render
    from ..progress import Progress

    shares = args.decode_share + args.reserved_share + args.fragmentation_share
    if shares > 1:  # checked before the trace is read, and named by its flags (not as bytes of the capacity model)
        raise ConfigError("--decode-share", f"--decode-share + --reserved-share + --fragmentation-share is {shares:g}: the parts of the KV memory sum to at most 1")
    prog = Progress("analyze", enabled=None if not args.no_progress else False)
    bpt, model_note = _bytes_per_token(args)
    prog("reading trace")
    trace = _load_trace(args)
    if trace.skipped_lines:
        lines = ", ".join(str(x) for x in trace.skipped_lines[:10]) + (" ..." if len(trace.skipped_lines) > 10 else "")
        print(f"kvpolicy analyze: skipped {len(trace.skipped_lines)} bad line(s) of {trace.source}: {lines}", file=sys.stderr)
    local = EffectiveCapacity.from_fractions(int(args.local_kv_gib * 2**30), active_decode=args.decode_share, reserved=args.reserved_share, fragmentation=args.fragmentation_share)
    report = analyze(
        trace, bytes_per_token=bpt, capacities_blocks=args.capacities_blocks, replicas=args.replicas, routing=args.routing,
        affinity_blocks=args.affinity_blocks, local_capacity=local, seed=args.seed, progress=prog,
    )
    report["model"] = model_note
    report["skipped_lines"] = list(trace.skipped_lines)
    if args.plot:
        from ..analysis import request_stack_distances
        from ..plots import analyze_figures

        prog("plots")
        report["plots"] = [str(p) for p in analyze_figures(report, trace, request_stack_distances(trace.block_offsets, trace.block_ids), args.plot)]
    prog.done()
    _write_report(args.json, report)
    print(f"model            {model_note}")
    print(render(report))
    if args.json:
        print(f"\nwrote {args.json}")
    if args.plot:
        print("plots            " + ", ".join(report["plots"]))
    return 0


# --------------------------------------------------------------------------- breakeven


def _cmd_breakeven(args: argparse.Namespace) -> int:
    from ..admission.breakeven import breakeven

    bpt, model_note = _bytes_per_token(args)
    prof = _read_checked_profile(args, bpt)
    res = breakeven(
        bytes_per_token=bpt, prefill=prof.prefill_model(), bandwidth_gbps=args.bandwidth_gbps, block_size_tokens=args.block_size,
        prefix_tokens=args.prefix_tokens, lookup_s=args.lookup_ms / 1e3, queue_s=args.queue_ms / 1e3, stage_s=args.stage_ms / 1e3,
        install_s=args.install_ms / 1e3, dispatch_s=args.dispatch_ms / 1e3, interference_s_per_gb=args.interference_ms_per_gb / 1e3,
        margin=args.margin,
    )
    if args.json:
        print(strict_json(res, indent=2))
        return 0
    inp = res["inputs"]
    print(f"model            {model_note}")
    print(f"link             {inp['bandwidth_gbps']} Gbit/s useful; lookup {inp['lookup_ms']} ms, queue {inp['queue_ms']} ms, stage {inp['stage_ms']} ms, install {inp['install_ms']} ms")
    print(f"recompute        dispatch {inp['dispatch_ms']} ms + T_prefill from {args.profile}; interference {inp['interference_ms_per_gb']} ms/GB; load iff T_remote + T_interf < {inp['margin']} x T_recompute\n")
    print(f"{'prefix_tokens':>14} {'useful_tokens':>14} {'load_bytes':>14} {'t_remote_ms':>12} {'t_interf_ms':>12} {'t_recompute_ms':>15} {'decision':>10}")
    for r in res["rows"]:
        print(f"{r['prefix_tokens']:>14,} {r['useful_tokens']:>14,} {r['load_bytes']:>14,} {r['t_remote_ms']:>12.2f} {r['t_interference_ms']:>12.2f} {r['t_recompute_ms']:>15.2f} {r['decision']:>10}")
    be = res["break_even_tokens"]
    if be:
        verdict = f"{be:,} tokens: loading wins from here"
    else:
        verdict = f"none: recompute wins at every length up to {inp['searched_up_to_tokens']:,} tokens"
    print(f"\nbreak-even       {verdict}")
    return 0


def _cmd_evict_bench(args: argparse.Namespace) -> int:
    from ..eviction.bench import compare, default_capacities, render
    from ..progress import Progress

    from ..eviction.replay import check_policy_names

    check_policy_names(args.policies)  # a misspelt name, or a policy of your own that does not load, fails before the trace is read
    prog = Progress("evict-bench", enabled=None if not args.no_progress else False)
    prog("reading trace")
    trace = _load_trace(args)
    bpt = _bytes_per_token(args)[0] if (args.config or args.bytes_per_token) else None
    caps = args.capacities_blocks or default_capacities(trace)
    res = compare(trace, args.policies, caps, bytes_per_token=bpt, progress=prog,
                  judge_from_request=_second_half(args, trace), sweep=_sweep(args, trace, len(args.policies) * len(caps)))
    return _print_report(prog, args.json, res, render(res))


def _cmd_sglang_bench(args: argparse.Namespace) -> int:
    from ..eviction.bench import default_capacities
    from ..integrations.sglang_bench import check_strategies, compare_strategies, render
    from ..progress import Progress

    check_strategies(args.strategies)  # a misspelt name fails before the trace is read
    prog = Progress("sglang-bench", enabled=None if not args.no_progress else False)
    prog("reading trace")
    trace = _load_trace(args)
    caps = args.capacities_blocks or default_capacities(trace)[:2]  # 1/64 and 1/16: where the strategies part
    res = compare_strategies(trace, caps, args.strategies, own_sglang=args.sglang_own, progress=prog)
    return _print_report(prog, args.json, res, render(res))


def _cmd_publish_bench(args: argparse.Namespace) -> int:
    from ..progress import Progress
    from ..publish_sim import publish_bench, render

    from ..publish import check_spec

    for spec in args.policies:  # a misspelt policy, or a filter of your own that does not load, fails here, before a large trace is read
        try:
            check_spec(spec)
        except ConfigError as e:
            raise ConfigError("--policies", e.problem) from None
    prog = Progress("publish-bench", enabled=None if not args.no_progress else False)
    bpt, model_note = _bytes_per_token(args)
    prog("reading trace")
    trace = _load_trace(args)
    res = publish_bench(trace, args.policies, replicas=args.replicas, routing=args.routing, pool_capacity_blocks=args.pool_capacity_blocks,
                        bytes_per_token=bpt, prefill=_prefill_model(args, bpt), write_bytes_per_s=args.write_gbps * 1e9 / 8, seed=args.seed, progress=prog,
                        judge_from_request=_second_half(args, trace), sweep=_sweep(args, trace, len(args.policies)))
    prog.done()
    res["model"] = model_note
    _write_report(args.json, res)
    print(f"model            {model_note}")
    print(render(res))
    if args.json:
        print(f"\nwrote {args.json}")
    return 0
