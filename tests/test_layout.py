"""The house's shape (issue #61): no module too long to read, no class whose lines can touch any state, no circle of
imports among the tools. Each check names what broke it."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src" / "kvpolicy"
MAX_LINES = 800
MAX_OWN_ATTRIBUTES = 30


def own_attributes(cls: ast.ClassDef) -> set[str]:
    """The distinct ``self.x`` a class's own methods read or write, less its methods and properties: the state a line
    of the class may touch (inherited state included — a subclass that touches its base's state touches it)."""
    callables = {f.name for f in cls.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
    callables |= {t.id for a in cls.body if isinstance(a, ast.Assign) and isinstance(a.value, ast.Call)
                  and isinstance(a.value.func, ast.Name) and a.value.func.id == "property" for t in a.targets if isinstance(t, ast.Name)}
    out: set[str] = set()
    for f in cls.body:
        if not isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) or not f.args.args:
            continue
        me = f.args.args[0].arg
        for n in ast.walk(f):
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == me and n.attr not in callables:
                out.add(n.attr)
    return out


def classes_over(limit: int, source: str) -> list[tuple[str, int]]:
    return [(c.name, len(a)) for c in ast.walk(ast.parse(source)) if isinstance(c, ast.ClassDef)
            for a in [own_attributes(c)] if len(a) > limit]


def test_no_module_in_src_is_over_800_lines():
    long = {str(p.relative_to(ROOT)): n for p in SRC.rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"over {MAX_LINES} lines: {long}"


def test_no_class_reads_or_writes_more_than_30_attributes_of_its_own():
    over = {f"{p.relative_to(ROOT)}:{name}": n for p in SRC.rglob("*.py") for name, n in classes_over(MAX_OWN_ATTRIBUTES, p.read_text())}
    assert not over, f"classes touching more than {MAX_OWN_ATTRIBUTES} attributes of their own: {over}"


def test_the_attribute_count_sees_reads_writes_and_inherited_state_but_not_methods():
    source = '''
class A(Base):
    def __init__(self):
        self.x = 1
    def f(self):
        return self.y + self.inherited + self.g()
    def g(self):
        return self.x
    p = property(lambda self: self.x)
'''
    (cls,) = [c for c in ast.walk(ast.parse(source)) if isinstance(c, ast.ClassDef)]
    assert own_attributes(cls) == {"x", "y", "inherited"}
    assert classes_over(2, source) == [("A", 3)] and classes_over(3, source) == []


def test_the_tools_import_no_circle():
    tools = {p.stem: p for p in (ROOT / "tools").glob("*.py")}
    imports: dict[str, set[str]] = {}
    for name, path in tools.items():
        names: set[str] = set()
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, ast.Import):
                names |= {a.name.split(".")[0] for a in n.names}
            elif isinstance(n, ast.ImportFrom) and n.module and not n.level:
                names.add(n.module.split(".")[0])
        imports[name] = names & set(tools)

    def reaches(a: str, b: str, seen: set[str]) -> bool:
        return any(x == b or (x not in seen and reaches(x, b, seen | {x})) for x in imports[a])

    circles = sorted(a for a in imports if reaches(a, a, {a}))
    assert not circles, f"tools in an import circle: {circles}"
