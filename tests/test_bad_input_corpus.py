"""Every subcommand against a corpus of bad input: exit 2, one line on stderr naming what was wrong, no traceback.

The cases are generated from the CLI's own parser, so a new subcommand or option
joins the corpus by itself: a numeric option gets non-finite, negative and
overflowing values; a file option gets a directory, a binary file, a missing
file and (for traces) numbers no reader should accept; an output option gets a
path it cannot write. Each subcommand needs one entry in ``BASE`` (valid
arguments to start from) and each string option one entry in ``KIND`` — a test
fails until they are there, so nothing new is left out. The error line must name
the option or the file: the refusal is for the bad value, not for anything else.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys

import pytest

from kvpolicy.cli import build_parser, main

HUGE_INT = "99999999999999999999999"  # > 2^63: Numba and numpy int64 overflow on it


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    p = build_parser()
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


SUBCOMMANDS = _subcommands()

# what each string-valued option (or positional) is: a file read, a file or folder written, or a name/choice
KIND = {
    "trace": "trace", "source": "trace", "tokens": "tokens", "profile": "profile", "namespace": "json-in", "secret_file": "text-in",
    "config": "config", "json": "out", "out": "out", "plot": "out-dir",
    "format": "name", "preset": "name", "routing": "name", "router": "name", "scenario": "name", "scheme": "name", "kv_dtype": "name",
    "dtype": "name", "host": "name", "model": "name", "model_name": "name", "openai_url": "name", "api_key_env": "name", "cache_salt": "name",
    "lora_name": "name", "lora_path": "name", "secret_hex": "name", "request": "name", "policies": "name", "strategies": "name", "controller_scope": "name",
    "endpoint": "name", "replay_endpoint": "name", "topic": "name", "directory": "name", "tenant": "name", "holder": "name", "verify": "name",
    "verify_hash_seed": "name", "on_gap": "name", "gguf": "gguf", "cache_type_k": "name", "cache_type_v": "name", "prompt_format": "name", "ray": "name",
}


#: subcommands whose trace is the token-id format ({"tokens": [...]}) rather than Mooncake/Bailian
TOKEN_TRACE_COMMANDS = {"diagnose"}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    trace = d / "trace.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": i * 100, "input_length": 64, "output_length": 8, "hash_ids": [0, 1, 2, 3 + i % 3]}) + "\n"
                             for i in range(12)))
    token_trace = d / "token-trace.jsonl"
    token_trace.write_text("".join(json.dumps({"timestamp": i, "tokens": list(range(40 + i))}) + "\n" for i in range(6)))
    tokens = d / "tokens.json"
    tokens.write_text(json.dumps(list(range(64))))
    profile = d / "profile.csv"
    profile.write_text("prefix_tokens,kv_bytes,cold_prefill_ms,local_hit_ttft_ms\n1024,524288,10,2\n2048,1048576,21,2.5\n4096,2097152,45,3\n")
    binary = d / "binary.bin"
    binary.write_bytes(b"\xff\xfe\x00\x9c" * 256)
    a_file = d / "a-file"
    a_file.write_text("x")
    nested = d / "nested.json"  # 200,000 lists deep: json.loads raised RecursionError (a traceback) on it
    nested.write_text("[" * 200_000 + "]" * 200_000)
    bad_traces = {  # a first line with chat_id: these files are Bailian (detected, or --format bailian)
        # with chat_id, so each is refused for the field it names — not for a missing chat_id
        "hash id >= 2^63": {"chat_id": 1, "timestamp": 0, "input_length": 32, "output_length": 1, "hash_ids": [2**63, 1]},
        "length 1e30": {"chat_id": 1, "timestamp": 0, "input_length": 10**30, "output_length": 1, "hash_ids": [1]},
        "negative length": {"chat_id": 1, "timestamp": 0, "input_length": -5, "output_length": 1, "hash_ids": [1]},
        "NaN timestamp": {"chat_id": 1, "timestamp": float("nan"), "input_length": 16, "output_length": 1, "hash_ids": [1]},
        "chat_id as a dict": {"chat_id": {"a": 1}, "parent_chat_id": -1, "timestamp": 0, "input_length": 16, "output_length": 1,
                              "hash_ids": [1]},
        "parent_chat_id as a list": {"chat_id": 1, "parent_chat_id": [1], "timestamp": 0, "input_length": 16, "output_length": 1,
                                     "hash_ids": [1]},
    }
    out = {}
    for i, (name, row) in enumerate(bad_traces.items()):
        f = d / f"bad{i}.jsonl"
        good = {"chat_id": 0, "parent_chat_id": -1, "timestamp": 0, "input_length": 16, "output_length": 1, "hash_ids": [7]}
        f.write_text(json.dumps(good) + "\n" + json.dumps(row) + "\n")
        out[name] = f
    bad_mooncake = {  # the same rows without chat_id are Mooncake: block ids go into an int64 column as they are (Bailian's are remapped)
        "hash id >= 2^63 (mooncake)": {"timestamp": 0, "input_length": 32, "output_length": 1, "hash_ids": [2**63, 1]},
        "output length 1e23 (mooncake)": {"timestamp": 0, "input_length": 16, "output_length": 10**23, "hash_ids": [1]},
        "timestamp past float range (mooncake)": {"timestamp": 10**400, "input_length": 16, "output_length": 1, "hash_ids": [1]},
        # not chained: an id that follows itself is a cycle, on which the replay kernels' leaf-first eviction never ended
        "an id after itself (mooncake)": {"timestamp": 1, "input_length": 32, "output_length": 1, "hash_ids": [9, 9]},
    }
    for i, (name, row) in enumerate(bad_mooncake.items()):
        f = d / f"badmc{i}.jsonl"
        f.write_text(json.dumps({"timestamp": 0, "input_length": 16, "output_length": 1, "hash_ids": [7]}) + "\n" + json.dumps(row) + "\n")
        out[name] = f
    deep = "[" * 200_000 + "]" * 200_000
    for name, first, row in (("nested 200,000 deep (mooncake)", '{"timestamp": 0, "input_length": 16, "output_length": 1, "hash_ids": [7]}',
                              '{"timestamp": 1, "input_length": 16, "output_length": 1, "hash_ids": ' + deep + "}"),
                             ("nested 200,000 deep (tokens)", '{"timestamp": 0, "tokens": [5, 6]}', '{"timestamp": 1, "tokens": ' + deep + "}")):
        f = d / f"nested-{len(out)}.jsonl"
        f.write_text(first + "\n" + row + "\n")
        out[name] = f
    bad_token_traces = {
        "token id >= 2^63": {"timestamp": 1, "tokens": [2**63, 1]},
        "token id 1e30": {"timestamp": 1, "tokens": [1e30]},
        "tokens not a list": {"timestamp": 1, "tokens": "abc"},
        "NaN timestamp (tokens)": {"timestamp": float("nan"), "tokens": [1, 2]},
    }
    for i, (name, row) in enumerate(bad_token_traces.items()):
        f = d / f"badtok{i}.jsonl"
        f.write_text(json.dumps({"timestamp": 0, "tokens": [5, 6]}) + "\n" + json.dumps(row) + "\n")
        out[name] = f
    return {"dir": d, "trace": trace, "token_trace": token_trace, "tokens": tokens, "profile": profile, "binary": binary, "a_file": a_file,
            "nested": nested, "bad_traces": out}


def base(cmd: str, f: dict) -> list[str]:
    """Valid arguments for each subcommand: a bad value replaces exactly one of them."""
    t = str(f["trace"])
    return {
        "size": ["--config", "llama-3-8b"],
        "keys": [str(f["tokens"]), "--scheme", "fast", "--block-size", "16"],
        "analyze": [t, "--block-size", "16", "-q"],
        "breakeven": ["--bytes-per-token", "512", "--profile", str(f["profile"]), "--bandwidth-gbps", "10"],
        "evict-bench": [t, "--block-size", "16", "--capacities-blocks", "4", "--policies", "lru", "-q"],
        "sglang-bench": [t, "--block-size", "16", "--capacities-blocks", "4", "--strategies", "sglang-lru", "-q"],
        "publish-bench": [t, "--block-size", "16", "--policies", "all", "--replicas", "2", "-q"],
        "plan-warmup": [t, "--block-size", "16", "--bytes-per-token", "512", "--replicas", "2", "--window-s", "10", "--bandwidth-gbps", "10"],
        "compare": [t, "--block-size", "16", "--bytes-per-token", "512", "--scenario", "steady", "--replicas", "2", "-q"],
        "profile": ["--lengths", "16", "--concurrency", "1", "--repeats", "2", "-q"],
        "serve-reference": ["--port", "0"],
        "diagnose": [str(f["token_trace"]), "--block-size", "16"],
        "lookup": [str(f["tokens"]), "--directory", "memory", "--tenant", "acme", "--block-size", "16", "--scheme", "fast"],
        "ingest-events": ["--endpoint", "tcp://127.0.0.1:9", "--directory", "memory", "--tenant", "acme", "--holder", "pod-1", "--block-size", "16",
                          "--scheme", "fast", "--max-seconds", "0.1"],
    }[cmd]


def _option(action: argparse.Action) -> str | None:
    return action.option_strings[0] if action.option_strings else None


def _set(argv: list[str], action: argparse.Action, value: str) -> list[str]:
    """argv with ``action``'s value replaced by ``value`` (or added)."""
    opt = _option(action)
    if opt is None:  # the positional is the first argument of every base that has one
        return [value] + argv[1:]
    out = list(argv)
    for name in action.option_strings:
        if name in out:
            out[out.index(name) + 1] = value
            return out
    return out + [opt, value]


def _numeric_values(action: argparse.Action) -> list[str]:
    t = action.type
    name = getattr(t, "__name__", "")
    if name.startswith("_int_list"):
        return ["1,-5", f"1,{HUGE_INT}", f"1,{2**40}", "nan", ""]
    if t is int or "int" in name:
        # 2^40: every count flag has a maximum of its own below it (issue #47) — 2^40 replicas, threads or layers
        # started a run that allocated or looped on it
        return ["-1", HUGE_INT, str(2**40), "nan", "1.5"]
    return ["nan", "inf", "-inf", "-1", "1e400"]


def cases():
    out = []
    for cmd, sp in SUBCOMMANDS.items():
        for a in sp._actions:
            if isinstance(a, (argparse._HelpAction, argparse._StoreTrueAction)) or a.dest == "help":
                continue
            label = _option(a) or a.dest
            if a.type is not None and getattr(a.type, "__name__", "") != "_policy_list":
                for v in _numeric_values(a):
                    out.append(pytest.param(cmd, a.dest, "number", v, id=f"{cmd} {label}={v}"))
                continue
            kind = KIND.get(a.dest)
            out.append(pytest.param(cmd, a.dest, "kind", kind, id=f"{cmd} {label} kind"))
            if kind in ("trace", "tokens", "profile", "json-in", "text-in", "config", "gguf"):
                for bad in ("directory", "binary", "missing"):
                    out.append(pytest.param(cmd, a.dest, "file", bad, id=f"{cmd} {label}={bad}"))
            if kind in ("tokens", "json-in", "config"):
                out.append(pytest.param(cmd, a.dest, "file", "nested", id=f"{cmd} {label}=nested"))
            if kind == "trace":
                bads = ("hash id >= 2^63", "length 1e30", "negative length", "NaN timestamp", "chat_id as a dict", "parent_chat_id as a list",
                        "hash id >= 2^63 (mooncake)", "output length 1e23 (mooncake)", "timestamp past float range (mooncake)",
                        "an id after itself (mooncake)", "nested 200,000 deep (mooncake)")
                if cmd in TOKEN_TRACE_COMMANDS:
                    bads = ("token id >= 2^63", "token id 1e30", "tokens not a list", "NaN timestamp (tokens)", "nested 200,000 deep (tokens)")
                for bad in bads:
                    out.append(pytest.param(cmd, a.dest, "trace", bad, id=f"{cmd} {label}: {bad}"))
            if kind in ("out", "out-dir"):
                out.append(pytest.param(cmd, a.dest, "output", "under-a-file", id=f"{cmd} {label}=under-a-file"))
    return out


def _action(cmd: str, dest: str) -> argparse.Action:
    return next(a for a in SUBCOMMANDS[cmd]._actions if a.dest == dest)


def _alarm(signum, frame):
    raise TimeoutError("the command ran on instead of refusing its input")


def _run(cmd: str, argv: list[str], capsys) -> tuple[int, str]:
    """main() in-process; a command that accepts the bad value and runs on (a server serving forever) fails at 60 s."""
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(60)
    try:
        code = main([cmd, *argv])
    except SystemExit as e:  # argparse
        code = e.code if isinstance(e.code, int) else 1
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    captured = capsys.readouterr()
    return code, captured.err


def _check(code: int, err: str, must_name: list[str]) -> None:
    lines = [x for x in err.strip().splitlines() if x.strip()]
    assert code == 2, f"exit {code}, stderr: {err[-600:]}"
    assert "Traceback" not in err, err[-2000:]
    assert len(lines) == 1, f"{len(lines)} lines on stderr:\n{err[-1500:]}"
    assert any(m in lines[0] for m in must_name), f"the error does not name {must_name}: {lines[0]}"


@pytest.mark.parametrize("cmd,dest,what,value", cases())
def test_bad_input_is_one_line_naming_it_exit_2(cmd, dest, what, value, files, capsys, tmp_path):
    a = _action(cmd, dest)
    argv = base(cmd, files)
    label = _option(a) or dest
    if what == "kind":
        assert value is not None, f"{cmd} {label}: say what it is in KIND (a file read, an output, a name) so the corpus covers it"
        return
    if what == "number":
        if value == "" and _option(a) is None:
            return
        _check(*_run(cmd, _set(argv, a, value) if value != "" else _set(argv, a, ","), capsys), [label, a.dest])
        return
    if what == "file":
        path = {"directory": files["dir"], "binary": files["binary"], "missing": files["dir"] / "no-such-file", "nested": files["nested"]}[value]
        names = [str(path), path.name, label]
        if KIND.get(dest) == "gguf" and cmd == "size":
            argv = []  # --gguf stands instead of the base's --config
        _check(*_run(cmd, _set(argv, a, str(path)), capsys), names)
        return
    if what == "trace":
        path = files["bad_traces"][value]
        fmt = ["--format", "bailian"] if "chat_id" in value else []
        extra = fmt if "--format" in [s for x in SUBCOMMANDS[cmd]._actions for s in x.option_strings] else []
        if "chat_id" in value and not extra:
            return  # this subcommand reads one format only
        _check(*_run(cmd, _set(argv, a, str(path)) + extra, capsys), [f"{path}:2", f"{path.name}:2"])
        return
    if what == "output":
        target = files["a_file"] / ("x.json" if KIND[dest] == "out" else "plots")
        argv2 = list(argv)
        if isinstance(a, argparse._StoreTrueAction):
            return
        _check(*_run(cmd, _set(argv2, a, str(target)), capsys), [str(target), str(files["a_file"]), label])
        return
    raise AssertionError(what)


def test_every_subcommand_has_a_base_and_every_option_a_kind(files):
    for cmd, sp in SUBCOMMANDS.items():
        base(cmd, files)  # a KeyError here: add the new subcommand to BASE
        for a in sp._actions:
            if a.type is None and not isinstance(a, (argparse._HelpAction, argparse._StoreTrueAction)) and a.nargs != 0:
                assert a.dest in KIND, f"{cmd} {_option(a) or a.dest}: classify it in KIND"


OUTPUT_RUNS = [
    ["analyze", "{trace}", "--block-size", "16", "-q", "--json", "{out}"],
    ["evict-bench", "{trace}", "--block-size", "16", "--capacities-blocks", "4", "--policies", "lru", "-q", "--json", "{out}"],
    ["sglang-bench", "{trace}", "--block-size", "16", "--capacities-blocks", "4", "--strategies", "sglang-lru", "-q", "--json", "{out}"],
    ["diagnose", "{trace}", "--block-size", "16", "--json", "{out}"],
]


@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_FSIZE")
@pytest.mark.parametrize("argv", OUTPUT_RUNS, ids=[a[0] for a in OUTPUT_RUNS])
def test_a_full_disk_is_one_line_and_leaves_the_previous_report_intact(argv, files, tmp_path):
    out = tmp_path / "report.json"
    out.write_text('{"previous": true}')
    args = [x.format(trace=files["trace"], out=out) for x in argv]
    code = ("import resource, signal, sys; resource.setrlimit(resource.RLIMIT_FSIZE, (64, 64)); "
            "signal.signal(signal.SIGXFSZ, signal.SIG_IGN); from kvpolicy.cli import main; sys.exit(main(sys.argv[1:]))")
    r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300)
    lines = [x for x in r.stderr.strip().splitlines() if x.strip()]
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(lines) == 1, r.stderr[-1500:]
    assert json.loads(out.read_text()) == {"previous": True}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"], "no temporary file left behind"


def test_an_unwritable_output_is_refused_before_any_work(files, monkeypatch, capsys):
    """A long profile or comparison must not run first and fail at the end on its output path."""
    import kvpolicy.cli as cli

    ran = []
    for name in ("_cmd_profile", "_cmd_compare"):
        monkeypatch.setattr(cli, name, lambda args, name=name: ran.append(name) or 0)
    target = files["a_file"] / "x.csv"
    code, err = _run("profile", base("profile", files) + ["--out", str(target)], capsys)
    assert code == 2 and "--out" in err and ran == []
    code, err = _run("compare", base("compare", files) + ["--plot", str(files["a_file"])], capsys)
    assert code == 2 and "--plot" in err and ran == []
    assert _run("compare", base("compare", files), capsys)[0] == 0 and ran == ["_cmd_compare"], "the stand-in runs when the output is fine"
