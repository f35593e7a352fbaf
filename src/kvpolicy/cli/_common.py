"""What every command shares: argument types with their limits, report writers, trace and profile loading."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any

from ..errors import ConfigError
from .._io import strict_json, write_text_atomic


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


# --------------------------------------------------------------------------- analyze


def _bytes_per_token(args: argparse.Namespace) -> tuple[int, str]:
    """Resolve the model's KV bytes per token from --config / --bytes-per-token."""
    from ..data import bundled_configs, resolve_config
    from ..geometry import KVGeometry

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
    from ..traces import generate, preset, read_trace

    if args.trace:
        return read_trace(args.trace, args.format, args.block_size, sort=args.sort, skip_bad_lines=args.skip_bad_lines)
    if args.format or args.sort or args.skip_bad_lines:
        raise ConfigError("--format", "--format/--sort/--skip-bad-lines need a TRACE file")
    overrides = {"seed": args.seed}
    if args.block_size:
        overrides["block_size_tokens"] = args.block_size
    return generate(preset(args.preset, **overrides))


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
    from ..sweep import Sweep, default_jobs

    if args.ray is not None:
        return Sweep(jobs=args.jobs or default_jobs(), ray_address=args.ray)
    if args.jobs is not None:
        return Sweep(jobs=args.jobs)
    return Sweep(jobs=1 if len(trace) * grid_jobs < AUTO_MIN_REQUEST_RUNS else default_jobs())


# --------------------------------------------------------------------------- publish-bench / plan-warmup


def _read_checked_profile(args: argparse.Namespace, bpt: int) -> Any:
    """The --profile CSV, refused when its measured bytes/token is not the model's (see --allow-mismatch)."""
    from ..profile import check_matches_model, read_profile

    prof = read_profile(args.profile)
    if not getattr(args, "allow_mismatch", False):
        model = "--bytes-per-token" if getattr(args, "bytes_per_token", None) else f"--config {getattr(args, 'config', None) or 'llama-3-8b'}"
        check_matches_model(prof, bpt, model)
    return prof


def _prefill_model(args: argparse.Namespace, bpt: int) -> Any:
    from ..publish_sim import DEFAULT_PREFILL

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
    from ..traces import FORMATS, PRESETS

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
