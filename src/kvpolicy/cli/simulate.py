"""The simulator's command: ``compare`` (every policy set on one trace and cluster)."""

from __future__ import annotations

import argparse
from typing import Any

from ..errors import ConfigError
from ._common import _bytes_per_token, _load_trace, _prefill_model, _second_half, _sweep, _write_report


def _cmd_compare(args: argparse.Namespace) -> int:
    from ..progress import Progress
    from ..sim import POLICY_SETS, SCENARIOS, compare, default_cluster, figures, render
    from ..sim.compare import check_offered_load, offered_load

    from ..sim import policy_set

    for p in args.policies or ():  # a misspelt set, or one of your own that does not load, fails before the trace is read
        policy_set(p)
    prog = Progress("compare", enabled=None if not args.no_progress else False)
    bpt, model_note = _bytes_per_token(args)
    prog("reading trace")
    if not args.trace and not args.block_size:
        args.block_size = 256  # the built-in preset at 256-token blocks: every scenario x policy set in well under a minute
    trace = _load_trace(args)
    scenarios = list(SCENARIOS) if args.scenario == "all" else [args.scenario]
    policies = args.policies or list(POLICY_SETS)
    if args.controller_scope is not None:  # kvpolicy's preset, still named kvpolicy, with one controller per replica (or the cluster's)
        import attrs

        if "kvpolicy" not in policies:
            raise ConfigError("--controller-scope", "applies to the kvpolicy policy set, which --policies leaves out "
                                                    "(a set of your own sets PolicySet.controller_scope itself)")

        policies = [attrs.evolve(policy_set(p), controller_scope=args.controller_scope) if p == "kvpolicy" else p for p in policies]
    prog.set_total(1 + len(scenarios) * len(set(policies) | {"recompute-only"}) + (1 if args.plot else 0))
    overrides: dict[str, Any] = {"router": args.router, "prefill_slots": args.prefill_slots, "decode_tokens_per_s": args.decode_tokens_per_s,
                                 "node_bandwidth_bytes_per_s": args.node_gbps * 1e9 / 8, "replica_bandwidth_bytes_per_s": args.replica_gbps * 1e9 / 8,
                                 "failure_rate": args.failure_rate, "timeout_rate": args.timeout_rate, "compute_factor": args.compute_factor,
                                 "link_prior_factor": args.link_prior_factor}
    if args.stage_gbps is not None:
        overrides["stage_bytes_per_s"] = args.stage_gbps * 1e9 / 8
    for name, value in (("--node-gbps", args.node_gbps), ("--replica-gbps", args.replica_gbps), ("--local-kv-gib", args.local_kv_gib),
                        ("--pool-share", args.pool_share)):
        if value < 0:
            raise ConfigError(name, f"must be non-negative, got {value}")
    cluster = default_cluster(trace, bytes_per_token=bpt, prefill=_prefill_model(args, bpt), replicas=args.replicas, local_kv_gib=args.local_kv_gib,
                              pool_share=args.pool_share, storage_nodes=args.storage_nodes, **overrides)
    load = offered_load(trace, cluster)
    if not args.allow_overload:
        check_offered_load(load)
    report, raw = compare(trace, cluster, scenarios=scenarios, policies=policies, seed=args.seed, progress=prog, load=load,
                          judge_from_request=_second_half(args, trace),
                          sweep=_sweep(args, trace, len(scenarios) * (len(policies) + ("recompute-only" not in policies))))
    report["model"] = model_note
    if args.plot:
        prog("plots")
        report["plots"] = [str(p) for p in figures(report, raw, args.plot)]
    prog.done()
    _write_report(args.json, report)
    print(f"model     {model_note}")
    print(render(report))
    if args.plot:
        print("plots     " + ", ".join(report["plots"]))
    if args.json:
        print(f"wrote     {args.json}")
    return 0
