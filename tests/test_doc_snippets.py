"""Every Python block in the README and docs runs as written, and what its comments claim it prints is what it prints.

Blocks run from the repository root, as a user in a fresh clone would (the README's
example data is there). A block that cannot run alone (it needs the user's own file, engine or object) is
marked ``<!-- fragment: why -->`` on the line before it; it must still parse.

A comment is a claim when it starts with what a value looks like (a digit, a
sign, a quote, a bracket): ``print(x)  # 10 30`` claims the printed line starts
with ``10 30``; a bare expression ``f(x)  # 0.6218`` claims its value, a float
to the comment's decimals, anything else by ``repr``. Other comments are prose.
"""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FRAGMENT = re.compile(r"<!--\s*fragment:\s*(.+?)\s*-->")


def _blocks():
    out = []
    for doc in DOCS:
        text = doc.read_text()
        for m in re.finditer(r"```python\n(.*?)```", text, re.S):
            line = text[:m.start()].count("\n") + 1
            previous = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()  # the line just before the block
            frag = FRAGMENT.fullmatch(previous)
            out.append(pytest.param(m.group(1), frag.group(1) if frag else None, id=f"{doc.relative_to(ROOT)}:{line}"))
    return out


BLOCKS = _blocks()

# Runs in a fresh interpreter: each top-level statement in turn; a claimed comment is checked against
# the statement's printed output or value.
RUNNER = r'''
import ast, contextlib, io, re, sys
src = open(sys.argv[1]).read()
lines = src.splitlines()
tree = ast.parse(src)
env = {"__name__": "__doc_snippet__"}
CLAIM = re.compile(r"#\s*([-+\d'\"(\[{].*)$")


def comment_of(node):
    """The comment after the statement on its last line, when it is a claim."""
    m = CLAIM.search(lines[node.end_lineno - 1][node.end_col_offset:])
    return m.group(1).strip() if m else None


def check(node, claim, shown, value, is_print):
    if is_print:
        ok = claim.startswith(shown) and shown != ""
    elif isinstance(value, float):
        m = re.match(r"-?\d+(?:\.(\d+))?", claim)
        ok = bool(m) and round(value, len(m.group(1) or "")) == float(m.group(0))
    else:
        ok = claim.startswith(repr(value))
    if not ok:
        print(f"CLAIM FAILED: line {node.lineno}: the comment says {claim!r}, it gave {shown if is_print else repr(value)!r}", file=sys.stderr)
        sys.exit(3)


for node in tree.body:
    claim = comment_of(node) if isinstance(node, ast.Expr) else None
    is_print = isinstance(node, ast.Expr) and isinstance(node.value, ast.Call) and getattr(node.value.func, "id", None) == "print"
    if claim is None:
        exec(compile(ast.Module([node], []), sys.argv[1], "exec"), env)
    elif is_print:
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            exec(compile(ast.Module([node], []), sys.argv[1], "exec"), env)
        sys.stdout.write(buf.getvalue())
        check(node, claim, buf.getvalue().strip(), None, True)
    else:
        value = eval(compile(ast.Expression(node.value), sys.argv[1], "eval"), env)
        if value is not None:
            check(node, claim, None, value, False)
'''


def test_the_docs_have_python_blocks_and_most_run():
    assert len(BLOCKS) >= 20
    assert sum(1 for p in BLOCKS if p.values[1] is None) >= 12


@pytest.mark.parametrize("code,fragment", BLOCKS)
def test_python_block_runs_and_prints_what_it_claims(code, fragment, tmp_path):
    ast.parse(code)  # a fragment must at least be Python
    if fragment is not None:
        return
    path = tmp_path / "snippet.py"
    path.write_text(code)
    runner = tmp_path / "runner.py"
    runner.write_text(RUNNER)
    out = subprocess.run([sys.executable, str(runner), str(path)], capture_output=True, text=True, timeout=300, cwd=str(ROOT))
    assert out.returncode == 0, out.stderr[-3000:]


def test_the_security_page_claims_only_what_a_named_test_shows():
    """docs/security.md (issue #47): every row of a threat table names the test that shows it, and every test the page
    names exists — written whole, or cut with '…' after a prefix that one test function has."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    page = (root / "docs" / "security.md").read_text()
    defined = set()
    for f in (root / "tests").glob("test_*.py"):
        defined.update(re.findall(r"^def (test_\w+)", f.read_text(), re.M))
    named = re.findall(r"`(?:tests/\w+\.py::)?(test_[\w…]+)`", page)
    assert len(named) >= 10
    for name in named:
        if name.endswith("…"):
            assert any(d.startswith(name[:-1]) for d in defined), f"docs/security.md names {name}: no test starts so"
        else:
            assert name in defined, f"docs/security.md names {name}, which no test defines"
    table = page[page.index("| threat | defence | tested by |"):].split("\n\n")[0].splitlines()[2:]
    assert table, "the threat table"
    for r in table:
        assert re.search(r"`test_[\w…]+`", r.rsplit("|", 2)[-2]), f"a threat row names no test: {r[:120]}"
