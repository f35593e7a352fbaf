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


def _exit_on_two(shared, spec):
    if spec == 2:
        os._exit(0)  # a job (a load rule of the user's, say) that ends its process without a word
    return spec


def _sigkill_on_two(shared, spec):
    if spec == 2:
        import signal

        os.kill(os.getpid(), signal.SIGKILL)  # what the OOM killer does
    return spec


def test_a_worker_that_dies_is_one_clear_error_never_a_hang_or_a_raw_traceback(monkeypatch):
    """Round three: a load rule calling os._exit hung a --jobs 2 sweep, and a worker killed by SIGKILL gave a raw
    BrokenProcessPool traceback. Either is now a SweepWorkerDied naming --jobs, how the worker ended and the job, and
    the other workers are ended at once."""
    import time

    from kvpolicy import sweep as sweep_mod
    from kvpolicy.errors import KVPolicyError

    monkeypatch.setattr(sweep_mod, "default_jobs", lambda: 4)
    for fn, how in ((_exit_on_two, "exit code 0"), (_sigkill_on_two, "killed by SIGKILL")):
        t0 = time.perf_counter()
        with pytest.raises(sweep_mod.SweepWorkerDied) as e:
            Sweep(jobs=2).map(fn, None, [1, 2, 3, 4])
        assert isinstance(e.value, KVPolicyError) and str(e.value).startswith("--jobs: ") and how in str(e.value)
        assert "--jobs 1" in str(e.value)
        assert time.perf_counter() - t0 < 60


def test_a_load_rule_that_exits_its_worker_is_one_line_from_compare(tmp_path, capsys, monkeypatch):
    from kvpolicy import sweep as sweep_mod

    monkeypatch.setattr(sweep_mod, "default_jobs", lambda: 4)
    rule = tmp_path / "dying.py"
    rule.write_text("import os\nimport attrs\nfrom kvpolicy.sim.policysets import policy_set\n\n"
                    "class Die:\n    def blocks_to_load(self, match, ctx):\n        os._exit(0)\n\n"
                    f"MINE = attrs.evolve(policy_set('vllm-like'), name='die', load={str(rule) + ':Die'!r})\n")
    assert main(["compare", "--preset", "chat", "--scenario", "steady", "--policies", f"vllm-like,{rule}:MINE", "--jobs", "2",
                 "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--jobs" in err[0] and "died" in err[0], err


def test_jobs_are_capped_by_the_cores_and_the_memory_there_are(monkeypatch):
    """--jobs took up to 1,024 and started a worker per job whatever the machine: an evict-bench grid reached 51
    workers and 8.1 GB on 2 cores. Workers are capped by the cores, by the memory available (512 MiB a worker) and by
    the jobs there are; `where` says so."""
    from kvpolicy import sweep as sweep_mod

    monkeypatch.setattr(sweep_mod, "default_jobs", lambda: 2)
    monkeypatch.setattr(sweep_mod, "memory_available_bytes", lambda: 64 * 2**30)
    assert Sweep(jobs=1024).workers(51) == 2 and Sweep(jobs=1024).workers(1) == 1
    assert "2 local processes" in Sweep(jobs=51).where and "capped" in Sweep(jobs=51).where
    monkeypatch.setattr(sweep_mod, "default_jobs", lambda: 64)
    monkeypatch.setattr(sweep_mod, "memory_available_bytes", lambda: 3 * sweep_mod.WORKER_MEMORY_BYTES + 1)
    assert Sweep(jobs=51).workers(100) == 3
    monkeypatch.setattr(sweep_mod, "memory_available_bytes", lambda: 0)
    assert Sweep(jobs=51).workers(100) == 1 and Sweep(jobs=51).where == "this process (--jobs 51 capped by this machine's cores and memory)"
    monkeypatch.setattr(sweep_mod, "memory_available_bytes", lambda: None)
    assert Sweep(jobs=8).workers(100) == 8 and Sweep(jobs=8).where == "8 local processes"


def test_a_port_that_accepts_tcp_but_is_not_ray_is_refused_in_seconds(capsys):
    """--ray at a port that accepted TCP but was not Ray passed the reachability check and held ray.init 550 s and
    more. The check now asks for the HTTP/2 answer Ray's gRPC servers give: a silent port and one that speaks
    HTTP/1.1 are each one line naming --ray."""
    import socket
    import threading
    import time

    from kvpolicy.sweep import _check_reachable

    for reply in (None, b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n"):
        srv = socket.socket()
        srv.bind(("127.0.0.1", 0))
        srv.listen(8)
        port = srv.getsockname()[1]
        held = []

        def serve():
            while True:
                try:
                    c, _ = srv.accept()
                except OSError:
                    return
                held.append(c)
                if reply is not None:
                    c.sendall(reply)

        threading.Thread(target=serve, daemon=True).start()
        try:
            t0 = time.perf_counter()
            with pytest.raises(ConfigError, match="not a Ray cluster") as e:
                _check_reachable(f"127.0.0.1:{port}", timeout_s=1.0)
            assert e.value.field == "--ray" and time.perf_counter() - t0 < 3
            if reply is not None:
                assert main(["compare", "--preset", "chat", "--scenario", "steady", "--policies", "sglang-like", "--ray",
                             f"ray://127.0.0.1:{port}", "--no-progress"]) == 2
                err = capsys.readouterr().err.strip().splitlines()
                assert len(err) == 1 and "--ray" in err[0] and "not a Ray cluster" in err[0]
        finally:
            srv.close()
            for c in held:
                c.close()
