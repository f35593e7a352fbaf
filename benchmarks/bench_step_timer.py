"""How fast and how closely the vLLM connector's step timer learns a deployment's compute.

vLLM hands a connector no request's compute time; the step timer (``kvpolicy.admission.steps.StepTimer``) learns it
from when steps are scheduled and when their outputs come back. Here an engine loop shaped like vLLM 0.33's
(``EngineCore.step`` with one step in flight, ``step_with_batch_queue`` with two: async scheduling) runs a GPU whose
steps take ``(base_s + ratio × profile) × noise`` — lognormal noise (σ = 0.15), 2 % of steps stalled by 20–80 ms (a
host hiccup), 5 % empty steps (half of them not reported), idle gaps between bursts — and the controller's prefill
ratio (its p50, what ``T_recompute`` uses) is read after 100, 300, 1,000 and 3,000 steps. The baseline beside it is
the prior kept as given (what the connector did before the timer): its error is the profile's.

    python benchmarks/bench_step_timer.py    # 60 % / 98 % of steps with a prefill x true ratios 0.5, 2, 4 x seeds 1..5 x 1, 2 steps in flight;
                                             # then a token-budgeted engine (2,048 / 8,192 tokens, decode tokens free or priced) (~1 min)
"""

from __future__ import annotations

import argparse
import sys
from collections import deque

import numpy as np

from _common import print_table

CHECKPOINTS = (100, 300, 1000, 3000)


def run(ratio: float, depth: int, seed: int, prefill_share: float = 0.6) -> dict[int, float]:
    from kvpolicy.admission import LatencyModel, LinkPrior
    from kvpolicy.admission.steps import StepTimer
    from kvpolicy.clock import ManualClock
    from kvpolicy.profile import PrefillModel

    rng = np.random.default_rng(seed)
    clock = ManualClock()
    model = LatencyModel(LinkPrior(bandwidth_bytes_per_s=25e9), PrefillModel(0.0, 5e-5, 2e-9, 0, 0))  # 300 s windows
    timer = StepTimer(model, clock.now_s, prefill_min_tokens=16, steps_in_flight=depth)
    base_s = 0.006
    out: dict[int, float] = {}
    queue: deque = deque()
    t, gpu_free, k, n = 0.0, 0.0, 0, max(CHECKPOINTS)
    idle_at = set(rng.choice(np.arange(1, n), size=n // 40, replace=False).tolist())
    prev_empty = False
    while k < n or queue:
        idle_here = k < n and k in idle_at and not prev_empty  # requests waiting for their KV keep the engine busy
        if k < n and not idle_here:
            empty = rng.random() < 0.05
            chunks = [] if empty else [(int(rng.integers(200, 8000)), 1) for _ in range(int(rng.integers(1, 40)))]
            if not empty and rng.random() < prefill_share:
                chunks.append((int(rng.integers(0, 8)) * 512, int(rng.integers(64, 4096))))
            clock.advance(t - clock.now_s())
            timer.scheduled(chunks)
            pred = sum(model.prefill_seconds(b, b + c) for b, c in chunks if c >= 16)
            seconds = 1e-4 if empty else (base_s + ratio * pred) * float(rng.lognormal(0.0, 0.15))
            if not empty and rng.random() < 0.02:
                seconds += float(rng.uniform(0.02, 0.08))
            gpu_free = max(t, gpu_free) + seconds
            queue.append((k, gpu_free, empty, empty and rng.random() < 0.5))
            prev_empty = empty
            k += 1
            if k in CHECKPOINTS:
                out[k] = model.prefill_ratio.q(0.5)
            if len(queue) < depth:
                continue  # room in the queue: schedule the next step at once
        elif not queue:  # no requests and nothing in flight: idle until the next request
            t += float(rng.exponential(2.0))
            idle_at.discard(k)
            continue
        _, done, empty, silent = queue.popleft()
        t = max(t, done)
        if not silent:
            clock.advance(t - clock.now_s())
            timer.finished(carries=empty or rng.random() < 0.3)
    return out


def budget_run(ratio: float, seed: int, budget: int, decode_cost: float, n: int = 3000) -> dict[int, float]:
    """An engine under load with chunked prefill (vLLM's ``max_num_batched_tokens``): every step carries 1-199
    decoding requests (one token each, 200-8,000 tokens of context) and a prefill chunk that fills the rest of the
    token budget — the prefill predicted for a step falls as its decode count rises. A decode token costs
    ``decode_cost`` × what the profile prices a token with its context at (0: nothing beyond the fixed part; 1: as much
    as a prefill token — a compute-bound batch), which the timer does not model."""
    from kvpolicy.admission import LatencyModel, LinkPrior
    from kvpolicy.admission.steps import StepTimer
    from kvpolicy.clock import ManualClock
    from kvpolicy.profile import PrefillModel

    rng = np.random.default_rng(seed)
    clock = ManualClock()
    profile = PrefillModel(0.0, 5e-5, 2e-9, 0, 0)
    model = LatencyModel(LinkPrior(bandwidth_bytes_per_s=25e9), profile)
    timer = StepTimer(model, clock.now_s, prefill_min_tokens=16)
    out: dict[int, float] = {}
    for k in range(1, n + 1):
        ctx = rng.integers(200, 8000, size=int(rng.integers(1, 200)))
        before, q = int(rng.integers(0, 8)) * 512, budget - ctx.size
        decode = decode_cost * float(np.sum(profile.marginal_s(ctx, ctx + 1)))
        seconds = (0.006 + ratio * (float(profile.marginal_s(before, before + q)) + decode)) * float(rng.lognormal(0.0, 0.15))
        timer.scheduled([(int(c), 1) for c in ctx] + [(before, q)])
        clock.advance(seconds)
        timer.finished(carries=False)
        if k in CHECKPOINTS:
            out[k] = model.prefill_ratio.q(0.5)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="1,2,3,4,5")
    ap.add_argument("--ratios", default="0.5,2,4")
    args = ap.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    ratios = [float(r) for r in args.ratios.split(",")]
    rows = []
    for share in (0.6, 0.98):  # the steps that carry a prefill chunk: 98 % is an engine under load
        for ratio in ratios:
            for depth in (1, 2):
                errs = {c: [] for c in CHECKPOINTS}
                for seed in seeds:
                    got = run(ratio, depth, seed, share)
                    for c in CHECKPOINTS:
                        errs[c].append(abs(got[c] / ratio - 1))
                prior = abs(1 / ratio - 1)
                rows.append([f"{share:.0%}", f"{ratio:g}x", str(depth), f"{prior:.0%}",
                             *(f"{np.median(errs[c]):.1%} / {max(errs[c]):.1%}" for c in CHECKPOINTS)])
    print(f"error of the learned compute (|learned / true - 1|, median / worst of {len(seeds)} seeds) after N steps; "
          "the prior kept as given is the baseline")
    print_table(["steps with a prefill", "true compute / profile", "steps in flight", "prior kept (baseline)", *(f"after {c:,} steps" for c in CHECKPOINTS)], rows)
    rows = []
    for budget in (2048, 8192):
        for decode_cost in (0.0, 1.0):
            for ratio in ratios:
                errs = {c: [] for c in CHECKPOINTS}
                for seed in seeds:
                    got = budget_run(ratio, seed, budget, decode_cost)
                    for c in CHECKPOINTS:
                        errs[c].append(got[c] / ratio - 1)
                rows.append([f"{budget:,}", f"{decode_cost:g}", f"{ratio:g}x", f"{abs(1 / ratio - 1):.0%}",
                             *(f"{np.median(errs[c]):+.1%} / {max(errs[c], key=abs):+.1%}" for c in CHECKPOINTS)])
    print("\nunder a token budget (chunked prefill under load: the prefill chunk fills what the decodes leave), signed error "
          "(learned / true - 1), median / largest of the seeds; a decode token costing 0 or 1 x the profile's price of a token")
    print_table(["token budget", "decode token cost", "true compute / profile", "prior kept (baseline)", *(f"after {c:,} steps" for c in CHECKPOINTS)], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
