"""Sweeps on local processes and on Ray return what a sequential run returns, byte for byte (issue #48)."""

import json
import os

import pytest

from kvpolicy.cli import main
from kvpolicy.errors import ConfigError
from kvpolicy.eviction.bench import compare as evict_compare
from kvpolicy.publish_sim import DEFAULT_PREFILL, publish_bench
from kvpolicy.sim import compare, default_cluster
from kvpolicy.sweep import Sweep, default_jobs
from kvpolicy.traces import generate, preset

BPT = 131072


@pytest.fixture(scope="module")
def trace():
    return generate(preset("chat", block_size_tokens=256, seed=11)).head(300)


def _json(x):
    return json.dumps(x, sort_keys=True, default=str)


def _square_plus(shared, spec):
    return shared + spec * spec


def _refuse(shared, spec):
    if spec == 2:
        raise ConfigError("spec", "two is refused")
    return spec


def test_a_sweep_keeps_the_order_of_its_specs_and_raises_a_jobs_own_error():
    specs = [5, 1, 4, 2, 3]
    assert Sweep().map(_square_plus, 10, specs) == [35, 11, 26, 14, 19]
    seen = []
    assert Sweep(jobs=2).map(_square_plus, 10, specs, progress=seen.append) == [35, 11, 26, 14, 19]
    assert sorted(seen) == sorted(str(s) for s in specs), "every job reported once"
    with pytest.raises(ConfigError, match="two is refused"):
        Sweep(jobs=2).map(_refuse, None, [1, 2, 3])


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_bad_jobs_are_refused_by_name(bad):
    with pytest.raises(ConfigError, match="--jobs"):
        Sweep(jobs=bad)
    with pytest.raises(ConfigError, match="--ray"):
        Sweep(ray_address="  ")
    assert default_jobs() >= 1


def test_compare_on_two_processes_is_the_sequential_report(trace):
    """Every (scenario, set) job runs on a worker with its own scenario and Prepared trace; the degraded view draws its
    failures from the seed, so any state shared between runs in a process would show here."""
    cl = default_cluster(trace, bytes_per_token=BPT, prefill=DEFAULT_PREFILL)
    kw = dict(scenarios=["steady", "degraded"], policies=["kvpolicy", "vllm-like", "sglang-like", "oracle"], seed=7)
    seq, raw_seq = compare(trace, cl, **kw)
    par, raw_par = compare(trace, cl, sweep=Sweep(jobs=2), **kw)
    assert _json(par) == _json(seq)
    assert list(raw_par) == list(raw_seq)
    assert (raw_par[("degraded", "kvpolicy")].ttft_s == raw_seq[("degraded", "kvpolicy")].ttft_s).all()


def test_evict_bench_and_publish_bench_on_two_processes_are_the_sequential_reports(trace):
    pols = ["lru", "s3fifo", "adaptive"]
    caps = [64, 512]
    assert _json(evict_compare(trace, pols, caps, judge_from_request=100, sweep=Sweep(jobs=2))) == \
        _json(evict_compare(trace, pols, caps, judge_from_request=100))
    pubs = ["all", "threshold-2", "dueling"]
    seq = publish_bench(trace, pubs, bytes_per_token=BPT)
    assert _json(publish_bench(trace, pubs, bytes_per_token=BPT, sweep=Sweep(jobs=2))) == _json(seq)
    assert [r["policy"] for r in seq["runs"]] == [*pubs, "oracle"]


def test_compare_on_ray_is_the_sequential_report(trace):
    if os.environ.get("KVPOLICY_REQUIRE_RAY"):
        import ray  # noqa: F401 - CI installs it: a missing Ray fails there
    else:
        pytest.importorskip("ray")
    cl = default_cluster(trace, bytes_per_token=BPT, prefill=DEFAULT_PREFILL)
    kw = dict(scenarios=["steady", "spike"], policies=["kvpolicy", "sglang-like"], seed=3)
    seq, _ = compare(trace, cl, **kw)
    on_ray, _ = compare(trace, cl, sweep=Sweep(jobs=2, ray_address="local"), **kw)
    assert _json(on_ray) == _json(seq)


def test_cli_jobs_give_the_same_report_and_bad_flags_are_named(tmp_path, capsys, trace):
    path = tmp_path / "t.jsonl"
    trace.to_mooncake_jsonl(path)
    outs = []
    for jobs in ("1", "2"):
        out = tmp_path / f"out{jobs}.json"
        assert main(["compare", str(path), "--format", "mooncake", "--block-size", "256", "--scenario", "steady", "--policies",
                     "kvpolicy,sglang-like", "--bytes-per-token", str(BPT), "--replicas", "4", "--json", str(out), "--no-progress",
                     "--jobs", jobs]) == 0
        outs.append(json.loads(out.read_text()))
    assert _json(outs[0]) == _json(outs[1])
    capsys.readouterr()
    assert main(["compare", str(path), "--format", "mooncake", "--jobs", "0", "--no-progress"]) == 2
    assert "--jobs" in capsys.readouterr().err
    assert main(["evict-bench", str(path), "--format", "mooncake", "--jobs", "many", "--no-progress"]) == 2
    assert "--jobs" in capsys.readouterr().err


def test_errors_cross_process_boundaries_whole():
    import pickle

    from kvpolicy.errors import TraceFormatError

    e = pickle.loads(pickle.dumps(ConfigError("--jobs", "must be positive")))
    assert isinstance(e, ConfigError) and e.field == "--jobs" and str(e) == "--jobs: must be positive"
    t = pickle.loads(pickle.dumps(TraceFormatError("t.jsonl", 3, "bad")))
    assert isinstance(t, TraceFormatError) and (t.path, t.line, t.problem) == ("t.jsonl", 3, "bad")


@pytest.mark.parametrize("address,says", [("bogus", "HOST:PORT"), ("127.0.0.1:1", "nothing answers"), ("ray://h:99999", "HOST:PORT")])
def test_a_ray_address_that_cannot_work_is_one_line_naming_ray(address, says, capsys):
    if not os.environ.get("KVPOLICY_REQUIRE_RAY"):
        pytest.importorskip("ray")
    assert main(["compare", "--preset", "chat", "--scenario", "steady", "--policies", "sglang-like", "--ray", address, "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--ray" in err[0] and says in err[0]
