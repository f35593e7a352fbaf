"""Every `kvpolicy ...` line in the README and docs parses with today's CLI, and every repo path it names exists.

A renamed flag or a moved data file breaks a documented command silently; this
catches it without running the (minutes-long) commands themselves. The README's
main command (`kvpolicy compare` on built-in data) is run for real by CI's users
and by tests/test_cli.py on small inputs.
"""

import re
import shlex
from pathlib import Path

import pytest

from kvpolicy.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _commands():
    out = []
    for doc in DOCS:
        text = doc.read_text()
        for block in re.findall(r"```bash\n(.*?)```", text, re.S):
            joined = block.replace("\\\n", " ")
            for line in joined.splitlines():
                line = line.split(" #")[0].strip()
                if line.startswith("#") or "kvpolicy " not in line:
                    continue
                for part in re.split(r"&&|;", line):
                    part = part.strip().rstrip("&").strip()
                    if part.startswith("kvpolicy "):
                        out.append((doc.name, part))
    return out


COMMANDS = _commands()


def test_the_docs_have_commands_to_check():
    assert len(COMMANDS) >= 20


@pytest.mark.parametrize("doc, line", COMMANDS, ids=[f"{d}:{i}" for i, (d, _) in enumerate(COMMANDS)])
def test_documented_command_parses_and_its_repo_paths_exist(doc, line):
    argv = shlex.split(line)[1:]
    if any("|" in a and not a.startswith("-") for a in argv):  # a syntax summary like --scheme keyed|fast
        pytest.skip("a usage summary, not a command")
    if any(a in ("[", "]") or a.startswith("[") for a in argv):
        pytest.skip("a usage summary with optional parts")
    try:
        build_parser().parse_args(argv)
    except SystemExit as exc:
        pytest.fail(f"{doc}: `{line}` does not parse (exit {exc.code})")
    for a in argv:
        for piece in a.split(","):  # --policies PATH.py:NAME,lru: each path, without the class it names
            path = piece.partition(":")[0] if ".py:" in piece else piece
            if path.startswith(("data/", "examples/", "benchmarks/")):
                assert (ROOT / path).exists(), f"{doc}: `{line}` names {path}, which is not in the repository"


def test_the_example_inputs_are_what_their_script_writes_and_diagnose_finds_the_time_line(tmp_path, capsys):
    """examples/data/ is reproducible from make_example_data.py, and the README's diagnose command finds what it plants."""
    import importlib.util
    import json
    import shutil

    from kvpolicy.cli import main

    src = ROOT / "examples" / "data"
    copy = tmp_path / "data"
    shutil.copytree(src, copy)
    spec = importlib.util.spec_from_file_location("make_example_data", copy / "make_example_data.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for name in ("tokens.json", "ns.json", "requests.jsonl"):
        (copy / name).unlink()
    mod.main()
    for name in ("tokens.json", "ns.json", "requests.jsonl"):
        assert (copy / name).read_bytes() == (src / name).read_bytes(), f"examples/data/{name} differs from what the script writes"
    out = tmp_path / "diag.json"
    assert main(["diagnose", str(src / "requests.jsonl"), "--json", str(out)]) == 0
    capsys.readouterr()
    report = json.loads(out.read_text())
    assert [(p["kind"], p["position_tokens"]) for p in report["patterns"]] == [("varying-span", 48)]
    assert report["flagged_requests"] == 13
