"""The brief's break-even calculation, as a table.

For each prefix length T (block-aligned to B):

    useful_tokens = floor(T / B) × B
    load_bytes    = bytes_per_token × useful_tokens
    T_remote      = lookup + queue + load_bytes / bandwidth + stage + install
    T_recompute   = dispatch + T_prefill(useful_tokens) − T_prefill(0)
                    (the profile's fitted model; its fixed per-request term is paid
                    whether or not the prefix is loaded, so it cancels)
    T_interf      = interference_s_per_gb × load_bytes / 1e9
    load  iff     T_remote + T_interf < margin × T_recompute

The break-even prefix is the smallest block-aligned length from which loading
wins (searched block by block up to ``search_max_tokens``); ``None`` if it never
does. Gigabits are 10^9 bits.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._validate import check_non_negative_number, check_positive_int, check_positive_number
from ..errors import ConfigError
from ..profile import PrefillModel


def breakeven(
    *,
    bytes_per_token: int,
    prefill: PrefillModel,
    bandwidth_gbps: float,
    block_size_tokens: int = 16,
    prefix_tokens: list[int] | tuple[int, ...] = (1024, 4096, 16384, 32768, 65536),
    lookup_s: float = 0.0005,
    queue_s: float = 0.0,
    stage_s: float = 0.0,
    install_s: float = 0.0,
    dispatch_s: float = 0.0,
    interference_s_per_gb: float = 0.0005,
    margin: float = 0.8,
    search_max_tokens: int | None = None,
) -> dict[str, Any]:
    # every input named when it is wrong; finite, whole where it counts (an infinite time, a negative prefix or a
    # fractional block size made a table of nonsense without a word)
    if not isinstance(prefill, PrefillModel):
        raise ConfigError("prefill", f"must be a PrefillModel, got {type(prefill).__name__}")
    check_positive_number("bandwidth_gbps", bandwidth_gbps)
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 < margin <= 1.5:
        raise ConfigError("margin", f"must be in (0, 1.5], got {margin!r}")
    for name, v in (("lookup_s", lookup_s), ("queue_s", queue_s), ("stage_s", stage_s), ("install_s", install_s), ("dispatch_s", dispatch_s), ("interference_s_per_gb", interference_s_per_gb)):
        check_non_negative_number(name, v)
    check_positive_int("block_size_tokens", block_size_tokens)
    check_positive_int("bytes_per_token", bytes_per_token)
    if isinstance(prefix_tokens, (str, bytes)) or not hasattr(prefix_tokens, "__iter__"):
        raise ConfigError("prefix_tokens", f"must be a list of prompt lengths in tokens, got {prefix_tokens!r}")
    prefix_tokens = list(prefix_tokens)
    if not prefix_tokens:
        raise ConfigError("prefix_tokens", "must name at least one prompt length")
    for v in prefix_tokens:
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
            raise ConfigError("prefix_tokens", f"each must be a positive int, got {v!r}")
    if search_max_tokens is not None:
        check_positive_int("search_max_tokens", search_max_tokens)
    bw_bytes = bandwidth_gbps * 1e9 / 8
    fixed_remote = lookup_s + queue_s + stage_s + install_s

    def evaluate(useful: np.ndarray) -> dict[str, np.ndarray]:
        load_bytes = useful.astype(np.float64) * bytes_per_token
        t_remote = fixed_remote + load_bytes / bw_bytes
        t_rec = dispatch_s + np.where(useful > 0, prefill(useful.astype(np.float64)) - prefill.a_s, 0.0)
        interf = interference_s_per_gb * load_bytes / 1e9
        win = (useful > 0) & (t_remote + interf < margin * t_rec)
        return {"load_bytes": load_bytes, "t_remote": t_remote, "t_rec": t_rec, "interf": interf, "win": win}

    T = np.asarray(sorted(prefix_tokens), dtype=np.int64)
    useful = (T // block_size_tokens) * block_size_tokens
    ev = evaluate(useful)
    rows = [
        {
            "prefix_tokens": int(T[i]), "useful_tokens": int(useful[i]), "load_bytes": int(ev["load_bytes"][i]),
            "t_remote_ms": float(ev["t_remote"][i] * 1e3), "t_interference_ms": float(ev["interf"][i] * 1e3),
            "t_recompute_ms": float(ev["t_rec"][i] * 1e3), "decision": "load" if ev["win"][i] else "recompute",
        }
        for i in range(T.size)
    ]
    top = search_max_tokens or max(int(T.max()) * 4, 1 << 20)
    grid = np.arange(block_size_tokens, top + 1, block_size_tokens, dtype=np.int64)
    wins = evaluate(grid)["win"]
    first = int(grid[np.argmax(wins)]) if wins.any() else None
    return {
        "rows": rows,
        "break_even_tokens": first,
        "inputs": {
            "bytes_per_token": bytes_per_token, "bandwidth_gbps": bandwidth_gbps, "block_size_tokens": block_size_tokens, "lookup_ms": lookup_s * 1e3,
            "queue_ms": queue_s * 1e3, "stage_ms": stage_s * 1e3, "install_ms": install_s * 1e3, "dispatch_ms": dispatch_s * 1e3,
            "interference_ms_per_gb": interference_s_per_gb * 1e3, "margin": margin, "searched_up_to_tokens": top,
        },
    }
