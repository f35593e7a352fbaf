"""Shared helpers for the benchmark scripts: timing and result output."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def timings(fn: Callable[[], Any], repeats: int = 7, warmup: int = 2) -> list[float]:
    """Seconds of each of ``repeats`` runs after ``warmup`` runs (Numba compiles on the first)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def best_of(fn: Callable[[], Any], repeats: int = 7, warmup: int = 2) -> float:
    """Median seconds of ``repeats`` runs after ``warmup`` runs."""
    return statistics.median(timings(fn, repeats, warmup))


def write_json(name: str, payload: dict[str, Any], out: str | None) -> Path:
    path = Path(out) if out else Path("bench-results") / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2))
    return path


def print_table(headers: list[str], rows: list[list[Any]]) -> None:
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    for j, r in enumerate(cells):
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))
        if j == 0:
            print("  ".join("-" * w for w in widths))


def add_stream_args(ap: Any) -> None:
    """The one-block stream's size (``bench_reuse.skewed_stream``): ``--accesses`` over ``--ids`` distinct ids, ``--seed``."""
    ap.add_argument("--accesses", type=int, default=10_000_000)
    ap.add_argument("--ids", type=int, default=1_000_000)
    ap.add_argument("--seed", type=int, default=0)


def add_check_flag(ap: Any) -> None:
    """``--check``: exit 1 when a documented target or a correctness check fails (CI runs the quick ones with it)."""
    ap.add_argument("--check", action="store_true", help="exit 1 when a documented target or a correctness check fails")


def report_targets(targets: dict[str, bool], check: bool) -> int:
    """Print every target as met / MISSED; with ``check``, a miss is exit status 1 (named on stderr)."""
    import sys

    print("\nTargets: " + ", ".join(f"{k}: {'met' if v else 'MISSED'}" for k, v in targets.items()))
    missed = [k for k, v in targets.items() if not v]
    if check and missed:
        print("check failed: " + "; ".join(missed), file=sys.stderr)
        return 1
    return 0
