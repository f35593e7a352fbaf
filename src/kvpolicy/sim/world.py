"""The simulated world (issue #48's rooms): the things a run is made of, each a small class with no behaviour of the
cluster's — a request and its state (:class:`_Req`), a multi-node read in flight (:class:`_Load`), a replica with its
prefill slots and local cache (:class:`_Replica`), a storage node (:class:`_Node`) — and what every run of a trace
shares (:class:`Prepared`), what it returns (:class:`SimResult`), and the seeded draws (:func:`_unit`) that make every
policy set see the same failures and routes.

The rooms that move these things live beside this module: :mod:`.events` (the clock and the event queue),
:mod:`.transfers` (the network's flows and the loads on them), :mod:`.pool` (the storage nodes: placement, publishing,
writes), :mod:`.overlap` (computing while loading), :mod:`.replicas` (routing, prefill slots, local caches, scale-out
and warmup) and :mod:`.lifecycle` (a request from arrival to its last decoded token); :mod:`.engine` assembles them.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from typing import Any

import attrs
import numpy as np

from ..admission.controller import LoadStatus
from ..errors import ConfigError
from ..eviction.kernels import next_use_per_ref
from ..eviction.policies import TraceOracle
from ..ledger import Ledger
from ..traces.model import check_trace
from .config import Degrade, Spike
from .network import Flow, Link

STATIC_ROUTERS = ("round-robin", "random", "prefix-affinity")
MAX_RETRIES = 3
#: the window of a replica's measured prefill utilisation (what the admission controller prices GPU seconds with): the
#: last seconds, as an engine's scheduler metrics report them — a measurement window, not a fitted constant
UTIL_WINDOW_S = 10.0
_M64 = (1 << 64) - 1


def _mix(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def _unit(*parts: int) -> float:
    h = 0x5EED
    for p in parts:
        h = _mix(h ^ (p & _M64))
    return (h >> 11) / float(1 << 53)


class _DictIndex:
    """Any mapping of resident keys (a local cache's nodes, the pool's directory) as a BlockIndex."""

    __slots__ = ("keys", "name")

    def __init__(self, keys: Any, name: str) -> None:
        self.keys = keys
        self.name = name

    def match_prefix(self, keys: Any) -> int:
        held = self.keys
        n = 0
        for k in keys:
            if k not in held:
                break
            n += 1
        return n


class _PeerIndex:
    """The blocks other replicas hold in their local caches, as one remote tier (what the directory learns from the
    engines' KV events): the longest run one peer holds, a block with a write or pull in flight ending it. ``holder``
    is the peer of the last match (None when the run is empty); ties go to the peer with the fewest flows leaving it,
    then the lowest index."""

    __slots__ = ("replicas", "exclude", "writing", "flow_count", "holder", "name")

    def __init__(self, replicas: list[Any], exclude: Any, writing: set[int], flow_count: Any) -> None:
        self.replicas = replicas
        self.exclude = exclude
        self.writing = writing
        self.flow_count = flow_count
        self.holder: Any = None
        self.name = "peers"

    def match_prefix(self, keys: Any) -> int:
        self.holder = None
        best = 0
        best_key: tuple[int, int] | None = None
        for r in self.replicas:
            if r is self.exclude:
                continue
            n = _leading_run(keys, r.cache.nodes, self.writing)
            if n == 0 or n < best:
                continue
            key = (self.flow_count(r.out), r.idx)
            if n > best or best_key is None or key < best_key:
                best, best_key, self.holder = n, key, r
        return best

    def held_run(self, keys: Any) -> int:
        """The longest leading run of ``keys`` one peer holds, writes in flight or not (what pulls could serve)."""
        return max((_leading_run(keys, r.cache.nodes, ()) for r in self.replicas if r is not self.exclude), default=0)


def _leading_run(keys: Any, held: Any, skip: Any) -> int:
    """How many of ``keys``, from the first, are in ``held`` and not in ``skip``."""
    n = 0
    for k in keys:
        if k not in held or k in skip:
            break
        n += 1
    return n


class _ReplicaOracle:
    """Next use of a block on one replica (request index; inf if never), given the routes."""

    __slots__ = ("uses", "clock")

    def __init__(self, uses: dict[int, list[int]], clock: Any) -> None:
        self.uses = uses
        self.clock = clock  # the global TraceOracle: its ``now`` is the latest arrived request

    def __call__(self, key: Any) -> float:
        u = self.uses.get(key)
        if not u:
            return math.inf
        i = bisect.bisect_right(u, self.clock.now)
        return float(u[i]) if i < len(u) else math.inf


def _replica_oracles(p: Prepared, routes: np.ndarray, clock: Any) -> dict[int, _ReplicaOracle]:
    by: dict[int, dict[int, list[int]]] = {}
    for i, keys in enumerate(p.keys):
        d = by.setdefault(int(routes[i]), {})
        for k in keys:
            lst = d.get(k)
            if lst is None:
                d[k] = [i]
            else:
                lst.append(i)
    return {r: _ReplicaOracle(d, clock) for r, d in by.items()}


class Prepared:
    """Per-trace data every run shares (read the trace once, feed every policy set)."""

    def __init__(self, trace: Any) -> None:
        check_trace(trace)
        if len(trace) == 0:
            raise ConfigError("trace", "has no requests")
        self.trace = trace
        B = trace.block_size_tokens
        off = trace.block_offsets.tolist()
        ids = trace.block_ids.tolist()
        self.keys = [ids[off[i]:off[i + 1]] for i in range(len(trace))]
        self.arrival_s = trace.arrival_s.tolist()
        self.input_tokens = trace.input_tokens.tolist()
        self.output_tokens = trace.output_tokens.tolist()
        self.matchable = trace.matchable_blocks.tolist()
        self.partial = trace.partial_block_ids.tolist()
        self.boundary = trace.publish_boundary_tokens.tolist() if trace.publish_boundary_tokens is not None else None
        self.tenant = [trace.tenant_names[x] for x in trace.tenant.tolist()] if trace.tenant is not None else None
        self.request_class = [trace.class_names[x] for x in trace.request_class.tolist()] if trace.request_class is not None else None
        self.block_size_tokens = B
        self._oracle: tuple[TraceOracle, list[int]] | None = None

    def oracle(self) -> tuple[TraceOracle, list[int]]:
        """(Belady's next-use oracle, per request the leading blocks used again later)."""
        if self._oracle is None:
            nu = next_use_per_ref(self.trace)
            off = self.trace.block_offsets
            pub = []
            for i in range(len(self.trace)):
                seg = nu[off[i]:off[i + 1]]
                bad = np.flatnonzero(~np.isfinite(seg))
                pub.append(int(bad[0]) if bad.size else int(seg.size))
            self._oracle = (TraceOracle(self.trace), pub)
        return self._oracle


def apply_spike(trace: Any, spike: Spike) -> Any:
    """Arrival rate × factor inside [t1, t2): requests that would arrive in
    [t1, t1 + factor·(t2 − t1)) are squeezed into the window; later ones move earlier."""
    t = trace.arrival_s.astype(np.float64).copy()
    t1, t2, f = spike.t1_s, spike.t2_s, spike.factor
    span = (t2 - t1) * f
    inside = (t >= t1) & (t < t1 + span)
    after = t >= t1 + span
    t[inside] = t1 + (t[inside] - t1) / f
    t[after] = t[after] - span + (t2 - t1)
    return attrs.evolve(trace, arrival_s=t)


@attrs.frozen
class PeerCopy:
    """A request's run as the peers alone hold it (no pool): the load planner's second source, proposed when the
    pool's copy is on a path too slow to load whole."""

    match: Any  # the PrefixMatch against the replica and the peers
    holder: Any  # the _Replica whose cache holds the run (None: no peer holds it)
    direct: bool  # the pull would go straight from the holder (PolicySet.pull_path)
    context: Any  # () -> the AdmissionContext a load rule is told of this run


class _Req:
    """One request's state through its life in the simulator."""

    __slots__ = ("i", "attempt", "first_arrival_s", "replica", "local", "found", "load", "load_id", "load_start_s", "load_groups",
                 "status", "reused", "not_loaded", "not_loaded_reason", "predicted_s", "load_s", "queue_enter_s", "prefill_s",
                 "pinned", "stall_s", "load_attempted", "decision", "xfer", "split", "cake", "slot_s", "meet_ver", "queued_tokens",
                 "queued_pred_s", "job_end_s", "waiting", "rechecked", "load_vias", "peer_run", "pull_direct", "routed_tokens")
    replica: Any  # the _Replica serving it
    local: int  # leading blocks found in the local cache
    found: int  # remote blocks found after them
    load: int  # remote blocks being (or having been) loaded
    load_id: int | None
    load_start_s: float
    load_groups: list[tuple[Any, list[int]]]
    #: per load group: the replica its blocks are pulled from through the group's node (None: read from the node)
    load_vias: list[Any]
    #: this request's pull goes straight from the peer (``PolicySet.pull_path``: "direct", or "choose" picked it)
    pull_direct: bool
    peer_run: int  # after the local run, the leading blocks one peer held on arrival (what a pull could serve; 0 without pulls)
    status: tuple[str, float, float]  # (load status, transfer seconds, stage seconds)
    reused: int  # blocks not prefilled (local + loaded)
    not_loaded: int
    not_loaded_reason: Any
    predicted_s: float | None
    load_s: float | None
    queue_enter_s: float
    prefill_s: float
    decision: Any
    xfer: _Load | None  # the load in flight (or last ended)
    split: int  # compute while loading: front blocks recomputed although found remotely
    cake: bool  # this request computes while it loads
    slot_s: float  # when its GPU job started
    queued_tokens: int
    queued_pred_s: float
    job_end_s: float
    rechecked: bool  # a late plain load the controller said to wait on: checked once at its limit, then raced

    def __init__(self, i: int, t: float) -> None:
        self.i = i
        self.attempt = 0
        self.routed_tokens = 0  # what the router counted for this attempt on its replica (kv-overlap)
        self.first_arrival_s = t
        self.pinned: list[int] = []
        self.load_groups = []
        self.load_vias = []
        self.peer_run = 0
        self.pull_direct = False
        self.load_attempted = False
        self.stall_s = 0.0
        self.xfer = None
        self.split = 0
        self.cake = False
        self.meet_ver = 0
        self.job_end_s = 0.0
        self.waiting = False  # a plain load (compute while loading) not yet queued for its slot


def release_leases(req: _Req) -> None:
    """Let go of what a request's load held: the pool's blocks it leased, or a peer's copy a pull held."""
    for (node, gk), via in zip(req.load_groups, req.load_vias):
        pol = node.policy if via is None else via.cache  # a pull held the peer's copy
        for key in gk:
            pol.unpin(key)
    req.load_groups = []
    req.load_vias = []


class _Load:
    """One multi-node read in flight: a flow per storage node holding a part of the range. A group pulled from a peer
    (``vias[j]`` a replica) is one relay flow through its node: the peer's egress, the node's ingress and egress, this
    replica's ingress — the node keeps what passes (published on demand). With ``direct``, those groups go straight
    from the peer's egress to this replica's ingress instead: the node named is only where a relay would have passed;
    nothing is written."""

    __slots__ = ("groups", "vias", "flows", "fails", "hung", "left", "t0", "reverse", "status", "ended", "end_s", "on_end", "payload",
                 "rep", "recorded", "direct")

    def __init__(self, rep: Any, groups: list[tuple[Any, list[int]]], t0: float, reverse: bool, on_end: Any, payload: Any,
                 vias: list[Any] | None = None, direct: bool = False) -> None:
        self.rep = rep
        self.direct = direct
        self.groups = groups
        self.vias: list[Any] = vias if vias is not None else [None] * len(groups)
        self.flows: list[Flow | None] = []
        self.fails: list[bool] = []
        self.hung = False
        self.left = 0
        self.t0 = t0
        self.reverse = reverse
        self.status: LoadStatus = "ok"
        self.ended = False
        self.end_s = t0
        self.on_end = on_end
        self.payload = payload
        self.recorded = False

    def arrived_blocks(self, block_bytes: int) -> int:
        """Blocks usable now, in transfer order: leading ones (forward) or trailing ones (reverse)."""
        order = range(len(self.groups) - 1, -1, -1) if self.reverse else range(len(self.groups))
        n = 0
        for j in order:
            f = self.flows[j]
            size = len(self.groups[j][1])
            got = 0 if f is None else min(int((f.done_bytes() + 1.0) // block_bytes), size)  # 1 byte of float slack
            n += got
            if got < size:
                break
        return n

    def delivered_bytes(self) -> int:
        return sum(int(round(f.done_bytes())) for f in self.flows if f is not None)


class _Replica:
    __slots__ = ("idx", "name", "cache", "index", "free_slots", "slots", "queue", "load_tokens", "routed_tokens", "active", "decode_tokens",
                 "inn", "out", "stage", "debt_s", "warming_until_s", "bytes_in", "queued_s", "running", "warm_left", "util", "util_t",
                 "hit_util", "hit_t")

    def __init__(self, idx: int, cache: Any, slots: int, inn: Link, out: Link, stage: Link | None) -> None:
        self.idx = idx
        self.name = f"replica-{idx}"
        self.cache = cache
        self.index = _DictIndex(cache.nodes, "local")
        self.free_slots = slots
        self.slots = slots
        self.util = 0.0  # the busy share of its prefill slots, averaged over the last UTIL_WINDOW_S (exponentially)
        self.util_t = 0.0
        self.hit_util = 0.0  # the busy share its remote hits spared it, over the same window (at hit_t)
        self.hit_t = 0.0
        self.queue: deque[_Req] = deque()
        self.load_tokens = 0
        self.routed_tokens = 0  # the router's own count: each request routed here and not yet prefilled, at its routing estimate
        self.active = 0
        self.decode_tokens = 0
        self.inn = inn
        self.out = out
        self.stage = stage
        self.debt_s = 0.0
        self.warming_until_s = -1.0
        self.warm_left = 0  # warmup loads planned for it and not yet ended
        self.bytes_in = 0
        self.queued_s = 0.0  # predicted GPU seconds of the requests waiting for a slot
        self.running: set[_Req] = set()

    def queue_wait_s(self, t: float) -> float:
        """What the replica's scheduler knows: predicted seconds before a new prefill could start."""
        if self.free_slots > 0 and not self.queue:
            return 0.0
        running = min((max(r.job_end_s - t, 0.0) for r in self.running), default=0.0)
        return running + self.queued_s / self.slots

    def utilisation(self, t: float) -> float:
        """The busy share of the prefill slots over the last ``UTIL_WINDOW_S`` (exponentially weighted), up to ``t``:
        what an engine's scheduler metrics report. Call before a slot is taken or freed, and to read it."""
        dt = t - self.util_t
        if dt > 0:
            w = math.exp(-dt / UTIL_WINDOW_S)
            self.util = self.util * w + (1.0 - self.free_slots / self.slots) * (1.0 - w)
            self.util_t = t
        return self.util

    def note_hit(self, t: float, gpu_s: float) -> None:
        """A request spared ``gpu_s`` seconds of prefill by loading blocks instead of recomputing them: the busy share
        its slots would have had, averaged over the window as :meth:`utilisation` averages theirs."""
        self.hit_util = self.hit_util * math.exp(-(t - self.hit_t) / UTIL_WINDOW_S) + gpu_s / (UTIL_WINDOW_S * self.slots)
        self.hit_t = t

    def utilisation_without_hits(self, t: float) -> float:
        """What the replica's utilisation (as last read) would have been had it recomputed what it loaded: may pass 1."""
        return self.util + self.hit_util * math.exp(-(t - self.hit_t) / UTIL_WINDOW_S)


class _Node:
    __slots__ = ("idx", "name", "policy", "out", "inn", "windows", "bytes_out")

    def __init__(self, idx: int, policy: Any, out: Link, inn: Link) -> None:
        self.idx = idx
        self.name = f"node-{idx}"
        self.policy = policy
        self.out = out
        self.inn = inn
        self.windows: list[Degrade] = []
        self.bytes_out = 0

    def state(self, t: float, base_failure: float) -> tuple[float, float]:
        for w in self.windows:
            if w.t1_s <= t < w.t2_s:
                return w.bandwidth_factor, w.failure_rate
        return 1.0, base_failure


@attrs.frozen(eq=False)
class SimResult:
    policy: str
    n_requests: int
    ttft_s: np.ndarray
    gpu_prefill_s: float
    bytes_read: int
    bytes_written: int
    bytes_sent: int
    loads: int
    loads_ok: int
    loads_failed: int
    loads_timeout: int
    retries: int
    warmup_bytes: int
    stall_s: float
    makespan_s: float
    replicas_final: int
    ledger: Ledger
    node_bytes_out: tuple[int, ...]
    replica_bytes_in: tuple[int, ...]
    completed: np.ndarray
    #: the replica that served each request (its last attempt)
    routes: np.ndarray
    #: bytes that crossed the network but were not used (a load cut where compute caught up, a failed tail)
    bytes_unused: int = 0
    #: warmup loads (the warmup planner's, not admitted requests' loads): started / ok / failed / timed out
    warm_loads: tuple[int, int, int, int] = (0, 0, 0, 0)
    #: per link: (sample times s, utilisation 0..1, flows on it) — the physical cause of a queue
    link_series: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = attrs.field(factory=dict)
    #: per request: seconds from joining its replica's prefill queue to getting a slot (its last attempt)
    queue_s: np.ndarray = attrs.field(factory=lambda: np.zeros(0))
    #: a held-out split: the figures count requests from this index on (``ttft_s`` keeps every request)
    judge_from_request: int = 0
    #: per request: GPU seconds of prefill it took, every attempt (``gpu_prefill_s`` is the sum over the judged ones)
    prefill_s: np.ndarray = attrs.field(factory=lambda: np.zeros(0))
    #: of ``bytes_written``, what pulls from peers wrote (blocks published on demand, when a second replica asked)
    bytes_pulled: int = 0
    #: of ``bytes_sent``, what direct pulls moved straight from a peer (``PolicySet.pull_path``): no node sent it
    bytes_direct: int = 0

    @property
    def judged_ttft_s(self) -> np.ndarray:
        return self.ttft_s[self.judge_from_request:]

    def quantile_ms(self, q: float) -> float:
        t = self.judged_ttft_s
        return float(np.quantile(t, q) * 1e3) if t.size else float("nan")

    def row(self) -> dict[str, Any]:
        led = self.ledger.to_dict()
        flows = led["flows"]
        return {
            "policy": self.policy,
            "requests": self.n_requests - self.judge_from_request,
            "ttft_p50_ms": self.quantile_ms(0.5),
            "ttft_p95_ms": self.quantile_ms(0.95),
            "ttft_p99_ms": self.quantile_ms(0.99),
            "ttft_mean_ms": float(self.judged_ttft_s.mean() * 1e3),
            "throughput_rps": self.n_requests / self.makespan_s if self.makespan_s > 0 else None,
            "gpu_prefill_s": self.gpu_prefill_s,
            "bytes_read": self.bytes_read,
            "bytes_written": self.bytes_written,
            "bytes_pulled": self.bytes_pulled,
            "bytes_sent": self.bytes_sent,
            "peak15_bytes_per_s": flows["total"]["peak_window_bytes_per_s"],
            "loads": self.loads, "loads_ok": self.loads_ok, "loads_failed": self.loads_failed, "loads_timeout": self.loads_timeout,
            "retries": self.retries,
            "warmup_bytes": self.warmup_bytes,
            "stall_s": self.stall_s,
            "bytes_unused": self.bytes_unused,
            "warm_loads": dict(zip(("started", "ok", "failed", "timeout"), self.warm_loads)),
            "replicas_final": self.replicas_final,
            "ledger": {"requests": led["requests"], "tokens": led["tokens"], "bytes": led["bytes"], "flows": flows,
                       "distributions": {k: v["ttft_s"] for k, v in led["distributions"].items()}},
            "e_benefit_s_per_s": led["expected_benefit"]["e_benefit_s_per_s"],
        }
