"""Two replica processes share a system prompt; the admission controller decides load vs recompute.

Replica A publishes the shared system prompt's blocks (only up to the
application's boundary — user messages stay private). Replica B receives
requests with the same system prompt and loads A's blocks over TCP when its
admission controller says the load beats recompute, learning the link and its
own prefill speed from live measurements. Between requests B's local cache is
dropped (other traffic evicted the prefix), so every request chooses again. In
the middle third A's link degrades (every transfer stalls 1 s): B's loads time
out (or arrive slower than recomputing) and the controller switches to
recompute; it keeps probing the link (one load per second here, every 30 s by
default) and forgets old measurements (2-second windows here, 5 minutes by
default), so once the link recovers, loads resume. B's ledger is printed at the end.

    python examples/two_replicas.py [--requests 24]
"""

from __future__ import annotations

import argparse
import json
import secrets
import time

import numpy as np

from kvpolicy.reference import ModelConfig
from kvpolicy.reference.replica import PeerReplica


def outcome(r: dict) -> str:
    """What was done for one request, in words: the admission verdict alone does not say it."""
    status = r["load_status"]
    if status == "ok":
        return f"loaded {r['loaded_blocks']} blocks"
    if status in ("timeout", "failed"):
        return f"load {'timed out' if status == 'timeout' else 'failed'}: recomputed"
    if r["remote_found"] == 0:
        return "recomputed (nothing found)"
    return "recomputed (declined)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--system-tokens", type=int, default=3000)
    args = ap.parse_args()
    cfg = ModelConfig()
    rng = np.random.default_rng(0)
    system = rng.integers(0, cfg.vocab_size, args.system_tokens).tolist()
    # the deployment secret: keys are keyed by it and peers authenticate with it (in production, read it from a file)
    secret = secrets.token_bytes(32)
    with PeerReplica.start(cfg, secret=secret, name="replica-a", publish="boundary") as a, \
            PeerReplica.start(cfg, secret=secret, name="replica-b", publish="boundary", peer=a, link_bytes_per_s=1e9,
                              breaker_open_s=1.0, window_s=2.0, probe_interval_s=1.0) as b:
        first = a.prefill(system + rng.integers(0, cfg.vocab_size, 40).tolist(), boundary_tokens=len(system), wait_published=True)
        print(f"replica-a published {first['published_blocks']} blocks of the system prompt ({len(system)} tokens)\n")
        print("admission: the controller's verdict before the load (wins = predicted p95 load + interference < margin x recompute)")
        print("done: what happened — loaded, or recomputed (declined, nothing found, or the load timed out / failed and fell back)\n")
        print(f"{'#':>3} {'phase':>9} {'local':>6} {'found':>6} {'loaded':>7} {'admission':>22} {'done':>28} {'TTFT ms':>8}")
        n = args.requests
        for i in range(n):
            phase = "degraded" if n // 3 <= i < 2 * n // 3 else "normal"
            a.set_faults(delay_s=1.0 if phase == "degraded" else 0.0)
            b.reset()
            user = rng.integers(0, cfg.vocab_size, int(rng.integers(20, 200))).tolist()
            r = b.prefill(system + user, boundary_tokens=len(system))
            print(f"{i:>3} {phase:>9} {r['local_blocks']:>6} {r['remote_found']:>6} {r['loaded_blocks']:>7} {str(r['reason'] or '-'):>22} "
                  f"{outcome(r):>28} {r['ttft_ms']:>8.1f}")
            time.sleep(0.25)
        led = b.ledger()
        print("\nreplica-b ledger")
        print("  requests :", json.dumps(led["requests"]))
        print("             (a request is remote_hit only if every matchable block was reused; here the user message after the")
        print("              publish boundary is always recomputed, so a request that loaded the system prompt is a partial_hit)")
        print("  tokens   :", json.dumps(led["tokens"]))
        for name, d in led["distributions"].items():
            t = d["ttft_s"]
            if t.get("count"):
                print(f"  {name:>18}: n={t['count']:>3}  p50 {t['p50'] * 1e3:8.1f} ms  p95 {t['p95'] * 1e3:8.1f} ms")


if __name__ == "__main__":
    main()
