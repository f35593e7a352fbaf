"""KV events made by the engines' own code — vLLM 0.33's BlockPool with its hasher, SGLang 0.5.23's RadixCache with its
recorder and native hash (tools/engine_events.py, read out of the downloaded wheels) — ingested by kvpolicy, and the
directory compared with what each engine holds at the end: no block missing, none stale.

The wheels: ``KVPOLICY_ENGINE_WHEELS`` names a directory holding ``vllm-0.33.0-*.whl`` and ``sglang-0.5.23-*.whl``
(``pip download vllm==0.33.0 sglang==0.5.23 --no-deps -d DIR``; .ci/run does), or ``KVPOLICY_ENGINE_EVENTS`` a cases file
the tool already wrote. Without it these tests skip — unless
``KVPOLICY_REQUIRE_ENGINE_WHEELS=1`` (CI), where a missing wheel is a failure.
"""

from __future__ import annotations

import base64
import glob
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from kvpolicy.keys import BlockHasher, Namespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import engine_events  # noqa: E402  (tools/engine_events.py: the engines' runs, and replaying a case into a directory)

sys.path.pop(0)
B = 16
NS = Namespace(model_id="m", model_revision="r", tokenizer_version="t", kv_dtype="bf16", block_size_tokens=B)
HASHER = BlockHasher(NS, "fast")


def _wheel(pattern: str) -> str | None:
    d = os.environ.get("KVPOLICY_ENGINE_WHEELS")
    hits = sorted(glob.glob(os.path.join(d, pattern))) if d else []
    return hits[0] if hits else None


@pytest.fixture(scope="module")
def cases():
    made = os.environ.get("KVPOLICY_ENGINE_EVENTS")  # a cases file tools/engine_events.py already wrote
    if made:
        return json.loads(Path(made).read_text())
    vllm, sglang = _wheel("vllm-0.33.0-*.whl"), _wheel("sglang-0.5.23-*.whl")
    if not (vllm and sglang):
        if os.environ.get("KVPOLICY_REQUIRE_ENGINE_WHEELS") == "1":
            pytest.fail("KVPOLICY_REQUIRE_ENGINE_WHEELS=1 but KVPOLICY_ENGINE_WHEELS holds no vLLM 0.33.0 and SGLang 0.5.23 wheels")
        pytest.skip("the engines' wheels are not here (KVPOLICY_ENGINE_WHEELS)")
    # made once per wheels and harness (the mutation tool runs these tests once per mutant): keyed by both
    tool = ROOT / "tools" / "engine_events.py"
    stamp = hashlib.sha256(f"{vllm}|{sglang}|{sys.executable}".encode() + tool.read_bytes()).hexdigest()[:16]
    out = Path(tempfile.gettempdir()) / f"kvpolicy-engine-events-{stamp}.json"
    if not out.exists():
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        subprocess.run([sys.executable, str(tool), "--vllm", vllm, "--sglang", sglang, "--out", str(tmp)], check=True, timeout=600)
        tmp.replace(out)
    return json.loads(out.read_text())


Replay, _expected, _directory, _run = engine_events.Replay, engine_events.expected, engine_events.directory_pairs, engine_events.run_case


def _check(case, **kw):
    d, ings, holder_of = _run(case, HASHER, **kw)
    want, got = _expected(case, HASHER, holder_of), _directory(d)
    missing, stale = want - got, got - want
    refused = {n: {r: c for r, c in i.refused.items() if c} for n, i in ings.items()}
    assert not missing and not stale, f"{len(missing)} held blocks missing, {len(stale)} stale of {len(want)}; refused {refused}"
    return d, ings


ENGINE_CASES = [f"vllm-{t}-{c}" for t in ("int", "bytes") for c in (
    "chain-lora-salt-mm", "evictions", "gpu-reset-cpu-kept", "sliding-window-null-blocks", "data-parallel", "restart-same-first-seq",
    "restart-noticed-late", "dp-gpu-reset-restart")] + [f"sglang-p{p}-{c}" for p in (16, 1) for c in ("chain", "salt-lora", "cpu-pinned-and-evict", "reset")]


@pytest.mark.parametrize("name", ENGINE_CASES)
def test_the_directory_holds_exactly_what_the_engine_holds(cases, name):
    case = cases[name]
    assert case["held"] or name.endswith("reset"), "a case whose engine holds nothing would prove nothing"
    _, ings = _check(case)
    if name.startswith("sglang"):
        hashes = [h for fr in case["frames"].values() for _, p in fr for h in _hashes(p)]
        assert any(h < 0 for h in hashes), "SGLang's hashes are signed: about half are negative, so some must be here"


def _hashes(payload_b64):
    import msgpack

    _, events, *_ = msgpack.unpackb(base64.b64decode(payload_b64), raw=False, strict_map_key=False)
    return [h for e in events for h in e.get("block_hashes", [])]


@pytest.mark.parametrize("name", [c for c in ENGINE_CASES if c.startswith("vllm") and "mm" not in c])
def test_verified_against_vllms_own_hashing(cases, name):
    """With --verify every vLLM block is re-derived from its tokens (and refused if it disagrees); the ones that
    carry what vLLM hashes but does not publish (a LoRA adapter's path) land unverified."""
    _, ings = _check(cases[name], verify="sha256")
    assert sum(i.refused["mismatched_hash"] for i in ings.values()) == 0
    assert sum(i.counts["verified_blocks"] for i in ings.values()) > 0


def test_an_engine_started_with_pythonhashseed_verifies_only_with_its_seed(cases):
    case = cases["vllm-int-pythonhashseed-42"]
    _, ings = _check(case, verify="sha256", seed="42")
    assert ings["pod-e0"].counts["verified_blocks"] == len(case["held"]) and ings["pod-e0"].refused["mismatched_hash"] == 0
    d, ings, _ = _run(case, HASHER, verify="sha256")  # told nothing: vLLM's default root, not hash_fn("42")
    assert ings["pod-e0"].refused["mismatched_hash"] > 0 and not _directory(d)


def test_the_cases_are_not_vacuous(cases):
    """The harness's ground truth moves with what the engines do: evictions and resets really drop blocks."""
    assert len(cases["vllm-int-evictions"]["held"]) < 5 + 3 * 3, "a 12-block pool cannot hold all 14 blocks"
    assert {h["medium"] for h in cases["vllm-int-gpu-reset-cpu-kept"]["held"]} == {"CPU"}
    assert {h["group"] for h in cases["vllm-int-sliding-window-null-blocks"]["held"]} == {0, 1}
    assert len([h for h in cases["vllm-int-sliding-window-null-blocks"]["held"] if h["group"] == 1]) == 5 - 2
    assert {h["stream"] for h in cases["vllm-int-restart-noticed-late"]["held"]} == {"new"}
    assert {h["medium"] for h in cases["sglang-p1-reset"]["held"]} == {"CPU_PINNED"}
    assert any(h["cache_salt"] for h in cases["sglang-p1-salt-lora"]["held"]) and any(h["lora_name"] for h in cases["sglang-p1-salt-lora"]["held"])
    assert any(h["mm_items"] for h in cases["vllm-int-chain-lora-salt-mm"]["held"])
    goal = cases["vllm-int-dp-gpu-reset-restart"]["held"]
    assert {(h["stream"], h["medium"]) for h in goal} == {("dp0", "GPU"), ("dp0", "CPU"), ("dp1-new", "GPU")}
