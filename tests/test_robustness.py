"""Bad input gets a clear error naming the field or file; reports are strict JSON, replaced atomically."""

import json
import math
import os
import subprocess
import sys

import pytest

from kvpolicy._io import strict_json, write_text_atomic
from kvpolicy import match
from kvpolicy.admission import AdmissionContext, CircuitBreaker, LogHistogram
from kvpolicy.cli import main
from kvpolicy.errors import ConfigError
from kvpolicy.eviction import make_policy
from kvpolicy.ledger import Ledger, RequestRecord


@pytest.mark.parametrize("kw,field", [
    (dict(open_s=float("nan")), "open_s"), (dict(window_s=float("inf")), "window_s"), (dict(failure_threshold=2.5), "failure_threshold"),
    (dict(half_open_probes=0), "half_open_probes"),
])
def test_breaker_refuses_non_finite_settings(kw, field):
    with pytest.raises(ConfigError) as e:
        CircuitBreaker(**kw)
    assert e.value.field == field


def test_values_that_would_give_silently_wrong_numbers_are_refused():
    h = LogHistogram()
    with pytest.raises(ConfigError, match="^n:"):
        h.record(1.0, n=-5)
    assert h.count == 0
    with pytest.raises(ConfigError, match="active_decodes"):
        AdmissionContext(block_bytes=1, active_decodes=float("nan"))
    led = Ledger(1024)
    with pytest.raises(ConfigError, match="size_bytes"):
        led.record_write(b"k" * 16, 1.0, -5)
    with pytest.raises(ConfigError, match="t_s"):
        led.record_replication(float("nan"), 10)
    before = dict(led.tokens)
    with pytest.raises(ConfigError, match="not_loaded_reason"):
        led.record(RequestRecord(prompt_tokens=100, block_size_tokens=16, remote_not_loaded_blocks=2, not_loaded_reason="bogus"))
    assert led.tokens == before, "a refused record changes nothing"
    with pytest.raises(ConfigError, match="ttft_s"):
        RequestRecord(prompt_tokens=100, block_size_tokens=16, ttft_s=float("nan"))


def test_reports_are_strict_json_and_replaced_atomically(tmp_path):
    assert json.loads(strict_json({"a": float("nan"), "b": [float("inf"), 1.5], "c": {"d": -math.inf}})) == {"a": None, "b": [None, 1.5],
                                                                                                        "c": {"d": None}}
    out = tmp_path / "r.json"
    write_text_atomic(out, "old")
    d = tmp_path / "dir"
    d.mkdir()
    with pytest.raises(ConfigError) as e:
        write_text_atomic(d, "new")  # a directory where the report should go
    assert str(d) in str(e.value)
    assert out.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["dir", "r.json"], "no temporary file left"


@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_FSIZE")
def test_a_full_disk_leaves_the_previous_report_intact(tmp_path):
    out = tmp_path / "r.json"
    out.write_text('{"previous": true}')
    code = (
        "import resource, sys; resource.setrlimit(resource.RLIMIT_FSIZE, (2048, 2048)); import signal; "
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN); from kvpolicy._io import write_text_atomic; "
        f"write_text_atomic({str(out)!r}, 'x' * 100000)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode != 0 and "cannot write the report" in r.stderr
    assert json.loads(out.read_text()) == {"previous": True}
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]


def test_cli_turns_os_and_encoding_errors_into_one_line(tmp_path, capsys):
    binary = tmp_path / "bin.jsonl"
    binary.write_bytes(b"\xff\xfe\x00\x01" * 100)
    for argv in (["analyze", str(tmp_path)], ["analyze", str(binary)], ["size", "--config", str(binary)]):
        code = main(argv)
        err = capsys.readouterr().err
        assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, (argv, err)
    os.chmod(tmp_path, 0o755)


@pytest.mark.parametrize("call,field", [
    (lambda: match([b"a", b"b"], 40, 7, block_size_tokens=16), "local"),
    (lambda: match([b"a", b"b"], 40, None, [b"a"], block_size_tokens=16), "remote tier 0"),
    (lambda: make_policy(["lru"], 10), "policy"),
    (lambda: make_policy("lru", 10).victims(None), "need_bytes"),
    (lambda: make_policy("adaptive", 10).victims(-3), "need_bytes"),
])
def test_api_misuse_names_the_argument(call, field):
    """A wrong object where an index, a policy name or a byte count belongs: a ConfigError naming it, not an
    AttributeError or TypeError from inside."""
    with pytest.raises(ConfigError) as e:
        call()
    assert e.value.field == field


def test_warmup_inputs_name_their_field():
    from kvpolicy.warmup import HotPrefix, WarmupConfig, plan_warmup

    with pytest.raises(ConfigError) as e:
        WarmupConfig(replicas=2, window_s=10.0, bandwidth_bytes_per_s=1e9, readiness_share="x")
    assert e.value.field == "readiness_share"
    with pytest.raises(ConfigError) as e:
        HotPrefix(prefix="p", size_bytes=10, access_count=3, recompute_s=0.1, blocks=5)
    assert e.value.field == "blocks"
    with pytest.raises(ConfigError) as e:
        plan_warmup(None, WarmupConfig(replicas=2, window_s=10.0, bandwidth_bytes_per_s=1e9))
    assert e.value.field == "prefixes"


@pytest.mark.parametrize("kw,field", [
    (dict(num_tokens=None), "num_tokens"), (dict(block_size_tokens=0), "block_size_tokens"), (dict(reused_blocks=-1), "reused_blocks"),
    (dict(time_s=float("nan")), "time_s"), (dict(boundary_tokens="x"), "boundary_tokens"),
])
def test_publish_request_names_its_field(kw, field):
    from kvpolicy.publish import PublishRequest

    with pytest.raises(ConfigError) as e:
        PublishRequest(**{"request_id": 1, "num_tokens": 64, "block_size_tokens": 16, **kw})
    assert e.value.field == field


def test_publish_filters_refuse_what_is_not_a_key_chain_or_a_spec():
    import numpy as np

    from kvpolicy.publish import PublishRequest, StructureAwarePublish, make_filter

    req = PublishRequest(request_id=1, num_tokens=np.int64(64), block_size_tokens=16)  # an engine's numpy int is an int
    f = StructureAwarePublish()
    for call in (lambda: f.observe(req, None), lambda: f.publishable(req, b"abcd")):
        with pytest.raises(ConfigError) as e:
            call()
        assert e.value.field == "keys"
    with pytest.raises(ConfigError) as e:
        make_filter(None)
    assert e.value.field == "policy"


@pytest.mark.parametrize("w", [None, "x", float("inf"), 0])
def test_ledger_window_names_itself(w):
    with pytest.raises(ConfigError) as e:
        Ledger(1024, window_s=w)
    assert e.value.field == "window_s"


def test_admission_inputs_name_their_field():
    from kvpolicy.admission import AdmissionContext, AdmissionController, LatencyModel
    from kvpolicy.admission.model import LinkPrior
    from kvpolicy.profile import PrefillModel

    prefill = PrefillModel(a_s=0.01, b_s_per_token=1e-4, c_s_per_token2=1e-9, rms_rel_error=0.0, max_rel_error=0.0)
    with pytest.raises(ConfigError) as e:
        LatencyModel(LinkPrior(1e9), prefill, window_s="x")
    assert e.value.field == "window_s"
    ctl = AdmissionController(LatencyModel(LinkPrior(1e9), prefill))
    ctx = AdmissionContext(block_bytes=1 << 20)
    for kw, field in ((dict(k=None), "k"), (dict(block_size_tokens=0), "block_size_tokens"), (dict(split_blocks=3), "split_blocks"),
                      (dict(ctx=None), "ctx")):
        with pytest.raises(ConfigError) as e:
            ctl.evaluate(**{"local_blocks": 1, "remote_blocks": 2, "k": 2, "block_size_tokens": 16, "ctx": ctx, **kw})
        assert e.value.field == field
    with pytest.raises(ConfigError) as e:
        ctl.record(None)
    assert e.value.field == "outcome"


@pytest.mark.parametrize("kw,field", [
    (dict(local_eviction="nope"), "local_eviction"), (dict(pool_eviction=None), "pool_eviction"), (dict(publish="threshold-0"), "publish"),
])
def test_policy_set_names_its_field(kw, field):
    """A misspelt policy in a set was refused only when the simulator built a replica, as 'policy'."""
    from kvpolicy.sim.policysets import PolicySet

    with pytest.raises(ConfigError) as e:
        PolicySet(name="mine", **kw)
    assert e.value.field == field


def test_prefill_fits_refuse_what_is_not_a_measurement():
    """A NaN that reached the least squares made LAPACK print to stderr and raise LinAlgError; a string a ValueError."""
    from kvpolicy.profile import fit_cross, fit_prefill, fit_prefill_rows

    cases = ((lambda: fit_prefill([1, 2, 3], [0.1, float("nan"), 0.3]), "seconds"), (lambda: fit_prefill([1, 2, "x"], [1, 2, 3]), "prefix_tokens"),
             (lambda: fit_prefill_rows([1, 2], [1, 1], [0.1, float("inf")], [0.1, 0.1]), "cold_prefill_ms"),
             (lambda: fit_prefill_rows([1, 2], [1], [0.1, 0.2], [0.1, 0.1]), "tail_tokens"),
             (lambda: fit_cross(None, [1], [1], [1]), "model"))
    for call, field in cases:
        with pytest.raises(ConfigError) as e:
            call()
        assert e.value.field == field
    # a local hit that was not measured is NaN, and still fits from the other rows
    m = fit_prefill_rows([256, 512, 1024], [16, 16, 16], [0.01, 0.02, 0.05], [0.002, float("nan"), 0.003])
    assert m.a_s >= 0 and m.rms_rel_error < 1


def _entry_points():
    from kvpolicy.analysis import analyze, prefix_groups, replica_view
    from kvpolicy.diagnose import diagnose, explain
    from kvpolicy.eviction import replay
    from kvpolicy.eviction.bench import compare
    from kvpolicy.eviction.kernels import replay_kernel
    from kvpolicy.publish_sim import publish_bench
    from kvpolicy.sim import Prepared

    return {"analyze": lambda t: analyze(t, bytes_per_token=512), "prefix_groups": lambda t: prefix_groups(t, 512),
            "replica_view": lambda t: replica_view(t, 2, bytes_per_token=512), "diagnose": diagnose, "explain": lambda t: explain(t, "r1"),
            "replay": lambda t: replay(t, "lru", 4), "replay_kernel": lambda t: replay_kernel(t, "lru", 4),
            "evict compare": lambda t: compare(t, ["lru"], [4]), "publish_bench": lambda t: publish_bench(t, ["all"], bytes_per_token=512),
            "Prepared": Prepared}


@pytest.mark.parametrize("entry", list(_entry_points()))
@pytest.mark.parametrize("not_a_trace", ["trace.jsonl", None])
def test_every_trace_entry_point_names_a_trace_that_is_not_one(entry, not_a_trace):
    """An AttributeError on a column name was what a path string or None where the trace goes got."""
    with pytest.raises(ConfigError) as e:
        _entry_points()[entry](not_a_trace)
    assert e.value.field == "trace"
