"""The trace model: columnar, numpy-backed, block references in CSR form.

One row per request, in arrival order:

* ``arrival_s``, ``input_tokens``, ``output_tokens``;
* the **full** blocks of the prompt as chained prefix-block ids in CSR form —
  ``block_ids[block_offsets[i]:block_offsets[i + 1]]`` — where equal id means the
  same reusable KV block (the same prefix up to and including it);
* the trailing **partial** block kept apart in ``partial_block_ids`` (−1 when the
  prompt is a whole number of blocks), so it can never count as a hit;
* optional labels: tenant, request class and session, as small ints with name tables.

Block ids are dense (0..num_block_ids−1) and numbered by first appearance, so
two traces with the same structure compare equal whatever ids the source used.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import attrs
import numba as nb
import numpy as np

from ..errors import ConfigError


def _arr(dtype: Any) -> Any:
    return attrs.field(converter=lambda a: np.ascontiguousarray(a, dtype=dtype))


def _str_tuple(x: Iterable[str]) -> tuple[str, ...]:
    return tuple(x)


def _int_tuple(x: Iterable[int]) -> tuple[int, ...]:
    return tuple(x)


def _opt_labels() -> Any:
    return attrs.field(default=None, converter=lambda a: None if a is None else np.ascontiguousarray(a, dtype=np.int32))


@attrs.frozen(eq=False)
class Trace:
    arrival_s: np.ndarray = _arr(np.float64)
    input_tokens: np.ndarray = _arr(np.int64)
    output_tokens: np.ndarray = _arr(np.int64)
    block_offsets: np.ndarray = _arr(np.int64)
    block_ids: np.ndarray = _arr(np.int64)
    partial_block_ids: np.ndarray = _arr(np.int64)
    block_size_tokens: int = attrs.field(default=512)
    tenant: np.ndarray | None = _opt_labels()
    tenant_names: tuple[str, ...] = attrs.field(default=(), converter=_str_tuple)
    request_class: np.ndarray | None = _opt_labels()
    class_names: tuple[str, ...] = attrs.field(default=(), converter=_str_tuple)
    session: np.ndarray | None = _opt_labels()
    #: optional raw prompts (CSR, uint32) — generic token traces keep them for diagnosis
    token_offsets: np.ndarray | None = attrs.field(default=None, converter=lambda a: None if a is None else np.ascontiguousarray(a, dtype=np.int64))
    tokens: np.ndarray | None = attrs.field(default=None, converter=lambda a: None if a is None else np.ascontiguousarray(a, dtype=np.uint32))
    request_ids: tuple[str, ...] = attrs.field(default=(), converter=_str_tuple)
    #: optional: per request, how many leading tokens the application allows to be shared
    #: (system prompt, template, documents) — everything after it is private
    publish_boundary_tokens: np.ndarray | None = attrs.field(default=None, converter=lambda a: None if a is None else np.ascontiguousarray(a, dtype=np.int64))
    source: str = "<memory>"
    skipped_lines: tuple[int, ...] = attrs.field(default=(), converter=_int_tuple)

    def __attrs_post_init__(self) -> None:
        n = self.arrival_s.size
        B = self.block_size_tokens
        if isinstance(B, bool) or not isinstance(B, int) or B <= 0:
            raise ConfigError("block_size_tokens", f"must be a positive int, got {B!r}")
        for name in ("input_tokens", "output_tokens", "partial_block_ids"):
            if getattr(self, name).size != n:
                raise ConfigError(name, f"has {getattr(self, name).size} rows, arrival_s has {n}")
        if self.block_offsets.size != n + 1 or (n + 1 and self.block_offsets[0] != 0) or self.block_offsets[-1] != self.block_ids.size:
            raise ConfigError("block_offsets", "must have n + 1 entries from 0 to len(block_ids)")
        if n and np.any(np.diff(self.block_offsets) < 0):
            raise ConfigError("block_offsets", "must be non-decreasing")
        if n and np.any(np.diff(self.arrival_s) < 0):
            raise ConfigError("arrival_s", "requests must be in arrival order")
        if np.any(self.input_tokens < 0) or np.any(self.output_tokens < 0):
            raise ConfigError("input_tokens", "token counts must be non-negative")
        full = self.input_tokens // B
        if not np.array_equal(np.diff(self.block_offsets), full):
            bad = int(np.argmax(np.diff(self.block_offsets) != full))
            raise ConfigError("block_ids", f"request {bad} has {int(np.diff(self.block_offsets)[bad])} full blocks, input_tokens {int(self.input_tokens[bad])} needs {int(full[bad])}")
        has_partial = (self.input_tokens % B) != 0
        if np.any((self.partial_block_ids >= 0) != has_partial):
            bad = int(np.argmax((self.partial_block_ids >= 0) != has_partial))
            raise ConfigError("partial_block_ids", f"request {bad}: a partial block id is required exactly when input_tokens is not a multiple of {B}")
        if (self.tokens is None) != (self.token_offsets is None):
            raise ConfigError("tokens", "tokens and token_offsets come together")
        if self.tokens is not None and self.token_offsets is not None:
            if self.token_offsets.size != n + 1 or not np.array_equal(np.diff(self.token_offsets), self.input_tokens):
                raise ConfigError("token_offsets", "must give each request exactly input_tokens tokens")
        if self.publish_boundary_tokens is not None and (
            self.publish_boundary_tokens.size != n or np.any(self.publish_boundary_tokens < 0) or np.any(self.publish_boundary_tokens > self.input_tokens)
        ):
            raise ConfigError("publish_boundary_tokens", "must give each request a boundary in [0, input_tokens]")
        conflict = chain_conflict(self.block_offsets, self.block_ids)
        if conflict is not None:
            raise ConfigError("block_ids", conflict.message())
        if self.request_ids and len(self.request_ids) != n:
            raise ConfigError("request_ids", f"has {len(self.request_ids)} entries, expected {n}")
        for labels, names, field in ((self.tenant, self.tenant_names, "tenant"), (self.request_class, self.class_names, "request_class"), (self.session, None, "session")):
            if labels is None:
                continue
            if labels.size != n:
                raise ConfigError(field, f"has {labels.size} rows, expected {n}")
            if names is not None and labels.size and (labels.min() < 0 or labels.max() >= len(names)):
                raise ConfigError(field, "label out of range of its name table")

    # ------------------------------------------------------------------ views

    def __len__(self) -> int:
        return int(self.arrival_s.size)

    @property
    def num_block_ids(self) -> int:
        """Number of distinct ids (full and partial share one id space)."""
        m = -1
        if self.block_ids.size:
            m = int(self.block_ids.max())
        if self.partial_block_ids.size:
            m = max(m, int(self.partial_block_ids.max()))
        return m + 1

    @property
    def full_blocks(self) -> np.ndarray:
        """Full blocks per request."""
        return np.diff(self.block_offsets)

    @property
    def matchable_blocks(self) -> np.ndarray:
        """Blocks per request that can be hits: ``floor((T − 1) / B)`` (the last token is recomputed)."""
        t = np.maximum(self.input_tokens - 1, 0)
        B = self.block_size_tokens
        if B & (B - 1) == 0:  # a power of two: a shift, ~10x cheaper than integer division over millions of rows
            return t >> (B.bit_length() - 1)
        return t // B

    @property
    def total_input_tokens(self) -> int:
        return int(self.input_tokens.sum())

    @property
    def duration_s(self) -> float:
        return float(self.arrival_s[-1] - self.arrival_s[0]) if len(self) else 0.0

    def blocks(self, i: int) -> np.ndarray:
        return self.block_ids[self.block_offsets[i] : self.block_offsets[i + 1]]

    def request_of_block_ref(self) -> np.ndarray:
        """For every entry of ``block_ids``, the request it belongs to."""
        return np.repeat(np.arange(len(self), dtype=np.int64), self.full_blocks)

    def position_of_block_ref(self) -> np.ndarray:
        """For every entry of ``block_ids``, its block index inside its request."""
        return np.arange(self.block_ids.size, dtype=np.int64) - np.repeat(self.block_offsets[:-1], self.full_blocks)

    def matchable_mask(self) -> np.ndarray:
        """For every entry of ``block_ids``: may it count as a hit (prefix and last-token rules)?"""
        return self.position_of_block_ref() < np.repeat(self.matchable_blocks, self.full_blocks)

    def head(self, n: int) -> Trace:
        """The first n requests."""
        n = min(n, len(self))
        end = int(self.block_offsets[n])
        kw = attrs.asdict(self, recurse=False)
        kw.update(
            arrival_s=self.arrival_s[:n], input_tokens=self.input_tokens[:n], output_tokens=self.output_tokens[:n],
            block_offsets=self.block_offsets[: n + 1], block_ids=self.block_ids[:end], partial_block_ids=self.partial_block_ids[:n],
            tenant=None if self.tenant is None else self.tenant[:n],
            request_class=None if self.request_class is None else self.request_class[:n],
            session=None if self.session is None else self.session[:n],
            token_offsets=None if self.token_offsets is None else self.token_offsets[: n + 1],
            tokens=None if self.tokens is None or self.token_offsets is None else self.tokens[: int(self.token_offsets[n])],
            request_ids=self.request_ids[:n],
            publish_boundary_tokens=None if self.publish_boundary_tokens is None else self.publish_boundary_tokens[:n],
        )
        return canonicalize(Trace(**kw))

    def prompt(self, i: int) -> np.ndarray:
        """Raw token ids of request i (only for traces that kept them)."""
        if self.tokens is None or self.token_offsets is None:
            raise ConfigError("tokens", f"{self.source}: this trace has no raw tokens (read a tokens JSONL with keep_tokens=True)")
        return self.tokens[self.token_offsets[i] : self.token_offsets[i + 1]]

    def iter_requests(self) -> Iterator[tuple[float, int, int, np.ndarray, int]]:
        for i in range(len(self)):
            yield float(self.arrival_s[i]), int(self.input_tokens[i]), int(self.output_tokens[i]), self.blocks(i), int(self.partial_block_ids[i])

    def to_mooncake_jsonl(self, path: str | Path) -> None:
        """Write as Mooncake JSONL (``timestamp`` ms, ``hash_ids`` with the partial block last)."""
        with open(path, "w") as f:
            for t, inp, out, blocks, partial in self.iter_requests():
                ids = blocks.tolist() + ([partial] if partial >= 0 else [])
                f.write(json.dumps({"timestamp": int(round(t * 1000)), "input_length": inp, "output_length": out, "hash_ids": ids}) + "\n")

    def summary(self) -> dict[str, Any]:
        return {
            "requests": len(self),
            "block_size_tokens": self.block_size_tokens,
            "input_tokens": self.total_input_tokens,
            "output_tokens": int(self.output_tokens.sum()),
            "block_refs": int(self.block_ids.size),
            "distinct_blocks": int(np.unique(self.block_ids).size) if self.block_ids.size else 0,
            "duration_s": self.duration_s,
        }


@nb.njit(cache=True)
def _min_max(a):  # pragma: no cover - compiled
    """Both in one pass over the ids: numpy's min() and max() read them twice (6–10 ms against 4.5–5 ms on 10M ids,
    a fifth of SHARDS' time at R = 0.01)."""
    lo = a[0]
    hi = a[0]
    for i in range(1, a.size):  # min() and max(), not branches: the loop vectorises
        x = a[i]
        lo = min(lo, x)
        hi = max(hi, x)
    return lo, hi


def check_trace(trace: Any, field: str = "trace") -> Trace:
    """``trace`` itself when it is a :class:`Trace` whose ids the kernels can index; else a ConfigError naming ``field``
    (not an AttributeError from whatever first reads a column, nor a MemoryError from deep inside numpy or Numba)."""
    if not isinstance(trace, Trace):
        raise ConfigError(field, f"must be a kvpolicy.traces.Trace (read_trace(path) or generate(preset(...)) gives one), got {type(trace).__name__}")
    n = len(trace)
    ids, partial = trace.block_ids, trace.partial_block_ids
    lo, hi = _min_max(ids) if ids.size else (0, -1)  # one pass: every consumer calls this, each replay of a bench too
    p_lo, p_hi = _min_max(partial) if n else (-1, -1)
    if lo < 0 or p_lo < -1:
        raise ConfigError(field, "block ids are non-negative (a partial block id of -1 means the request has none)")
    refs = ids.size + n
    top = max(int(hi), int(p_hi))
    if top + 1 > 4 * refs + (1 << 20):
        # every kernel and table keeps a record per id, indexed by it: a trace built by hand from raw 64-bit hashes
        # would size them by its largest id (8 bytes x 10**15 ...) and fail deep inside numpy or Numba
        raise ConfigError(field, f"block ids must be dense: the largest is {top:,} for {refs:,} block references; renumber them with "
                          "kvpolicy.traces.canonicalize(trace) (the trace readers and generate() do)")
    return trace


@attrs.frozen
class ChainConflict:
    """Two references of one block id with different predecessors: ``request``'s block ``position`` against the
    earlier ``first_request``'s block ``first_position`` (a predecessor of −1: the block starts its request)."""

    block_id: int
    request: int
    position: int
    predecessor: int
    first_request: int
    first_position: int
    first_predecessor: int

    def message(self, where: str | None = None, first_where: str | None = None) -> str:
        def pred(p: int) -> str:
            return "nothing (it starts the request)" if p < 0 else f"id {p}"

        where = where or f"request {self.request}, block {self.position}"
        first_where = first_where or f"request {self.first_request}, block {self.first_position}"
        return (f"{where}: block id {self.block_id} follows {pred(self.predecessor)}, but {pred(self.first_predecessor)} at "
                f"{first_where}; block ids must be chained — an id stands for its whole prefix, so it always follows the "
                "same id (Mooncake's hash_ids are; per-block content hashes are not: use --format bailian)")


@nb.njit(cache=True)
def _chain_kernel(off, ids, lo, span, stop_at_first, bad_requests):  # pragma: no cover - compiled
    """Requests in order; an id's first reference fixes its predecessor (−1: it starts its request). A request with a
    reference that disagrees is bad and its own first sightings are undone (a bad request teaches nothing). Returns
    (bad requests written to ``bad_requests``, the first offending reference, the earlier reference it contradicts)."""
    pred = np.full(span, -2, dtype=np.int64)  # −2: not seen; −1: starts a request; else the predecessor's slot
    first_ref = np.empty(span, dtype=np.int64)
    longest = 0
    for r in range(off.size - 1):
        longest = max(longest, off[r + 1] - off[r])
    written = np.empty(max(longest, 1), dtype=np.int64)
    n_bad = 0
    fb = -1
    fa = -1
    for r in range(off.size - 1):
        nw = 0
        ok = True
        for x in range(off[r], off[r + 1]):
            k = ids[x] - lo
            p = -1 if x == off[r] else ids[x - 1] - lo
            q = pred[k]
            if q == -2:
                pred[k] = p
                first_ref[k] = x
                written[nw] = k
                nw += 1
            elif q != p:
                ok = False
                if fb < 0:
                    fb = x
                    fa = first_ref[k]
                break
        if not ok:
            for w in range(nw):
                pred[written[w]] = -2
            bad_requests[n_bad] = r
            n_bad += 1
            if stop_at_first:
                break
    return n_bad, fb, fa


def chain_check(block_offsets: np.ndarray, block_ids: np.ndarray, *, all_bad: bool = False) -> tuple[np.ndarray, ChainConflict | None]:
    """Requests whose block ids are not chained: an id's first reference fixes what it follows (another id, or the
    start of its request); a later reference that follows anything else makes its request bad, and a bad request's
    own first sightings do not count. Returns (the bad requests — only the first unless ``all_bad`` —, the first
    conflict). O(references) through a lookup table when the ids are dense (as trace ids are), else after a remap."""
    ids = np.ascontiguousarray(block_ids, dtype=np.int64)
    off = np.ascontiguousarray(block_offsets, dtype=np.int64)
    bad = np.empty(max(off.size - 1, 0), dtype=np.int64)
    if ids.size < 2:
        return bad[:0], None
    lo, hi = int(ids.min()), int(ids.max())
    keys = ids
    if hi - lo + 1 > max(4 * ids.size, 1 << 20):  # sparse: a table over the span would not fit
        keys = first_appearance_ids(ids)
        lo, hi = 0, int(keys.max())
    n_bad, fb, fa = _chain_kernel(off, keys, lo, hi - lo + 1, not all_bad, bad)
    if fb < 0:
        return bad[:0], None
    rb = int(np.searchsorted(off, fb, side="right") - 1)
    ra = int(np.searchsorted(off, fa, side="right") - 1)

    def pred(x: int, r: int) -> int:
        return -1 if x == off[r] else int(ids[x - 1])

    return bad[:n_bad], ChainConflict(int(ids[fb]), rb, fb - int(off[rb]), pred(fb, rb), ra, fa - int(off[ra]), pred(fa, ra))


def chain_conflict(block_offsets: np.ndarray, block_ids: np.ndarray) -> ChainConflict | None:
    """The first reference (in trace order) of a block id whose predecessor differs from that id's first reference —
    None when every id always follows the same id (or always starts its request). A prefix cache keyed by such ids
    would hold a block whose prefix differs between requests, and the leaf-first eviction of the replay kernels
    never terminates on the cycles they can form ([1, 2] then [2, 1], or [1, 1])."""
    return chain_check(block_offsets, block_ids)[1]


def canonical_ids(block_offsets: np.ndarray, block_ids: np.ndarray, partial_block_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(full block ids, partial block ids) renumbered densely by first appearance — full blocks, then the partial
    one, request by request — on the arrays, so a reader can build its Trace once, already canonical."""
    n = partial_block_ids.size
    full = np.diff(block_offsets)
    counts = full + (partial_block_ids >= 0)
    stream = np.empty(int(counts.sum()), dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64) if n else np.zeros(0, np.int64)
    full_pos = np.repeat(starts, full) + (np.arange(block_ids.size, dtype=np.int64) - np.repeat(block_offsets[:-1], full))
    stream[full_pos] = block_ids
    has_p = partial_block_ids >= 0
    part_pos = starts[has_p] + full[has_p]
    stream[part_pos] = partial_block_ids[has_p]
    dense = first_appearance_ids(stream)
    partial = np.full(n, -1, dtype=np.int64)
    partial[has_p] = dense[part_pos]
    return dense[full_pos], partial


def canonicalize(trace: Trace) -> Trace:
    """Renumber ids densely by first appearance (full blocks, then the partial one, request by request)."""
    full, partial = canonical_ids(trace.block_offsets, trace.block_ids, trace.partial_block_ids)
    return attrs.evolve(trace, block_ids=full, partial_block_ids=partial)


@nb.njit(cache=True)
def _first_appearance_table(ids, lo, span):
    table = np.full(span, -1, dtype=np.int64)
    out = np.empty(ids.size, dtype=np.int64)
    nxt = 0
    for i in range(ids.size):
        k = ids[i] - lo
        v = table[k]
        if v < 0:
            v = nxt
            table[k] = v
            nxt += 1
        out[i] = v
    return out


def first_appearance_ids(ids: np.ndarray) -> np.ndarray:
    """Map arbitrary int ids to 0.. in order of first appearance.

    O(N) through a lookup table when the id range is at most ~4× the number of
    accesses (ids from traces usually are); sort-based otherwise.
    """
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    if ids.size == 0:
        return ids
    lo, hi = int(ids.min()), int(ids.max())
    span = hi - lo + 1
    if span <= max(4 * ids.size, 1 << 20):
        return _first_appearance_table(ids, lo, span)
    uniq, first, inv = np.unique(ids, return_index=True, return_inverse=True)
    order = np.argsort(first, kind="stable")
    rank = np.empty(uniq.size, dtype=np.int64)
    rank[order] = np.arange(uniq.size, dtype=np.int64)
    return rank[inv.reshape(-1)]
