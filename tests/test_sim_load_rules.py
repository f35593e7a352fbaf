"""A load rule of your own in the simulator (issue #48), and a short run's report pinned: what the simulator decides
must not move under a refactoring of its insides."""

import json
import math
import os
from pathlib import Path

import attrs
import pytest

from kvpolicy.errors import ConfigError
from kvpolicy.protocols import LoadRule
from kvpolicy.publish_sim import DEFAULT_PREFILL
from kvpolicy.sim import PolicySet, compare, default_cluster, policy_set
from kvpolicy.traces import generate, preset

BPT = 131072
GOLDEN = Path(__file__).parent / "golden" / "sim_chat_seed5.json"

RULES = '''
class MinTokens:
    """sglang-like's rule, written from scratch: load every found block when they are at least 256 tokens."""

    def blocks_to_load(self, match, ctx):
        R = match.remote_total_blocks
        return R if R * match.block_size_tokens >= 256 else 0


class HalfWhenBusy:
    """Load half of what was found when the replica has a queue, all of it otherwise."""

    def __init__(self):
        self.asked = 0

    def blocks_to_load(self, match, ctx):
        self.asked += 1
        R = match.remote_total_blocks
        return R // 2 if ctx.queue_wait_s > 0 else R


class TooMany:
    def blocks_to_load(self, match, ctx):
        return match.remote_total_blocks + 1


class NoMethod:
    pass


class Explodes:
    def __init__(self):
        raise RuntimeError("no config")
'''


@pytest.fixture(scope="module")
def trace():
    return generate(preset("chat", block_size_tokens=256, seed=5)).head(400)


@pytest.fixture
def rules(tmp_path):
    f = tmp_path / "myrules.py"
    f.write_text(RULES)
    return f


def test_a_rule_written_from_scratch_reproduces_the_preset_it_copies(trace, rules):
    """Differential: sglang-like with its load rule replaced by the same rule written as a LoadRule gives the same run."""
    cl = default_cluster(trace, bytes_per_token=BPT, prefill=DEFAULT_PREFILL)
    mine = attrs.evolve(policy_set("sglang-like"), name="mine", load=f"{rules}:MinTokens")
    rep, raw = compare(trace, cl, scenarios=["steady", "degraded"], policies=["sglang-like", mine], seed=5)
    for s in ("steady", "degraded"):
        a, b = raw[(s, "sglang-like")], raw[(s, "mine")]
        assert (a.ttft_s == b.ttft_s).all() and a.bytes_read == b.bytes_read and a.loads == b.loads and a.gpu_prefill_s == b.gpu_prefill_s
        assert a.loads > 0
    half = attrs.evolve(policy_set("vllm-like"), name="half", load=f"{rules}:HalfWhenBusy")
    _, raw2 = compare(trace, cl, scenarios=["steady"], policies=["vllm-like", half], seed=5)
    assert raw2[("steady", "half")].bytes_read <= raw2[("steady", "vllm-like")].bytes_read
    assert isinstance(__import__("kvpolicy.sim.policysets", fromlist=["load_own_rule"]).load_own_rule(f"{rules}:HalfWhenBusy"), LoadRule)


def test_a_rule_that_answers_out_of_range_or_does_not_build_is_named(trace, rules):
    cl = default_cluster(trace, bytes_per_token=BPT, prefill=DEFAULT_PREFILL)
    with pytest.raises(ConfigError, match=r"load: .*TooMany.*blocks_to_load answered"):
        compare(trace, cl, scenarios=["steady"], policies=[PolicySet("bad", load=f"{rules}:TooMany")])
    with pytest.raises(ConfigError, match="no blocks_to_load"):
        PolicySet("x", load=f"{rules}:NoMethod")
    with pytest.raises(ConfigError, match="RuntimeError: no config"):
        PolicySet("x", load=f"{rules}:Explodes")
    with pytest.raises(ConfigError, match="unknown load rule"):
        PolicySet("x", load="sometimes")


def _rows(report):
    keep = ("scenario", "policy", "ttft_p50_ms", "ttft_p95_ms", "ttft_p99_ms", "gpu_prefill_s", "gpu_saved_s", "bytes_read",
            "bytes_written", "loads", "e_benefit_s_per_s")
    return [{k: r.get(k) for k in keep} for r in report["runs"]]


def _close(a, b, where=""):
    if isinstance(a, float) or isinstance(b, float):
        if a is None or b is None or (isinstance(a, float) and math.isnan(a)):
            assert a == b or (a != a and b != b), where
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


def test_a_short_run_is_pinned(trace):
    """Every view, every preset set, 400 chat requests at seed 5: each run's figures as they were when pinned (issue
    #48: the simulator is to be split into rooms with every decision and number unchanged). Regenerate only on purpose
    (KVPOLICY_WRITE_GOLDEN=1) and say why in the commit."""
    cl = default_cluster(trace, bytes_per_token=BPT, prefill=DEFAULT_PREFILL)
    rep, _ = compare(trace, cl, seed=5)
    got = _rows(rep)
    if os.environ.get("KVPOLICY_WRITE_GOLDEN") == "1":
        GOLDEN.write_text(json.dumps(got, indent=1, sort_keys=True))
    if not GOLDEN.exists():
        pytest.fail(f"golden file {GOLDEN} is missing: a missing golden file is a failure, never a regeneration "
                    "(regenerate on purpose with KVPOLICY_WRITE_GOLDEN=1 and review the diff)")
    _close(got, json.loads(GOLDEN.read_text()), "runs")
