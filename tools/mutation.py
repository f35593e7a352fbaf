"""Mutation testing of kvpolicy's decision modules: do the tests notice when a decision changes?

    python tools/mutation.py                       # every module in MODULES, every mutant (long: see docs/testing.md)
    python tools/mutation.py publish admission     # some modules
    python tools/mutation.py sim --sample 60 --seed 3 --jobs 2
    python tools/mutation.py publish --list        # the mutants, not run
    python tools/mutation.py --rotate --sample 40 --check   # CI: one module chosen by the commit, a sample of its mutants

How it works (no copy of the tree, no re-import per mutant):

1. **Mutants.** Each module's source is parsed; inside every function and method (never module- or class-level
   code, never a ``@njit`` kernel: numba compiles its own copy) small faults are generated one at a time:
   an arithmetic operator swapped (``+`` ↔ ``-``, ``*`` ↔ ``/``), a comparison moved across its boundary
   (``<`` ↔ ``<=``, ``==`` ↔ ``!=``, ``in`` ↔ ``not in``), ``and`` ↔ ``or``, a ``not`` dropped, a number nudged
   (n → n + 1, 0.0 → 1.0), ``True`` ↔ ``False``, ``min`` ↔ ``max``, ``break`` ↔ ``continue``, and a call statement
   or an augmented assignment deleted (``policy.on_access(key)`` → nothing: the fault "not told about reads").
   Strings, docstrings, ``raise`` arguments, ``assert`` statements and lines marked ``# pragma: no mutate`` are left alone.
2. **Tests that cover it.** One run of the module's test files under coverage, with one coverage context per test,
   tells which tests execute each line, in any thread, and in any Python a test starts (``python -m kvpolicy ...``,
   ``python -c ...``, a spawned sweep worker): ``tools/mutation_hook/sitecustomize.py``, first on ``PYTHONPATH``, records
   those under the test's name. A mutant runs against only the tests that executed its statement, fastest
   first, stopping at the first failure; a mutant on a line no test executes survives without a run (``uncovered``).
3. **Running one.** The parent imports everything once; each mutant runs in a forked child that compiles the
   mutated module, swaps the mutated code object into the live function (``func.__code__``: every reference to the
   function, in any module, sees the fault; a Python the tests start installs the same mutant at startup, through the
   same hook), and runs the selected tests in-process with Hypothesis derandomized.
   A child that overruns its time (twice the selected tests' own time, plus a margin) is killed and the mutant
   counts as killed (``timeout``), as every mutation tool counts it.

Score = killed / (mutants − equivalent). Equivalent mutants (a fault that cannot change behaviour) are listed in
``tools/mutation_equivalent.json`` by id, each with one line on why; they are reported, not hidden.
"""

from __future__ import annotations

import argparse
import ast
import copy
import hashlib
import importlib
import inspect
import io
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Iterator
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src"
EQUIVALENT_FILE = Path(__file__).with_name("mutation_equivalent.json")

#: the decision modules (issue #49), each with the tests that exercise it and its goal
MODULES: dict[str, dict[str, Any]] = {
    "admission": {"paths": ["kvpolicy/admission/controller.py", "kvpolicy/admission/model.py", "kvpolicy/admission/breaker.py",
                            "kvpolicy/admission/ramp.py", "kvpolicy/admission/histogram.py", "kvpolicy/admission/steps.py"],
                  "tests": ["tests/test_admission.py", "tests/test_sim.py", "tests/test_decisions.py", "tests/test_sim_decisions.py"]},
    "sim": {"paths": ["kvpolicy/sim/engine.py", "kvpolicy/sim/events.py", "kvpolicy/sim/world.py", "kvpolicy/sim/transfers.py",
                      "kvpolicy/sim/pool.py", "kvpolicy/sim/overlap.py", "kvpolicy/sim/replicas.py", "kvpolicy/sim/lifecycle.py",
                      "kvpolicy/sim/network.py", "kvpolicy/sim/planner.py", "kvpolicy/sim/tally.py"],
            "tests": ["tests/test_sim.py", "tests/test_network.py", "tests/test_decisions.py", "tests/test_sim_decisions.py",
                      "tests/test_sim_load_rules.py", "tests/test_sim_pinned.py"]},
    "publish": {"paths": ["kvpolicy/publish/rules.py", "kvpolicy/publish/value.py", "kvpolicy/publish/dueling.py",
                            "kvpolicy/publish/specs.py"],
                "tests": ["tests/test_publish.py", "tests/test_sim.py", "tests/test_decisions.py", "tests/test_sim_decisions.py"]},
    "ledger": {"paths": ["kvpolicy/ledger.py", "kvpolicy/prices.py"],
               "tests": ["tests/test_ledger.py", "tests/test_sim_load_rules.py", "tests/test_sim_pinned.py"]},
    "directory": {"paths": ["kvpolicy/directory/memory.py", "kvpolicy/directory/redis.py", "kvpolicy/directory/base.py"],
                  "tests": ["tests/test_directory.py", "tests/test_directory_cluster.py"]},
    "transport": {"paths": ["kvpolicy/reference/transport.py"], "tests": ["tests/test_transport_security.py", "tests/test_reference.py"]},
    "integrations": {"paths": ["kvpolicy/integrations/vllm_events.py", "kvpolicy/integrations/vllm_zmq.py",
                               "kvpolicy/integrations/vllm_kv_connector.py"],
                     "tests": ["tests/test_integrations.py", "tests/test_engine_events.py"]},
    "write-admission": {"paths": ["kvpolicy/write_admission.py"], "tests": ["tests/test_decisions.py"]},
    "learned-eviction": {"paths": ["kvpolicy/eviction/learned.py", "kvpolicy/eviction/hit_density.py"],
                         "tests": ["tests/test_learned_eviction.py", "tests/test_hit_density.py"]},
}
GOAL = 0.80

# ----------------------------------------------------------------------------------------------- mutants

_BINOP_SWAP = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult, ast.FloorDiv: ast.Mult,
               ast.Mod: ast.FloorDiv, ast.Pow: ast.Mult, ast.LShift: ast.RShift, ast.RShift: ast.LShift,
               ast.BitAnd: ast.BitOr, ast.BitOr: ast.BitAnd, ast.BitXor: ast.BitOr}
_CMP_SWAP = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq, ast.NotEq: ast.Eq,
             ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn, ast.NotIn: ast.In}
_OP_TEXT = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%", ast.Pow: "**",
            ast.LShift: "<<", ast.RShift: ">>", ast.BitAnd: "&", ast.BitOr: "|", ast.BitXor: "^", ast.Lt: "<", ast.LtE: "<=",
            ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!=", ast.Is: "is", ast.IsNot: "is not", ast.In: "in",
            ast.NotIn: "not in", ast.And: "and", ast.Or: "or"}
_NUMBA = ("njit", "jit", "vectorize", "guvectorize", "cfunc", "generated_jit")


_SOURCES: dict[str, str] = {}


def source_of(path: str) -> str:
    """The module's source as it was when first read (and imported): edits made while a run goes on change nothing."""
    if path not in _SOURCES:
        _SOURCES[path] = (SRC / path).read_text()
    return _SOURCES[path]


def _decorator_names(fn: ast.AST) -> set[str]:
    out = set()
    for d in getattr(fn, "decorator_list", ()):
        while isinstance(d, ast.Call):
            d = d.func
        if isinstance(d, ast.Attribute):
            out.add(d.attr)
        elif isinstance(d, ast.Name):
            out.add(d.id)
    return out


class _Sites(ast.NodeVisitor):
    """Every mutation site inside a function, in a fixed walk order: (node, kind, detail, statement, function qualname)."""

    def __init__(self, source_lines: list[str]) -> None:
        self.lines = source_lines
        self.sites: list[tuple[ast.AST, str, Any, ast.stmt, str]] = []
        self._scope: list[str] = []
        self._fn: list[str] = []  # the qualname of the enclosing function (innermost)
        self._stmt: ast.stmt | None = None
        self._skip = 0
        self._locals: list[set[str]] = []  # per enclosing function: its parameters and the names it assigns
        self._loaded: list[list[str]] = []  # per enclosing function: the local names read so far, in walk order

    # scopes
    def _visit_scope(self, node: Any, is_fn: bool) -> None:
        if is_fn and _decorator_names(node) & set(_NUMBA):
            return  # numba compiles its own copy: a swapped __code__ would never run
        self._scope.append(node.name)
        if is_fn:
            self._fn.append(".".join(self._scope))
            self._scope.append("<locals>")
            self._locals.append(_local_names(node))
            self._loaded.append([])
            self._default_sites(node)
        body = node.body
        start = 0
        if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
                and isinstance(body[0].value.value, str):
            start = 1  # the docstring
        if is_fn:
            self._block_sites(body, start)  # the body itself, not a copy: a swap is made in the list
        body = body[start:]
        for stmt in body:
            self.visit(stmt)
        if is_fn:
            self._scope.pop()
            self._fn.pop()
            self._locals.pop()
            self._loaded.pop()
        self._scope.pop()

    def _default_sites(self, fn: Any) -> None:
        """A wrong default: each number or bool a parameter defaults to (the function object's own defaults: installed
        by setting ``__defaults__`` / ``__kwdefaults__``, not the code)."""
        a = fn.args
        line = self.lines[fn.lineno - 1] if fn.lineno - 1 < len(self.lines) else ""
        if "pragma: no mutate" in line:
            return
        for which, values in (("pos", a.defaults), ("kw", a.kw_defaults)):
            for i, d in enumerate(values):
                if isinstance(d, ast.Constant) and isinstance(d.value, (bool, int, float)):
                    self.sites.append((d, "default", (which, i), fn, self._fn[-1]))

    def _block_sites(self, stmts: list[ast.stmt], start: int = 0) -> None:
        """A moved statement: each statement from ``start`` swapped with the one after it (neither a jump, a definition
        or a pass)."""
        if not self._fn:
            return
        simple = (ast.Expr, ast.Assign, ast.AugAssign, ast.AnnAssign, ast.If, ast.For, ast.While, ast.With, ast.Try, ast.Delete)
        for j in range(start, len(stmts) - 1):
            a, b = stmts[j], stmts[j + 1]
            if not (isinstance(a, simple) and isinstance(b, simple)):
                continue
            if any("pragma: no mutate" in self.lines[x.lineno - 1] for x in (a, b) if x.lineno - 1 < len(self.lines)):
                continue
            if isinstance(a, ast.Expr) and isinstance(a.value, ast.Constant):
                continue
            self.sites.append((a, "swap", (stmts, j), a, self._fn[-1]))

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self._visit_scope(node, True)

    visit_AsyncFunctionDef = visit_FunctionDef  # type: ignore[assignment]

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self._visit_scope(node, False)

    def visit_Lambda(self, node: ast.Lambda) -> None:
        if self._fn:  # a lambda inside a function is part of that function's code
            self.visit(node.body)

    def generic_visit(self, node: ast.AST) -> None:
        if isinstance(node, ast.stmt):
            if not self._fn:  # module or class level: not mutable in a live process
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    self.visit(node)
                    return
                for child in ast.iter_child_nodes(node):
                    if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.stmt)):
                        self.visit(child)
                return
            if isinstance(node, (ast.Assert, ast.Raise, ast.Import, ast.ImportFrom, ast.Global, ast.Nonlocal)):
                return
            line = self.lines[node.lineno - 1] if node.lineno - 1 < len(self.lines) else ""
            if "pragma: no mutate" in line:
                return
            prev, self._stmt = self._stmt, node
            self._statement_sites(node)
            for field in ("body", "orelse", "finalbody"):
                block = getattr(node, field, None)
                if isinstance(block, list) and block and isinstance(block[0], ast.stmt):
                    self._block_sites(block)
            if isinstance(node, ast.AnnAssign):  # an annotation is never evaluated here (from __future__ import annotations)
                for child in (node.target, node.value):
                    if child is not None:
                        self.visit(child)
            else:
                super().generic_visit(node)
            self._stmt = prev
            return
        if isinstance(node, ast.JoinedStr):
            return  # f-strings: messages
        if self._fn and self._stmt is not None:
            self._expr_sites(node)
        super().generic_visit(node)

    def _add(self, node: ast.AST, kind: str, detail: Any) -> None:
        assert self._stmt is not None
        self.sites.append((node, kind, detail, self._stmt, self._fn[-1]))

    def _statement_sites(self, node: ast.stmt) -> None:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
            self._add(node, "delete", None)
        elif isinstance(node, ast.AugAssign):
            self._add(node, "delete", None)
            if type(node.op) in _BINOP_SWAP:
                self._add(node, "augop", _BINOP_SWAP[type(node.op)])
        elif isinstance(node, ast.Break):
            self._add(node, "break", None)
        elif isinstance(node, ast.Continue):
            self._add(node, "continue", None)

    def _expr_sites(self, node: ast.AST) -> None:
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOP_SWAP:
            if not (isinstance(node.op, ast.Mod) and isinstance(node.left, ast.Constant) and isinstance(node.left.value, str)):
                self._add(node, "binop", _BINOP_SWAP[type(node.op)])
        elif isinstance(node, ast.Compare):
            for i, op in enumerate(node.ops):
                if type(op) in _CMP_SWAP:
                    self._add(node, "cmp", (i, _CMP_SWAP[type(op)]))
        elif isinstance(node, ast.BoolOp):
            self._add(node, "boolop", ast.Or if isinstance(node.op, ast.And) else ast.And)
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            self._add(node, "not", None)
        elif isinstance(node, ast.Constant) and not isinstance(node.value, (str, bytes)) and node.value is not None \
                and node.value is not Ellipsis:
            self._add(node, "const", None)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("min", "max"):
            self._add(node, "minmax", None)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and self._locals and node.id in self._locals[-1]:
            seen = self._loaded[-1]
            other = next((x for x in reversed(seen) if x != node.id), None)
            if other is not None:  # a variable swapped for the last other local read before it
                self._add(node, "name", other)
            seen.append(node.id)
        if isinstance(node, ast.Call) and not (isinstance(node.func, ast.Name) and node.func.id in ("min", "max", "print", "len")):
            for k in node.keywords:  # a dropped argument: each keyword, and the last positional one
                if k.arg is not None:
                    self._add(node, "dropkw", k.arg)
            if len(node.args) >= 2 and not any(isinstance(x, ast.Starred) for x in node.args):
                self._add(node, "droparg", len(node.args) - 1)


def _sites(tree: ast.Module, source: str) -> list[tuple[ast.AST, str, Any, ast.stmt, str]]:
    v = _Sites(source.splitlines())
    for stmt in tree.body:
        v.visit(stmt)
    return v.sites


def _local_names(fn: Any) -> set[str]:
    """A function's parameters and the names it binds (its own body, not nested functions')."""
    a = fn.args
    names = {x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs]} | {x.arg for x in (a.vararg, a.kwarg) if x is not None}
    stack = list(fn.body)
    while stack:
        n = stack.pop()
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            names.add(n.id)
        stack.extend(ast.iter_child_nodes(n))
    return names - {"self", "cls"}


def _new_const(value: Any) -> Any:
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return 1.0 if value == 0 else value * 2.0
    if isinstance(value, complex):
        return value + 1
    return value


def _apply(node: ast.AST, kind: str, detail: Any) -> None:
    """Mutate ``node`` in place (the kinds that replace the node itself are done by :class:`_Replace`)."""
    if kind in ("binop", "augop", "boolop"):
        node.op = detail()  # type: ignore[attr-defined]
    elif kind == "cmp":
        i, new = detail
        node.ops[i] = new()  # type: ignore[attr-defined]
    elif kind == "const":
        node.value = _new_const(node.value)  # type: ignore[attr-defined]
    elif kind == "minmax":
        node.func.id = "max" if node.func.id == "min" else "min"  # type: ignore[attr-defined]
    elif kind == "name":
        node.id = detail  # type: ignore[attr-defined]
    elif kind == "dropkw":
        node.keywords = [k for k in node.keywords if k.arg != detail]  # type: ignore[attr-defined]
    elif kind == "droparg":
        del node.args[detail]  # type: ignore[attr-defined]
    elif kind == "default":
        node.value = _new_const(node.value)  # type: ignore[attr-defined]
    elif kind == "swap":
        block, j = detail
        block[j], block[j + 1] = block[j + 1], block[j]


def _first_line(node: ast.AST) -> str:
    return ast.unparse(node).splitlines()[0]


def _describe(node: ast.AST, kind: str, detail: Any) -> tuple[str, str]:
    """(before, after) as short source text, without touching the tree."""
    before = _first_line(node)
    if kind == "delete":
        return before, "pass"
    if kind == "break":
        return before, "continue"
    if kind == "continue":
        return before, "break"
    if kind == "not":
        return before, _first_line(node.operand)  # type: ignore[attr-defined]
    if kind == "swap":
        block, j = detail
        return before, f"(after) {_first_line(block[j + 1])}"
    twin = copy.deepcopy(node)
    _apply(twin, kind, detail)
    return before, _first_line(twin)


class _Replace(ast.NodeTransformer):
    """Replace one node (by identity) with another, or with ``pass``."""

    def __init__(self, target: ast.AST, kind: str) -> None:
        self.target, self.kind = target, kind
        self.after = ""

    def visit(self, node: ast.AST) -> Any:
        if node is self.target:
            if self.kind == "delete":
                return ast.copy_location(ast.Pass(), node)
            if self.kind == "not":
                self.after = ast.unparse(node.operand).splitlines()[0]  # type: ignore[attr-defined]
                return node.operand  # type: ignore[attr-defined]
            if self.kind == "break":
                return ast.copy_location(ast.Continue(), node)
            if self.kind == "continue":
                return ast.copy_location(ast.Break(), node)
        return super().visit(node)


class Mutant:
    __slots__ = ("module", "path", "index", "kind", "qualname", "line", "end_line", "before", "after", "id")

    def __init__(self, module: str, path: str, index: int, kind: str, qualname: str, line: int, end_line: int, before: str,
                 after: str, ident: str) -> None:
        self.module, self.path, self.index, self.kind, self.qualname = module, path, index, kind, qualname
        self.line, self.end_line, self.before, self.after, self.id = line, end_line, before, after, ident

    def describe(self) -> str:
        return f"{self.path}:{self.line} {self.qualname}: {self.before!r} -> {self.after!r}"


def mutants_of(module: str, path: str) -> list[Mutant]:
    source = source_of(path)
    tree = ast.parse(source)
    out: list[Mutant] = []
    seen: dict[str, int] = {}
    for index, (node, kind, detail, stmt, qualname) in enumerate(_sites(tree, source)):
        before, after = _describe(node, kind, detail)
        # a stable id: the function, the statement's text, the change, and its occurrence among identical ones
        key = f"{path}|{qualname}|{_first_line(stmt)}|{kind}|{before}|{after}"
        seen[key] = seen.get(key, 0) + 1
        ident = hashlib.sha1(f"{key}|{seen[key]}".encode()).hexdigest()[:10]
        out.append(Mutant(module, path, index, kind, qualname, stmt.lineno, stmt.end_lineno or stmt.lineno, before, after, ident))
    return out


def _mutated_tree(m: Mutant) -> ast.Module:
    source = source_of(m.path)
    tree = ast.parse(source)
    node, kind, detail, _, _ = _sites(tree, source)[m.index]
    _apply(node, kind, detail)
    if kind in ("delete", "not", "break", "continue"):
        _Replace(node, kind).visit(tree)
    ast.fix_missing_locations(tree)
    return tree


def _module_name(path: str) -> str:
    return path[:-3].replace("/", ".").removesuffix(".__init__")


def _live_function(module: types.ModuleType, qualname: str, firstline: int) -> Any:
    """The live function object for ``qualname`` (its outermost part reachable from the module)."""
    obj: Any = module
    for part in qualname.split("."):
        d = getattr(obj, "__dict__", {})
        if part not in d:
            return None
        obj = d[part]
        if isinstance(obj, (staticmethod, classmethod)):
            obj = obj.__func__
        elif isinstance(obj, property):
            obj = next((f for f in (obj.fget, obj.fset, obj.fdel) if f is not None and f.__code__.co_firstlineno == firstline), obj.fget)
        elif hasattr(obj, "func") and type(obj).__name__ == "cached_property":
            obj = obj.func
    while hasattr(obj, "__wrapped__"):
        obj = obj.__wrapped__
    return obj if isinstance(obj, types.FunctionType) else None


def _code_objects(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            yield from _code_objects(c)


def reachable(m: Mutant) -> str | None:
    """The qualname of the live function whose code holds the mutant (nested functions: their outermost one)."""
    return m.qualname.split(".<locals>.")[0]


def _install_default(m: Mutant, mod: types.ModuleType) -> None:
    """A wrong default of a module- or class-level function: its function object's own defaults, changed in place."""
    source = source_of(m.path)
    tree = ast.parse(source)
    _, _, (which, i), fndef, _ = _sites(tree, source)[m.index]
    first = fndef.decorator_list[0].lineno if fndef.decorator_list else fndef.lineno  # type: ignore[attr-defined]
    fn = _live_function(mod, m.qualname, first)
    if fn is None:
        raise LookupError(f"no live function {m.qualname}")
    if which == "pos":
        d = list(fn.__defaults__ or ())
        d[i] = _new_const(d[i])
        fn.__defaults__ = tuple(d)
    else:
        name = fndef.args.kwonlyargs[i].arg  # type: ignore[attr-defined]
        kw = dict(fn.__kwdefaults__ or {})
        kw[name] = _new_const(kw[name])
        fn.__kwdefaults__ = kw


def install(m: Mutant) -> None:
    """Swap the mutated code into the live function (in this process); a wrong default of a function defined at module
    or class level goes into the function object's defaults (a nested function's are in its outer function's code)."""
    mod = importlib.import_module(_module_name(m.path))
    if m.kind == "default" and "<locals>" not in m.qualname:
        _install_default(m, mod)
        return
    tree = _mutated_tree(m)
    code = compile(tree, str(SRC / m.path), "exec")
    outer = reachable(m)
    assert outer is not None
    new = next((c for c in _code_objects(code) if c.co_qualname == outer), None)
    if new is None:
        raise LookupError(f"no code object {outer} in the mutated module")
    fn = _live_function(mod, outer, new.co_firstlineno)
    if fn is None:
        raise LookupError(f"no live function {outer}")
    if fn.__code__.co_freevars != new.co_freevars:
        raise LookupError(f"{outer}: free variables differ")
    fn.__code__ = new


def install_by_index(path: str, index: int) -> None:
    """Install the ``index``-th mutant of ``path`` (tools/mutation_hook/sitecustomize.py: in a subprocess a test started)."""
    m = next((x for x in mutants_of("subprocess", path) if x.index == index), None)
    if m is None:
        raise LookupError(f"no mutant {index} of {path}")
    install(m)


HOOK = Path(__file__).with_name("mutation_hook")


def _with_hook(env: dict[str, str]) -> None:
    """Every Python a test starts imports tools/mutation_hook/sitecustomize.py first."""
    old = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = os.pathsep.join([str(HOOK), str(SRC)] + ([old] if old else []))


def installable(m: Mutant) -> bool:
    mod = importlib.import_module(_module_name(m.path))
    outer = reachable(m)
    if outer is None:
        return False
    source_fn = None
    for c in _code_objects(compile(source_of(m.path), str(SRC / m.path), "exec")):
        if c.co_qualname == outer:
            source_fn = c
            break
    return source_fn is not None and _live_function(mod, outer, source_fn.co_firstlineno) is not None


# ----------------------------------------------------------------------------------------------- coverage: which test runs which line


class _ContextPlugin:
    def __init__(self, cov: Any) -> None:
        self.cov = cov
        self.durations: dict[str, float] = {}
        self.failed: list[str] = []

    def pytest_runtest_setup(self, item: Any) -> None:
        self.cov.switch_context(item.nodeid)
        os.environ["KVPOLICY_MUTATION_CONTEXT"] = item.nodeid  # a subprocess the test starts records under its name

    def pytest_runtest_logreport(self, report: Any) -> None:
        self.durations[report.nodeid] = self.durations.get(report.nodeid, 0.0) + report.duration
        if report.failed:
            self.failed.append(report.nodeid)


def _pytest_args(extra: list[str]) -> list[str]:
    return ["-q", "-p", "no:cacheprovider", "--no-header", "-x", "--tb=no", "-o", "addopts=", *extra]


def covering_tests(paths: list[str], tests: list[str]) -> tuple[dict[str, dict[int, set[str]]], dict[str, float]]:
    """Per source file, per line: the test node ids that executed it; and each test's duration."""
    import coverage
    import pytest

    files = [str(SRC / p) for p in paths]
    cov = coverage.Coverage(data_file=None, include=files, branch=False)
    plugin = _ContextPlugin(cov)
    saved = dict(os.environ)
    sub_dir = tempfile.mkdtemp(prefix="kvpolicy-mutation-cov-")
    # subprocesses the tests start (python -m kvpolicy, python -c ...) record their own coverage, under the test's name
    os.environ.update({"KVPOLICY_MUTATION_COV": sub_dir, "KVPOLICY_MUTATION_FILES": os.pathsep.join(files)})
    _with_hook(os.environ)  # type: ignore[arg-type]
    cov.start()
    try:
        with redirect_stdout(io.StringIO()), redirect_stderr(io.StringIO()):
            rc = pytest.main(["-q", "-p", "no:cacheprovider", "--no-header", "--tb=short", "-o", "addopts=", *tests], plugins=[plugin])
    finally:
        cov.stop()
        os.environ.clear()
        os.environ.update(saved)
    if plugin.failed:
        shutil.rmtree(sub_dir, ignore_errors=True)
        raise SystemExit(f"mutation: the tests fail without any mutant ({rc}): {plugin.failed[:5]}")
    datas = [cov.get_data()]
    for name in sorted(os.listdir(sub_dir)):
        d = coverage.CoverageData(basename=os.path.join(sub_dir, name))
        d.read()
        datas.append(d)
    out: dict[str, dict[int, set[str]]] = {}
    for p, f in zip(paths, files):
        merged: dict[int, set[str]] = {}
        for data in datas:  # (read from their files: removed only after)
            for ln, ctx in data.contexts_by_lineno(f).items():
                merged.setdefault(ln, set()).update(c for c in ctx if c)
        out[p] = merged
    shutil.rmtree(sub_dir, ignore_errors=True)
    return out, plugin.durations


# ----------------------------------------------------------------------------------------------- running mutants


def _child(m: Mutant, tests: list[str]) -> int:
    import hypothesis
    import pytest

    hypothesis.settings.register_profile("mutation", derandomize=True, database=None, deadline=None,
                                         parent=hypothesis.settings.get_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev")))
    hypothesis.settings.load_profile("mutation")
    os.environ.pop("KVPOLICY_MUTATION_COV", None)
    os.environ["KVPOLICY_MUTANT"] = f"{m.path}:{m.index}"  # a subprocess a test starts installs the same mutant
    _with_hook(os.environ)  # type: ignore[arg-type]
    try:
        install(m)
    except Exception as e:  # noqa: BLE001 - a mutant that does not even install
        print(f"mutation: could not install {m.id}: {e}", file=sys.stderr)
        return 99
    devnull = open(os.devnull, "w")  # noqa: SIM115
    os.dup2(devnull.fileno(), 1)
    os.dup2(devnull.fileno(), 2)
    rc = pytest.main(_pytest_args(tests))
    return int(rc)


def run_mutants(mutants: list[Mutant], lines: dict[str, dict[int, set[str]]], durations: dict[str, float], jobs: int,
                progress: bool = True) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    queue = list(mutants)
    running: dict[int, tuple[Mutant, float, float, list[str]]] = {}
    done = 0
    total = len(mutants)
    while queue or running:
        while queue and len(running) < jobs:
            m = queue.pop(0)
            sel: set[str] = set()
            for ln in range(m.line, m.end_line + 1):
                sel |= lines.get(m.path, {}).get(ln, set())
            if not sel:
                results.append({"mutant": m, "status": "uncovered", "tests": 0, "seconds": 0.0})
                done += 1
                continue
            tests = sorted(sel, key=lambda t: durations.get(t, 1.0))
            budget = 2.0 * sum(durations.get(t, 1.0) for t in tests) + 20.0
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:  # the child: never returns
                code = 98
                try:
                    code = _child(m, tests)
                finally:
                    os._exit(code)
            running[pid] = (m, time.monotonic(), budget, tests)
        if not running:
            continue
        time.sleep(0.02)
        for pid, (m, t0, budget, tests) in list(running.items()):
            got, status = os.waitpid(pid, os.WNOHANG)
            elapsed = time.monotonic() - t0
            if got == 0:
                if elapsed > budget:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    results.append({"mutant": m, "status": "timeout", "tests": len(tests), "seconds": elapsed})
                    del running[pid]
                    done += 1
                continue
            del running[pid]
            done += 1
            rc = os.waitstatus_to_exitcode(status)
            if rc == 0:
                st = "survived"
            elif rc == 99:
                st = "error"
            elif rc in (1, 3):  # tests failed / internal error in a test (an exception the mutant caused)
                st = "killed"
            elif rc < 0:
                st = "killed"  # died of a signal: a crash the mutant caused
            else:
                st = "killed" if rc in (2,) else "error"
            results.append({"mutant": m, "status": st, "tests": len(tests), "seconds": elapsed})
            if progress:
                print(f"  [{done}/{total}] {st:>9}  {m.describe()}", flush=True)
    return results


def load_equivalent() -> dict[str, str]:
    if not EQUIVALENT_FILE.exists():
        return {}
    rows = json.loads(EQUIVALENT_FILE.read_text())
    out = {}
    for r in rows:
        if not isinstance(r, dict) or not isinstance(r.get("id"), str) or not isinstance(r.get("why"), str) or not r["why"].strip():
            raise SystemExit(f"mutation: {EQUIVALENT_FILE.name}: each row needs an 'id' and a one-line 'why', got {r!r}")
        out[r["id"]] = r["why"]
    return out


def score(results: list[dict[str, Any]], equivalent: dict[str, str]) -> dict[str, Any]:
    n = len(results)
    eq = [r for r in results if r["mutant"].id in equivalent]
    live = [r for r in results if r["mutant"].id not in equivalent]
    killed = sum(1 for r in live if r["status"] in ("killed", "timeout"))
    survived = [r for r in live if r["status"] in ("survived", "uncovered")]
    errors = [r for r in live if r["status"] == "error"]
    denom = len(live) - len(errors)
    return {"mutants": n, "killed": killed, "timeout": sum(1 for r in live if r["status"] == "timeout"),
            "survived": sum(1 for r in survived if r["status"] == "survived"),
            "uncovered": sum(1 for r in survived if r["status"] == "uncovered"), "equivalent": len(eq), "errors": len(errors),
            "score": killed / denom if denom else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("modules", nargs="*", help=f"modules to mutate (default: all): {', '.join(MODULES)}")
    ap.add_argument("--sample", type=int, default=None, help="run a random sample of this many mutants per module")
    ap.add_argument("--seed", type=int, default=0, help="the sample's seed")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--rotate", action="store_true", help="one module, chosen by the commit (CI's rotation)")
    ap.add_argument("--list", action="store_true", help="list the mutants; run nothing")
    ap.add_argument("--check", action="store_true", help=f"exit 1 when a module's score is under its goal ({GOAL:.0%}%)")
    ap.add_argument("--ids", nargs="+", default=None, metavar="ID", help="only these mutants (ids as the survivors list prints them)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    for name in args.modules:
        if name not in MODULES:
            ap.error(f"unknown module {name!r}; known: {', '.join(MODULES)}")
    if args.sample is not None and args.sample <= 0:
        ap.error("--sample must be positive")
    if args.jobs <= 0:
        ap.error("--jobs must be positive")
    names = args.modules or list(MODULES)
    if args.rotate:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip() or "0"
        names = [sorted(names)[int(head[:8], 16) % len(names)]]
        args.seed = int(head[8:16], 16)
    sys.path[:0] = [str(SRC), str(ROOT / "tests")]  # this tree's package, whatever is installed
    os.chdir(ROOT)
    for name in names:  # read every source now, and import it from the same text
        for p in MODULES[name]["paths"]:
            source_of(p)
            importlib.import_module(_module_name(p))
    equivalent = load_equivalent()
    report: dict[str, Any] = {}
    rc = 0
    for name in names:
        cfg = MODULES[name]
        tests = [t for t in cfg["tests"] if (ROOT / t).exists()]
        muts = [m for p in cfg["paths"] for m in mutants_of(name, p)]
        muts = [m for m in muts if installable(m)]
        if args.ids is not None:
            muts = [m for m in muts if m.id in set(args.ids)]
        elif args.sample is not None and args.sample < len(muts):
            muts = sorted(random.Random(f"{args.seed}:{name}").sample(muts, args.sample), key=lambda m: (m.path, m.index))
        if args.list:
            for m in muts:
                print(f"{m.id}  {m.describe()}")
            print(f"{name}: {len(muts)} mutants")
            continue
        print(f"== {name}: {len(muts)} mutants of {', '.join(cfg['paths'])}; tests: {', '.join(tests)}", flush=True)
        t0 = time.monotonic()
        lines, durations = covering_tests(cfg["paths"], tests)
        print(f"   coverage of {len(durations)} tests in {time.monotonic() - t0:.0f} s", flush=True)
        results = run_mutants(muts, lines, durations, args.jobs, progress=not args.quiet)
        s = score(results, equivalent)
        s["seconds"] = time.monotonic() - t0
        s["sampled"] = args.sample is not None
        surv = [r for r in results if r["status"] in ("survived", "uncovered") and r["mutant"].id not in equivalent]
        s["survivors"] = [{"id": r["mutant"].id, "status": r["status"], "where": r["mutant"].describe()} for r in surv]
        s["equivalent_ids"] = [{"id": r["mutant"].id, "where": r["mutant"].describe(), "why": equivalent[r["mutant"].id]}
                               for r in results if r["mutant"].id in equivalent]
        s["errors_ids"] = [{"id": r["mutant"].id, "where": r["mutant"].describe()} for r in results if r["status"] == "error"]
        report[name] = s
        print(f"\n   survivors of {name}:")
        for r in s["survivors"]:
            print(f"     {r['id']}  {r['status']:>9}  {r['where']}")
        for r in s["errors_ids"]:
            print(f"     {r['id']}      error  {r['where']}")
    if args.list:
        return 0
    print("\n| module | mutants | killed | survived | uncovered | equivalent | score | goal |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for name, s in report.items():
        sc = "-" if s["score"] is None else f"{s['score']:.1%}"
        ok = s["score"] is not None and s["score"] >= GOAL
        print(f"| {name}{' (sample)' if s['sampled'] else ''} | {s['mutants']} | {s['killed']} | {s['survived']} | {s['uncovered']} | "
              f"{s['equivalent']} | {sc} | {'met' if ok else 'MISSED'} |")
        if args.check and not ok:
            rc = 1
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=str))
    return rc


if __name__ == "__main__":
    sys.exit(main())
