"""Trace readers: Mooncake JSONL, Qwen/Bailian JSONL, generic token JSONL.

Every malformed line raises :class:`~kvpolicy.errors.TraceFormatError` naming the
file and line — bad JSON, a missing field, a negative length, ``hash_ids``
inconsistent with ``input_length`` and the block size, time going backwards
(unless ``sort=True``). ``skip_bad_lines=True`` skips them instead and records
the line numbers in ``Trace.skipped_lines``; nothing is ever skipped silently.
"""

from __future__ import annotations

import math

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import numpy as np

from .._io import json_loads
from ..errors import ConfigError, TraceFormatError
from .model import Trace, canonical_ids, chain_check

Format = Literal["mooncake", "bailian", "tokens"]
FORMATS = ("mooncake", "bailian", "tokens")


def open_trace(path: str | Path) -> Any:
    """A binary line reader for a trace file, gzip-compressed (``.gz``, or a gzip magic number) or plain."""
    import gzip

    p = Path(path)
    if p.is_dir():
        raise TraceFormatError(str(path), None, "is a directory, not a trace file")
    with open(p, "rb") as f:
        magic = f.read(2)
    if p.suffix == ".gz" or magic == b"\x1f\x8b":
        return gzip.open(p, "rb")
    return open(p, "rb")


#: the longest line a trace may have: a million-token prompt as JSON is ~8 MB. A 2 MB gzip bomb of one 2 GiB line
#: peaked at 4.3 GB of memory when lines were read whole; now it is refused after 64 MiB of it (issue #47)
MAX_LINE_BYTES = 64 * 2**20


def _numbered(f: Any, path: str) -> Iterator[tuple[int, bytes]]:
    """``enumerate(f, 1)`` that turns a corrupt or truncated gzip stream, or a line over MAX_LINE_BYTES, into a
    TraceFormatError — reading at most MAX_LINE_BYTES + 1 bytes of any line."""
    import gzip

    lineno = 0
    while True:
        try:
            raw = f.readline(MAX_LINE_BYTES + 1)
        except (gzip.BadGzipFile, EOFError, OSError) as exc:
            raise TraceFormatError(path, lineno + 1 if lineno else None, f"not a readable gzip stream ({exc})") from None
        if not raw:
            return
        lineno += 1
        if len(raw) > MAX_LINE_BYTES:
            raise TraceFormatError(path, lineno, f"a line longer than {MAX_LINE_BYTES // 2**20} MiB (a decompression bomb, or not a trace)")
        yield lineno, raw


class _Lines:
    """Numbered JSON objects of a JSONL file; errors carry file and line."""

    def __init__(self, path: str | Path, skip_bad_lines: bool) -> None:
        self.path = str(path)
        self.skip = skip_bad_lines
        self.skipped: list[int] = []
        if not Path(path).exists():
            raise TraceFormatError(self.path, None, "no such file")

    def __iter__(self) -> Iterator[tuple[int, dict[str, Any]]]:
        with open_trace(self.path) as f:
            for lineno, raw in _numbered(f, self.path):
                if not raw.strip():
                    continue
                try:
                    obj = json_loads(raw)
                except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                    self.bad(lineno, f"not valid JSON ({getattr(exc, 'msg', exc)})")
                    continue
                if not isinstance(obj, dict):
                    self.bad(lineno, f"expected a JSON object, got {type(obj).__name__}")
                    continue
                yield lineno, obj

    def bad(self, lineno: int, problem: str) -> None:
        if not self.skip:
            raise TraceFormatError(self.path, lineno, problem)
        self.skipped.append(lineno)


_INT64_END = 2**63  # the columns are int64: a larger integer cannot be stored, so it is a bad line, not an OverflowError


class _Reject(Exception):
    """A line-level problem, turned into TraceFormatError (or a skip) by the caller."""


def _int_field(obj: dict[str, Any], name: str, default: int | None = None) -> int:
    if name not in obj:
        if default is not None:
            return default
        raise _Reject(f"missing field {name!r}")
    v = obj[name]
    if isinstance(v, bool) or not isinstance(v, int):
        raise _Reject(f"field {name!r} must be an integer, got {v!r}")
    if v >= _INT64_END:
        raise _Reject(f"field {name!r} is too large ({v}; at most 2**63 - 1)")
    if v < 0:
        raise _Reject(f"field {name!r} is negative ({v})")
    return v


def _num_field(obj: dict[str, Any], name: str, default: float | None = None) -> float:
    if name not in obj:
        if default is not None:
            return default
        raise _Reject(f"missing field {name!r}")
    v = obj[name]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v if isinstance(v, float) else _float_or_inf(v)):
        raise _Reject(f"field {name!r} must be a finite number, got {v!r}")
    if v < 0:
        raise _Reject(f"field {name!r} is negative ({v})")
    return float(v)


def _float_or_inf(v: int) -> float:
    """An int as a float, or inf where it has no float (beyond ~1.8e308): such a time is not finite."""
    try:
        return float(v)
    except OverflowError:
        return math.inf


def _hash_ids(obj: dict[str, Any], input_length: int, block_size: int) -> list[int]:
    ids = obj.get("hash_ids")
    if ids is None:
        raise _Reject("missing field 'hash_ids'")
    if not isinstance(ids, list):
        raise _Reject(f"field 'hash_ids' must be a list, got {type(ids).__name__}")
    want = -(-input_length // block_size)
    if len(ids) != want:
        raise _Reject(f"hash_ids has {len(ids)} ids but input_length {input_length} needs ceil({input_length}/{block_size}) = {want}")
    for i, h in enumerate(ids):
        if isinstance(h, bool) or not isinstance(h, int) or not 0 <= h < _INT64_END:
            raise _Reject(f"hash_ids[{i}] must be an integer in [0, 2**63), got {h!r}")
    return ids


class _Builder:
    """Collects requests, then builds a canonical Trace (sorting if asked)."""

    def __init__(self, block_size: int) -> None:
        self.B = block_size
        self.arrival: list[float] = []
        self.inp: list[int] = []
        self.out: list[int] = []
        self.lines: list[int] = []
        self.ids: list[int] = []
        self.n_ids: list[int] = []
        self.labels: dict[str, list[str]] = {"tenant": [], "class": [], "session": []}
        self.request_ids: list[str] = []
        self.tokens: list[np.ndarray] = []

    def add(self, lineno: int, t: float, inp: int, out: int, ids: list[int], tenant: str | None = None, cls: str | None = None, session: str | None = None) -> None:
        self.lines.append(lineno)
        self.arrival.append(t)
        self.inp.append(inp)
        self.out.append(out)
        self.ids.extend(ids)
        self.n_ids.append(len(ids))
        self.labels["tenant"].append(tenant if tenant is not None else "")
        self.labels["class"].append(cls if cls is not None else "")
        self.labels["session"].append(session if session is not None else "")

    def drop_unchained(self, source: str, skip: bool, skipped: list[int]) -> None:
        """Full-block ids must be chained (:func:`~kvpolicy.traces.model.chain_check`, in file order): the first line
        that breaks it is an error naming it and the line that first showed the id — or, skipping, every such line
        is dropped (a dropped line teaches nothing) and listed with the skipped ones."""
        n = len(self.arrival)
        n_ids = np.asarray(self.n_ids, dtype=np.int64)
        ids = np.asarray(self.ids, dtype=np.int64)
        full = np.minimum(np.asarray(self.inp, dtype=np.int64) // self.B, n_ids)
        starts = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(n_ids, out=starts[1:])
        is_full = (np.arange(ids.size) - np.repeat(starts[:-1], n_ids)) < np.repeat(full, n_ids)
        off = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(full, out=off[1:])
        bad, c = chain_check(off, ids[is_full], all_bad=skip)
        if c is None:
            return
        if not skip:
            raise TraceFormatError(source, self.lines[c.request], c.message(
                where=f"hash_ids[{c.position}]", first_where=f"line {self.lines[c.first_request]}, hash_ids[{c.first_position}]"))
        drop = set(bad.tolist())
        keep = [i for i in range(n) if i not in drop]
        skipped.extend(self.lines[i] for i in drop)
        skipped.sort()
        self.ids = np.concatenate([ids[starts[i]:starts[i + 1]] for i in keep]).tolist() if keep else []
        for name in ("arrival", "inp", "out", "lines", "n_ids"):
            setattr(self, name, [getattr(self, name)[i] for i in keep])
        self.labels = {k: [v[i] for i in keep] for k, v in self.labels.items()}
        if self.request_ids:
            self.request_ids = [self.request_ids[i] for i in keep]
        if self.tokens:
            self.tokens = [self.tokens[i] for i in keep]

    def build(self, source: str, sort: bool, skipped: list[int], skip: bool = False) -> Trace:
        self.drop_unchained(source, skip, skipped)
        if not self.arrival:
            raise TraceFormatError(source, None, f"no requests in the trace ({len(skipped)} bad lines skipped)")
        B = self.B
        n = len(self.arrival)
        arrival = np.asarray(self.arrival, dtype=np.float64)
        inp = np.asarray(self.inp, dtype=np.int64)
        out = np.asarray(self.out, dtype=np.int64)
        n_ids = np.asarray(self.n_ids, dtype=np.int64)
        ids = np.asarray(self.ids, dtype=np.int64)
        starts = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(n_ids, out=starts[1:])
        order = None
        if n > 1 and np.any(np.diff(arrival) < 0):
            if not sort:
                bad = int(np.argmax(np.diff(arrival) < 0)) + 1
                raise TraceFormatError(source, self.lines[bad], f"time goes backwards ({arrival[bad]:.6g} s after {arrival[bad - 1]:.6g} s); pass sort=True / --sort to reorder")
            order = np.argsort(arrival, kind="stable")
        if order is not None:
            arrival, inp, out, n_ids_o = arrival[order], inp[order], out[order], n_ids[order]
            ids = np.concatenate([ids[starts[i] : starts[i + 1]] for i in order]) if n else ids
            n_ids = n_ids_o
            starts = np.zeros(n + 1, dtype=np.int64)
            np.cumsum(n_ids, out=starts[1:])
        has_p = (inp % B) != 0
        partial = np.full(n, -1, dtype=np.int64)
        last = starts[1:] - 1
        partial[has_p] = ids[last[has_p]]
        keep = np.ones(ids.size, dtype=bool)
        keep[last[has_p]] = False
        full_ids = ids[keep]
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(inp // B, out=offsets[1:])
        kw: dict[str, Any] = {}
        for key, field in (("tenant", "tenant"), ("class", "request_class"), ("session", "session")):
            vals = self.labels[key]
            if order is not None:
                vals = [vals[i] for i in order]
            if any(vals):
                names = sorted(set(vals))
                index = {v: i for i, v in enumerate(names)}
                kw[field] = np.asarray([index[v] for v in vals], dtype=np.int32)
                if field == "tenant":
                    kw["tenant_names"] = names
                elif field == "request_class":
                    kw["class_names"] = names
        if self.request_ids:
            kw["request_ids"] = [self.request_ids[i] for i in order] if order is not None else self.request_ids
        if self.tokens:
            toks = [self.tokens[i] for i in order] if order is not None else self.tokens
            tok_off = np.zeros(n + 1, dtype=np.int64)
            np.cumsum([t.size for t in toks], out=tok_off[1:])
            kw["token_offsets"] = tok_off
            kw["tokens"] = np.concatenate(toks) if toks else np.zeros(0, np.uint32)
        # canonical before the Trace exists: it is built (and its ids checked) once, not once raw and once renumbered
        full_ids, partial = canonical_ids(offsets, full_ids, partial)
        return Trace(
            arrival_s=arrival, input_tokens=inp, output_tokens=out, block_offsets=offsets, block_ids=full_ids,
            partial_block_ids=partial, block_size_tokens=B, source=source, skipped_lines=skipped, **kw,
        )


def _read(path: str | Path, block_size: int, sort: bool, skip_bad_lines: bool, row: Callable[[int, dict[str, Any], _Builder], None]) -> Trace:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ConfigError("block_size_tokens", f"must be a positive int, got {block_size!r}")
    lines = _Lines(path, skip_bad_lines)
    b = _Builder(block_size)
    for lineno, obj in lines:
        try:
            row(lineno, obj, b)
        except _Reject as exc:
            lines.bad(lineno, str(exc))
    if not b.arrival:
        raise TraceFormatError(str(path), None, "no requests in the trace" + (f" ({len(lines.skipped)} bad lines skipped)" if lines.skipped else ""))
    return b.build(str(path), sort, lines.skipped, skip_bad_lines)


def read_mooncake(path: str | Path, block_size_tokens: int = 512, *, sort: bool = False, skip_bad_lines: bool = False) -> Trace:
    """Mooncake JSONL: ``timestamp`` (ms), ``input_length``, ``output_length``, chained ``hash_ids`` (a full block's
    id always follows the same id, or always starts its request: a line where one does not is bad, naming the line
    that first showed the id)."""

    def row(lineno: int, obj: dict[str, Any], b: _Builder) -> None:
        t = _num_field(obj, "timestamp") / 1000.0
        inp = _int_field(obj, "input_length")
        out = _int_field(obj, "output_length")
        b.add(lineno, t, inp, out, _hash_ids(obj, inp, block_size_tokens))

    return _read(path, block_size_tokens, sort, skip_bad_lines, row)


def read_bailian(path: str | Path, block_size_tokens: int = 16, *, sort: bool = False, skip_bad_lines: bool = False) -> Trace:
    """Qwen/Bailian JSONL ("KVCache Cache in the Wild"): per-block *content* ids, chained here.

    Fields: ``chat_id``, ``parent_chat_id`` (−1 for a first turn), ``timestamp``
    (s), ``input_length``, ``output_length``, ``type``, ``turn``, ``hash_ids``.
    A block's prefix identity is the chain of content ids up to it, so block i
    gets id ``chain[(id of block i−1, content id i)]``. Sessions follow
    ``parent_chat_id`` back to the first turn.
    """
    chain: dict[tuple[int, int], int] = {}
    root_of: dict[Any, Any] = {}

    def row(lineno: int, obj: dict[str, Any], b: _Builder) -> None:
        t = _num_field(obj, "timestamp")
        inp = _int_field(obj, "input_length")
        out = _int_field(obj, "output_length")
        if "chat_id" not in obj:
            raise _Reject("missing field 'chat_id'")
        content = _hash_ids(obj, inp, block_size_tokens)
        ids = []
        parent = -1
        for c in content:
            key = (parent, c)
            nid = chain.get(key)
            if nid is None:
                nid = len(chain)
                chain[key] = nid
            ids.append(nid)
            parent = nid
        chat, par = obj["chat_id"], obj.get("parent_chat_id", -1)
        for name, v in (("chat_id", chat), ("parent_chat_id", par)):
            if isinstance(v, bool) or not isinstance(v, (int, str, type(None))):
                raise _Reject(f"field {name!r} must be an integer or a string, got {type(v).__name__}")
        root = root_of.get(par, par) if par not in (-1, None) else chat
        root_of[chat] = root
        cls = obj.get("type")
        b.add(lineno, t, inp, out, ids, cls=str(cls) if cls is not None else None, session=str(root))

    return _read(path, block_size_tokens, sort, skip_bad_lines, row)


def read_tokens_jsonl(
    path: str | Path,
    block_size_tokens: int = 16,
    *,
    namespace: Any = None,
    keep_tokens: bool = True,
    sort: bool = False,
    skip_bad_lines: bool = False,
) -> Trace:
    """Generic JSONL with raw token ids: ``{"tokens": [...], "timestamp": s, ...}``.

    Optional fields: ``timestamp`` (seconds; default: the line's index),
    ``output_length`` (default 0), ``tenant``, ``app`` or ``class``, ``session``,
    ``request_id``. Blocks are keyed with kvpolicy's ``fast`` chained hash under
    ``namespace`` (one namespace per tenant, so tenants never share a block).
    """
    from ..keys import BlockHasher, Namespace

    if namespace is None:
        namespace = Namespace(model_id="trace", model_revision="unspecified", tokenizer_version="unspecified", kv_dtype="bf16", block_size_tokens=block_size_tokens)
    if namespace.block_size_tokens != block_size_tokens:
        raise ConfigError("block_size_tokens", f"{block_size_tokens} disagrees with the namespace's {namespace.block_size_tokens}")
    hashers: dict[str, Any] = {}
    key_ids: dict[bytes, int] = {}
    partial_counter = [0]
    index = [0]

    def row(lineno: int, obj: dict[str, Any], b: _Builder) -> None:
        toks = obj.get("tokens")
        if not isinstance(toks, list):
            raise _Reject("missing field 'tokens' (a list of token ids)" if toks is None else f"field 'tokens' must be a list, got {type(toks).__name__}")
        for i, tk in enumerate(toks):
            if isinstance(tk, bool) or not isinstance(tk, int) or not 0 <= tk < 2**32:
                raise _Reject(f"tokens[{i}] must be an integer in [0, 2**32), got {tk!r}")
        t = _num_field(obj, "timestamp", default=float(index[0]))
        out = _int_field(obj, "output_length", default=0)
        tenant = obj.get("tenant")
        cls = obj.get("app", obj.get("class"))
        for name, v in (("tenant", tenant), ("app", cls), ("session", obj.get("session")), ("request_id", obj.get("request_id"))):
            if v is not None and not isinstance(v, (str, int)):
                raise _Reject(f"field {name!r} must be a string or integer, got {v!r}")
        tkey = str(tenant) if tenant is not None else namespace.tenant
        h = hashers.get(tkey)
        if h is None:
            h = BlockHasher(namespace.evolve(tenant=tkey), "fast")
            hashers[tkey] = h
        arr = np.asarray(toks, dtype=np.uint32)
        ids = []
        for k in h.hash_blocks(arr):
            nid = key_ids.get(k)
            if nid is None:
                nid = len(key_ids)
                key_ids[k] = nid
            ids.append(nid)
        if arr.size % block_size_tokens:
            partial_counter[0] += 1
            ids.append((1 << 62) + partial_counter[0])  # unique per request: a partial block is never a hit
        b.add(lineno, t, arr.size, out, ids, tenant=None if tenant is None else str(tenant), cls=None if cls is None else str(cls), session=None if obj.get("session") is None else str(obj["session"]))
        b.request_ids.append(str(obj.get("request_id", index[0])))
        if keep_tokens:
            b.tokens.append(arr)
        index[0] += 1

    trace = _read(path, block_size_tokens, sort, skip_bad_lines, row)
    return trace


def detect_format(path: str | Path) -> Format:
    """Guess the format from the first non-empty line's fields."""
    p = Path(path)
    if not p.exists():
        raise TraceFormatError(str(path), None, "no such file")
    with open_trace(p) as f:
        for lineno, raw in _numbered(f, str(path)):
            if not raw.strip():
                continue
            try:
                obj = json_loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise TraceFormatError(str(path), lineno, "not valid JSON; cannot detect the format") from None
            if not isinstance(obj, dict):
                raise TraceFormatError(str(path), lineno, "expected a JSON object; cannot detect the format")
            if "tokens" in obj:
                return "tokens"
            if "chat_id" in obj:
                return "bailian"
            if "hash_ids" in obj:
                return "mooncake"
            raise TraceFormatError(str(path), lineno, f"unknown trace format (fields {sorted(obj)}); pass --format mooncake|bailian|tokens")
    raise TraceFormatError(str(path), None, "empty trace")


def read_trace(path: str | Path, format: Format | None = None, block_size_tokens: int | None = None, **kw: Any) -> Trace:
    """Read any supported trace; the format is detected when not given."""
    fmt = format or detect_format(path)
    if fmt not in FORMATS:
        raise ConfigError("format", f"must be one of {FORMATS}, got {fmt!r}")
    if fmt == "mooncake":
        return read_mooncake(path, block_size_tokens or 512, **kw)
    if fmt == "bailian":
        return read_bailian(path, block_size_tokens or 16, **kw)
    return read_tokens_jsonl(path, block_size_tokens or 16, **kw)
