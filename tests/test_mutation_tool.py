"""tools/mutation.py's fault kinds (issue #60): each new operator makes the change it names, in the tree that is
compiled and installed — a swap that changed a copy of a body (the docstring sliced off) changed nothing."""

import ast
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import mutation  # noqa: E402

PATH = "kvpolicy/write_admission.py"


@pytest.fixture(scope="module")
def mutants():
    return mutation.mutants_of("write-admission", PATH)


def _gate_source(tree):
    return ast.unparse(next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "gate"))


def test_every_new_kind_is_generated(mutants):
    kinds = {m.kind for m in mutants}
    assert {"swap", "name", "dropkw", "droparg", "default"} <= kinds, kinds


def test_a_swap_moves_the_statement_in_the_tree_that_is_compiled(mutants):
    m = next(x for x in mutants if x.kind == "swap" and x.qualname == "gate" and x.before.startswith("if peek is None"))
    got = _gate_source(mutation._mutated_tree(m))
    assert got.index("victims = peek(n * block_bytes)") < got.index("if peek is None:")
    orig = _gate_source(ast.parse(mutation.source_of(PATH)))
    assert orig.index("if peek is None:") < orig.index("victims = peek(n * block_bytes)")


def test_a_swapped_name_and_a_dropped_argument_change_exactly_their_node(mutants):
    name = next(x for x in mutants if x.kind == "name" and x.qualname == "gate")
    assert name.before != name.after and name.after in ("n", "tier", "admission", "candidates", "block_bytes", "peek", "victims", "free")
    drop = next(x for x in mutants if x.kind == "dropkw" and x.qualname == "gate")
    assert "free_blocks" in drop.before and "free_blocks" not in drop.after


def test_a_wrong_default_goes_into_the_live_functions_defaults(mutants):
    from kvpolicy import write_admission

    m = next(x for x in mutants if x.kind == "default" and x.qualname == "WriteAdmission.__init__")
    fn = write_admission.WriteAdmission.__init__
    saved = (fn.__defaults__, fn.__kwdefaults__)
    try:
        mutation.install(m)
        assert (fn.__defaults__, fn.__kwdefaults__) != saved
    finally:
        fn.__defaults__, fn.__kwdefaults__ = saved


# --- subprocesses (issue #60): a line that runs only in a Python a test starts is covered, and its mutant is installed there

_SUBPROCESS_TEST = '''
import subprocess, sys

def test_gate_in_a_subprocess():
    code = "from kvpolicy.write_admission import gate; print(gate)"
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
'''


def test_a_line_run_only_in_a_subprocess_is_covered_under_the_test_that_started_it(tmp_path):
    import os

    test_file = tmp_path / "test_sub.py"
    test_file.write_text(_SUBPROCESS_TEST.replace("print(gate)", "print(gate(object(), None, [], 1))"))
    saved = dict(os.environ)
    try:
        lines, _ = mutation.covering_tests([PATH], [str(test_file)])
    finally:
        os.environ.clear()
        os.environ.update(saved)
    body = next(n for n in ast.parse(mutation.source_of(PATH)).body if isinstance(n, ast.FunctionDef) and n.name == "gate")
    covered = {ln for ln, ctx in lines[PATH].items() if body.lineno < ln <= body.end_lineno and any("test_sub.py" in c for c in ctx)}
    assert covered, "gate's body ran in the subprocess but no line of it was recorded"
    assert "KVPOLICY_MUTATION_COV" not in os.environ


def _code_hash_in_a_subprocess(env):
    import subprocess

    code = ("import hashlib; from kvpolicy.write_admission import gate; "
            "print(hashlib.sha1(gate.__code__.co_code + repr(gate.__code__.co_consts).encode()).hexdigest())")
    return subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True).stdout.strip()


def test_a_mutant_is_installed_in_a_subprocess_a_test_starts(mutants):
    import os

    m = next(x for x in mutants if x.qualname == "gate" and x.kind != "default")
    env = dict(os.environ)
    mutation._with_hook(env)
    plain = _code_hash_in_a_subprocess(env)
    env["KVPOLICY_MUTANT"] = f"{m.path}:{m.index}"
    assert _code_hash_in_a_subprocess(env) != plain, m.describe()
