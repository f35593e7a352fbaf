"""Measuring commands: ``profile`` (a real engine's prefill and load figures) and ``serve-reference``."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .._io import strict_json
from ._common import _bytes_per_token


def _cmd_profile(args: argparse.Namespace) -> int:
    from ..progress import Progress
    from ..reference.model import ModelConfig
    from ..reference.profiling import ReferenceProfileTarget, run_profile

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
    from ..reference.profiling import figure, render

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
    from ..integrations.llamacpp import LlamaCppProfileTarget
    from ..reference.profiling import run_profile

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
    from ..openai_profile import OpenAIProfileTarget
    from ..reference.profiling import run_profile

    bpt = _bytes_per_token(args)[0] if (args.config or args.bytes_per_token) else None
    if args.gguf is not None:  # a llama.cpp server: its KV bytes from the model file it serves
        from ..gguf import GGUFModel

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
    from ..reference.http_server import ReferenceHTTPServer
    from ..reference.model import ModelConfig

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
