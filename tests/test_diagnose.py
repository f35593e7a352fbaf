import json

import numpy as np
import pytest

from kvpolicy.cli import main
from kvpolicy.diagnose import diagnose, explain
from kvpolicy.errors import ConfigError
from kvpolicy.testing.assembly import assembly_trace, tokens_trace
from kvpolicy.traces import generate, preset, read_tokens_jsonl, write_tokens_jsonl


def dominant(kw):
    d = diagnose(assembly_trace(40, **kw))
    return d, max(d.patterns(), key=lambda p: p["lost_tokens"])


def test_a_date_at_a_fixed_early_position():
    d, p = dominant({"date": True})
    assert (p["kind"], p["position_tokens"]) == ("varying-span", 40)
    assert p["requests"] >= 35 and d.lost_hit_tokens > 0


def test_tool_definitions_in_shuffled_order():
    _, p = dominant({"shuffle_tools": True})
    assert p["kind"] == "reordered"
    assert p["position_tokens"] == 256 + 6 * 12  # where the tools begin (after system prompt and JSON)


def test_json_with_reordered_keys():
    _, p = dominant({"json_key_order": True})
    assert p["kind"] == "edited" and 256 <= p["position_tokens"] < 256 + 12


def test_an_insertion_that_shifts_the_rest():
    _, p = dominant({"insertion": True})
    assert (p["kind"], p["position_tokens"]) == ("edited", 256)


@pytest.mark.parametrize("kw", [{"distinct": True}, {}])
def test_no_false_alarms(kw):
    assert diagnose(assembly_trace(40, **kw)).flags == ()


def test_no_false_alarms_on_growing_sessions():
    tr = generate(preset("chat", n_requests=150, block_size_tokens=16), keep_tokens=True)
    assert diagnose(tr).flags == ()  # multi-turn growth is a prefix extension, not a divergence


def test_explain_a_request():
    tr = assembly_trace(10, date=True)
    ex = explain(tr, "req-5")
    assert any("diverged from request" in r and "token 40" in r for r in ex["reasons"])
    clean = assembly_trace(6)  # ~60 shared blocks: an LRU of 4 blocks cannot hold them
    ex = explain(clean, "req-5", capacity_blocks=4)
    assert any(r.startswith("evicted:") for r in ex["reasons"]) and ex["lru_hit_tokens"] < ex["reusable_tokens_infinite_cache"]
    first = explain(assembly_trace(3, distinct=True), "req-0")
    assert any("never seen" in r for r in first["reasons"])
    with pytest.raises(ConfigError, match="no request"):
        explain(tr, "nope")



def test_explain_a_shared_request_id_names_the_positions(tmp_path):
    """A retry reuses its request id: explaining "a" must not silently pick the first of them (here a cold miss, while
    the retry was served from the cache) — it is an error listing both, and '#N' names one."""
    rows = [{"tokens": list(range(40)), "timestamp": 0, "request_id": "a"},
            {"tokens": list(range(100, 140)), "timestamp": 1, "request_id": "b"},
            {"tokens": list(range(40)), "timestamp": 2, "request_id": "a"}]
    p = tmp_path / "t.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tr = read_tokens_jsonl(p, 16)
    with pytest.raises(ConfigError, match=r"2 requests .* have the id 'a' \(#0, #2\)"):
        explain(tr, "a")
    assert explain(tr, "#2")["reusable_tokens_infinite_cache"] == 32 and explain(tr, "#0")["reusable_tokens_infinite_cache"] == 0
    assert explain(tr, "b")["reusable_tokens_infinite_cache"] == 0
    with pytest.raises(ConfigError, match="#0 to #2"):
        explain(tr, "#3")

def test_diagnose_needs_tokens():
    with pytest.raises(ConfigError, match="raw tokens"):
        diagnose(generate(preset("chat", n_requests=10)))


def test_diagnose_command(tmp_path, capsys):
    tr = assembly_trace(30, date=True, block_size_tokens=16)
    p = tmp_path / "t.jsonl"
    write_tokens_jsonl(tr, p)
    out = tmp_path / "d.json"
    assert main(["diagnose", str(p), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "varying-span" in text and "lost hit tokens" in text
    d = json.loads(out.read_text())
    assert set(d) >= {"lost_hit_tokens", "total_input_tokens", "patterns"}
    assert d["patterns"][0]["kind"] == "varying-span" and d["patterns"][0]["position_tokens"] == 40
    assert set(d["patterns"][0]) >= {"kind", "position_tokens", "requests", "lost_tokens"}
    assert main(["diagnose", str(p), "--request", "req-7"]) == 0
    assert "diverged from request" in capsys.readouterr().out
    assert main(["diagnose", str(p), "--request", "zzz"]) == 2


def test_tokens_trace_helper_matches_reader(tmp_path):
    prompts = [np.arange(40, dtype=np.uint32), np.arange(50, dtype=np.uint32)]
    tr = tokens_trace(prompts, 16)
    assert tr.blocks(0).tolist() == tr.blocks(1)[:2].tolist()
