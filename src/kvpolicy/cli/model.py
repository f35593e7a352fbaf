"""Model geometry commands: ``size`` (KV bytes per token and prefix) and ``keys`` (a prompt's block keys)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Literal

from ..errors import ConfigError
from .._io import json_loads, read_text
from ._common import _emit, _human_bytes


# --------------------------------------------------------------------------- size


def _cmd_size(args: argparse.Namespace) -> int:
    from ..data import bundled_configs, resolve_config
    from ..geometry import KVGeometry, useful_tokens
    from ..profile import read_profile

    if (args.config is None) == (args.gguf is None):
        raise ConfigError("--config", "give exactly one of --config (an HF config.json) or --gguf (a GGUF model file)")
    B = args.block_size
    if args.gguf is not None:
        from ..gguf import GGUFModel

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
            from ..profile import MISMATCH_TOLERANCE

            if abs(1.0 / pr["formula_over_measured"] - 1.0) > MISMATCH_TOLERANCE:
                lines.append(
                    f"MISMATCH         more than {MISMATCH_TOLERANCE:.0%} apart: this profile was measured on another model or KV dtype; "
                    "breakeven / compare / publish-bench / plan-warmup refuse it with this config unless --allow-mismatch"
                )
        from ..profile import describe_prefill

        lines += describe_prefill(m)
    return "\n".join(lines)


# --------------------------------------------------------------------------- keys


def _read_tokens(path: str) -> list[int]:
    from ..errors import InputFormatError

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
    from ..keys import BlockHasher, Namespace

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
    from ..keys import vllm_block_hashes

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
