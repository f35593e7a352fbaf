"""Hypothesis strategies for prefix-cache policies.

Small alphabets by default, so shrinking yields readable counterexamples.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import strategies as st

from ..admission.model import LinkPrior
from ..keys import KV_DTYPE_BYTES, Namespace
from ..traces import Trace, canonicalize


def namespaces(block_sizes: tuple[int, ...] = (4, 16)) -> st.SearchStrategy[Namespace]:
    return st.builds(
        Namespace,
        model_id=st.sampled_from(["m1", "m2"]),
        model_revision=st.sampled_from(["r1", "r2"]),
        tokenizer_version=st.just("t1"),
        kv_dtype=st.sampled_from(sorted(KV_DTYPE_BYTES)),
        block_size_tokens=st.sampled_from(list(block_sizes)),
        position_encoding=st.fixed_dictionaries({"rope_theta": st.sampled_from([10000, 500000])}),
        tenant=st.sampled_from(["a", "b"]),
        data_class=st.sampled_from(["public", "shared", "private"]),
    )


def block_sizes() -> st.SearchStrategy[int]:
    return st.sampled_from([1, 2, 4, 16])


def capacities(max_blocks: int = 16) -> st.SearchStrategy[int]:
    return st.integers(1, max_blocks)


@st.composite
def token_sequences(draw: Any, vocab: int = 8, max_requests: int = 8) -> list[list[int]]:
    """Prompts with shared structure: system prompt → shared document → private
    tail, multi-turn growth (a turn extends an earlier prompt) and branching."""
    system = draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=8))
    docs = draw(st.lists(st.lists(st.integers(0, vocab - 1), min_size=0, max_size=8), min_size=1, max_size=3))
    prompts: list[list[int]] = []
    for _ in range(draw(st.integers(1, max_requests))):
        kind = draw(st.sampled_from(["new", "turn", "branch"])) if prompts else "new"
        tail = draw(st.lists(st.integers(0, vocab - 1), max_size=6))
        if kind == "new":
            prompts.append(system + draw(st.sampled_from(docs)) + tail)
        else:
            base = draw(st.sampled_from(prompts))
            cut = len(base) if kind == "turn" else draw(st.integers(0, len(base)))
            prompts.append(base[:cut] + tail)
    return prompts


@st.composite
def prefix_traces(draw: Any, max_requests: int = 25, shape: str | None = None, block_size_tokens: int | None = None) -> Trace:
    """Request-level chained traces (Mooncake/Bailian-shaped: chained block ids,
    a partial last block) with controllable reuse: ``zipf`` (popular chains),
    ``loop`` (a cycle of chains), ``scan`` (no reuse), ``sessions`` (multi-turn
    growth), or a mix."""
    B = block_size_tokens or draw(st.sampled_from([1, 2, 4]))
    kind = shape or draw(st.sampled_from(["zipf", "loop", "scan", "sessions", "mixed"]))
    n = draw(st.integers(1, max_requests))
    chains: list[list[int]] = []
    nxt = 0
    rows = []
    for i in range(n):
        if kind == "scan" or not chains:
            chain: list[int] = []
        elif kind == "loop":
            chain = list(chains[i % min(len(chains), 3)])
        elif kind == "zipf":
            k = min(int(draw(st.integers(1, 8)) ** 1.5) - 1, len(chains) - 1)
            base = chains[k]
            chain = base[: draw(st.integers(0, len(base)))]
        elif kind == "sessions":
            chain = list(chains[-1]) if draw(st.booleans()) else []
        else:
            base = draw(st.sampled_from(chains))
            chain = base[: draw(st.integers(0, len(base)))] if draw(st.booleans()) else []
        for _ in range(draw(st.integers(0 if chain else 1, 3))):
            chain = chain + [nxt]
            nxt += 1
        chains.append(chain)
        rows.append((chain, draw(st.integers(0, B - 1))))
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum([len(c) for c, _ in rows], out=offsets[1:])
    ids = np.asarray([x for c, _ in rows for x in c], dtype=np.int64)
    inp = np.asarray([len(c) * B + t for c, t in rows], dtype=np.int64)
    partial = np.where(inp % B != 0, nxt + np.arange(n), -1)
    return canonicalize(Trace(arrival_s=np.arange(n, dtype=float), input_tokens=inp, output_tokens=np.ones(n, np.int64),
                              block_offsets=offsets, block_ids=ids, partial_block_ids=partial, block_size_tokens=B))


def latency_distributions(max_size: int = 50) -> st.SearchStrategy[list[float]]:
    """Positive latencies with long tails (seconds)."""
    return st.lists(st.floats(1e-5, 1.0).map(lambda x: x**3 * 10), min_size=1, max_size=max_size)


def link_figures() -> st.SearchStrategy[LinkPrior]:
    return st.builds(
        LinkPrior,
        bandwidth_bytes_per_s=st.floats(1e8, 1e11),
        lookup_s=st.floats(0, 0.005),
        transfer_overhead_s=st.floats(0, 0.002),
        install_s_per_block=st.floats(0, 1e-4),
        dispatch_s=st.floats(0, 0.01),
    )
