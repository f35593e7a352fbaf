"""Every decision of a run, pinned (issue #48): the simulator's rooms and its fast paths must leave each request's TTFT,
prefill time, queueing and route, and every figure of the report, as they were when this file was written.

The golden file was written by the code of d197e89, before the simulator was split into rooms and made faster, so this
test is the side-by-side comparison of the old code's JSON with the new code's on a slice (``agent`` at seed 5, 600
requests, every view, the kvpolicy set and vllm-like). Regenerate only on purpose (KVPOLICY_WRITE_GOLDEN=1) and say
why in the commit: a missing golden file is a failure."""

import json
import math
import os
from pathlib import Path

import pytest

from kvpolicy.publish_sim import DEFAULT_PREFILL
from kvpolicy.sim import compare, default_cluster
from kvpolicy.traces import generate, preset

BPT = 131072
GOLDEN = Path(__file__).parent / "golden" / "sim_agent_seed5_decisions.json"


def _close(a, b, where=""):
    if isinstance(a, float) or isinstance(b, float):
        if isinstance(a, float) and math.isnan(a):
            assert isinstance(b, float) and math.isnan(b), where
        else:
            assert a == pytest.approx(b, rel=1e-9, abs=1e-12), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _close(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _close(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def _decisions():
    trace = generate(preset("agent", block_size_tokens=256, seed=5)).head(600)
    cl = default_cluster(trace, bytes_per_token=BPT, prefill=DEFAULT_PREFILL)
    rep, raw = compare(trace, cl, seed=5, policies=["kvpolicy", "vllm-like"])
    out = {"runs": rep["runs"], "requests": {}}
    for (scenario, policy), res in sorted(raw.items()):
        if policy == "recompute-only":
            continue
        out["requests"][f"{scenario}/{policy}"] = {
            "ttft_s": [float(x) for x in res.ttft_s],
            "prefill_s": [float(x) for x in res.prefill_s],
            "queue_s": [float(x) for x in res.queue_s],
            "routes": [int(x) for x in res.routes],
            "node_bytes_out": [int(x) for x in res.node_bytes_out],
        }
    return json.loads(json.dumps(out))  # the report as a user's JSON reader sees it (tuples become lists)


def test_every_request_of_a_slice_is_decided_as_it_was_pinned():
    got = _decisions()
    if os.environ.get("KVPOLICY_WRITE_GOLDEN") == "1":
        GOLDEN.write_text(json.dumps(got, sort_keys=True))
    if not GOLDEN.exists():
        pytest.fail(f"golden file {GOLDEN} is missing: a missing golden file is a failure, never a regeneration "
                    "(regenerate on purpose with KVPOLICY_WRITE_GOLDEN=1 and review the diff)")
    want = json.loads(GOLDEN.read_text())
    assert len(want["requests"]) == 8 and all(len(v["ttft_s"]) >= 600 for v in want["requests"].values())
    _close(got, want, "")
