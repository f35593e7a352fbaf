"""Test helpers: the published prefix-trace strategy and a flat-stream trace builder."""

import numpy as np

from kvpolicy.testing.strategies import prefix_traces
from kvpolicy.traces import Trace


def flat_trace(ids, block_size=2):
    """Each access its own request of one full block (+1 token so it is matchable)."""
    ids = np.asarray(ids, dtype=np.int64)
    n = ids.size
    return Trace(arrival_s=np.arange(n, dtype=float), input_tokens=np.full(n, block_size + 1), output_tokens=np.ones(n, np.int64),
                 block_offsets=np.arange(n + 1), block_ids=ids, partial_block_ids=np.arange(n) + (int(ids.max()) + 1 if n else 0),
                 block_size_tokens=block_size)

def chain_trace(requests, block_size=2):
    """One request per list of full block ids (+1 token, so every full block is matchable)."""
    ids = np.asarray([b for r in requests for b in r], dtype=np.int64)
    n = len(requests)
    lens = np.asarray([len(r) for r in requests])
    return Trace(arrival_s=np.arange(n, dtype=float), input_tokens=lens * block_size + 1, output_tokens=np.ones(n, np.int64),
                 block_offsets=np.concatenate([[0], np.cumsum(lens)]), block_ids=ids,
                 partial_block_ids=np.arange(n) + int(ids.max()) + 1, block_size_tokens=block_size)


__all__ = ["chain_trace", "flat_trace", "prefix_traces"]
