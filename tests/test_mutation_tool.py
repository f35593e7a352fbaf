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
