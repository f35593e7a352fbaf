"""PNG figures for reports (matplotlib is optional: ``pip install kvpolicy[plot]``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from .errors import ConfigError


def _plt() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("--plot", "needs matplotlib: pip install 'kvpolicy[plot]'") from None
    return plt


def save_figure(plt: Any, fig: Any, path: Path) -> Path:
    """Lay out, write (PNG, 110 dpi) and close a figure; returns its path. Written to a temporary file beside it and
    renamed into place, as ``--json`` reports are: a symlink planted at ``path`` is replaced, never written through,
    and a failure leaves the previous figure whole."""
    import io

    from ._io import write_bytes_atomic

    fig.tight_layout()
    buf = io.BytesIO()
    try:
        fig.savefig(buf, format="png", dpi=110)
    finally:
        plt.close(fig)
    return write_bytes_atomic(path, buf.getvalue(), "the figure")


def analyze_figures(report: dict[str, Any], trace: Any, distances: np.ndarray, out_dir: str | Path) -> list[Path]:
    """MRC, reuse-distance CDF and bytes over time. Returns the written paths."""
    plt = _plt()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    block_gib = report["block_bytes"] / 2**30

    fig, ax = plt.subplots(figsize=(7, 4.5))
    caps = [row["capacity_blocks"] * block_gib for row in report["mrc"]]
    ax.plot(caps, [row["token_hit_ratio"] for row in report["mrc"]], marker="o", label="LRU (prefix rule)")
    ax.axhline(report["ceiling_token_hit_ratio"], color="k", ls="--", label="infinite cache")
    ax.set_xscale("log")
    ax.set_xlabel("cache capacity (GiB of KV)")
    ax.set_ylabel("token hit ratio (share of prefill avoided)")
    ax.set_title("LRU hit-ratio curve (1 - miss ratio), prefix rule")
    ax.legend()
    paths.append(save_figure(plt, fig, out / "mrc.png"))

    d = np.sort(distances[distances >= 0]) * block_gib
    fig, ax = plt.subplots(figsize=(7, 4.5))
    if d.size:
        ax.plot(d, np.arange(1, d.size + 1) / d.size)
        ax.set_xscale("log")
    ax.set_xlabel("reuse distance (GiB of distinct KV between two uses)")
    ax.set_ylabel("CDF of re-references")
    ax.set_title("Reuse distance")
    paths.append(save_figure(plt, fig, out / "reuse_distance_cdf.png"))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    t = trace.arrival_s
    if t.size:
        bins = np.arange(0, t[-1] + 60, 60)
        kv = np.histogram(t, bins=bins, weights=trace.input_tokens * report["bytes_per_token"])[0]
        ax.plot(bins[:-1] / 60, kv * 8 / 60 / 1e9, label="prefill KV produced")
    ax.set_xlabel("minute")
    ax.set_ylabel("Gbit/s")
    ax.set_title("KV bytes over time (1-minute bins)")
    ax.legend()
    paths.append(save_figure(plt, fig, out / "bytes_over_time.png"))
    return paths
