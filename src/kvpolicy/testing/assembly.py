"""Token traces with injected prompt-assembly nondeterminism (for diagnosis tests).

A prompt is assembled the way a chat service does it::

    system prompt [with a date at a fixed position] → [an insertion]
    → JSON context [key order] → tool definitions [order] → unique user message

Each cause can be switched on; with all off, requests share everything but the
user message. ``distinct=True`` makes every request's shared part different
(no false alarms expected).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..traces import Trace, canonicalize


def assembly_trace(n_requests: int = 40, *, date: bool = False, shuffle_tools: bool = False, json_key_order: bool = False,
                   insertion: bool = False, distinct: bool = False, block_size_tokens: int = 16, seed: int = 0,
                   system_tokens: int = 256, date_position: int = 40, n_tools: int = 6, tool_tokens: int = 96,
                   json_keys: int = 6, json_value_tokens: int = 6, user_tokens: int = 48) -> Trace:
    rng = np.random.default_rng(seed)
    vocab = 50_000
    system = rng.integers(1000, vocab, system_tokens)
    tools = [rng.integers(1000, vocab, tool_tokens) for _ in range(n_tools)]
    keys = [rng.integers(1000, vocab, 3) for _ in range(json_keys)]
    values = [rng.integers(1000, vocab, json_value_tokens) for _ in range(json_keys)]
    prompts = []
    for i in range(n_requests):
        r = np.random.default_rng([seed, i])
        sys_i = system.copy()
        if distinct:
            sys_i = r.integers(1000, vocab, system_tokens)
        if date:
            sys_i[date_position : date_position + 6] = r.integers(100, 999, 6)  # "2026-11-29 18:41"
        order = r.permutation(n_tools) if shuffle_tools else np.arange(n_tools)
        tool_part = np.concatenate([tools[j] if not distinct else r.integers(1000, vocab, tool_tokens) for j in order])
        korder = r.permutation(json_keys) if json_key_order else np.arange(json_keys)
        json_part = np.concatenate([np.concatenate([[7], keys[j], [8], values[j], [9]]) for j in korder])
        parts = [sys_i, json_part, tool_part]
        if insertion and i % 2 == 1:
            parts.insert(1, r.integers(1000, vocab, 12))  # e.g. a retry banner shifted everything after it
        parts.append(r.integers(1000, vocab, user_tokens))
        prompts.append(np.concatenate(parts).astype(np.uint32))
    return tokens_trace(prompts, block_size_tokens)


def tokens_trace(prompts: list[np.ndarray], block_size_tokens: int, arrival_s: Any = None) -> Trace:
    """A Trace (with raw tokens) from prompt arrays, keyed with the ``fast`` hasher."""
    from ..keys import BlockHasher, Namespace

    B = block_size_tokens
    h = BlockHasher(Namespace(model_id="assembly", model_revision="1", tokenizer_version="1", kv_dtype="bf16", block_size_tokens=B), "fast")
    key_ids: dict[bytes, int] = {}
    ids: list[int] = []
    offs = [0]
    partial: list[int] = []
    for p in prompts:
        for k in h.hash_blocks(p):
            ids.append(key_ids.setdefault(k, len(key_ids)))
        offs.append(len(ids))
        partial.append(-1 if p.size % B == 0 else 1 << 40 | len(partial))
    n = len(prompts)
    tok_off = np.zeros(n + 1, np.int64)
    np.cumsum([p.size for p in prompts], out=tok_off[1:])
    part = np.asarray(partial, dtype=np.int64)
    return canonicalize(Trace(
        arrival_s=np.arange(n, dtype=float) if arrival_s is None else arrival_s, input_tokens=np.asarray([p.size for p in prompts]),
        output_tokens=np.ones(n, np.int64), block_offsets=np.asarray(offs), block_ids=np.asarray(ids, dtype=np.int64),
        partial_block_ids=part, block_size_tokens=B, token_offsets=tok_off, tokens=np.concatenate(prompts) if prompts else np.zeros(0, np.uint32),
        request_ids=[f"req-{i}" for i in range(n)], source="assembly",
    ))
