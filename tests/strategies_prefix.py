"""Shared Hypothesis strategy: request-level chained prefix traces."""

import numpy as np
from hypothesis import strategies as st

from kvpolicy.traces import Trace, canonicalize


@st.composite
def prefix_traces(draw, max_requests=25, block_sizes=(1, 2, 4)):
    B = draw(st.sampled_from(list(block_sizes)))
    n = draw(st.integers(1, max_requests))
    chains: list[list[int]] = []
    next_id = 0
    rows = []
    for _ in range(n):
        if chains and draw(st.booleans()):
            base = draw(st.sampled_from(chains))
            chain = base[: draw(st.integers(0, len(base)))]
        else:
            chain = []
        for _ in range(draw(st.integers(0, 4))):
            chain = chain + [next_id]
            next_id += 1
        chains.append(chain)
        rows.append((chain, draw(st.integers(0, B - 1))))
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum([len(c) for c, _ in rows], out=offsets[1:])
    ids = np.asarray([x for c, _ in rows for x in c], dtype=np.int64)
    inp = np.asarray([len(c) * B + t for c, t in rows], dtype=np.int64)
    partial = np.where(inp % B != 0, next_id + np.arange(n), -1)
    tr = Trace(arrival_s=np.arange(n, dtype=float), input_tokens=inp, output_tokens=np.ones(n, np.int64), block_offsets=offsets, block_ids=ids, partial_block_ids=partial, block_size_tokens=B)
    return canonicalize(tr)


def flat_trace(ids, block_size=2):
    """Each access its own request of one full block (+1 token so it is matchable)."""
    ids = np.asarray(ids, dtype=np.int64)
    n = ids.size
    return Trace(arrival_s=np.arange(n, dtype=float), input_tokens=np.full(n, block_size + 1), output_tokens=np.ones(n, np.int64),
                 block_offsets=np.arange(n + 1), block_ids=ids, partial_block_ids=np.arange(n) + (int(ids.max()) + 1 if n else 0),
                 block_size_tokens=block_size)
