"""The ``kvpolicy`` command."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

from .errors import ConfigError, KVPolicyError
from .gguf import KV_CACHE_TYPES
from ._io import json_loads, read_text, strict_json, write_text_atomic

DEFAULT_PREFIXES = (4096, 16384, 32768, 65536)


#: the largest integer any flag takes: above every count, length or capacity a trace or a cluster has, far below int64 overflow
MAX_CLI_INT = 2**40


class _Parser(argparse.ArgumentParser):
    """argparse, with a usage error on one line (the message names the flag) instead of usage + error."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _ints(text: str, low: int, high: int = MAX_CLI_INT) -> list[int]:
    """Comma-separated integers, each in [low, high]; anything else is an argparse error naming the value."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers, got {text!r}") from None
    if not values or any(not low <= v <= high for v in values):
        raise argparse.ArgumentTypeError(f"expected integers in [{low}, {high}], got {text!r}")
    return values


def _int_list(text: str) -> list[int]:
    return _ints(text, 1)


def _ints_upto(high: int, low: int = 1, many: bool = False) -> Callable[[str], Any]:
    """A flag's parser with its own maximum (issue #47): far above any real deployment or trace, and low enough that
    a typo (2^40 replicas, threads, layers) is refused with the flag named instead of starting a run that allocates
    or loops on it."""

    def parse(text: str) -> Any:
        return _ints(text, low, high) if many else _one_int(text, low, high)

    parse.__name__ = f"_int{'_list' if many else ''}_{low}_{high}"  # "int" in the name: the bad-input corpus tries it
    return parse


#: per-flag maxima: a block of a million tokens, 4,096 replicas or nodes, a billion bytes of KV per token, ...
MAX_BLOCK_TOKENS = 2**20
MAX_REPLICAS = 4096
MAX_BYTES_PER_TOKEN = 2**30
MAX_SEED = 2**32 - 1
MAX_PROMPT_TOKENS = 2**24
MAX_CAPACITY_BLOCKS = 2**32
MAX_THREADS = 1024
_block_size = _ints_upto(MAX_BLOCK_TOKENS)
_replicas = _ints_upto(MAX_REPLICAS)
_bytes_per_token_int = _ints_upto(MAX_BYTES_PER_TOKEN)
_seed = _ints_upto(MAX_SEED, low=0)
_token_lengths = _ints_upto(MAX_PROMPT_TOKENS, many=True)
_capacities = _ints_upto(MAX_CAPACITY_BLOCKS, many=True)


def _one_int(text: str, low: int, high: int = MAX_CLI_INT) -> int:
    values = _ints(text, low, high)
    if len(values) != 1:
        raise argparse.ArgumentTypeError(f"expected one integer, got {text!r}")
    return values[0]


def _non_negative_int(text: str) -> int:
    return _one_int(text, 0)


def _port(text: str) -> int:
    return _one_int(text, 0, 65535)


def _non_negative_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(v) or v < 0:
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return v


def _positive_float(text: str) -> float:
    """A finite number > 0: for rates, windows and bandwidths, where 0 means nothing (--stage-gbps 0 meant "no staging")."""
    v = _non_negative_float(text)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return v


#: the most GiB of KV per replica a flag takes (1 PiB: past any accelerator, and its byte count far inside int64 — 1e300 GiB was inf bytes)
MAX_CLI_GIB = 2**20


def _gib(text: str) -> float:
    v = _non_negative_float(text)
    if v > MAX_CLI_GIB:
        raise argparse.ArgumentTypeError(f"expected GiB in [0, {MAX_CLI_GIB}], got {text!r}")
    return v


def _positive_int(text: str) -> int:
    return _one_int(text, 1)


def _emit(payload: dict[str, Any], as_json: bool, render: Callable[[dict[str, Any]], str]) -> None:
    if as_json:
        print(strict_json(payload, indent=2))
    else:
        print(render(payload))


def _print_report(prog: Any, path: str | None, payload: dict[str, Any], text: str) -> int:
    """End a bench command: the progress line closed, ``--json OUT`` written, the report printed (exit status 0)."""
    prog.done()
    _write_report(path, payload)
    print(text)
    if path:
        print(f"\nwrote {path}")
    return 0


def _write_report(path: str | None, payload: dict[str, Any]) -> None:
    """Write a --json OUT report: strict JSON (null, never NaN), replaced atomically (parents created)."""
    if path:
        write_text_atomic(path, strict_json(payload, indent=2))


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.2f} {unit}"
        n /= 1024
    return f"{n}"  # pragma: no cover


# --------------------------------------------------------------------------- size


def _cmd_size(args: argparse.Namespace) -> int:
    from .data import bundled_configs, resolve_config
    from .geometry import KVGeometry, useful_tokens
    from .profile import read_profile

    if (args.config is None) == (args.gguf is None):
        raise ConfigError("--config", "give exactly one of --config (an HF config.json) or --gguf (a GGUF model file)")
    B = args.block_size
    if args.gguf is not None:
        from .gguf import GGUFModel

        if args.kv_dtype is not None:
            raise ConfigError("--kv-dtype", "is for --config; a GGUF's cache types are --cache-type-k / --cache-type-v")
        m = GGUFModel.read(args.gguf)
        bpt = m.bytes_per_token(args.cache_type_k, args.cache_type_v)
        kv = sorted(set(m.num_kv_heads))
        payload: dict[str, Any] = {
            "config": str(args.gguf),
            "geometry": {"kind": "gguf", "architecture": m.architecture, "name": m.name, "num_layers": m.num_layers,
                         "num_kv_heads": kv[0] if len(kv) == 1 else list(m.num_kv_heads), "key_length": m.key_length,
                         "value_length": m.value_length, "type_k": args.cache_type_k, "type_v": args.cache_type_v},
            "bytes_per_token": bpt, "block_size_tokens": B, "prefixes": [],
        }
    else:
        if args.cache_type_k != "f16" or args.cache_type_v != "f16":
            raise ConfigError("--cache-type-k", "is for --gguf; an HF config's KV format is --kv-dtype")
        path = resolve_config(args.config)
        if not path.exists():
            raise ConfigError("--config", f"no such file {args.config!r}; bundled configs: {sorted(bundled_configs())}")
        geom = KVGeometry.from_hf_config(path, kv_dtype=args.kv_dtype)
        bpt = geom.bytes_per_token
        payload = {
            "config": str(args.config),
            "geometry": {
                "kind": geom.kind,
                "num_layers": geom.num_layers,
                "num_kv_heads": geom.num_kv_heads,
                "head_dim": geom.head_dim,
                "mla_latent_dim": geom.mla_latent_dim,
                "bytes_per_element": geom.bytes_per_element,
            },
            "bytes_per_token": bpt,
            "block_size_tokens": B,
            "prefixes": [],
        }
    prefill = None
    if args.profile:
        prof = read_profile(args.profile)
        prefill = prof.prefill_model()
        slope = prof.bytes_per_token if len(prof) >= 2 else None
        payload["profile"] = {
            "path": str(args.profile),
            "rows": len(prof),
            "byte_slopes_per_token": [float(s) for s in prof.byte_slopes()],
            "measured_bytes_per_token": slope,
            "formula_over_measured": (bpt / slope) if slope else None,
            "prefill_model": prefill.to_dict(),
        }
    for T in args.prefix_tokens:
        u = useful_tokens(T, B)
        row: dict[str, Any] = {"prefix_tokens": T, "useful_tokens": u, "kv_bytes": bpt * T, "load_bytes": bpt * u}
        if prefill is not None:
            row["t_prefill_ms"] = float(prefill(T)) * 1e3
        payload["prefixes"].append(row)
    _emit(payload, args.json, _render_size)
    return 0


def _render_size(p: dict[str, Any]) -> str:
    g = p["geometry"]
    if g["kind"] == "gguf":
        formula = (f"sum over L={g['num_layers']} layers of K row (Hkv={g['num_kv_heads']} x {g['key_length']} {g['type_k']}) "
                   f"+ V row (Hkv x {g['value_length']} {g['type_v']})  ({g['architecture']}, llama.cpp cache)")
    elif g["kind"] == "mla":
        formula = f"L={g['num_layers']} x latent={g['mla_latent_dim']} x q={g['bytes_per_element']}  (MLA)"
    else:
        formula = f"2 x L={g['num_layers']} x Hkv={g['num_kv_heads']} x D={g['head_dim']} x q={g['bytes_per_element']}"
    lines = [
        f"model config     {p['config']}",
        f"bytes per token  {p['bytes_per_token']:,}  = {formula}",
        f"block size       {p['block_size_tokens']} tokens ({_human_bytes(p['bytes_per_token'] * p['block_size_tokens'])} per block)",
        "",
    ]
    has_t = any("t_prefill_ms" in r for r in p["prefixes"])
    head = f"{'prefix_tokens':>14} {'useful_tokens':>14} {'kv_bytes':>16} {'load_bytes':>16}" + (f" {'t_prefill_ms':>13}" if has_t else "")
    lines.append(head)
    for r in p["prefixes"]:
        line = f"{r['prefix_tokens']:>14,} {r['useful_tokens']:>14,} {_human_bytes(r['kv_bytes']):>16} {_human_bytes(r['load_bytes']):>16}"
        if has_t:
            line += f" {r['t_prefill_ms']:>13.1f}"
        lines.append(line)
    if "profile" in p:
        pr = p["profile"]
        m = pr["prefill_model"]
        lines += ["", f"profile          {pr['path']} ({pr['rows']} rows)"]
        if pr["measured_bytes_per_token"] is not None:
            lines.append(
                f"measured slope   {pr['measured_bytes_per_token']:,.1f} bytes/token "
                f"(formula / measured = {pr['formula_over_measured']:.3f})"
            )
            from .profile import MISMATCH_TOLERANCE

            if abs(1.0 / pr["formula_over_measured"] - 1.0) > MISMATCH_TOLERANCE:
                lines.append(
                    f"MISMATCH         more than {MISMATCH_TOLERANCE:.0%} apart: this profile was measured on another model or KV dtype; "
                    "breakeven / compare / publish-bench / plan-warmup refuse it with this config unless --allow-mismatch"
                )
        from .profile import describe_prefill

        lines += describe_prefill(m)
    return "\n".join(lines)


# --------------------------------------------------------------------------- keys


def _read_tokens(path: str) -> list[int]:
    from .errors import InputFormatError

    text = read_text(path, "tokens")
    try:
        data = json_loads(text)
    except json.JSONDecodeError as exc:
        raise InputFormatError(path, exc.lineno, f"not valid JSON ({exc.msg})") from None
    if not isinstance(data, list):
        raise InputFormatError(path, 1, f"expected a JSON list of token ids, got {type(data).__name__}")
    for i, t in enumerate(data):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < 2**32:
            raise InputFormatError(path, None, f"item {i} is {t!r}; token ids are integers in [0, 2**32)")
    return data


def _hasher(args: argparse.Namespace, command: str) -> Any:
    """The deployment's BlockHasher from --namespace (JSON), --block-size, --scheme and the secret (--secret-file,
    KVPOLICY_SECRET_HEX or --secret-hex)."""
    from .keys import BlockHasher, Namespace

    if args.namespace:
        try:
            ns_data = json_loads(read_text(args.namespace, "--namespace"))
        except json.JSONDecodeError as exc:
            raise ConfigError("--namespace", f"{args.namespace}:{exc.lineno}: not valid JSON ({exc.msg})") from None
        if not isinstance(ns_data, dict):
            raise ConfigError("--namespace", f"{args.namespace}: must be a JSON object")
        ns_data.setdefault("block_size_tokens", args.block_size)
        ns = Namespace.from_dict(ns_data)
        if ns.block_size_tokens != args.block_size:
            raise ConfigError("--block-size", f"{args.block_size} disagrees with the namespace's block_size_tokens {ns.block_size_tokens}")
    else:
        ns = Namespace(model_id="unspecified", model_revision="unspecified", tokenizer_version="unspecified", kv_dtype="bf16", block_size_tokens=args.block_size)
    secret = None
    if args.secret_hex and args.secret_file:
        raise ConfigError("--secret-file", "give --secret-file or --secret-hex, not both")
    secret_hex = args.secret_hex or os.environ.get("KVPOLICY_SECRET_HEX")
    if args.secret_file:
        secret_hex = read_text(args.secret_file, "--secret-file").strip()
        mode = os.stat(args.secret_file).st_mode
        if mode & 0o077:  # as ssh says of a private key: others on this host can read the deployment's secret
            print(f"kvpolicy {command}: warning: {args.secret_file} is readable by other users (mode {mode & 0o777:04o}); chmod 600 it",
                  file=sys.stderr)
    if secret_hex:
        try:
            secret = bytes.fromhex(secret_hex)
        except ValueError:
            raise ConfigError("--secret-file" if args.secret_file else "--secret-hex", "is not hexadecimal") from None
    if args.scheme == "keyed" and secret is None:
        raise ConfigError("--secret-hex", "the keyed scheme needs a deployment secret: 16..64 bytes as hex in --secret-file or KVPOLICY_SECRET_HEX (--secret-hex shows it in ps and shell history)")
    return BlockHasher(ns, args.scheme, secret=secret)


def _cmd_keys(args: argparse.Namespace) -> int:
    from .keys import vllm_block_hashes

    tokens = _read_tokens(args.tokens)
    if args.scheme.startswith("vllm-"):
        if args.namespace or args.secret_hex or args.secret_file:
            raise ConfigError("--scheme", "vLLM schemes take no --namespace or --secret-hex/--secret-file (vLLM keys have no namespace)")
        algo: Literal["sha256", "sha256_cbor"] = "sha256" if args.scheme == "vllm-sha256" else "sha256_cbor"
        hashes = [h.hex() for h in vllm_block_hashes(tokens, args.block_size, algo, args.cache_salt, args.lora_name, args.lora_path)]
    else:
        if args.cache_salt or args.lora_name or args.lora_path:
            raise ConfigError("--cache-salt", "--cache-salt/--lora-* apply to vllm-* schemes; kvpolicy keys put tenant and adapter in --namespace")
        hashes = _hasher(args, "keys").hash_blocks(tokens).hex()
    payload = {"scheme": args.scheme, "block_size": args.block_size, "num_tokens": len(tokens), "block_hashes": hashes}
    if args.json:
        print(json.dumps({"block_hashes": hashes}))
    else:
        tail = len(tokens) % args.block_size
        print(f"{len(hashes)} full blocks of {args.block_size} tokens ({payload['scheme']}); {tail} tail tokens get no key")
        for i, h in enumerate(hashes):
            print(f"{i:6d}  {h}")
    return 0


# --------------------------------------------------------------------------- analyze


def _bytes_per_token(args: argparse.Namespace) -> tuple[int, str]:
    """Resolve the model's KV bytes per token from --config / --bytes-per-token."""
    from .data import bundled_configs, resolve_config
    from .geometry import KVGeometry

    if getattr(args, "bytes_per_token", None) and getattr(args, "config", None):
        raise ConfigError("--bytes-per-token", "give --config or --bytes-per-token, not both")
    if getattr(args, "bytes_per_token", None):
        return args.bytes_per_token, f"{args.bytes_per_token:,} bytes/token (given)"
    name = getattr(args, "config", None) or "llama-3-8b"
    path = resolve_config(name)
    if not path.exists():
        raise ConfigError("--config", f"no such file {name!r}; bundled configs: {sorted(bundled_configs())}")
    bpt = KVGeometry.from_hf_config(path, kv_dtype=getattr(args, "kv_dtype", None)).bytes_per_token
    note = "" if getattr(args, "config", None) else " (default model; pass --config or --bytes-per-token)"
    return bpt, f"{name}: {bpt:,} bytes/token{note}"


def _load_trace(args: argparse.Namespace) -> Any:
    from .traces import generate, preset, read_trace

    if args.trace:
        return read_trace(args.trace, args.format, args.block_size, sort=args.sort, skip_bad_lines=args.skip_bad_lines)
    if args.format or args.sort or args.skip_bad_lines:
        raise ConfigError("--format", "--format/--sort/--skip-bad-lines need a TRACE file")
    overrides = {"seed": args.seed}
    if args.block_size:
        overrides["block_size_tokens"] = args.block_size
    return generate(preset(args.preset, **overrides))


def _cmd_analyze(args: argparse.Namespace) -> int:
    from .analysis import EffectiveCapacity, analyze, render
    from .progress import Progress

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
        from .analysis import request_stack_distances
        from .plots import analyze_figures

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
    from .admission.breakeven import breakeven

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


# --------------------------------------------------------------------------- ingest-events


def _endpoint_for_rank(endpoint: str, rank: int, flag: str) -> str:
    """vLLM publishes data-parallel rank r on the endpoint's port + r (its replay socket too)."""
    m = re.fullmatch(r"(tcp://[^\s]+):(\d{1,5})", endpoint or "")
    if not m:
        if rank:
            raise ConfigError(flag, f"must be tcp://HOST:PORT with --ranks > 1 (rank r is on PORT + r), got {endpoint!r}")
        if not re.fullmatch(r"(tcp|ipc|inproc)://\S+", endpoint or ""):
            raise ConfigError(flag, f"must be a ZMQ endpoint such as tcp://HOST:PORT, got {endpoint!r}")
        return endpoint
    port = int(m.group(2)) + rank
    if not 0 < port < 65536:
        raise ConfigError(flag, f"port {port} (for rank {rank}) is outside 1..65535")
    return f"{m.group(1)}:{port}"


#: ingest-events: a crashed worker is restarted after this many seconds, doubling with each crash in a row (at most 30 s)
SIDECAR_BACKOFF_S = 0.5
#: ... and the sidecar gives up (exit 1) after this many crashes in a row: a worker that crashes at once every time
SIDECAR_MAX_CRASHES = 8


def _cmd_ingest_events(args: argparse.Namespace) -> int:
    """Feed a directory from an engine's KV events until SIGINT / SIGTERM (or --max-seconds): the sidecar of a pod."""
    import logging
    import signal
    import threading
    import time

    from .integrations.vllm_events import KVEventIngestor, ZmqEventSubscriber

    hasher = _hasher(args, "ingest-events")
    bpt = _bytes_per_token(args)[0]
    directory = _directory_from(args.directory)
    if args.ranks > 1024:  # a socket and a thread each: a typo of 10000 would open 10,000 of both
        raise ConfigError("--ranks", f"at most 1024 data-parallel ranks per sidecar, got {args.ranks}")
    for flag, ep in (("--endpoint", args.endpoint), ("--replay-endpoint", args.replay_endpoint)):
        if ep:
            _endpoint_for_rank(ep, args.ranks - 1, flag)  # every rank's port exists, before any socket is opened
    if args.replay_endpoint:  # vLLM offsets both sockets by the rank: 5557 and 5558 put rank 1's events on rank 0's replay
        events = {_endpoint_for_rank(args.endpoint, r, "--endpoint") for r in range(args.ranks)}
        clash = sorted(events & {_endpoint_for_rank(args.replay_endpoint, r, "--replay-endpoint") for r in range(args.ranks)})
        if clash:
            raise ConfigError("--replay-endpoint", f"with --ranks {args.ranks}, {clash[0]} would be both a rank's event socket and "
                                                   "another's replay socket (the engine cannot bind both): put the replay ports "
                                                   "past the event ports' range, e.g. events 5557 and replay 5557 + ranks")
    if args.verify_hash_seed is not None and args.verify is None:
        raise ConfigError("--verify-hash-seed", "only means something with --verify")
    subs = []
    for r in range(args.ranks):
        holder = args.holder if args.ranks == 1 else f"{args.holder}-dp{r}"
        ing = KVEventIngestor(directory, args.tenant, hasher, holder=holder, bytes_per_token=bpt, verify_algo=args.verify,
                              none_hash_seed=args.verify_hash_seed)
        replay = _endpoint_for_rank(args.replay_endpoint, r, "--replay-endpoint") if args.replay_endpoint else None
        try:
            subs.append(ZmqEventSubscriber(ing, _endpoint_for_rank(args.endpoint, r, "--endpoint"), topic=args.topic, replay_endpoint=replay,
                                           on_gap=args.on_gap))
        except ConfigError as e:
            for sub in subs:
                sub.close()
            field = e.field if e.field.startswith("--") else f"--{e.field.replace('_', '-')}"  # the library names its argument
            raise ConfigError(field, e.problem) from None
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)} \
        if threading.current_thread() is threading.main_thread() else {}
    # each refused batch or event is a warning of its own: a bad publisher would flood the sidecar's log, so the stats
    # lines count them by reason and -v shows each — on the events logger alone, put back as it was on the way out
    log = logging.getLogger("kvpolicy.events")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("kvpolicy ingest-events: %(levelname)s: %(message)s"))
    saved = (log.level, log.propagate)
    log.addHandler(handler)
    log.setLevel(logging.WARNING if args.verbose else logging.ERROR)
    log.propagate = False
    restarts = [0] * len(subs)
    last_error: list[str | None] = [None] * len(subs)
    fatal: list[str] = []

    def supervised(i: int, sub: Any) -> None:
        """Run one rank's subscriber; an exception out of it (a directory that raised, a bug) is logged, counted and the
        worker restarted after a backoff — a worker never dies silently. Crashes in a row past SIDECAR_MAX_CRASHES (no
        message handled between them) stop the sidecar, which then exits 1."""
        in_a_row = 0
        while not stop.is_set():
            handled = sub.ingestor.counts["batches"] + sub.ingestor.counts["malformed_frames"]
            try:
                sub.run(stop)
                return
            except Exception as e:  # noqa: BLE001 - whatever it was, the sidecar says so and goes on
                restarts[i] += 1
                last_error[i] = f"{type(e).__name__}: {e}"
                progressed = sub.ingestor.counts["batches"] + sub.ingestor.counts["malformed_frames"] > handled
                in_a_row = 1 if progressed else in_a_row + 1
                print(f"kvpolicy ingest-events: error: rank {i} ({sub.ingestor.holder}) crashed: {last_error[i]} "
                      f"(restarts {restarts[i]}, {in_a_row} in a row)", file=sys.stderr, flush=True)
                if in_a_row >= SIDECAR_MAX_CRASHES:
                    fatal.append(f"rank {i} ({sub.ingestor.holder}) crashed {in_a_row} times in a row, the last: {last_error[i]}")
                    stop.set()
                    return
                stop.wait(min(SIDECAR_BACKOFF_S * 2 ** (in_a_row - 1), 30.0))

    workers = [threading.Thread(target=supervised, args=(i, sub), daemon=True, name=f"kv-events-{i}") for i, sub in enumerate(subs)]

    def stats(final: bool) -> dict[str, Any]:
        out: dict[str, Any] = {"time_s": round(time.time(), 3), "final": final, "ranks": []}
        for i, sub in enumerate(subs):
            ing = sub.ingestor
            out["ranks"].append({"holder": ing.holder, "counts": dict(ing.counts), "refused": {k: v for k, v in ing.refused.items() if v},
                                 "restarts": restarts[i], "last_error": last_error[i]})
        errors = getattr(directory, "errors", None)
        if errors is not None:
            out["directory_errors"] = errors
            out["directory_error_kinds"] = dict(getattr(directory, "error_kinds", {}) or {})
        if final:
            out["fatal"] = fatal[0] if fatal else None
        return out

    for w in workers:
        w.start()
    t_end = time.monotonic() + args.max_seconds if args.max_seconds else None
    next_report = time.monotonic() + args.stats_every_s
    try:
        while not stop.is_set():
            if t_end is not None and time.monotonic() >= t_end:
                break
            stop.wait(0.1)
            if time.monotonic() >= next_report:
                print(json.dumps(stats(False)), flush=True)
                next_report += args.stats_every_s
    finally:
        stop.set()
        for w in workers:
            w.join(timeout=5.0)
        for sub in subs:
            sub.close()
        for sig, old_handler in previous.items():
            signal.signal(sig, old_handler)
        log.removeHandler(handler)
        log.setLevel(saved[0])
        log.propagate = saved[1]
    final = stats(True)
    print(json.dumps(final), flush=True)
    if args.json:
        _write_report(args.json, final)
    if fatal:
        print(f"kvpolicy ingest-events: error: cannot go on: {fatal[0]}", file=sys.stderr, flush=True)
        return 1
    return 0


def _directory_from(url: str) -> Any:
    from .directory import InMemoryDirectory

    if url == "memory":
        return InMemoryDirectory()
    if re.match(r"^rediss?://", url or ""):
        from .directory import RedisDirectory

        return RedisDirectory(url=url)
    raise ConfigError("--directory", f"must be redis://HOST:PORT/DB (or rediss://), or 'memory' for a dry run, got {url!r}")


def _cmd_lookup(args: argparse.Namespace) -> int:
    """What the shared directory holds of one prompt: its keys as this deployment builds them, the leading run a
    request would match, and who holds each block — the other end of ingest-events ("why did this request miss?")."""
    from .integrations.vllm_events import extra_keys_for

    tokens = _read_tokens(args.tokens)
    hasher = _hasher(args, "lookup")
    n = len(tokens) // args.block_size
    extras = extra_keys_for(n, lora_name=args.lora_name, cache_salt=args.cache_salt) if (args.lora_name or args.cache_salt) else None
    keys = list(hasher.hash_blocks(tokens, extra_keys=extras)) if n else []
    directory = _directory_from(args.directory)
    matched = directory.match_prefix(args.tenant, keys) if keys else 0
    rows = directory.lookup(args.tenant, keys) if keys else []
    errors = getattr(directory, "errors", 0)
    if errors:
        raise ConfigError("--directory", f"{args.directory} did not answer ({errors} failed calls): is it up, and does this connection's ACL allow "
                          f"tenant {args.tenant!r}?")
    blocks = [{"index": i, "key": k.hex(), "holders": [{"holder": e.holder, "tier": e.tier, "size_bytes": e.size_bytes,
                                                         "expires_at_s": e.expires_at_s} for e in row]}
              for i, (k, row) in enumerate(zip(keys, rows))]
    report = {"tenant": args.tenant, "block_size_tokens": args.block_size, "num_tokens": len(tokens), "full_blocks": n,
              "matched_blocks": matched, "blocks": blocks}
    if args.json:
        _write_report(args.json, report)
    held = sum(1 for b in blocks if b["holders"])
    print(f"{n} full blocks of {args.block_size} tokens; the directory matches the leading {matched} "
          f"({matched * args.block_size:,} tokens); {held} of them held by someone")
    for b in blocks[: matched + 1] if not args.all else blocks:
        who = ", ".join(f"{h['holder']} ({h['tier']})" for h in b["holders"]) or "nobody: the match stops here"
        print(f"{b['index']:6d}  {b['key']}  {who}")
    if args.json:
        print(f"\nwrote {args.json}")
    return 0


# --------------------------------------------------------------------------- evict-bench


def _second_half(args: argparse.Namespace, trace: Any) -> int:
    """The first judged request of ``--judge-second-half`` (0: the whole trace). A trace of one request has no halves:
    judging "the second half" would silently judge all of it."""
    if not args.judge_second_half:
        return 0
    if len(trace) < 2:
        raise ConfigError("--judge-second-half", f"needs at least 2 requests to split; {trace.source} has {len(trace)}")
    return len(trace) // 2


#: below this many request-runs (requests × jobs of the grid) a sweep stays in this process by default: a spawned worker
#: takes ~1.5 s to start (it imports kvpolicy and numpy), about what 3,000 simulated requests take, so a grid smaller
#: than ~10 s of sequential work would only wait for its workers
AUTO_MIN_REQUEST_RUNS = 20_000


def _add_sweep_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--jobs", type=_ints_upto(MAX_THREADS), default=None,
                   help="worker processes for the grid's independent runs (default: the machine's cores, or 1 for a grid too small to "
                        "pay for their start-up); the results are the same whatever the number")
    p.add_argument("--ray", default=None, metavar="ADDRESS",
                   help="run the grid on Ray: 'auto' (this machine's cluster), 'ray://HOST:PORT', or 'local' (start one here); "
                        "needs pip install 'kvpolicy[ray]'")


def _sweep(args: argparse.Namespace, trace: Any, grid_jobs: int) -> Any:
    """Where the grid's runs go: --ray, else --jobs processes, else the cores when the grid is large enough."""
    from .sweep import Sweep, default_jobs

    if args.ray is not None:
        return Sweep(jobs=args.jobs or default_jobs(), ray_address=args.ray)
    if args.jobs is not None:
        return Sweep(jobs=args.jobs)
    return Sweep(jobs=1 if len(trace) * grid_jobs < AUTO_MIN_REQUEST_RUNS else default_jobs())


def _cmd_evict_bench(args: argparse.Namespace) -> int:
    from .eviction.bench import compare, default_capacities, render
    from .progress import Progress

    from .eviction.replay import check_policy_names

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
    from .eviction.bench import default_capacities
    from .integrations.sglang_bench import check_strategies, compare_strategies, render
    from .progress import Progress

    check_strategies(args.strategies)  # a misspelt name fails before the trace is read
    prog = Progress("sglang-bench", enabled=None if not args.no_progress else False)
    prog("reading trace")
    trace = _load_trace(args)
    caps = args.capacities_blocks or default_capacities(trace)[:2]  # 1/64 and 1/16: where the strategies part
    res = compare_strategies(trace, caps, args.strategies, own_sglang=args.sglang_own, progress=prog)
    return _print_report(prog, args.json, res, render(res))


# --------------------------------------------------------------------------- publish-bench / plan-warmup


def _read_checked_profile(args: argparse.Namespace, bpt: int) -> Any:
    """The --profile CSV, refused when its measured bytes/token is not the model's (see --allow-mismatch)."""
    from .profile import check_matches_model, read_profile

    prof = read_profile(args.profile)
    if not getattr(args, "allow_mismatch", False):
        model = "--bytes-per-token" if getattr(args, "bytes_per_token", None) else f"--config {getattr(args, 'config', None) or 'llama-3-8b'}"
        check_matches_model(prof, bpt, model)
    return prof


def _prefill_model(args: argparse.Namespace, bpt: int) -> Any:
    from .publish_sim import DEFAULT_PREFILL

    return _read_checked_profile(args, bpt).prefill_model() if args.profile else DEFAULT_PREFILL


def _pool_capacity(v: str) -> int | str | None:
    if v == "infinite":
        return None
    if v == "compare":
        return v
    try:
        return _positive_int(v)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"must be a positive int, 'compare' or 'infinite', got {v!r}") from None


def _cmd_publish_bench(args: argparse.Namespace) -> int:
    from .progress import Progress
    from .publish_sim import publish_bench, render

    from .publish import check_spec

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
    from .traces import detect_format, generate, preset, read_trace
    from .warmup import HotPrefix, hot_prefixes_from_trace

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
    from .warmup import WarmupConfig, plan_warmup

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
    from .diagnose import diagnose, explain
    from .traces import read_tokens_jsonl

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


def _cmd_compare(args: argparse.Namespace) -> int:
    from .progress import Progress
    from .sim import POLICY_SETS, SCENARIOS, compare, default_cluster, figures, render
    from .sim.compare import check_offered_load, offered_load

    from .sim import policy_set

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


def _cmd_profile(args: argparse.Namespace) -> int:
    from .progress import Progress
    from .reference.model import ModelConfig
    from .reference.profiling import ReferenceProfileTarget, run_profile

    prog = Progress("profile", enabled=None if not args.no_progress else False)
    if args.openai_url:
        return _profile_openai(args, prog)
    if args.prompt_format != "ids":
        raise ConfigError("--prompt-format", "goes with --openai-url (in-process engines take token ids)")
    if args.gguf:
        return _profile_llamacpp(args, prog)
    if args.model or args.config or args.bytes_per_token:
        raise ConfigError("--model", "--model/--config/--bytes-per-token go with --openai-url (the reference engine is configured by --layers/--heads/...)")
    cfg = ModelConfig(num_layers=args.layers, num_heads=args.heads, num_kv_heads=args.kv_heads, head_dim=args.head_dim, dtype=args.dtype)
    for L in args.lengths:
        if L % args.block_size:
            raise ConfigError("--lengths", f"{L} is not a multiple of the block size {args.block_size}")
    prog("starting the peer replica")
    target = ReferenceProfileTarget(cfg, block_size_tokens=args.block_size, max_prefix_tokens=max(args.lengths), seed=args.seed)
    try:
        prof, report = run_profile(target, args.lengths, args.concurrency, repeats=args.repeats, tail_tokens=args.tail_tokens, progress=prog,
                                   expected_bytes_per_token=cfg.geometry().bytes_per_token)
    finally:
        target.close()
    report["engine"] = {"model": "kvpolicy reference transformer (numpy)", "layers": cfg.num_layers, "heads": cfg.num_heads,
                        "kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "dtype": cfg.dtype, "block_size_tokens": args.block_size,
                        "transport": "TCP loopback between two processes"}
    e = report["engine"]
    return _finish_profile(args, prog, prof, report, f"{e['model']}: {e['layers']} layers, {e['heads']} heads / {e['kv_heads']} KV heads x "
                           f"{e['head_dim']}, {e['dtype']}, {e['block_size_tokens']}-token blocks; remote = {e['transport']}")


def _finish_profile(args: argparse.Namespace, prog: Any, prof: Any, report: dict[str, Any], engine_line: str) -> int:
    """Plot, write the CSV, print the report (or its JSON): the same for every profile target."""
    from .reference.profiling import figure, render

    if args.plot:
        prog("plot")
        report["plots"] = [str(figure(report, args.plot))]
    prog.done()
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        prof.write(args.out)
    if args.json:
        print(strict_json(report, indent=2))
        return 0
    print(f"engine           {engine_line}")
    print(render(report))
    if args.out:
        print(f"wrote            {args.out}  (kvpolicy breakeven / compare --profile read it)")
    if args.plot:
        print("plots            " + ", ".join(report["plots"]))
    return 0


def _profile_llamacpp(args: argparse.Namespace, prog: Any) -> int:
    from .integrations.llamacpp import LlamaCppProfileTarget
    from .reference.profiling import run_profile

    if args.model or args.config or args.bytes_per_token:
        raise ConfigError("--gguf", "the GGUF gives the model and its KV bytes: drop --model/--config/--bytes-per-token")
    for L in args.lengths:
        if L % args.block_size:
            raise ConfigError("--lengths", f"{L} is not a multiple of the block size {args.block_size}")
    prog("loading the model and publishing the longest prefix")
    target = LlamaCppProfileTarget(args.gguf, block_size_tokens=args.block_size, max_prefix_tokens=max(args.lengths),
                                   max_tail_tokens=args.tail_tokens, seed=args.seed, n_threads=args.threads)
    try:
        prof, report = run_profile(target, args.lengths, args.concurrency, repeats=args.repeats, tail_tokens=args.tail_tokens, progress=prog,
                                   expected_bytes_per_token=target.model.bytes_per_token())
    finally:
        target.close()
    m = target.model
    report["engine"] = {"model": f"{m.name} ({m.architecture}, llama.cpp via llama-cpp-python)", "gguf": str(args.gguf),
                        "block_size_tokens": args.block_size, "threads": args.threads,
                        "transport": "TCP loopback to a block server in this process"}
    e = report["engine"]
    return _finish_profile(args, prog, prof, report, f"{e['model']}, {args.threads} threads, {args.block_size}-token blocks; remote = {e['transport']}")


def _profile_openai(args: argparse.Namespace, prog: Any) -> int:
    from .openai_profile import OpenAIProfileTarget
    from .reference.profiling import run_profile

    bpt = _bytes_per_token(args)[0] if (args.config or args.bytes_per_token) else None
    if args.gguf is not None:  # a llama.cpp server: its KV bytes from the model file it serves
        from .gguf import GGUFModel

        if bpt is not None:
            raise ConfigError("--gguf", "give one source of KV bytes: --gguf, --config or --bytes-per-token")
        bpt = GGUFModel.read(args.gguf).bytes_per_token()
    prog("connecting")
    target = OpenAIProfileTarget(args.openai_url, args.model, bytes_per_token=bpt, seed=args.seed,
                                 api_key=os.environ.get(args.api_key_env) if args.api_key_env else None, prompt_format=args.prompt_format)
    try:
        prof, report = run_profile(target, args.lengths, args.concurrency, repeats=args.repeats, tail_tokens=args.tail_tokens, progress=prog,
                                   expected_bytes_per_token=bpt)
    finally:
        target.close()
    report["engine"] = {"model": args.model, "url": args.openai_url, "kv_bytes": target.kv_bytes_source}
    return _finish_profile(args, prog, prof, report, f"{args.model} at {args.openai_url} (streaming /v1/completions, TTFT = first streamed token); "
                           f"KV bytes {'read from /metrics' if target.kv_bytes_source == 'metrics' else 'COMPUTED from --config, not measured'}")


def _cmd_serve_reference(args: argparse.Namespace) -> int:
    from .reference.http_server import ReferenceHTTPServer
    from .reference.model import ModelConfig

    cfg = ModelConfig(num_layers=args.layers, num_heads=args.heads, num_kv_heads=args.kv_heads, head_dim=args.head_dim, dtype=args.dtype)
    try:
        srv = ReferenceHTTPServer(args.host, args.port, config=cfg, block_size_tokens=args.block_size, capacity_blocks=args.capacity_blocks,
                                  model_name=args.model_name, verbose=args.verbose)
    except OSError as exc:
        raise ConfigError("--port", f"cannot listen on {args.host}:{args.port} ({exc.strerror or exc})") from None
    print(f"serving {args.model_name} (reference engine, {cfg.geometry().bytes_per_token} KV bytes/token) on {srv.url}: "
          "POST /v1/completions (token-id prompts, streaming), GET /v1/models, GET /metrics", flush=True)
    try:
        srv.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        srv.server_close()
    return 0


def _reference_model_args(p: argparse.ArgumentParser) -> None:
    """The reference engine's shape: the same flags wherever it runs (profile, serve-reference)."""
    p.add_argument("--block-size", type=_block_size, default=16)
    p.add_argument("--layers", type=_ints_upto(1024), default=2)
    p.add_argument("--heads", type=_ints_upto(1024), default=4)
    p.add_argument("--kv-heads", type=_ints_upto(1024), default=1)
    p.add_argument("--head-dim", type=_ints_upto(4096), default=32)
    p.add_argument("--dtype", choices=["float32", "float16"], default="float32")


def _policy_list(text: str) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items:
        raise argparse.ArgumentTypeError("expected a comma-separated list of policies")
    return items


def _add_trace_args(p: argparse.ArgumentParser, *, model: bool = True) -> None:
    """A trace (file or synthetic preset); ``model``: also the model whose KV bytes the command reports."""
    from .traces import FORMATS, PRESETS

    p.add_argument("trace", nargs="?", default=None, help="trace file (JSONL); default: a built-in synthetic preset")
    p.add_argument("--format", choices=FORMATS, default=None, help="trace format (default: detected)")
    p.add_argument("--block-size", type=_block_size, default=None, help="block size in tokens (default: 512 mooncake, 16 bailian/tokens, 64 synthetic)")
    p.add_argument("--sort", action="store_true", help="sort requests by time instead of rejecting a trace whose time goes backwards")
    p.add_argument("--skip-bad-lines", action="store_true", help="skip malformed lines (counted and reported) instead of failing")
    p.add_argument("--preset", choices=sorted(PRESETS), default="mixed", help="synthetic preset when no TRACE is given (default mixed)")
    p.add_argument("--seed", type=_seed, default=0)
    if not model:
        return
    p.add_argument("--config", default=None, help="model config.json or bundled name (default llama-3-8b)")
    p.add_argument("--kv-dtype", default=None, help="KV element format override (e.g. fp8)")
    p.add_argument("--bytes-per-token", type=_bytes_per_token_int, default=None, help="KV bytes per token instead of --config")


# --------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    from .data import bundled_configs

    from . import __version__

    p = _Parser(prog="kvpolicy", description="Prefix KV-cache policy for LLM serving.")
    p.add_argument("--version", action="version", version=f"kvpolicy {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    s = sub.add_parser("size", help="KV bytes per token and per prefix from a model config (and a measured profile)")
    s.add_argument("--config", default=None, help=f"HF config.json path, or a bundled name: {', '.join(sorted(bundled_configs()))}")
    s.add_argument("--gguf", default=None, help="a GGUF model file (llama.cpp): the geometry from its metadata, tensors not read")
    s.add_argument("--cache-type-k", choices=sorted(KV_CACHE_TYPES), default="f16", help="llama.cpp's K cache type (--gguf; default f16)")
    s.add_argument("--cache-type-v", choices=sorted(KV_CACHE_TYPES), default="f16", help="llama.cpp's V cache type (--gguf; default f16)")
    s.add_argument("--kv-dtype", default=None, help="KV element format override (fp8, bf16, fp16, fp32); default: the config's torch_dtype")
    s.add_argument("--block-size", type=_block_size, default=16, help="block size in tokens (default 16)")
    s.add_argument("--prefix-tokens", type=_token_lengths, default=list(DEFAULT_PREFIXES), help="comma-separated prefix lengths (default 4096,16384,32768,65536)")
    s.add_argument("--profile", default=None, help="measured profile CSV: prefix_tokens,kv_bytes,cold_prefill_ms,local_hit_ttft_ms")
    s.add_argument("--json", action="store_true", help="print JSON")
    s.set_defaults(func=_cmd_size)

    k = sub.add_parser("keys", help="block keys of a token sequence (kvpolicy or vLLM-compatible)")
    k.add_argument("tokens", help="JSON file holding a list of token ids")
    k.add_argument("--scheme", choices=["keyed", "fast", "vllm-sha256", "vllm-sha256-cbor"], default="keyed")
    k.add_argument("--block-size", type=_block_size, required=True)
    k.add_argument("--namespace", default=None, help="namespace JSON (kvpolicy schemes); default: an unspecified-model namespace")
    k.add_argument("--secret-hex", default=None, help="deployment secret as hex (visible in ps and shell history: prefer --secret-file or env KVPOLICY_SECRET_HEX)")
    k.add_argument("--secret-file", default=None, help="file holding the deployment secret as hex (one line)")
    k.add_argument("--cache-salt", default=None)
    k.add_argument("--lora-name", default=None)
    k.add_argument("--lora-path", default=None)
    k.add_argument("--json", action="store_true")
    k.set_defaults(func=_cmd_keys)

    ie = sub.add_parser("ingest-events", help="feed the shared directory from a vLLM / SGLang pod's KV events (a sidecar; runs until stopped)")
    ie.add_argument("--endpoint", required=True, help="the engine's KV event PUB socket, e.g. tcp://vllm-0:5557 (vLLM: --kv-events-config endpoint)")
    ie.add_argument("--replay-endpoint", default=None, help="its replay socket (e.g. tcp://vllm-0:5558): gaps in the sequence are fetched again")
    ie.add_argument("--ranks", type=_ints_upto(MAX_REPLICAS), default=1, help="data-parallel ranks: rank r publishes on PORT + r (default 1)")
    ie.add_argument("--topic", default="", help="topic prefix to subscribe to (default: every topic)")
    ie.add_argument("--directory", required=True, help="redis://HOST:PORT/DB (or rediss://), or 'memory' for a dry run that only counts")
    ie.add_argument("--tenant", required=True, help="the tenant whose namespace these blocks live in")
    ie.add_argument("--holder", required=True, help="this engine's name in the directory (rank r of several: HOLDER-dpR)")
    ie.add_argument("--namespace", default=None, help="namespace JSON of the deployment (as for kvpolicy keys); default: an unspecified-model namespace")
    ie.add_argument("--block-size", type=_block_size, required=True, help="the engine's block size in tokens")
    ie.add_argument("--scheme", choices=["keyed", "fast"], default="keyed")
    ie.add_argument("--secret-hex", default=None, help="deployment secret as hex (visible in ps: prefer --secret-file or env KVPOLICY_SECRET_HEX)")
    ie.add_argument("--secret-file", default=None, help="file holding the deployment secret as hex (one line)")
    ie.add_argument("--verify", choices=["sha256", "sha256_cbor"], default=None,
                    help="check each stored block's engine hash against vLLM's own hashing of its tokens (the engine's --prefix-caching-hash-algo)")
    ie.add_argument("--verify-hash-seed", default=None, metavar="SEED",
                    help="the engine's PYTHONHASHSEED, if it sets one: vLLM roots every hash chain in it, so --verify refuses every block without it")
    ie.add_argument("--on-gap", choices=["forget", "keep"], default="forget",
                    help="batches lost and not in the replay socket may have removed blocks: forget what this engine was known to "
                         "hold (default), or keep it and only count them")
    ie.add_argument("--config", default=None, help="model config.json or bundled name, for the bytes a block holds (default llama-3-8b)")
    ie.add_argument("--kv-dtype", default=None)
    ie.add_argument("--bytes-per-token", type=_bytes_per_token_int, default=None)
    ie.add_argument("--stats-every-s", type=_positive_float, default=30.0, help="print a JSON stats line this often (default 30)")
    ie.add_argument("--max-seconds", type=_positive_float, default=None, help="stop after this long (default: run until SIGINT / SIGTERM)")
    ie.add_argument("--json", default=None, metavar="OUT", help="write the final stats as JSON")
    ie.add_argument("--verbose", "-v", action="store_true", help="log each refused batch or event (default: counted in the stats lines only)")
    ie.set_defaults(func=_cmd_ingest_events)

    lk = sub.add_parser("lookup", help="what the shared directory holds of one prompt: its keys, the leading run a request matches, who holds each block")
    lk.add_argument("tokens", help="JSON file holding a list of token ids (the prompt)")
    lk.add_argument("--directory", required=True, help="redis://HOST:PORT/DB (or rediss://); 'memory': an empty one (the keys alone)")
    lk.add_argument("--tenant", required=True)
    lk.add_argument("--block-size", type=_block_size, required=True)
    lk.add_argument("--namespace", default=None, help="the deployment's namespace JSON (as for kvpolicy keys and ingest-events)")
    lk.add_argument("--scheme", choices=["keyed", "fast"], default="keyed")
    lk.add_argument("--secret-hex", default=None, help="deployment secret as hex (visible in ps: prefer --secret-file or env KVPOLICY_SECRET_HEX)")
    lk.add_argument("--secret-file", default=None, help="file holding the deployment secret as hex (one line)")
    lk.add_argument("--lora-name", default=None, help="the request's LoRA adapter (its blocks carry it, as vLLM's events do)")
    lk.add_argument("--cache-salt", default=None, help="the request's cache salt (on its first block, as vLLM's events put it)")
    lk.add_argument("--all", action="store_true", help="list every block, not only the matched run and the block it stops at")
    lk.add_argument("--json", default=None, metavar="OUT")
    lk.set_defaults(func=_cmd_lookup)

    a = sub.add_parser("analyze", help="what a trace says before anyone buys a cache: reuse, MRC, replicas, byte flows, verdict")
    _add_trace_args(a)
    a.add_argument("--capacities-blocks", type=_capacities, default=None, help="MRC capacities in blocks (default: powers of two up to the distinct blocks)")
    a.add_argument("--replicas", type=_replicas, default=8)
    a.add_argument("--routing", choices=["random", "round-robin", "prefix-affinity"], default="round-robin", help="how the current deployment routes (default round-robin)")
    a.add_argument("--affinity-blocks", type=_ints_upto(MAX_BLOCK_TOKENS), default=4, help="prefix-affinity hashes the first k full blocks (default 4)")
    a.add_argument("--local-kv-gib", type=_gib, default=32.0, help="physical KV cache per replica in GiB (default 32; minus the decode/reserved/fragmentation shares below = 20.8 GiB for prefixes)")
    a.add_argument("--decode-share", type=_non_negative_float, default=0.25, help="share of it held by active decodes (default 0.25)")
    a.add_argument("--reserved-share", type=_non_negative_float, default=0.05, help="reserved share (default 0.05)")
    a.add_argument("--fragmentation-share", type=_non_negative_float, default=0.05, help="fragmentation share (default 0.05)")
    a.add_argument("--json", default=None, metavar="OUT", help="write the full report as JSON")
    a.add_argument("--plot", default=None, metavar="DIR", help="write PNG figures (needs matplotlib)")
    a.add_argument("--quiet", "-q", "--no-progress", dest="no_progress", action="store_true", help="no progress on stderr (default: a progress bar on a terminal, one line per finished unit elsewhere)")
    a.set_defaults(func=_cmd_analyze)

    b = sub.add_parser("breakeven", help="remote load vs recompute per prefix length, and the break-even prefix")
    b.add_argument("--config", default=None, help="model config.json or bundled name (default llama-3-8b)")
    b.add_argument("--kv-dtype", default=None)
    b.add_argument("--bytes-per-token", type=_bytes_per_token_int, default=None)
    b.add_argument("--profile", required=True, help="measured profile CSV (prefix_tokens,kv_bytes,cold_prefill_ms,local_hit_ttft_ms)")
    b.add_argument("--allow-mismatch", action="store_true", help="use a --profile whose measured KV bytes/token differs from the model's by more than 10%%")
    b.add_argument("--bandwidth-gbps", type=_positive_float, required=True, help="useful bandwidth under contention, Gbit/s (10^9 bits)")
    for flag, default, what in (("--lookup-ms", 0.5, "hash + metadata lookup"), ("--queue-ms", 0.0, "waiting for link/staging/server"),
                                ("--stage-ms", 0.0, "copy through CPU memory"), ("--install-ms", 0.0, "placing blocks into the cache"),
                                ("--dispatch-ms", 0.0, "recompute dispatch overhead"), ("--interference-ms-per-gb", 0.5, "time stolen from active requests per GB loaded")):
        b.add_argument(flag, type=_non_negative_float, default=default, help=f"{what} (default {default})")
    b.add_argument("--margin", type=_positive_float, default=0.8, help="load iff T_remote + T_interf < margin x T_recompute (default 0.8)")
    b.add_argument("--block-size", type=_block_size, default=16)
    b.add_argument("--prefix-tokens", type=_token_lengths, default=[1024, 4096, 16384, 32768, 65536])
    b.add_argument("--json", action="store_true")
    b.set_defaults(func=_cmd_breakeven)

    e = sub.add_parser("evict-bench", help="replay a trace through eviction policies, with Belady and the infinite cache beside them")
    _add_trace_args(e)
    e.add_argument("--capacities-blocks", type=_capacities, default=None, help="capacities in blocks (default: 1/64, 1/16, 1/4, 1/2 of the distinct blocks)")
    e.add_argument("--policies", type=_policy_list, default=["lru", "fifo", "lfu", "ttl", "s3fifo", "sieve", "arc", "gdsf", "reuse-distance", "hit-density", "adaptive", "lrb", "belady"],
                   help="comma-separated (default: lru,fifo,lfu,ttl,s3fifo,sieve,arc,gdsf,reuse-distance,hit-density,adaptive,lrb,belady; also belady-bypass; "
                        "and your own: MODULE:CLASS or PATH.py:CLASS, an EvictionPolicy subclass built as CLASS(capacity_bytes, clock=clock))")
    e.add_argument("--judge-second-half", action="store_true",
                   help="a held-out split: every policy runs over the whole trace but only the second half's requests are scored")
    e.add_argument("--json", default=None, metavar="OUT")
    e.add_argument("--quiet", "-q", "--no-progress", dest="no_progress", action="store_true", help="no progress on stderr (default: a progress bar on a terminal, one line per finished unit elsewhere)")
    _add_sweep_args(e)
    e.set_defaults(func=_cmd_evict_bench)

    from .integrations.sglang_bench import DEFAULT_STRATEGIES as SGLANG_BENCH_STRATEGIES

    sg = sub.add_parser("sglang-bench", help="which eviction strategy to run in SGLang: a trace through SGLang's radix-cache eviction loop, "
                                             "SGLang's LRU and LFU beside kvpolicy's strategies and Belady")
    _add_trace_args(sg, model=False)  # block hits: no model's bytes in them
    sg.add_argument("--capacities-blocks", type=_capacities, default=None,
                    help="capacities in blocks, one token per block (default: 1/64 and 1/16 of the distinct blocks)")
    sg.add_argument("--strategies", type=_policy_list, default=list(SGLANG_BENCH_STRATEGIES),
                    help=f"comma-separated (default: {','.join(SGLANG_BENCH_STRATEGIES)}; also kvpolicy-gdsf, kvpolicy-lru, kvpolicy-lfu)")
    sg.add_argument("--sglang-own", action="store_true",
                    help="replay through the installed SGLang's own RadixCache (default: kvpolicy's stand-in of its loop, SGLang's tree shape)")
    sg.add_argument("--json", default=None, metavar="OUT")
    sg.add_argument("--quiet", "-q", "--no-progress", dest="no_progress", action="store_true", help="no progress on stderr")
    sg.set_defaults(func=_cmd_sglang_bench)

    pb = sub.add_parser("publish-bench", help="bytes each publish policy writes vs bytes re-read by other replicas, beside the oracle")
    _add_trace_args(pb)
    pb.add_argument("--policies", type=_policy_list, default=["all", "never", "threshold-2", "threshold-3", "threshold-4", "boundary", "reuse-aware", "structure-aware",
                                                             "dueling"],
                    help="comma-separated; compose with + (e.g. boundary+reuse-aware); your own filter: MODULE:CLASS or PATH.py:CLASS")
    pb.add_argument("--replicas", type=_replicas, default=8)
    pb.add_argument("--routing", choices=["random", "round-robin", "prefix-affinity"], default="round-robin")
    pb.add_argument("--pool-capacity-blocks", type=_pool_capacity, default="compare",
                    help="blocks the LRU pool holds: a positive int, 'compare' (default: the pool kvpolicy compare gives the trace, a "
                         "quarter of its distinct blocks) or 'infinite' (where issue #20's goals were measured)")
    pb.add_argument("--profile", default=None, help="measured profile CSV for recompute seconds (default: an order-of-magnitude model)")
    pb.add_argument("--allow-mismatch", action="store_true", help="use a --profile whose measured KV bytes/token differs from the model's by more than 10%%")
    pb.add_argument("--write-gbps", type=_positive_float, default=100.0, help="pool write bandwidth for the reuse-aware cost (default 100)")
    pb.add_argument("--judge-second-half", action="store_true",
                    help="a held-out split: every filter learns over the whole trace but only writes and re-reads of the second half's requests count")
    pb.add_argument("--json", default=None, metavar="OUT")
    pb.add_argument("--quiet", "-q", "--no-progress", dest="no_progress", action="store_true", help="no progress on stderr (default: a progress bar on a terminal, one line per finished unit elsewhere)")
    _add_sweep_args(pb)
    pb.set_defaults(func=_cmd_publish_bench)

    w = sub.add_parser("plan-warmup", help="schedule loads of measured hot prefixes into new replicas within caps and bandwidth")
    w.add_argument("source", nargs="?", default=None, help="trace (JSONL) or HOT.json; default: a built-in synthetic preset")
    w.add_argument("--preset", default="mixed")
    w.add_argument("--seed", type=_seed, default=0)
    w.add_argument("--block-size", type=_block_size, default=None)
    w.add_argument("--config", default=None)
    w.add_argument("--kv-dtype", default=None)
    w.add_argument("--bytes-per-token", type=_bytes_per_token_int, default=None)
    w.add_argument("--profile", default=None, help="measured profile CSV for recompute seconds")
    w.add_argument("--allow-mismatch", action="store_true", help="use a --profile whose measured KV bytes/token differs from the model's by more than 10%%")
    w.add_argument("--replicas", type=_replicas, required=True)
    w.add_argument("--window-s", type=_positive_float, required=True)
    w.add_argument("--bandwidth-gbps", type=_positive_float, required=True, help="useful link bandwidth, Gbit/s")
    w.add_argument("--current-load-gbps", type=_non_negative_float, default=0.0)
    w.add_argument("--max-loads-per-replica", type=_ints_upto(MAX_THREADS), default=2)
    w.add_argument("--max-loads-pool", type=_ints_upto(MAX_REPLICAS * MAX_THREADS), default=8)
    w.add_argument("--min-access-count", type=_ints_upto(MAX_SEED, low=0), default=2, help="only prefixes used by at least this many requests are planned")
    w.add_argument("--max-prefixes", type=_ints_upto(10**6), default=64)
    w.add_argument("--readiness-share", type=_non_negative_float, default=0.9)
    w.add_argument("--json", action="store_true")
    w.set_defaults(func=_cmd_plan_warmup)

    from .sim import POLICY_SETS, ROUTERS

    cp = sub.add_parser("compare", help="simulate a cluster: kvpolicy beside vllm-like, sglang-like, lmcache-like, recompute-only and the oracle")
    _add_trace_args(cp)
    cp.add_argument("--scenario", choices=["steady", "scale-out", "spike", "degraded", "all"], default="all", help="load view (default all)")
    cp.add_argument("--policies", type=_policy_list, default=None, help=f"comma-separated policy sets (default {','.join(POLICY_SETS)}); your own: PATH.py:NAME or MODULE:NAME naming a kvpolicy.sim.PolicySet")
    cp.add_argument("--profile", default=None, help="measured profile CSV for prefill times (default: an order-of-magnitude model)")
    cp.add_argument("--allow-overload", action="store_true", help="simulate even when the offered prefill load exceeds the cluster's capacity with an infinite cache")
    cp.add_argument("--allow-mismatch", action="store_true", help="use a --profile whose measured KV bytes/token differs from the model's by more than 10%%")
    cp.add_argument("--replicas", type=_replicas, default=8)
    cp.add_argument("--router", choices=list(ROUTERS), default="round-robin", help="request router (default round-robin)")
    cp.add_argument("--local-kv-gib", type=_gib, default=28.0, help="local KV per replica, GiB, after reserved and fragmentation (default 28 = analyze's 32 GiB physical less 5%%+5%%, rounded); running decodes pin their blocks in it during the run, so no decode share is taken off up front")
    cp.add_argument("--storage-nodes", type=_replicas, default=4)
    cp.add_argument("--pool-share", type=_non_negative_float, default=0.25, help="pool capacity as a share of the trace's distinct KV bytes (default 0.25)")
    cp.add_argument("--node-gbps", type=_non_negative_float, default=40.0, help="useful bandwidth per storage node, Gbit/s (default 40)")
    cp.add_argument("--replica-gbps", type=_non_negative_float, default=40.0, help="useful NIC bandwidth per replica, Gbit/s (default 40)")
    cp.add_argument("--stage-gbps", type=_positive_float, default=None, help="staging copy through CPU memory, Gbit/s (default: direct path)")
    cp.add_argument("--failure-rate", type=_non_negative_float, default=0.0, help="probability a transfer fails outside degradation windows (default 0)")
    cp.add_argument("--timeout-rate", type=_non_negative_float, default=0.0, help="probability a transfer hangs until it times out (default 0)")
    cp.add_argument("--compute-factor", type=_positive_float, default=1.0,
                    help="the replicas' real prefill over the profile's, which kvpolicy's controller is given as its prior and "
                         "learns from the prefills it times (default 1; 2: GPUs twice as slow as profiled; 0.5: twice as fast)")
    cp.add_argument("--link-prior-factor", type=_positive_float, default=1.0,
                    help="kvpolicy's controller's prior for the links' bandwidth over the real one; it learns B_eff from the "
                         "transfers it admits (default 1; 4: it is told links 4x faster than they are)")
    cp.add_argument("--controller-scope", choices=["cluster", "replica"], default=None,
                    help="kvpolicy's admission controller: one for the cluster (the preset: it hears every replica) or one per "
                         "replica, as an engine process embeds it")
    cp.add_argument("--prefill-slots", type=_ints_upto(MAX_THREADS), default=1, help="concurrent prefills per replica (default 1)")
    cp.add_argument("--decode-tokens-per-s", type=_positive_float, default=30.0, help="decode rate per request (default 30)")
    cp.add_argument("--judge-second-half", action="store_true",
                    help="a held-out split: every set learns over the whole trace, only the second half's requests (and bytes "
                         "written from its start) are counted")
    cp.add_argument("--json", default=None, metavar="OUT", help="write every run as JSON")
    cp.add_argument("--plot", default=None, metavar="DIR", help="write PNG figures (needs matplotlib)")
    cp.add_argument("--quiet", "-q", "--no-progress", dest="no_progress", action="store_true", help="no progress on stderr (default: a progress bar on a terminal, one line per finished unit elsewhere)")
    _add_sweep_args(cp)
    cp.set_defaults(func=_cmd_compare)

    pr = sub.add_parser("profile", help="measure bytes/token, cold prefill, local-hit TTFT and remote load on an engine (the reference engine by default)")
    pr.add_argument("--lengths", type=_token_lengths, default=[1024, 2048, 4096, 8192], help="prefix lengths in tokens (default 1024,2048,4096,8192)")
    pr.add_argument("--concurrency", type=_ints_upto(MAX_THREADS, many=True), default=[1, 4], help="concurrency levels (default 1,4; 1 is always measured)")
    pr.add_argument("--repeats", type=_ints_upto(10**5), default=5, help="runs per measurement alone (default 5)")
    pr.add_argument("--tail-tokens", type=_ints_upto(MAX_PROMPT_TOKENS), default=16, help="new tokens after the prefix (default 16)")
    _reference_model_args(pr)
    pr.add_argument("--seed", type=_seed, default=0)
    pr.add_argument("--out", default=None, metavar="CSV", help="write the profile CSV (prefix_tokens,kv_bytes,cold_prefill_ms,local_hit_ttft_ms,...)")
    pr.add_argument("--json", action="store_true", help="print the report as JSON")
    pr.add_argument("--plot", default=None, metavar="DIR")
    pr.add_argument("--quiet", "-q", "--no-progress", dest="no_progress", action="store_true", help="no progress on stderr (default: a progress bar on a terminal, one line per finished unit elsewhere)")
    pr.add_argument("--gguf", default=None, metavar="FILE", help="profile llama.cpp (llama-cpp-python) running this GGUF model in-process "
                                                                  "instead; with --openai-url, the served model's file (its KV bytes)")
    pr.add_argument("--threads", type=_ints_upto(MAX_THREADS), default=2, help="with --gguf: llama.cpp threads per context (default 2)")
    pr.add_argument("--openai-url", default=None, metavar="URL", help="profile an OpenAI-compatible server (vLLM, SGLang, TGI, kvpolicy serve-reference) instead")
    pr.add_argument("--model", default=None, help="with --openai-url: the served model's name")
    pr.add_argument("--config", default=None, help="with --openai-url: model config for KV bytes when the server's /metrics does not give them")
    pr.add_argument("--kv-dtype", default=None)
    pr.add_argument("--bytes-per-token", type=_bytes_per_token_int, default=None, help="with --openai-url: KV bytes per token instead of --config")
    pr.add_argument("--prompt-format", choices=["ids", "text"], default="ids",
                    help="with --openai-url: send token ids (default) or text of one-token words, counted by the server's tokenizer "
                         "(llama-cpp-python's server takes text only)")
    pr.add_argument("--api-key-env", default=None, metavar="VAR", help="with --openai-url: environment variable holding the API key")
    pr.set_defaults(func=_cmd_profile)

    sr = sub.add_parser("serve-reference", help="serve the reference engine over an OpenAI-compatible HTTP API (for kvpolicy profile --openai-url)")
    sr.add_argument("--host", default="127.0.0.1")
    sr.add_argument("--port", type=_port, default=8000)
    sr.add_argument("--model-name", default="kvpolicy-reference")
    sr.add_argument("--capacity-blocks", type=_ints_upto(MAX_CAPACITY_BLOCKS), default=16384)
    _reference_model_args(sr)
    sr.add_argument("--verbose", action="store_true", help="log every request")
    sr.set_defaults(func=_cmd_serve_reference)

    dg = sub.add_parser("diagnose", help="find misses caused by nondeterministic prompt assembly; explain one request's misses")
    dg.add_argument("trace", help="token trace (JSONL with raw token ids)")
    dg.add_argument("--block-size", type=_block_size, default=None, help="block size in tokens (default 16)")
    dg.add_argument("--min-shared", type=_non_negative_float, default=0.8, help="share of content a request must share with an earlier one (default 0.8)")
    dg.add_argument("--request", default=None, help="explain this request: its id, or #N for the N-th request (from 0) when several share an id")
    dg.add_argument("--capacity-blocks", type=_ints_upto(MAX_CAPACITY_BLOCKS), default=None, help="with --request: replay an LRU cache of this size to find evictions")
    dg.add_argument("--sort", action="store_true")
    dg.add_argument("--skip-bad-lines", action="store_true")
    dg.add_argument("--json", default=None, metavar="OUT")
    dg.set_defaults(func=_cmd_diagnose)
    return p


def _check_outputs(args: argparse.Namespace) -> None:
    """Refuse an output path that cannot be written before any work is done (not after a long run)."""
    for flag in ("json", "out", "plot"):
        v = getattr(args, flag, None)
        if not isinstance(v, str) or not v:
            continue
        p = Path(v)
        parent = p.parent
        if not parent.is_dir():
            raise ConfigError(f"--{flag}", f"{v}: cannot write there ({parent} is not a directory)")
        if flag == "plot" and p.exists() and not p.is_dir():
            raise ConfigError("--plot", f"{v}: is a file, expected a directory for the plots")
        if flag != "plot" and p.is_dir():
            raise ConfigError(f"--{flag}", f"{v}: is a directory, expected a file")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error, already printed on one line (2)
        return exc.code if isinstance(exc.code, int) else 2
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        _check_outputs(args)
        return int(args.func(args))
    except KVPolicyError as exc:
        print(f"kvpolicy {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except UnicodeDecodeError as exc:  # a binary or non-UTF-8 file where text was expected
        print(f"kvpolicy {args.command}: error: a file is not UTF-8 text ({exc.reason} at byte {exc.start})", file=sys.stderr)
        return 2
    except OSError as exc:  # a directory where a file was expected, a missing or unreadable file, a full disk
        where = f"{exc.filename}: " if getattr(exc, "filename", None) else ""
        print(f"kvpolicy {args.command}: error: {where}{exc.strerror or exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # pragma: no cover - e.g. `kvpolicy keys ... | head`
        return 0
    except MemoryError:
        print(f"kvpolicy {args.command}: error: not enough memory for these settings (a capacity, length or count too large?)", file=sys.stderr)
        return 2
