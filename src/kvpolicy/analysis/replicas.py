"""Replica view: where reuse lands under a routing rule, and what it costs in bytes.

With N replicas and a router, each reuse of a block is either on the **same
replica** as an earlier use (a local cache could serve it) or only on **another**
(only a shared pool could). Per request, under the prefix rule and with infinite
caches:

    G = leading matchable blocks seen before anywhere     (the ceiling)
    L = leading matchable blocks seen before on this replica   (L ≤ G)
    cross-replica = G − L

Byte flows with a shared pool (infinite, deduplicating):

    R_read            = bytes of cross-replica blocks (read from the pool)
    R_write(all)      = bytes of every block's first appearance (publish everything)
    R_write(re-read)  = bytes of first appearances later read by another replica

each as a mean over the trace and over its worst 15-minute window.
"""

from __future__ import annotations

from typing import Any, Literal

import attrs
import numba as nb
import numpy as np

from .._mix import splitmix64
from .._validate import check_non_negative_int, check_non_negative_number, check_positive_int
from ..errors import ConfigError
from ..traces.model import check_trace

Routing = Literal["random", "round-robin", "prefix-affinity"]
ROUTINGS: tuple[str, ...] = ("random", "round-robin", "prefix-affinity")
WINDOW_S = 900.0


@nb.njit(cache=True)
def _rendezvous(keys, n_replicas, seed, out):
    """Highest-random-weight hashing: stable when replicas are added or removed."""
    for i in range(keys.size):
        best = np.uint64(0)
        arg = 0
        for r in range(n_replicas):
            w = splitmix64((np.uint64(keys[i]) * np.uint64(1000003)) ^ splitmix64(np.uint64(r) + np.uint64(seed)))
            if r == 0 or w > best:
                best = w
                arg = r
        out[i] = arg


def route(trace: Any, n_replicas: int, routing: Routing = "round-robin", *, affinity_blocks: int = 4, seed: int = 0) -> np.ndarray:
    """Replica of every request. ``prefix-affinity`` hashes the chain id of the first k full blocks."""
    if isinstance(n_replicas, bool) or not isinstance(n_replicas, int) or n_replicas <= 0:
        raise ConfigError("replicas", f"must be a positive int, got {n_replicas!r}")
    if routing not in ROUTINGS:
        raise ConfigError("routing", f"must be one of {ROUTINGS}, got {routing!r}")
    check_positive_int("affinity_blocks", affinity_blocks)  # checked whatever the routing: a bad one is a caller's bug
    check_non_negative_int("seed", seed)  # a NaN seed went into the rendezvous hash as a float
    n = len(trace)
    if routing == "round-robin":
        return (np.arange(n) % n_replicas).astype(np.int32)
    if routing == "random":
        return np.random.default_rng(seed).integers(0, n_replicas, n).astype(np.int32)
    depth = np.minimum(trace.full_blocks, affinity_blocks)
    has = depth > 0
    keys = np.empty(n, dtype=np.int64)
    keys[has] = trace.block_ids[trace.block_offsets[:-1][has] + depth[has] - 1]
    keys[~has] = (1 << 40) + trace.partial_block_ids[~has]  # no full block: spread by the partial id
    out = np.empty(n, dtype=np.int32)
    _rendezvous(keys.astype(np.int64), n_replicas, seed, out)
    return out


@nb.njit(cache=True)
def _replica_kernel(offsets, ids, matchable, replica, n_ids, n_replicas, g_out, l_out, first_ref, cross_ref):
    words = (n_replicas + 63) // 64
    seen = np.zeros((n_ids, words), dtype=np.uint64)
    any_seen = np.zeros(n_ids, dtype=np.bool_)
    for r in range(offsets.size - 1):
        p = replica[r]
        w = p // 64
        bit = np.uint64(1) << np.uint64(p % 64)
        g = 0
        loc = 0
        g_open = True
        l_open = True
        for j in range(offsets[r], offsets[r + 1]):
            x = ids[j]
            if not matchable[j]:
                break
            if g_open and any_seen[x]:
                g += 1
                if l_open and (seen[x, w] & bit) != 0:
                    loc += 1
                else:
                    l_open = False
                    cross_ref[j] = True
            else:
                break
        g_out[r] = g
        l_out[r] = loc
        for j in range(offsets[r], offsets[r + 1]):
            x = ids[j]
            if not any_seen[x]:
                first_ref[j] = True
            any_seen[x] = True
            seen[x, w] |= bit


@attrs.frozen(eq=False)
class ReplicaView:
    routing: str
    replicas: int
    global_blocks: np.ndarray  # per request: G
    local_blocks: np.ndarray  # per request: L
    read_bytes: np.ndarray  # per request
    write_all_bytes: np.ndarray
    write_reread_bytes: np.ndarray
    arrival_s: np.ndarray
    block_size_tokens: int
    total_input_tokens: int

    @property
    def local_tokens(self) -> int:
        return int(self.local_blocks.sum()) * self.block_size_tokens

    @property
    def cross_tokens(self) -> int:
        return int((self.global_blocks - self.local_blocks).sum()) * self.block_size_tokens

    @property
    def ceiling_tokens(self) -> int:
        return int(self.global_blocks.sum()) * self.block_size_tokens

    def flows(self, window_s: float = WINDOW_S) -> dict[str, Any]:
        duration = float(self.arrival_s[-1] - self.arrival_s[0]) if self.arrival_s.size else 0.0
        w = min(window_s, duration) if duration > 0 else 0.0
        out: dict[str, Any] = {"window_s": w, "duration_s": duration}
        for name, series in (("read", self.read_bytes), ("write_all", self.write_all_bytes), ("write_reread", self.write_reread_bytes)):
            total = float(series.sum())
            out[f"{name}_bytes"] = total
            out[f"{name}_mean_bytes_per_s"] = total / duration if duration > 0 else 0.0
            out[f"{name}_peak_bytes_per_s"] = worst_window_rate(self.arrival_s, series, w)
        return out

    replica: np.ndarray = attrs.field(factory=lambda: np.zeros(0, np.int32))
    input_tokens: np.ndarray = attrs.field(factory=lambda: np.zeros(0, np.int64))

    @property
    def load_imbalance(self) -> float:
        """Busiest replica's input tokens over the mean (1.0 = perfectly even)."""
        if self.input_tokens.size == 0:
            return 1.0
        per = np.bincount(self.replica, weights=self.input_tokens, minlength=self.replicas)
        return float(per.max() / max(per.mean(), 1e-300))

    def to_dict(self) -> dict[str, Any]:
        ceiling = max(self.ceiling_tokens, 1)
        return {
            "routing": self.routing,
            "replicas": self.replicas,
            "load_imbalance": self.load_imbalance,
            "ceiling_tokens": self.ceiling_tokens,
            "local_tokens": self.local_tokens,
            "cross_replica_tokens": self.cross_tokens,
            "local_share_of_ceiling": self.local_tokens / ceiling,
            "cross_share_of_ceiling": self.cross_tokens / ceiling,
            "local_token_hit_ratio": self.local_tokens / max(self.total_input_tokens, 1),
            "cross_token_hit_ratio": self.cross_tokens / max(self.total_input_tokens, 1),
            "flows": self.flows(),
        }


def worst_window_rate(times_s: np.ndarray, values: np.ndarray, window_s: float) -> float:
    """Max over windows [t_i, t_i + window) of Σ values / window (bytes/s); a window of 0: the total."""
    check_non_negative_number("window_s", window_s)  # a NaN window answered NaN, an infinite one 0 bytes/s
    if values.size == 0:
        return 0.0
    if window_s <= 0:
        return float(values.sum())
    c = np.concatenate([[0.0], np.cumsum(values, dtype=np.float64)])
    end = np.searchsorted(times_s, times_s + window_s, side="left")
    return float(np.max(c[end] - c[: times_s.size]) / window_s)


def replica_view(trace: Any, n_replicas: int, routing: Routing = "round-robin", *, bytes_per_token: int, affinity_blocks: int = 4, seed: int = 0) -> ReplicaView:
    check_trace(trace)
    if isinstance(bytes_per_token, bool) or not isinstance(bytes_per_token, int) or bytes_per_token <= 0:
        raise ConfigError("bytes_per_token", f"must be a positive int, got {bytes_per_token!r}")
    rep = route(trace, n_replicas, routing, affinity_blocks=affinity_blocks, seed=seed)
    n = len(trace)
    g = np.zeros(n, dtype=np.int64)
    loc = np.zeros(n, dtype=np.int64)
    first = np.zeros(trace.block_ids.size, dtype=np.bool_)
    cross = np.zeros(trace.block_ids.size, dtype=np.bool_)
    if trace.block_ids.size:
        _replica_kernel(trace.block_offsets, trace.block_ids, trace.matchable_mask(), rep, max(trace.num_block_ids, 1), n_replicas, g, loc, first, cross)
    block_bytes = bytes_per_token * trace.block_size_tokens
    ever_cross = np.zeros(max(trace.num_block_ids, 1), dtype=np.bool_)
    ever_cross[trace.block_ids[cross]] = True
    req = trace.request_of_block_ref()
    write_all = np.bincount(req[first], minlength=n).astype(np.float64) * block_bytes
    rr = first & ever_cross[trace.block_ids] if trace.block_ids.size else first
    write_rr = np.bincount(req[rr], minlength=n).astype(np.float64) * block_bytes
    read = (g - loc).astype(np.float64) * block_bytes
    return ReplicaView(
        routing, n_replicas, g, loc, read, write_all, write_rr, trace.arrival_s, trace.block_size_tokens,
        trace.total_input_tokens, replica=rep, input_tokens=trace.input_tokens,
    )
