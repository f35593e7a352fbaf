"""Admission and ledger speed, side by side with key building in the same run.

* ``decide()`` on realistic 32K-token matches with warm estimators (every term
  learned from observations), against building the keyed block keys of the same
  32K-token request: a decision must cost under 5 % of the key building;
* the ledger records ≥ 500k outcomes/s on a realistic mix of outcomes.

    python benchmarks/bench_admission.py [--json OUT]
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
from _common import add_check_flag, report_targets, best_of, print_table, write_json

from kvpolicy.admission import AdmissionConfig, AdmissionContext, AdmissionController, LatencyModel, LinkPrior, LoadOutcome
from kvpolicy.keys import BlockHasher, Namespace
from kvpolicy.ledger import Ledger, RequestRecord
from kvpolicy.matching import PrefixMatch
from kvpolicy.profile import fit_prefill

B = 16
TOKENS = 32768


def warm_controller(rng: np.random.Generator) -> AdmissionController:
    prefill = fit_prefill([4096, 16384, 32768, 65536], [0.31, 1.41, 3.19, 7.6])
    c = AdmissionController(LatencyModel(LinkPrior(bandwidth_bytes_per_s=12.5e9), prefill),
                            AdmissionConfig(max_loads_per_replica=10**9, max_loads_per_source=10**9, max_queue_bytes_per_source=1e30))
    ctx = AdmissionContext(block_bytes=131072 * B)
    for _ in range(2000):  # warm every estimator with observed outcomes
        remote = int(rng.integers(64, 2000))
        d = c.decide(PrefixMatch(TOKENS, B, (TOKENS - 1) // B, 0, (remote,), ("pool",), "miss"), ctx)
        if d.loads:
            c.record(LoadOutcome(d.load_id, "ok", d.load_blocks, lookup_s=rng.lognormal(-7.5, 0.3), transfer_s=d.load_bytes / 10e9 * rng.lognormal(0, 0.2),
                                 install_s=d.load_blocks * 2e-5, stall_s=1e-4))
        c.model.observe_prefill(0, int(rng.integers(1024, TOKENS)), float(rng.uniform(0.1, 3.0)), dispatch_s=0.002)
    return c


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_check_flag(ap)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--ledger-records", type=int, default=300_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(args.seed)

    ns = Namespace(model_id="bench", model_revision="r", tokenizer_version="t", kv_dtype="bf16", block_size_tokens=B)
    hasher = BlockHasher(ns, "keyed", secret=bytes(range(32)))
    tokens = rng.integers(0, 150_000, TOKENS).astype(np.uint32)
    t_keys = best_of(lambda: hasher.hash_blocks(tokens), repeats=args.repeats)

    c = warm_controller(rng)
    ctx = AdmissionContext(block_bytes=131072 * B)
    matches = [PrefixMatch(TOKENS, B, (TOKENS - 1) // B, int(l), (int(r),), ("pool",), "miss")
               for l, r in zip(rng.integers(0, 512, 256), rng.integers(1, 1500, 256))]

    def decide_all() -> None:
        for m in matches:
            d = c.decide(m, ctx)
            if d.load_id is not None:
                c.cancel(d.load_id)

    t_decide = best_of(decide_all, repeats=args.repeats) / len(matches)
    ratio = t_decide / t_keys
    print(f"A {TOKENS:,}-token request, block size {B}; estimators warmed with 2,000 observed loads\n")
    print_table(["operation", "microseconds", "share of key building"], [
        ["build keyed block keys (BLAKE2b)", f"{t_keys * 1e6:.1f}", "100%"],
        ["decide() (incl. cancel of the admitted slot)", f"{t_decide * 1e6:.1f}", f"{ratio:.2%}"],
    ])

    # the ledger: a realistic mix of outcomes
    recs = []
    keys = [bytes(rng.integers(0, 256, 16, dtype=np.uint8)) for _ in range(64)]
    led = Ledger(bytes_per_token=131072)
    for k in keys[:32]:
        led.record_write(k, 0.0, 2 * 2**20)
    for i in range(4096):
        T = int(rng.integers(200, 32768))
        m = (T - 1) // B
        local = int(rng.integers(0, m + 1)) if rng.random() < 0.6 else 0
        remote = int(rng.integers(0, m - local + 1)) if rng.random() < 0.3 else 0
        miss = m - local - remote
        recs.append(RequestRecord(
            prompt_tokens=T, block_size_tokens=B, local_blocks=local, remote_loaded_blocks=remote,
            missing_keys=tuple(keys[int(j)] for j in rng.integers(0, 64, min(miss, 2))), request_class=("chat", "rag", "agent")[i % 3],
            arrival_s=i * 0.01, ttft_s=float(rng.uniform(0.01, 2)), prefill_s=float(rng.uniform(0.01, 2)), load_s=0.05 if remote else None,
            predicted_recompute_s=0.2 if remote else None, load_attempted=bool(remote),
        ))
    n = args.ledger_records
    for r in recs:  # warm up
        led.record(r)
    t0 = time.perf_counter()
    for i in range(n):
        led.record(recs[i & 4095])
    t_ledger = time.perf_counter() - t0
    rate = n / t_ledger
    print(f"\nLedger: {n:,} outcomes in {t_ledger:.3f} s -> {rate:,.0f} outcomes/s")
    targets = {"decide < 5% of key building": ratio < 0.05, "ledger >= 500k outcomes/s": rate >= 500_000}
    rc = report_targets(targets, args.check)
    path = write_json("bench_admission", {"keys_s": t_keys, "decide_s": t_decide, "decide_share": ratio, "ledger_outcomes_per_s": rate, "targets": targets}, args.json)
    print(f"wrote {path}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
