"""How well the prefill model fitted from a profile predicts prefills after a cached prefix.

``kvpolicy profile`` measures each prefix cold, with all of it cached and with about
half of it cached, every prompt being the prefix plus a short tail. This script
profiles the reference engine at ``--lengths``, then times a grid of prefills at
every mix of cached and new tokens, and compares each measured TTFT with what three
fits of the same profile predict:

* the causal cross term (x = 2c) and the sequential fit — the model before the
  half-hit rows existed;
* x from the half-hit rows, sequential fit (a CSV without ``tail_tokens``);
* every row as the prefill it ran, all terms fitted at once (``tail_tokens`` known).

Baseline in the same run: the causal model. Error = predicted / measured − 1.

    python benchmarks/bench_prefill_model.py [--lengths 64,256,512,1024] [--repeats 7] [--json OUT]
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMEXPR_NUM_THREADS"):
    os.environ[_v] = "1"

import attrs  # noqa: E402
import numpy as np  # noqa: E402
from _common import write_json  # noqa: E402

CACHED = (0, 64, 256, 512, 1024, 2048)
NEW = (16, 64, 160, 320, 512, 1024)


def measure_grid(repeats: int, seed: int = 0) -> list[tuple[int, int, float]]:
    """(cached tokens, new tokens, median TTFT s) of the reference engine, each cached part put there by an earlier request."""
    from kvpolicy.reference.engine import ReferenceEngine
    from kvpolicy.reference.model import ModelConfig

    cfg = ModelConfig()
    rng = np.random.default_rng(seed)
    base = rng.integers(0, cfg.vocab_size, max(CACHED)).astype(np.int64)
    engine = ReferenceEngine(cfg, block_size_tokens=16, capacity_blocks=1024)
    rows = []
    for r, q in itertools.product(CACHED, NEW):
        ts = []
        for _ in range(repeats):
            engine.reset()
            if r:
                engine.prefill(base[:r], publish=False)
            out = engine.prefill(np.concatenate([base[:r], rng.integers(0, cfg.vocab_size, q)]), publish=False)
            if out.local_blocks != r // 16:
                raise RuntimeError(f"expected {r // 16} cached blocks, got {out.local_blocks}")
            ts.append(out.timings["ttft_s"])
        rows.append((r, q, float(np.median(ts))))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="64,256,512,1024", help="profile lengths (default: bench_sim_vs_real's, 64-1,024)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from kvpolicy.reference.model import ModelConfig
    from kvpolicy.reference.profiling import ReferenceProfileTarget, run_profile

    lengths = [int(x) for x in args.lengths.split(",")]
    target = ReferenceProfileTarget(ModelConfig(), block_size_tokens=16, max_prefix_tokens=max(lengths))
    try:
        prof, _ = run_profile(target, lengths, (1,), repeats=5)
    finally:
        target.close()
    grid = measure_grid(args.repeats)
    joint = prof.prefill_model()
    sequential = attrs.evolve(prof, extra={k: v for k, v in prof.extra.items() if k != "tail_tokens"}).prefill_model()
    causal = attrs.evolve(sequential, cross_s_per_token2=None, cross_rms_rel_error=None)
    r = np.array([g[0] for g in grid], dtype=float)
    q = np.array([g[1] for g in grid], dtype=float)
    y = np.array([g[2] for g in grid])
    replay = (r > 0) & (r + q <= 1400) & (q <= 512)  # the hits bench_sim_vs_real's chat slice serves
    out = {"lengths": lengths, "grid": grid, "models": {}}
    print(f"profile at {lengths} tokens; {len(grid)} prefills measured at cached {list(CACHED)} x new {list(NEW)} tokens")
    print(f"{'model':<58} {'rms err':>8} {'hits, mean err':>15} {'vs causal':>10}")
    base_rms = None
    for name, m in (("causal cross term x = 2c, sequential fit (the baseline)", causal), ("x from the half-hit rows, sequential fit", sequential),
                    ("every row as the prefill it ran, fitted whole", joint)):
        rel = np.asarray(m.prefill_s(r, r + q)) / y - 1.0
        rms = float(np.sqrt(np.mean(rel**2)))
        base_rms = base_rms or rms
        hits = float(np.mean(rel[replay]))
        out["models"][name] = {"model": m.to_dict(), "rms_rel_error": rms, "replay_hits_mean_rel_error": hits}
        print(f"{name:<58} {rms:>8.1%} {hits:>+15.1%} {base_rms / rms:>9.1f}x")
    print(f"d: {sequential.d_s_per_cached_token:.3g} s per cached token sequentially, {joint.d_s_per_cached_token:.3g} fitted whole")
    print(f"wrote {write_json('prefill_model', out, args.json)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
