"""Miss diagnosis: prompt-assembly determinism, and why a request missed.

Before blaming the cache, check that prompts are assembled deterministically:
one service inserts the date, another reorders the tools, a third serializes
JSON differently — the prompts look the same, the token sequences differ, and
nothing matches after the first changed token.

**Fingerprints.** Every prompt is cut by *content-defined chunking*: a gear
rolling hash over the tokens (``h = 2h + gear(token)``, so it depends on the last
~64 tokens only) marks a boundary where ``h & mask == 0`` (average
``2^mask_bits`` tokens, clamped to [``min_chunk``, ``max_chunk``]); each chunk gets
an unchained hash. An insertion moves boundaries only near itself, so shifted
content is still recognised. Both run in Numba.

**Detection.** For each request, the earlier request sharing the most chunk
tokens is found through an inverted index (each chunk remembers its ``K`` most
recent requests). If the share is ≥ ``min_shared`` but the token-level prefix
match with that request breaks at position k while ≥ ``min_lost_tokens`` of the
shared content lies after k, the request is flagged; its **lost hit tokens** are
the matched content after k, rounded down to whole blocks.

**Classification** (by where the sequences resynchronise after k):

* ``reordered`` — chunks after k appear in the earlier request in another order
  (tools, documents);
* ``varying-span`` — a short (≤ ``small_span``) differing span of equal length on
  both sides, not a permutation of each other (a timestamp, a request id);
* ``edited`` — a short differing span that is a permutation (JSON keys
  serialized in another order) or has a different length (an insertion that
  shifts the rest);
* ``other`` — anything else.

Flags are grouped by kind and position; each group has its count, the tokens it
cost and one worked example.
"""

from __future__ import annotations

import re
from collections import deque
from typing import Any

import attrs
import numba as nb
import numpy as np

from ._mix import splitmix64
from .errors import ConfigError
from .traces.model import check_trace

KINDS = ("varying-span", "reordered", "edited", "other")

_GEAR = np.random.default_rng(0x6B76).integers(0, 2**63, 4096, dtype=np.uint64)


@nb.njit(cache=True)
def cdc_kernel(tokens, offsets, gear, mask, min_chunk, max_chunk, starts, lens, hashes, chunk_offsets):
    """Content-defined chunks of every prompt. Returns the number of chunks."""
    n = 0
    for r in range(offsets.size - 1):
        chunk_offsets[r] = n
        s = offsets[r]
        e = offsets[r + 1]
        h = np.uint64(0)
        start = s
        ch = np.uint64(0xCBF29CE484222325)
        for i in range(s, e):
            t = tokens[i]
            h = (h << np.uint64(1)) + gear[splitmix64(t) & np.uint64(4095)]
            ch = (ch ^ np.uint64(t)) * np.uint64(0x100000001B3)
            size = i - start + 1
            if (size >= min_chunk and (h & np.uint64(mask)) == 0) or size >= max_chunk or i == e - 1:
                starts[n] = start
                lens[n] = size
                hashes[n] = np.int64(splitmix64(ch ^ np.uint64(size)))
                n += 1
                start = i + 1
                h = np.uint64(0)
                ch = np.uint64(0xCBF29CE484222325)
    chunk_offsets[offsets.size - 1] = n
    return n


@attrs.frozen
class Flag:
    request: int
    request_id: str
    earlier: int
    earlier_id: str
    kind: str
    position_tokens: int
    lost_tokens: int
    shared_fraction: float
    span_request: tuple[int, int]  # differing span in this request [start, end)
    span_earlier: tuple[int, int]  # and in the earlier one


def _chunks(trace: Any, mask_bits: int, min_chunk: int, max_chunk: int) -> tuple[np.ndarray, ...]:
    if trace.tokens is None or trace.token_offsets is None:
        raise ConfigError("trace", f"{trace.source}: diagnosis needs raw tokens (a tokens JSONL trace)")
    total = int(trace.tokens.size)
    cap = total + len(trace) + 1
    starts = np.empty(cap, np.int64)
    lens = np.empty(cap, np.int64)
    hashes = np.empty(cap, np.int64)
    chunk_off = np.empty(len(trace) + 1, np.int64)
    n = cdc_kernel(trace.tokens, trace.token_offsets, _GEAR, (1 << mask_bits) - 1, min_chunk, max_chunk, starts, lens, hashes, chunk_off)
    return starts[:n], lens[:n], hashes[:n], chunk_off


def _lcp(a: np.ndarray, b: np.ndarray) -> int:
    m = min(a.size, b.size)
    if m == 0:
        return 0
    neq = np.flatnonzero(a[:m] != b[:m])
    return int(neq[0]) if neq.size else m


def classify(a: np.ndarray, b: np.ndarray, k: int, a_chunks: list[tuple[int, int, int]], b_chunks: list[tuple[int, int, int]],
             small_span: int) -> tuple[str, tuple[int, int], tuple[int, int], int]:
    """Kind, differing spans (earlier a, request b) and matched tokens of b after k."""
    pos_in_a: dict[int, int] = {}
    for s, ln, h in a_chunks:
        if s >= k:
            pos_in_a.setdefault(h, s)
    seq = [(s, ln, pos_in_a[h]) for s, ln, h in b_chunks if s >= k and h in pos_in_a]
    matched = sum(ln for _, ln, _ in seq)
    if not seq:
        return "other", (k, a.size), (k, b.size), 0
    pa = [p for _, _, p in seq]
    if any(y < x for x, y in zip(pa, pa[1:])):
        return "reordered", (k, a.size), (k, b.size), matched
    j, _, i = seq[0]
    while i > k and j > k and a[i - 1] == b[j - 1]:  # tighten the span to the exact resync point
        i -= 1
        j -= 1
    ra, rb = a[k:i], b[k:j]
    if max(ra.size, rb.size) > small_span:
        return "other", (k, i), (k, j), matched
    if ra.size == rb.size and not np.array_equal(np.sort(ra), np.sort(rb)):
        return "varying-span", (k, i), (k, j), matched
    return "edited", (k, i), (k, j), matched


@attrs.frozen
class Diagnosis:
    flags: tuple[Flag, ...]
    total_input_tokens: int
    ceiling_hit_tokens: int
    block_size_tokens: int

    @property
    def lost_hit_tokens(self) -> int:
        return sum(f.lost_tokens for f in self.flags)

    def patterns(self, position_bucket_tokens: int = 16) -> list[dict[str, Any]]:
        groups: dict[tuple[str, int], list[Flag]] = {}
        for f in self.flags:
            groups.setdefault((f.kind, f.position_tokens // position_bucket_tokens), []).append(f)
        out = []
        for (kind, _), fl in sorted(groups.items(), key=lambda kv: -sum(f.lost_tokens for f in kv[1])):
            ex = max(fl, key=lambda f: f.lost_tokens)
            out.append({
                "kind": kind, "position_tokens": int(np.median([f.position_tokens for f in fl])), "requests": len(fl),
                "lost_tokens": sum(f.lost_tokens for f in fl),
                "example": {"request": ex.request_id, "earlier": ex.earlier_id, "position_tokens": ex.position_tokens,
                            "span_request": list(ex.span_request), "span_earlier": list(ex.span_earlier)},
            })
        return out

    def to_dict(self) -> dict[str, Any]:
        lost = self.lost_hit_tokens
        return {
            "lost_hit_tokens": lost,
            "total_input_tokens": self.total_input_tokens,
            "lost_share_of_input": lost / max(self.total_input_tokens, 1),
            "ceiling_hit_tokens": self.ceiling_hit_tokens,
            "lost_share_of_ceiling_plus_lost": lost / max(self.ceiling_hit_tokens + lost, 1),
            "flagged_requests": len(self.flags),
            "patterns": self.patterns(),
            "worst": [attrs.asdict(f) for f in sorted(self.flags, key=lambda f: -f.lost_tokens)[:10]],
        }


def diagnose(trace: Any, *, min_shared: float = 0.8, min_lost_tokens: int | None = None, mask_bits: int = 4, min_chunk: int = 4,
             max_chunk: int = 64, small_span: int = 64, candidates_per_chunk: int = 4) -> Diagnosis:
    """Find requests whose prefix match breaks early although their content was seen."""
    check_trace(trace)
    if not 0 < min_shared <= 1:
        raise ConfigError("min_shared", f"must be in (0, 1], got {min_shared}")
    from .analysis import PrefixMRC

    B = trace.block_size_tokens
    min_lost = 2 * B if min_lost_tokens is None else min_lost_tokens
    starts, lens, hashes, coff = _chunks(trace, mask_bits, min_chunk, max_chunk)
    toff = trace.token_offsets
    index: dict[int, deque] = {}
    flags = []
    ids = trace.request_ids or tuple(str(i) for i in range(len(trace)))
    for r in range(len(trace)):
        cs, ce = int(coff[r]), int(coff[r + 1])
        base = int(toff[r])
        score: dict[int, int] = {}
        for c in range(cs, ce):
            q = index.get(int(hashes[c]))
            if q:
                ln = int(lens[c])
                for j in set(q):
                    score[j] = score.get(j, 0) + ln
        n_tok = int(toff[r + 1] - toff[r])
        if score and n_tok:
            best = max(score, key=lambda j: (score[j], j))
            shared = score[best] / n_tok
            if shared >= min_shared:
                a = trace.prompt(best)
                b = trace.prompt(r)
                k = _lcp(a, b)
                if k < b.size:
                    a_base = int(toff[best])
                    a_chunks = [(int(starts[c]) - a_base, int(lens[c]), int(hashes[c])) for c in range(int(coff[best]), int(coff[best + 1]))]
                    b_chunks = [(int(starts[c]) - base, int(lens[c]), int(hashes[c])) for c in range(cs, ce)]
                    kind, span_a, span_b, matched = classify(a, b, k, a_chunks, b_chunks, small_span)
                    matchable = (n_tok - 1) // B * B
                    lost = min(matched, max(matchable - k, 0)) // B * B
                    if lost >= min_lost:
                        flags.append(Flag(r, str(ids[r]), best, str(ids[best]), kind, k, lost, shared, span_b, span_a))
        for c in range(cs, ce):
            q = index.setdefault(int(hashes[c]), deque(maxlen=candidates_per_chunk))
            if not q or q[-1] != r:
                q.append(r)
    ceiling = PrefixMRC.from_trace(trace).ceiling_blocks * B
    return Diagnosis(tuple(flags), trace.total_input_tokens, ceiling, B)


def _request_index(trace: Any, request_id: str) -> int:
    """The request ``request_id`` names: its id (the row's position when the trace has none), or ``#N`` — the N-th
    request (from 0) in arrival order, for an id several requests share (a retry reuses its id); a shared id is an
    error listing their positions, not the first of them picked silently."""
    if re.fullmatch(r"#[0-9]+", request_id):
        r = int(request_id[1:])
        if r >= len(trace):
            raise ConfigError("--request", f"{request_id}: {trace.source} has {len(trace)} requests (#0 to #{len(trace) - 1})")
        return r
    ids = [str(x) for x in trace.request_ids] if trace.request_ids else [str(i) for i in range(len(trace))]
    where = [i for i, x in enumerate(ids) if x == request_id]
    if not where:
        raise ConfigError("--request", f"no request {request_id!r} in {trace.source}")
    if len(where) > 1:
        shown = ", ".join(f"#{i}" for i in where[:5]) + (", ..." if len(where) > 5 else "")
        raise ConfigError("--request", f"{len(where)} requests in {trace.source} have the id {request_id!r} ({shown}): name one by its position, e.g. --request '#{where[-1]}'")
    return where[0]


def explain(trace: Any, request_id: str, diagnosis: Diagnosis | None = None, capacity_blocks: int | None = None) -> dict[str, Any]:
    """Why did this request miss what it missed — in the ledger's terms where they apply."""
    check_trace(trace)
    r = _request_index(trace, str(request_id))
    from .analysis.stack import request_stack_distances

    B = trace.block_size_tokens
    d = request_stack_distances(trace.block_offsets, trace.block_ids)
    s, e = int(trace.block_offsets[r]), int(trace.block_offsets[r + 1])
    m = int(trace.matchable_blocks[r])
    run = 0
    while run < min(e - s, m) and d[s + run] >= 0:
        run += 1
    out: dict[str, Any] = {"request": str(request_id), "input_tokens": int(trace.input_tokens[r]), "reusable_tokens_infinite_cache": run * B}
    reasons = []
    if run == 0 and (e - s) > 0:
        reasons.append("never seen: no earlier request shares its first block")
    diag = diagnosis or diagnose(trace)
    flag = next((f for f in diag.flags if f.request == r), None)
    if flag is not None:
        reasons.append(f"diverged from request {flag.earlier_id} at token {flag.position_tokens} ({flag.kind}); {flag.lost_tokens} tokens of shared content lost")
        out["divergence"] = attrs.asdict(flag)
    if capacity_blocks:
        from .eviction.kernels import replay_kernel

        res = replay_kernel(trace, "lru", capacity_blocks)
        hit = int(res.hits[s : s + run].sum())
        if hit < run:
            reasons.append(f"evicted: {run - hit} of the {run} previously seen leading blocks were gone from an LRU cache of {capacity_blocks} blocks")
        out["lru_hit_tokens"] = hit * B
    if not reasons:
        reasons.append("no avoidable miss: everything reusable was a hit" if run else "nothing to reuse")
    out["reasons"] = reasons
    return out
