"""The discrete-event cluster simulator.

One run = one trace × one :class:`~kvpolicy.sim.config.ClusterConfig` × one
:class:`~kvpolicy.sim.policysets.PolicySet`. The physics are identical for every
policy set; only the decisions differ, and every decision is made by the same
online objects an engine embeds: :func:`kvpolicy.matching.match` over block
indexes, eviction policies (local caches and storage nodes), publish filters,
the :class:`~kvpolicy.admission.AdmissionController`, the warmup planner and the
:class:`~kvpolicy.ledger.Ledger`.

A request's life::

    ARRIVE ─ router picks a replica ─ match (local run, then the pool's run)
      ├─ load k remote blocks? ── transfer(s) on the storage node's link and the
      │                          replica's NIC (FIFO, shared with writes) ── LOAD_DONE
      │                          (ok / failed / timeout → recompute, or retry for failure="fail")
      └─ PREFILL (FIFO queue, ``prefill_slots`` at a time) ── first token (TTFT)
           ── cache computed blocks locally, publish what the filter allows ── DECODE
           (blocks pinned while output is generated) ── DECODE_DONE (unpin)

Network (:mod:`kvpolicy.sim.network`): every link has a capacity per direction —
a storage node's egress and ingress, a replica NIC's ingress and egress, and
optionally a replica's staging copy through CPU memory. A read is a flow over
(node egress, replica ingress[, staging]); a write over ([staging,] replica
egress, node ingress): the two directions meet only on the staging copy. Concurrent flows share each link max-min fairly, recomputed whenever
a flow starts or ends or a degradation window opens or closes; a flow starts
moving bytes ``transfer_overhead_s`` after it is issued. Publishes run in the
same class as loads (``publish_priority="fair"``, what engines do: their
background writes are flows like any other) or below them (``"background"``,
which only a staging copy makes mean anything). Failures are drawn from a hash of (seed, request, attempt,
node), so every policy set sees the same failures; a failed transfer delivers a
drawn share of its blocks intact first; a hung one delivers nothing until the
transport or the policy gives up.
Compute while loading (policy sets with ``compute_while_loading``): the request
takes its prefill slot while its load runs; the GPU prefills the range from the
front while the load delivers it from the back, and they meet where they cross
(the load is then cut); the rest of the prompt follows.
Interference: a load of S bytes steals ``interference_s_per_byte × S`` of GPU
time from the receiving replica (the next prefill starts that much later) and
from each of its active decodes; the sum is reported as ``stall_s``.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections import deque
from typing import Any

import attrs
import numpy as np

from .._validate import check_non_negative_int, check_split
from ..admission import AdmissionConfig, AdmissionContext, AdmissionController, LatencyModel, LinkPrior, LoadOutcome
from ..admission.controller import LoadStatus
from ..errors import CapacityError, ConfigError
from ..eviction.kernels import next_use_per_ref
from ..eviction.policies import TraceOracle
from ..eviction.replay import make_policy
from ..ledger import Ledger, PublicationLog, RequestRecord
from ..matching import match
from ..publish import PublishRequest, make_filter
from ..publish_sim import block_recompute_s
from ..traces.model import check_trace
from ..warmup import WarmupConfig, hot_prefixes_from_trace, plan_warmup
from .config import ClusterConfig, Degrade, ScaleOut, Spike
from .network import Flow, FlowNetwork, Link
from .._own import is_own
from .policysets import PolicySet, load_own_rule
from ..write_admission import WriteAdmission, gate

ARRIVE, LOAD_DONE, PREFILL_DONE, DECODE_DONE, WRITE_DONE, WARM_DONE, SCALE_OUT, READY, NET, TIMER, MEET, CAPACITY, SAMPLE = range(13)
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


class _Clock:
    __slots__ = ("t",)

    def __init__(self) -> None:
        self.t = 0.0

    def now_s(self) -> float:
        return self.t


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


class _Req:
    """One request's state through its life in the simulator."""

    __slots__ = ("i", "attempt", "first_arrival_s", "replica", "local", "found", "load", "load_id", "load_start_s", "load_groups",
                 "status", "reused", "not_loaded", "not_loaded_reason", "predicted_s", "load_s", "queue_enter_s", "prefill_s",
                 "pinned", "stall_s", "load_attempted", "decision", "xfer", "split", "cake", "slot_s", "meet_ver", "queued_tokens",
                 "queued_pred_s", "job_end_s", "waiting", "rechecked")
    replica: Any  # the _Replica serving it
    local: int  # leading blocks found in the local cache
    found: int  # remote blocks found after them
    load: int  # remote blocks being (or having been) loaded
    load_id: int | None
    load_start_s: float
    load_groups: list[tuple[Any, list[int]]]
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
        self.first_arrival_s = t
        self.pinned: list[int] = []
        self.load_attempted = False
        self.stall_s = 0.0
        self.xfer = None
        self.split = 0
        self.cake = False
        self.meet_ver = 0
        self.job_end_s = 0.0
        self.waiting = False  # a plain load (compute while loading) not yet queued for its slot


class _Load:
    """One multi-node read in flight: a flow per storage node holding a part of the range."""

    __slots__ = ("groups", "flows", "fails", "hung", "left", "t0", "reverse", "status", "ended", "end_s", "on_end", "payload", "rep",
                 "recorded")

    def __init__(self, rep: Any, groups: list[tuple[Any, list[int]]], t0: float, reverse: bool, on_end: Any, payload: Any) -> None:
        self.rep = rep
        self.groups = groups
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
    __slots__ = ("idx", "name", "cache", "index", "free_slots", "slots", "queue", "load_tokens", "active", "decode_tokens", "inn", "out",
                 "stage", "debt_s", "warming_until_s", "bytes_in", "queued_s", "running", "warm_left", "util", "util_t")

    def __init__(self, idx: int, cache: Any, slots: int, inn: Link, out: Link, stage: Link | None) -> None:
        self.idx = idx
        self.name = f"replica-{idx}"
        self.cache = cache
        self.index = _DictIndex(cache.nodes, "local")
        self.free_slots = slots
        self.slots = slots
        self.util = 0.0  # the busy share of its prefill slots, averaged over the last UTIL_WINDOW_S (exponentially)
        self.util_t = 0.0
        self.queue: deque[_Req] = deque()
        self.load_tokens = 0
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

    def utilisation(self, t: float) -> float:
        """The busy share of the prefill slots over the last ``UTIL_WINDOW_S`` (exponentially weighted), up to ``t``:
        what an engine's scheduler metrics report. Call before a slot is taken or freed, and to read it."""
        dt = t - self.util_t
        if dt > 0:
            w = math.exp(-dt / UTIL_WINDOW_S)
            self.util = self.util * w + (1.0 - self.free_slots / self.slots) * (1.0 - w)
            self.util_t = t
        return self.util


class _Node:
    __slots__ = ("idx", "name", "policy", "out", "inn", "windows", "bytes_out", "bytes_in")

    def __init__(self, idx: int, policy: Any, out: Link, inn: Link) -> None:
        self.idx = idx
        self.name = f"node-{idx}"
        self.policy = policy
        self.out = out
        self.inn = inn
        self.windows: list[Degrade] = []
        self.bytes_out = 0
        self.bytes_in = 0

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


class Simulator:
    def __init__(self, prepared: Prepared | Any, cluster: ClusterConfig, policy_set: PolicySet, *,
                 events: tuple[ScaleOut | Degrade, ...] = (), seed: int = 0, compute_scale: Any = None, judge_from_request: int = 0) -> None:
        """``compute_scale``: optional, one positive number per request (trace order) multiplying ``compute_factor``
        for that request's own prefill — the compute a real run measured, replayed (e.g. each request's measured
        forward pass over the profile's). The router's and the oracles' predictions keep the cluster's model: an
        engine does not know a request's compute before it runs; kvpolicy's controller hears it afterwards.

        ``judge_from_request`` = k > 0 is a held-out split: every policy runs (and learns) over the whole trace, but the
        result counts only requests k onwards — their TTFTs, prefill seconds, loads and reads — and the bytes written or
        replicated from request k's arrival on (the ledger likewise). Bytes sent and unused stay whole-run figures."""
        self.p = prepared if isinstance(prepared, Prepared) else Prepared(prepared)
        self._scale: np.ndarray | None = None
        if compute_scale is not None:
            try:
                scale = np.asarray(compute_scale, dtype=float)
            except (TypeError, ValueError) as err:
                raise ConfigError("compute_scale", f"needs one number per request: {err}") from None
            if scale.ndim != 1 or scale.size != len(self.p.trace):
                raise ConfigError("compute_scale", f"needs one number per request ({len(self.p.trace)}), got shape {scale.shape}")
            bad = np.flatnonzero(~np.isfinite(scale) | (scale <= 0))
            if bad.size:
                raise ConfigError("compute_scale", f"must be finite and > 0; request {int(bad[0])} has {float(scale[bad[0]])}")
            self._scale = scale
        if not isinstance(cluster, ClusterConfig):
            raise ConfigError("cluster", "must be a kvpolicy.sim.ClusterConfig")
        if not isinstance(policy_set, PolicySet):
            raise ConfigError("policy_set", "must be a kvpolicy.sim.PolicySet")
        check_non_negative_int("seed", seed)  # mixed into every failure and routing draw
        self.judge_k = check_split(judge_from_request, len(self.p.trace))
        self.t_judge = float(self.p.arrival_s[self.judge_k]) if self.judge_k else -math.inf
        self.c = cluster
        self.ps = policy_set
        self.seed = seed
        for e in events:
            if isinstance(e, Degrade) and e.node >= cluster.storage_nodes:
                raise ConfigError("node", f"degrade names node {e.node}, the pool has {cluster.storage_nodes} nodes")
            if not isinstance(e, (ScaleOut, Degrade)):
                raise ConfigError("events", f"unknown event {e!r} (spikes are applied to the trace: apply_spike)")
        self.events = tuple(events)
        self.B = self.p.block_size_tokens
        self.block_bytes = cluster.block_bytes(self.B)
        self.clock = _Clock()
        ps = policy_set
        self._oracle: TraceOracle | None = None
        self._oracle_pub: list[int] | None = None
        self._local_oracles: dict[int, _ReplicaOracle] | None = None
        if "belady" in (ps.local_eviction, ps.pool_eviction) or ps.publish == "oracle" or ps.load == "oracle":
            self._oracle, self._oracle_pub = self.p.oracle()
            if ps.local_eviction == "belady":
                routes = self.static_routes()
                if routes is not None:  # a local cache's Belady ranks by the next use on *that* replica
                    self._local_oracles = _replica_oracles(self.p, routes, self._oracle)
        self.net = FlowNetwork()
        self._net_wake = math.inf
        self.write_priority = 1 if cluster.publish_priority == "background" else 0
        self.replicas: list[_Replica] = [self._new_replica(i) for i in range(cluster.replicas)]
        self.nodes = [_Node(j, self._policy(ps.pool_eviction, cluster.pool_capacity_bytes_per_node),
                            self.net.add_link(f"node-{j}.out", cluster.node_bandwidth_bytes_per_s),
                            self.net.add_link(f"node-{j}.in", cluster.node_bandwidth_bytes_per_s)) for j in range(cluster.storage_nodes)]
        for e in events:
            if isinstance(e, Degrade):
                self.nodes[e.node].windows.append(e)
        # requests computing while they load, in the order they took their slots: a dict, not a set — a set of
        # objects iterates in address order, and _net_changed re-plans each of them, pushing events in that order
        self.cake_in_slot: dict[_Req, None] = {}
        self.bytes_unused = 0
        self._series: dict[str, tuple[list[float], list[float], list[float]]] = {}
        self._util: dict[str, float] = {}
        self.where: dict[int, _Node] = {}
        self.pool_index = _DictIndex(self.where, "pool")
        self.writing: set[int] = set()
        trace = self.p.trace
        self.ledger = Ledger(cluster.bytes_per_token, publication_log=PublicationLog(max_exact_keys=max(trace.num_block_ids + 1, 1024)),
                             judge_from_s=self.t_judge if self.judge_k else None,
                             write_cost_s_per_byte=(1.0 / cluster.node_bandwidth_bytes_per_s) if cluster.node_bandwidth_bytes_per_s > 0 else None,
                             eviction_cost_s_per_token=cluster.compute_factor * cluster.prefill.b_s_per_token)
        self.filter = self._make_filter()
        self.write_gate: WriteAdmission | None = None
        if ps.write_admission == "tinylfu" and ps.uses_pool:
            blocks_per_node = cluster.pool_capacity_bytes_per_node // self.block_bytes
            self.write_gate = WriteAdmission(capacity_blocks=max(blocks_per_node * cluster.storage_nodes, 1))
        self.controller: AdmissionController | None = None
        self.load_rule: Any = load_own_rule(ps.load) if is_own(ps.load) else None  # one per run: its state is this run's
        if ps.load == "admission":
            # the prior is the deployment's own figures: the path's slowest link (the staging copy is a
            # link of the path, pipelined with the network leg)
            bw = min(cluster.node_bandwidth_bytes_per_s, cluster.replica_bandwidth_bytes_per_s, cluster.stage_bytes_per_s or math.inf)
            prior = LinkPrior(bandwidth_bytes_per_s=max(bw * cluster.link_prior_factor, 1e-3), lookup_s=cluster.lookup_s, transfer_overhead_s=cluster.transfer_overhead_s,
                              stage_bytes_per_s=None, install_s_per_block=cluster.install_s_per_block,
                              dispatch_s=cluster.dispatch_s, interference_s_per_byte=cluster.interference_s_per_byte)

            def make_controller() -> AdmissionController:
                return AdmissionController(LatencyModel(prior, cluster.prefill), AdmissionConfig(compute_while_loading=ps.compute_while_loading, gpu_s_price=ps.gpu_s_price),
                                           clock=self.clock)

            self._make_controller = make_controller
            #: the cluster's controller (controller_scope "cluster"), or replica 0's ("replica": each replica has its own)
            self.controller = make_controller()
        #: controller_scope "replica": each replica's own, by replica index (made when the replica first needs it)
        self.controllers: dict[int, AdmissionController] = {}
        self._rr = 0
        self._seq = 0
        self.heap: list[tuple[float, int, int, Any]] = []
        self.n_arrived = -1
        # counters
        self.gpu_prefill_s = 0.0
        self.bytes_read = self.bytes_written = self.bytes_sent = 0
        self.loads = self.loads_ok = self.loads_failed = self.loads_timeout = self.retries = 0
        self.stall_s = 0.0
        self.warmup_bytes = 0
        self.warm_loads = self.warm_loads_ok = self.warm_loads_failed = self.warm_loads_timeout = 0
        n = len(trace)
        self.ttft = np.full(n, np.nan)
        self.queue = np.full(n, np.nan)  # seconds each request waited for a prefill slot (its last attempt)
        self.prefill_per = np.zeros(n)  # GPU seconds of prefill each request took (every attempt)
        self.completed = np.zeros(n, dtype=np.int64)
        self.routes = np.full(n, -1, dtype=np.int64)
        self.t_last = 0.0

    # ------------------------------------------------------------------ construction

    def _policy(self, name: str, capacity_bytes: int) -> Any:
        kw: dict[str, Any] = {}
        if name in ("belady", "belady-bypass"):
            kw["oracle"] = self._oracle
        return make_policy(name, capacity_bytes, clock=self.clock, **kw)

    def _new_replica(self, idx: int) -> _Replica:
        if self._local_oracles is not None:
            oracle = self._local_oracles.get(idx) or _ReplicaOracle({}, self._oracle)
            cache = make_policy("belady", self.c.local_capacity_bytes, clock=self.clock, oracle=oracle)
        else:
            cache = self._policy(self.ps.local_eviction, self.c.local_capacity_bytes)
        c = self.c
        net = self.net
        stage = net.add_link(f"replica-{idx}.stage", c.stage_bytes_per_s) if c.stage_bytes_per_s else None
        return _Replica(idx, cache, c.prefill_slots, net.add_link(f"replica-{idx}.in", c.replica_bandwidth_bytes_per_s),
                        net.add_link(f"replica-{idx}.out", c.replica_bandwidth_bytes_per_s), stage)

    def _make_filter(self) -> Any:
        spec = self.ps.publish
        if spec == "oracle" or not self.ps.uses_pool:
            return None
        if "+" not in spec and spec in ("all", "never", "boundary") or spec.startswith("threshold"):
            return make_filter(spec)
        if spec.startswith("boundary+") and self.p.boundary is None:
            spec = spec[len("boundary+"):]  # the trace marks no boundary: the reuse filter alone
        n = len(self.replicas)
        cross = (n - 1) / n if self.c.router not in ("prefix-affinity", "kv-overlap") else 0.1
        pool_blocks = self.c.storage_nodes * (self.c.pool_capacity_bytes_per_node // self.block_bytes)
        return make_filter(spec, block_bytes=self.block_bytes, recompute_s=block_recompute_s(self.c.prefill, self.B),
                           write_bytes_per_s=max(self.c.node_bandwidth_bytes_per_s, 1e-3), cross_replica_share=cross,
                           pool_capacity_blocks=max(pool_blocks, 1))

    def seed_pool(self, chains: Any) -> int:
        """Start with the pool already holding these key chains (a shared cache filled earlier,
        e.g. for the brief's read-only experiment). Placement and capacity as for any write;
        returns the blocks now held."""
        chunk = self.c.placement_chunk_blocks
        for chain in chains:
            chain = [int(k) for k in chain]
            for j in range(0, len(chain), chunk):
                node = self._place(chain[j])
                self._write_done((node, chain[j:j + chunk], chain, "default"), 0.0)
        self.bytes_written = 0
        self.ledger.clear_flow("write")
        return len(self.where)

    def _push(self, t: float, kind: int, obj: Any) -> None:
        self._seq += 1
        heapq.heappush(self.heap, (t, self._seq, kind, obj))

    # ------------------------------------------------------------------ run

    def run(self) -> SimResult:
        p = self.p
        for i, t in enumerate(p.arrival_s):
            self._push(t, ARRIVE, _Req(i, t))
        for e in self.events:
            if isinstance(e, ScaleOut):
                self._push(e.t_s, SCALE_OUT, e)
            elif isinstance(e, Degrade):
                self._push(e.t1_s, CAPACITY, self.nodes[e.node])
                self._push(e.t2_s, CAPACITY, self.nodes[e.node])
        t_first, t_end = p.arrival_s[0], p.arrival_s[-1]
        self._sample_s = max((t_end - t_first) / 200.0, 1e-3)
        self._push(t_first, SAMPLE, None)
        heap = self.heap
        clock = self.clock
        handlers = (self._arrive, self._load_done, self._prefill_done, self._decode_done, self._write_done, self._warm_done, self._scale_out,
                    self._ready, self._net_event, self._timer, self._meet, self._capacity, self._sample)
        while heap:
            t, _, kind, obj = heapq.heappop(heap)
            clock.t = t
            handlers[kind](obj, t)
        if any(ctl.loads_in_flight() for ctl in (self.controller, *self.controllers.values()) if ctl is not None):
            raise AssertionError("loads still in flight at the end of the run")  # pragma: no cover - conservation
        t0 = p.arrival_s[0]
        return SimResult(
            policy=self.ps.name, n_requests=len(p.arrival_s), ttft_s=self.ttft.copy(), gpu_prefill_s=self.gpu_prefill_s,
            bytes_read=self.bytes_read, bytes_written=self.bytes_written, bytes_sent=self.bytes_sent, loads=self.loads,
            loads_ok=self.loads_ok, loads_failed=self.loads_failed, loads_timeout=self.loads_timeout, retries=self.retries,
            warmup_bytes=self.warmup_bytes, stall_s=self.stall_s, makespan_s=self.t_last - t0, replicas_final=len(self.replicas), ledger=self.ledger,
            node_bytes_out=tuple(n.bytes_out for n in self.nodes), replica_bytes_in=tuple(r.bytes_in for r in self.replicas),
            completed=self.completed.copy(), routes=self.routes.copy(), bytes_unused=self.bytes_unused,
            warm_loads=(self.warm_loads, self.warm_loads_ok, self.warm_loads_failed, self.warm_loads_timeout),
            link_series={k: (np.asarray(a), np.asarray(b), np.asarray(c)) for k, (a, b, c) in self._series.items()},
            queue_s=self.queue.copy(), judge_from_request=self.judge_k, prefill_s=self.prefill_per.copy(),
        )

    # ------------------------------------------------------------------ routing

    def _route(self, req: _Req, t: float) -> _Replica:
        reps = self.replicas
        c = self.c
        kind = c.router
        keys = self.p.keys[req.i]
        if kind in STATIC_ROUTERS:
            r = reps[self._static_pick(req.i, req.attempt, len(reps), self._rr)]
            self._rr += 1
        elif kind == "least-loaded":
            r = min(reps, key=lambda x: (x.load_tokens, x.idx))
        else:  # kv-overlap (Dynamo-style): prefill tokens still needed + queued prefill + decode load
            T = self.p.input_tokens[req.i]
            m = self.p.matchable[req.i]
            best = None
            for x in reps:
                ov = x.index.match_prefix(keys[:m])
                cost = (T - ov * self.B) + x.load_tokens + c.decode_weight * x.decode_tokens
                if best is None or cost < best[0]:
                    best = (cost, x)
            assert best is not None
            r = best[1]
        if self.ps.warmup and t < r.warming_until_s and keys and keys[0] in self.where and keys[0] not in r.cache.nodes:
            warm = [x for x in reps if t >= x.warming_until_s]
            if warm:  # rule 2: repeating requests go to warm replicas while this one warms
                r = min(warm, key=lambda x: (x.load_tokens, x.idx))
        return r

    def _static_pick(self, i: int, attempt: int, n_replicas: int, rr: int) -> int:
        """Replica index for the routers that do not look at replica state."""
        kind = self.c.router
        if kind == "round-robin":
            return rr % n_replicas
        if kind == "random":
            return int(_unit(self.seed, i, attempt, 17) * n_replicas)
        keys = self.p.keys[i]  # prefix-affinity: rendezvous hash of the first k blocks' chain id
        k = min(len(keys), self.c.affinity_blocks)
        h = keys[k - 1] if k else (1 << 40) + self.p.partial[i]
        return max(range(n_replicas), key=lambda x: _mix((h * 1000003) ^ _mix(x + self.seed)))

    def static_routes(self) -> np.ndarray | None:
        """Every request's replica when the router ignores replica state (round-robin, random,
        prefix-affinity) and no request is retried — what the oracle may know in hindsight."""
        if self.c.router not in STATIC_ROUTERS:
            return None
        outs = sorted((e for e in self.events if isinstance(e, ScaleOut)), key=lambda e: e.t_s)
        n, k = self.c.replicas, 0
        out = np.empty(len(self.p.arrival_s), dtype=np.int64)
        for i, t in enumerate(self.p.arrival_s):
            while k < len(outs) and outs[k].t_s < t:  # on a tie the arrival is handled first
                n += outs[k].replicas
                k += 1
            out[i] = self._static_pick(i, 0, n, i)
        return out

    # ------------------------------------------------------------------ pool placement and transfers

    def _ctl(self, rep: _Replica) -> AdmissionController | None:
        """The admission controller that decides for ``rep`` (None: the set does not use one)."""
        if self.controller is None or self.ps.controller_scope == "cluster" or rep.idx == 0:
            return self.controller
        ctl = self.controllers.get(rep.idx)
        if ctl is None:
            ctl = self.controllers[rep.idx] = self._make_controller()
        return ctl

    def _healthy(self, node: _Node, rep: _Replica | None = None) -> bool:
        """Whether ``node``'s breaker is closed — in ``rep``'s controller (the cluster's, or the first replica's
        when none is named)."""
        ctl = self._ctl(rep) if rep is not None else self.controller
        if ctl is None:
            return True
        b = ctl.breakers.get(node.name)
        return b is None or b.state == "closed"

    def _place(self, chunk_key: int, rep: _Replica | None = None) -> _Node:
        """Rendezvous placement of a chunk; kvpolicy skips nodes whose breaker is open (in the writer's controller)."""
        mix = _mix
        order = sorted(self.nodes, key=lambda n: -mix((chunk_key * 0x9E3779B1) ^ mix(n.idx + 7)))
        if self.ps.load == "admission":
            for n in order:
                if self._healthy(n, rep):
                    return n
        return order[0]

    def _groups(self, keys: list[int]) -> list[tuple[_Node, list[int]]]:
        out: list[tuple[_Node, list[int]]] = []
        where = self.where
        for k in keys:
            n = where[k]
            if out and out[-1][0] is n:
                out[-1][1].append(k)
            else:
                out.append((n, [k]))
        return out

    def _begin_read(self, rep: _Replica, groups: list[tuple[_Node, list[int]]], t0: float, req_i: int, attempt: int, *,
                    reverse: bool, on_end: Any, payload: Any, priority: int = 0) -> _Load:
        """Start reading ``groups`` into ``rep`` at t0: one flow per storage node, in parallel.

        Each node's draw (seed, request, attempt, node) decides whether its transfer
        hangs (delivers nothing until a timeout) or fails after a drawn share of its
        blocks arrived intact. ``on_end(load, t)`` runs once when every flow has ended
        or a timeout (transport or policy) gives up on the rest."""
        c = self.c
        bb = self.block_bytes
        load = _Load(rep, groups, t0, reverse, on_end, payload)
        for node, ks in groups:
            _, fail = node.state(t0, c.failure_rate)
            if c.timeout_rate and _unit(self.seed, req_i, attempt, node.idx, 2) < c.timeout_rate:
                load.flows.append(None)
                load.fails.append(False)
                load.hung = True
                continue
            failed = _unit(self.seed, req_i, attempt, node.idx, 1) < fail
            n = len(ks)
            if failed:  # blocks before the failure arrive intact
                n = int(_unit(self.seed, req_i, attempt, node.idx, 3) * len(ks))
            path = (node.out, rep.inn) if rep.stage is None else (node.out, rep.inn, rep.stage)
            now = self.clock.t  # issued at t0 (after the directory lookup): it moves bytes from t0 + overhead
            f = self.net.start(now, path, n * bb, latency_s=max(t0 - now, 0.0) + c.transfer_overhead_s, payload=(load, node),
                               on_done=self._read_flow_end, priority=priority)
            load.flows.append(f)
            load.fails.append(failed)
            load.left += 1
        self._push(t0 + c.transport_timeout_s, TIMER, (load, "timeout"))
        self._net_changed()
        return load

    def _account_read(self, node: _Node, rep: _Replica, nbytes: float) -> None:
        nb = int(round(nbytes))
        node.bytes_out += nb
        rep.bytes_in += nb
        self.bytes_sent += nb

    def _read_flow_end(self, f: Flow, t: float) -> None:
        load, node = f.payload
        self._account_read(node, load.rep, f.size_bytes)
        load.left -= 1
        if load.left == 0 and not load.hung and not load.ended:
            self._end_load(load, t, "failed" if any(load.fails) else "ok")

    def _end_load(self, load: _Load, t: float, status: LoadStatus) -> None:
        """Stop whatever still moves (counting what it delivered) and report the load's end."""
        load.ended = True
        load.end_s = t
        load.status = status
        for f, (node, _) in zip(load.flows, load.groups):
            if f is not None and f.alive:
                self._account_read(node, load.rep, self.net.cancel(t, f))
        self._net_changed()
        load.on_end(load, t)

    def _timer(self, item: tuple[Any, str], t: float) -> None:
        obj, kind = item
        if kind == "switch":  # a plain load ran past its p95 prediction: compute from the front while it goes on
            req: _Req = obj
            if req.waiting and not req.rechecked and req.decision is not None and req.xfer is not None:
                # past its p95 prediction: wait on while the link says the bytes come in time (the controller's rule)
                ctl = self._ctl(req.replica)
                assert ctl is not None
                self.net.sync(t)
                elapsed = t - req.load_start_s
                if ctl.keep_waiting(req.decision, elapsed, self._arrival_s(req.xfer, req.load, t) - t):
                    req.rechecked = True
                    self._push(req.load_start_s + ctl.wait_limit_s(req.decision), TIMER, (req, "switch"))
                    return
            if req.waiting:
                req.waiting = False
                self._enqueue(req.replica, req, t, req.local)
            return
        if kind == "write":
            f: Flow = obj
            if f.alive:  # the write never lands
                self.net.cancel(t, f)
                self.writing.difference_update(f.payload[1])
                self._net_changed()
            return
        load: _Load = obj
        if not load.ended:
            self._end_load(load, t, "timeout")

    def _net_changed(self) -> None:
        """After any change to the network: wake up at its next event; re-plan meeting points."""
        for req in list(self.cake_in_slot):
            self._cake_schedule(req, self.net.t)
        nxt = self.net.next_event_s()
        if nxt < math.inf:
            self._push(nxt, NET, self.net.version)

    def _net_event(self, version: int, t: float) -> None:
        if version != self.net.version:
            return  # a newer wake-up exists
        self.net.advance(t)
        self._net_changed()

    def _capacity(self, node: _Node, t: float) -> None:
        """A degradation window opens or closes on a node: both directions of its port change."""
        factor, _ = node.state(t, self.c.failure_rate)
        self.net.set_capacity(t, node.out, self.c.node_bandwidth_bytes_per_s * factor)
        self.net.set_capacity(t, node.inn, self.c.node_bandwidth_bytes_per_s * factor)
        self._net_changed()

    def _sample(self, _: Any, t: float) -> None:
        """Per-link utilisation and flows, for the report's plot of where queues come from."""
        for name, (_, util, nflows) in self.net.link_state().items():
            series = self._series.get(name)
            if series is None:
                series = self._series[name] = ([], [], [])
            series[0].append(t)
            series[1].append(util)
            series[2].append(nflows)
            recent = series[1][-4:]  # what an engine's NIC counters give: the recent mean
            self._util[name] = sum(recent) / len(recent)
        if t < self.p.arrival_s[-1] or self.heap:
            step = self._sample_s
            if t >= self.p.arrival_s[-1] and self.heap and not self.net.active_flows():
                # past the last arrival with the network idle: until the next event every sample would record zeros.
                # Skip them, keeping the last 4 before it (what _util averages), so a long tail of decodes costs a few
                # samples, not (tail / step) of them — at --decode-tokens-per-s 1e-10, billions.
                idle = int((self.heap[0][0] - t) / step) - 4
                if idle > 1:
                    step *= idle
            self._push(t + step, SAMPLE, None)

    def _predict_read_s(self, rep: _Replica, groups: list[tuple[_Node, list[int]]]) -> float:
        """Seconds a read issued now would take if the flows now on its links stayed (the oracle's view)."""
        c = self.c
        worst = 0.0
        for node, ks in groups:
            rate = math.inf
            for link in ((node.out, rep.inn) if rep.stage is None else (node.out, rep.inn, rep.stage)):
                rate = min(rate, link.capacity_bytes_per_s / (self.net.flow_count(link) + 1))
            if rate <= 0:
                return math.inf
            worst = max(worst, c.transfer_overhead_s + len(ks) * self.block_bytes / rate)
        return worst

    # ------------------------------------------------------------------ events

    def _arrive(self, req: _Req, t: float) -> None:
        p = self.p
        i = req.i
        if i > self.n_arrived:
            self.n_arrived = i
            if self._oracle is not None:
                self._oracle.now = i
        rep = self._route(req, t)
        req.replica = rep
        self.routes[i] = rep.idx
        keys = p.keys[i]
        m = p.matchable[i]
        T = p.input_tokens[i]
        ps = self.ps
        if ps.uses_pool:
            pm = match(keys[:m], T, rep.index, self.pool_index, block_size_tokens=self.B)
            R = pm.remote_total_blocks
        else:
            pm = match(keys[:m], T, rep.index, block_size_tokens=self.B)
            R = 0
        L = pm.local_blocks
        cache = rep.cache
        for k in keys[:L]:
            cache.on_access(k)
            cache.pin(k)
        req.pinned = keys[:L]
        req.local = L
        req.found = R
        req.load = 0
        req.split = 0
        req.cake = False
        req.waiting = False
        req.rechecked = False
        req.xfer = None
        req.not_loaded = 0
        req.not_loaded_reason = None
        req.predicted_s = None
        req.load_s = None
        req.decision = None
        t0 = t + (self.c.lookup_s if ps.uses_pool else 0.0)
        k = 0
        s_ = 0
        if R:
            load = ps.load
            if load == "always":
                k = R
            elif load == "min-tokens":
                k = R if R * self.B >= ps.min_load_tokens else 0
            elif load == "admission":
                ctl = self._ctl(rep)
                assert ctl is not None
                d = ctl.decide(pm, self._load_ctx(rep, keys[L], R, t))
                req.decision = d
                k = d.load_blocks
                s_ = d.split_blocks
                if k:
                    req.predicted_s = d.t_recompute_p50_s
            elif load == "oracle":
                k = self._oracle_k(rep, keys, L, R, req)
            else:  # a rule of your own (kvpolicy.protocols.LoadRule), on what the admission controller is told
                k = self.load_rule.blocks_to_load(pm, self._load_ctx(rep, keys[L], R, t))
                if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 0 <= k <= R:
                    raise ConfigError("load", f"{load!r}.blocks_to_load answered {k!r} for {R} remote blocks: it must be an int in [0, {R}]")
                k = int(k)
        if k < R:
            req.not_loaded = R - k
            req.not_loaded_reason = "declined"
        if k == 0:
            if ps.uses_pool and t0 > t:  # the directory lookup happens before the prefill is queued
                req.reused = L
                self._push(t0, READY, req)
            else:
                self._enqueue(rep, req, t, L)
            return
        # start the load of blocks [L+s, L+k)
        req.load = k
        req.split = s_
        req.load_attempted = True
        req.load_start_s = t0
        # computing while loading, the whole range is requested from the back and cut where the GPU's
        # front meets it (s is only the controller's prediction of that point)
        groups = self._groups(keys[L:L + k])
        req.load_groups = groups
        for node, gk in groups:
            pol = node.policy
            for key in gk:
                pol.on_access(key)
                pol.pin(key)  # a lease: not evicted under the reader
        if req.predicted_s is None:
            req.predicted_s = self.c.dispatch_s + self.c.prefill_s(L * self.B, (L + k) * self.B) - self.c.prefill_a_s
        self.loads += i >= self.judge_k
        if ps.compute_while_loading:
            # the load runs from the back; a split plan queues for its prefill slot now (the GPU computes
            # the front meanwhile), a plain load waits for its bytes until its p95 prediction has passed
            req.cake = True
            req.xfer = self._begin_read(rep, groups, t0, i, req.attempt, reverse=True, on_end=self._cake_load_end, payload=req)
            req.reused = L
            after = req.decision.compute_after_s if req.decision is not None else 0.0
            if not after:
                self._push(t0, READY, req)
            else:
                req.waiting = True
                self._push(t0 + after, TIMER, (req, "switch"))
            return
        req.xfer = self._begin_read(rep, groups, t0, i, req.attempt, reverse=False, on_end=self._req_load_end, payload=req)
        limit = math.inf
        if ps.timeout == "admission" and req.decision is not None and req.decision.soft_timeout_s is not None:
            limit = req.decision.soft_timeout_s
        elif ps.timeout == "sglang":
            limit = 1.0 + 0.25 * k * self.B / 1024
        if limit < self.c.transport_timeout_s:
            self._push(t + limit, TIMER, (req.xfer, "timeout"))

    def _load_ctx(self, rep: _Replica, first_key: int, R: int, t: float) -> AdmissionContext:
        """What a load rule is told of a request's R remote blocks starting at ``first_key``: the replica, the node that
        holds them, the path's flows, the replica's queue and utilisation — the same for the admission controller and
        a rule of your own."""
        src = self.where[first_key]
        return AdmissionContext(block_bytes=self.block_bytes, replica=rep.name, source=src.name, active_decodes=rep.active,
                                warming=t < rep.warming_until_s, path_flows_bytes=self._path_flows(rep, src, R * self.block_bytes),
                                queue_wait_s=self._queue_wait_s(rep, t), prefill_queue_requests=len(rep.queue),
                                prefill_utilisation=rep.utilisation(t))

    def _path_flows(self, rep: _Replica, node: _Node, size_bytes: float) -> tuple[float, ...]:
        """What a transport reports of the path: the remaining bytes of the flows on its busiest
        link (the source's egress, this replica's ingress, or its staging copy, which write-backs share) that a load
        would share with."""
        best: list[float] = []
        best_q = -1.0
        self.net.sync(self.clock.t)  # the flows as they stand now, not at the network's last event
        for link in ((node.out, rep.inn) if rep.stage is None else (node.out, rep.inn, rep.stage)):
            flows = self.net.flows_on(link, 0)  # a load is foreground: background flows (warmup, background writes) never delay it
            q = sum(r if r < size_bytes else size_bytes for r in flows)
            if q > best_q:
                best, best_q = flows, q
        return tuple(best)

    def _queue_wait_s(self, rep: _Replica, t: float) -> float:
        """What the replica's scheduler knows: predicted seconds before a new prefill could start."""
        slots = self.c.prefill_slots
        if rep.free_slots > 0 and not rep.queue:
            return 0.0
        running = min((max(r.job_end_s - t, 0.0) for r in rep.running), default=0.0)
        return running + rep.queued_s / slots

    def _oracle_k(self, rep: _Replica, keys: list[int], L: int, R: int, req: _Req) -> int:
        """Hindsight on its own draws (failure, hang), foresight of the links as they are now:
        the k whose load beats recomputing most."""
        c = self.c
        for node, _ in self._groups(keys[L:L + R]):
            _, fail = node.state(self.clock.t, c.failure_rate)
            if (c.timeout_rate and _unit(self.seed, req.i, req.attempt, node.idx, 2) < c.timeout_rate) or \
                    _unit(self.seed, req.i, req.attempt, node.idx, 1) < fail:
                return 0  # it knows this load would not deliver
        best_k, best = 0, 0.0
        k = 1
        while True:
            kk = min(k, R)
            took = c.lookup_s + self._predict_read_s(rep, self._groups(keys[L:L + kk])) + c.install_s_per_block * kk
            gain = c.prefill_s(L * self.B, (L + kk) * self.B) - c.prefill_a_s - took
            if gain > best:
                best_k, best = kk, gain
            if kk == R:
                return best_k
            k *= 2

    def _req_load_end(self, load: _Load, t: float) -> None:
        req: _Req = load.payload
        end = t + (self.c.install_s_per_block * req.load if load.status == "ok" else 0.0)
        self._push(end, LOAD_DONE, req)

    def _release_leases(self, req: _Req) -> None:
        for node, gk in req.load_groups:
            pol = node.policy
            for key in gk:
                pol.unpin(key)
        req.load_groups = []

    def _charge_interference(self, rep: _Replica, req: _Req, nbytes: float) -> float:
        stall = self.c.interference_s_per_byte * nbytes
        rep.debt_s += stall
        total_stall = stall * (1 + rep.active)
        if req.i >= self.judge_k:
            self.stall_s += total_stall
        req.stall_s += total_stall
        return stall

    def _record_outcome(self, req: _Req, load: _Load, status: LoadStatus, ok_blocks: int, t: float) -> int:
        """Tell the controller how the load went (once); returns the usable blocks."""
        load.recorded = True
        judged = req.i >= self.judge_k
        if status == "ok":
            self.loads_ok += judged
        elif status == "timeout":
            self.loads_timeout += judged
        else:
            self.loads_failed += judged
        delivered = load.delivered_bytes()
        stall = self._charge_interference(req.replica, req, delivered)
        ctl = self._ctl(req.replica)
        if ctl is None or req.decision is None:
            return ok_blocks
        n = req.load
        out = LoadOutcome(load_id=req.decision.load_id, status=status, ok_blocks=min(ok_blocks, n), lookup_s=self.c.lookup_s,
                          transfer_s=(load.end_s if load.ended else t) - load.t0, install_s=self.c.install_s_per_block * ok_blocks if status == "ok" else None,
                          stall_s=stall if status == "ok" else None, bytes_delivered=delivered)
        return ctl.record(out).usable_blocks

    def _load_done(self, req: _Req, t: float) -> None:
        rep: _Replica = req.replica
        load = req.xfer
        assert load is not None
        status = load.status
        self._release_leases(req)
        arrived = load.arrived_blocks(self.block_bytes)
        k = req.load
        usable = self._record_outcome(req, load, status, arrived, t)
        if self.controller is None or req.decision is None:
            usable = k if status == "ok" else 0  # the baselines use a load whole or not at all
        self.bytes_unused += max(load.delivered_bytes() - usable * self.block_bytes, 0)
        keys = self.p.keys[req.i]
        L = req.local
        if usable:
            req.load_s = t - req.load_start_s
            if req.i >= self.judge_k:
                self.bytes_read += usable * self.block_bytes
            for key in keys[L:L + usable]:
                self.ledger.record_read(key)
            if usable < k:
                req.not_loaded += k - usable
                req.not_loaded_reason = "timeout" if status == "timeout" else "transfer_error"
                req.load = usable
            self._install(rep, req, keys, L, L + usable)
            self._enqueue(rep, req, t, L + usable)
            return
        if self.ps.failure == "fail" and req.attempt < MAX_RETRIES:
            # the error surfaces to the client, which resubmits at once
            self.retries += req.i >= self.judge_k
            self._unpin(rep, req)
            req.attempt += 1
            self._push(t, ARRIVE, req)
            return
        req.not_loaded += req.load
        req.not_loaded_reason = "timeout" if status == "timeout" else "transfer_error"
        req.load = 0
        self._enqueue(rep, req, t, L)

    # ---------------------------------------------------------------- compute while loading

    def _k(self, req: _Req) -> float:
        """This request's compute over the cluster's model (``compute_scale``; 1 without one)."""
        return 1.0 if self._scale is None else float(self._scale[req.i])

    def _front_s(self, req: _Req, L: int, j: int) -> float:
        """GPU seconds to prefill blocks [L, L+j) with [0, L) cached (dispatch and fixed term included)."""
        if j <= 0:
            return 0.0
        c = self.c
        return c.dispatch_s + self._k(req) * c.prefill_s(L * self.B, (L + j) * self.B)

    def _tail_s(self, req: _Req, front_blocks: int, extent_blocks: int) -> float:
        """GPU seconds for the rest of the prompt after blocks [0, L + extent), given the front computed."""
        c = self.c
        k = self._k(req)
        start = (req.local + extent_blocks) * self.B
        T = self.p.input_tokens[req.i]
        rest = k * (c.prefill_s(start, T) - c.prefill_a_s)
        return rest + (c.dispatch_s + k * c.prefill_a_s if front_blocks == 0 else 0.0)

    def _arrival_s(self, load: _Load, m: int, now: float) -> float:
        """When the trailing m blocks of a reverse load will all have arrived, at today's rates."""
        bb = self.block_bytes
        when = now
        for j in range(len(load.groups) - 1, -1, -1):
            if m <= 0:
                break
            size = len(load.groups[j][1])
            need = min(size, m) * bb
            m -= size
            f = load.flows[j]
            if f is None:
                return math.inf
            done = f.done_bytes()
            if done + 1.0 >= need:
                continue
            if not f.alive or f.size_bytes + 1.0 < need:
                return math.inf  # ended short (failed) or cut: these blocks will not come
            rate = f.rate_bytes_per_s
            if rate <= 0:  # not moving (yet): re-planned when the rates change
                return math.inf
            when = max(when, now + (need - done) / rate)
        return when

    def _cake_schedule(self, req: _Req, now: float) -> float:
        """Plan the meeting point: the front j minimising max(slot + front(j), arrival of the last k−j)."""
        load = req.xfer
        assert load is not None
        self.net.sync(now)  # the bytes moved by now, not by the network's last event (or every re-plan pushes the meeting later)
        L, K = req.local, req.load
        s_ = 0
        t_s = req.slot_s

        def meet(j: int) -> float:
            return max(t_s + self._front_s(req, L, j), self._arrival_s(load, K - j, now))

        lo, hi = s_, K
        while lo < hi:  # the first j where the front is no earlier than the arrivals
            mid = (lo + hi) // 2
            if t_s + self._front_s(req, L, mid) >= self._arrival_s(load, K - mid, now):
                hi = mid
            else:
                lo = mid + 1
        best = meet(lo)
        if lo > s_:
            best = min(best, meet(lo - 1))
        req.meet_ver += 1
        req.job_end_s = best + self._tail_s(req, K, K)
        when = max(best, now)
        self._push(when, MEET, (req, req.meet_ver))
        return when

    def _cake_load_end(self, load: _Load, t: float) -> None:
        req: _Req = load.payload
        if req in self.cake_in_slot:
            self._cake_schedule(req, t)
            return
        if not load.recorded:  # not computing yet: the outcome is known now
            self._cake_record(req, load, t)
        if req.waiting:  # a plain load that ended in time: now it queues, its bytes already here
            req.waiting = False
            req.reused = req.local  # it queues once its blocks are installed: an event then, not a queue entry stamped ahead of now
            self._push(t + self.c.install_s_per_block * load.arrived_blocks(self.block_bytes), READY, req)

    def _cake_record(self, req: _Req, load: _Load, t: float) -> int:
        status: LoadStatus = load.status
        if status == "ok" and load.hung:
            status = "timeout"
        m = load.arrived_blocks(self.block_bytes)
        self._release_leases(req)
        return self._record_outcome(req, load, status, m, t)

    def _meet(self, item: tuple[_Req, int], t: float) -> None:
        req, ver = item
        if ver != req.meet_ver or req not in self.cake_in_slot:
            return
        load = req.xfer
        assert load is not None
        self.net.sync(t)  # what has arrived by now
        L, K = req.local, req.load
        m = min(load.arrived_blocks(self.block_bytes), K)
        j = K - m
        front_done = req.slot_s + self._front_s(req, L, j)
        if front_done > t + 1e-9:  # the front has not reached what arrived: re-plan
            if self._cake_schedule(req, t) <= t:  # no later point to wait for: the front decides
                req.meet_ver += 1
                self._push(front_done, MEET, (req, req.meet_ver))
            return
        self.cake_in_slot.pop(req, None)
        if not load.ended:
            self._end_load(load, t, "failed" if any(load.fails) else "timeout" if load.hung else "ok")
        if not load.recorded:
            self._cake_record(req, load, t)
        self._cake_finish(req, m, t)

    def _cake_finish(self, req: _Req, m: int, t_front_done: float) -> None:
        """The range is covered: m blocks loaded from the back, the rest of it computed; the tail follows."""
        load = req.xfer
        assert load is not None
        K = req.load
        j = K - m
        keys = self.p.keys[req.i]
        L = req.local
        for key in keys[L + j:L + K]:
            self.ledger.record_read(key)
        if req.i >= self.judge_k:
            self.bytes_read += m * self.block_bytes
        self.bytes_unused += max(load.delivered_bytes() - m * self.block_bytes, 0)
        assert load.ended  # both callers end it first (_start: it had ended; _meet: cut where the front met it)
        if m:
            req.load_s = load.end_s - req.load_start_s
        tail = self._tail_s(req, j, K)
        busy = (t_front_done - req.slot_s) + tail
        req.prefill_s = busy
        self.prefill_per[req.i] += busy
        if req.i >= self.judge_k:
            self.gpu_prefill_s += busy
        req.job_end_s = t_front_done + tail
        # the ledger's view: the front [L, L+j) was found remotely and recomputed (the split), m blocks loaded
        req.split = j
        req.load = m
        self._push(t_front_done + tail, PREFILL_DONE, req)

    def _install(self, rep: _Replica, req: _Req, keys: list[int], start: int, end: int) -> None:
        """Insert keys[start:end] into the local cache (pinned for this request); stop at the first that does not fit
        (its parent missing, no room, refused)."""
        cache = rep.cache
        bb = self.block_bytes
        nodes = cache.nodes
        for j in range(start, end):
            key = keys[j]
            if key in nodes:
                if j >= len(req.pinned):
                    cache.pin(key)
                    req.pinned.append(key)
                continue
            parent = keys[j - 1] if j else None
            if parent is not None and parent not in nodes:
                return
            try:
                cache.victims(bb, key)
            except CapacityError:
                return
            if not cache.admit(key, bb, parent):
                return
            cache.on_insert(key, bb, parent)
            cache.pin(key)
            req.pinned.append(key)

    def _unpin(self, rep: _Replica, req: _Req) -> None:
        cache = rep.cache
        for key in req.pinned:
            cache.unpin(key)
        req.pinned = []

    def _enqueue(self, rep: _Replica, req: _Req, t: float, reused_blocks: int) -> None:
        req.reused = reused_blocks
        req.queue_enter_s = t
        rep.queue.append(req)
        T = self.p.input_tokens[req.i]
        expect = reused_blocks + (req.load - req.split if req.cake else 0)  # what it expects to skip
        req.queued_tokens = T - expect * self.B
        req.queued_pred_s = self.c.dispatch_s + self.c.prefill_s(expect * self.B, T)
        rep.load_tokens += req.queued_tokens
        rep.queued_s += req.queued_pred_s
        self._start(rep, t)

    def _start(self, rep: _Replica, t: float) -> None:
        c = self.c
        while rep.free_slots > 0 and rep.queue:
            req = rep.queue.popleft()
            rep.utilisation(t)
            rep.free_slots -= 1
            rep.queued_s = max(rep.queued_s - req.queued_pred_s, 0.0)
            rep.running.add(req)
            debt, rep.debt_s = rep.debt_s, 0.0
            load = req.xfer
            req.slot_s = t + debt
            if req.cake and load is not None:
                if not load.ended:  # the GPU prefills the range from the front while it loads from the back
                    self.cake_in_slot[req] = None
                    self._cake_schedule(req, t)
                    continue
                m = min(load.arrived_blocks(self.block_bytes), req.load)
                self._cake_finish(req, m, req.slot_s + self._front_s(req, req.local, req.load - m))
                continue
            T = self.p.input_tokens[req.i]
            k = self._k(req)
            dur = c.dispatch_s + k * c.prefill_s(req.reused * self.B, T)
            req.prefill_s = dur
            self.prefill_per[req.i] += dur
            if req.i >= self.judge_k:
                self.gpu_prefill_s += dur
            ctl = self._ctl(rep)
            if ctl is not None and self.ps.learn_compute:  # the engine times its prefill: the controller learns the real compute
                start = req.reused * self.B
                ctl.model.observe_prefill(start, T - start, k * c.compute_factor * float(c.prefill.marginal_s(start, T)))
            req.job_end_s = t + dur + debt
            self._push(t + dur + debt, PREFILL_DONE, req)

    def _ready(self, req: _Req, t: float) -> None:
        self._enqueue(req.replica, req, t, req.reused)

    def _prefill_done(self, req: _Req, t: float) -> None:
        p = self.p
        rep: _Replica = req.replica
        i = req.i
        rep.utilisation(t)
        rep.free_slots += 1
        rep.running.discard(req)
        T = p.input_tokens[i]
        rep.load_tokens -= req.queued_tokens
        self.ttft[i] = t - req.first_arrival_s
        ctl = self._ctl(rep)
        if ctl is not None:  # the engine reports every request's TTFT: the controller's derived p95 target
            ctl.observe_ttft(t - req.first_arrival_s)
        self.queue[i] = req.slot_s - req.queue_enter_s
        self.completed[i] += 1
        self.t_last = max(self.t_last, t)
        keys = p.keys[i]
        self._install(rep, req, keys, req.reused, len(keys))
        m = p.matchable[i]
        used = req.local + req.split + req.load + req.not_loaded
        cls = p.request_class[i] if p.request_class else "default"
        rec = RequestRecord(
            prompt_tokens=T, block_size_tokens=self.B, local_blocks=req.local, remote_loaded_blocks=req.load,
            remote_not_loaded_blocks=req.not_loaded, not_loaded_reason=req.not_loaded_reason if req.not_loaded else None,
            missing_keys=tuple(keys[used:m]), request_class=cls, arrival_s=req.first_arrival_s, ttft_s=t - req.first_arrival_s,
            prefill_s=req.prefill_s, load_s=req.load_s, queue_s=self.queue[i], predicted_recompute_s=req.predicted_s if req.load else None,
            load_attempted=req.load_attempted, stall_s=req.stall_s if self.ps.uses_pool else None, split_blocks=req.split,
        )
        self.ledger.record(rec)
        self._publish(rep, req, keys, t)
        rep.active += 1
        out = p.output_tokens[i]
        rep.decode_tokens += T + out
        self._push(t + out / self.c.decode_tokens_per_s, DECODE_DONE, req)
        self._start(rep, t)

    def _decode_done(self, req: _Req, t: float) -> None:
        rep: _Replica = req.replica
        rep.active -= 1
        rep.decode_tokens -= self.p.input_tokens[req.i] + self.p.output_tokens[req.i]
        self._unpin(rep, req)

    # ------------------------------------------------------------------ publishing

    def _publish(self, rep: _Replica, req: _Req, keys: list[int], t: float) -> None:
        ps = self.ps
        if not ps.uses_pool or not keys:
            return
        i = req.i
        p = self.p
        if ps.publish == "oracle":
            assert self._oracle_pub is not None
            n = self._oracle_pub[i]
        else:
            f = self.filter
            util = self._util
            pool_in = sum(util.get(n.inn.name, 0.0) for n in self.nodes) / len(self.nodes)
            preq = PublishRequest(request_id=(i, req.attempt), num_tokens=p.input_tokens[i], block_size_tokens=self.B, time_s=t,
                                  tenant=p.tenant[i] if p.tenant else "default", boundary_tokens=p.boundary[i] if p.boundary else None,
                                  replica=rep.name, reused_blocks=req.local + req.load, local_blocks=req.local,
                                  write_path_utilisation=max(util.get(rep.out.name, 0.0), pool_in))
            f.observe(preq, keys)
            n = f.publishable(preq, keys)
        if self.write_gate is not None:
            self.write_gate.observe((i, req.attempt), keys)
        if n <= 0:
            return
        where = self.where
        writing = self.writing
        moving = self.ps.load == "admission" and self.ps.republish_unhealthy  # blocks held by an unhealthy node, written again elsewhere
        chunk = self.c.placement_chunk_blocks
        batches: dict[_Node, list[int]] = {}
        order: list[tuple[int, _Node]] = []  # (chain position, node) of each block to write, in chain order
        target: _Node | None = None
        for j, key in enumerate(keys[:n]):
            if j % chunk == 0:
                target = None
            node = where.get(key)
            if node is not None and not (moving and not self._healthy(node, rep)):
                node.policy.on_access(key)
                continue
            if key in writing:
                continue
            if target is None:
                target = self._place(keys[j - j % chunk], rep)
            if target is node:
                continue
            batches.setdefault(target, []).append(key)
            order.append((j, target))
        if self.write_gate is not None and batches:
            batches = self._gate_writes(batches, order)
        if not batches:
            return
        c = self.c
        cls = p.request_class[i] if p.request_class else "default"
        for node, todo in batches.items():
            nbytes = len(todo) * self.block_bytes
            writing.update(todo)
            path = (rep.out, node.inn) if rep.stage is None else (rep.stage, rep.out, node.inn)  # the staging copy carries both directions
            f = self.net.start(t, path, nbytes, priority=self.write_priority, latency_s=c.transfer_overhead_s,
                               payload=(node, todo, keys, cls), on_done=self._write_flow_end)
            self._push(t + c.transport_timeout_s, TIMER, (f, "write"))  # a write still moving then never lands
        self._net_changed()

    def _gate_writes(self, batches: dict[_Node, list[int]], order: list[tuple[int, _Node]]) -> dict[_Node, list[int]]:
        """A write into a full node must beat the block it would displace there (TinyLFU, ``write_admission``): each
        node admits a leading run of its blocks; the chain is cut at its first refused block (prefix-closed)."""
        assert self.write_gate is not None
        ok = {node: gate(node.policy, self.write_gate, todo, self.block_bytes) for node, todo in batches.items()}
        seen: dict[_Node, int] = {}
        cut = None
        for j, node in order:
            seen[node] = seen.get(node, 0) + 1
            if seen[node] > ok[node]:
                cut = j
                break
        if cut is None:
            return batches
        count: dict[_Node, int] = {}  # the blocks before the cut, per node
        for j, node in order:
            if j >= cut:
                break
            count[node] = count.get(node, 0) + 1
        return {node: batches[node][:c] for node, c in count.items()}

    def _write_flow_end(self, f: Flow, t: float) -> None:
        node = f.payload[0]
        node.bytes_in += int(f.size_bytes)
        self._push(t, WRITE_DONE, f.payload)

    def _write_done(self, item: tuple[_Node, list[int], list[int], str], t: float) -> None:
        node, todo, chain, cls = item
        pol = node.policy
        where = self.where
        bb = self.block_bytes
        pos = {k: j for j, k in enumerate(chain)}
        for key in todo:
            self.writing.discard(key)
        for key in todo:
            old = where.get(key)
            if old is node or key in pol.nodes:
                continue
            try:
                victims = pol.victims(bb, key)
            except CapacityError:
                break
            for v in victims:
                if where.get(v) is node:  # a block moved elsewhere lives on there
                    del where[v]
                    self.ledger.record_eviction(v, t)
            j = pos[key]
            parent = chain[j - 1] if j else None
            if parent is not None and parent not in pol.nodes:
                parent = None  # the parent lives on another node, or was just evicted: a new root here
            pol.on_insert(key, bb, parent)
            where[key] = node
            if t >= self.t_judge:
                self.bytes_written += bb
            self.ledger.record_write(key, t, bb, tier=node.name, request_class=cls)

    # ------------------------------------------------------------------ scale-out and warmup

    def _scale_out(self, ev: ScaleOut, t: float) -> None:
        start = len(self.replicas)
        new = [self._new_replica(start + j) for j in range(ev.replicas)]
        self.replicas.extend(new)
        if not self.ps.warmup:
            return
        c = self.c
        n_seen = max(self.n_arrived + 1, 1)
        seen = self.p.trace.head(n_seen)  # its block ids renumbered densely (canonical): mapped back to the run's own below
        own = self.p.trace.block_ids[: int(self.p.trace.block_offsets[min(n_seen, len(self.p.trace))])].tolist()
        back = dict(zip(seen.block_ids.tolist(), own))
        hot = hot_prefixes_from_trace(seen, bytes_per_token=c.bytes_per_token, recompute_s=lambda tok: c.prefill_s(0, int(tok)))
        bw = min(c.node_bandwidth_bytes_per_s * c.storage_nodes, c.replica_bandwidth_bytes_per_s * ev.replicas)
        plan = plan_warmup(hot, WarmupConfig(replicas=ev.replicas, window_s=c.warmup_window_s, bandwidth_bytes_per_s=max(bw, 1e-3),
                                             current_load_bytes_per_s=min(self.bytes_read / max(t, 1.0), bw * 0.5)))
        chains = {h.prefix: tuple(back[b] for b in h.blocks) for h in hot}
        for j, r in enumerate(new):
            ready = plan.ready_at_s.get(j)
            r.warming_until_s = t + (ready if ready is not None else c.warmup_window_s)
        for load in plan.schedule:
            new[load.replica].warm_left += 1
            self._push(t + load.start_s, WARM_DONE, ("start", new[load.replica], chains[load.prefix]))

    def _warm_step_done(self, rep: _Replica, t: float) -> None:
        """Readiness is what the replica holds, not a predicted time: once its last planned warmup
        load has ended (whatever happened to it), it serves repeating requests like any other."""
        rep.warm_left -= 1
        if rep.warm_left <= 0:
            rep.warming_until_s = min(rep.warming_until_s, t)

    def _warm_load_end(self, load: _Load, t: float) -> None:
        rep, chain, have = load.payload
        got = load.arrived_blocks(self.block_bytes)  # a warm load that ran out of time still keeps its leading blocks
        self.bytes_unused += max(load.delivered_bytes() - got * self.block_bytes, 0)
        self._push(t, WARM_DONE, (load.status, rep, chain[:have + got], have))

    def _warm_done(self, item: tuple, t: float) -> None:
        phase, rep, chain = item[:3]
        if phase == "start":
            run = self.pool_index.match_prefix(list(chain))  # only what the pool holds can be warmed
            have = rep.index.match_prefix(list(chain))
            if run <= have:
                self._warm_step_done(rep, t)
                return
            ks = list(chain[have:run])
            self.warm_loads += 1
            # warming is bulk work in the background class: it takes only what serving traffic leaves
            self._begin_read(rep, self._groups(ks), t, -1 - rep.idx, len(ks) + have, reverse=False, on_end=self._warm_load_end,
                             payload=(rep, chain[:run], have), priority=1)
            return
        self._warm_step_done(rep, t)
        if phase == "ok":
            self.warm_loads_ok += 1
        elif phase == "timeout":
            self.warm_loads_timeout += 1
        else:
            self.warm_loads_failed += 1
        cache = rep.cache
        bb = self.block_bytes
        sent = (len(chain) - item[3]) * bb if len(item) > 3 else 0  # type: ignore[misc]
        if t >= self.t_judge:
            self.bytes_read += sent
            self.warmup_bytes += sent
        self.ledger.record_replication(t, sent)
        for j, key in enumerate(chain):
            if key in cache.nodes:
                continue
            parent = chain[j - 1] if j else None
            try:
                cache.victims(bb, key)
            except CapacityError:
                break
            if parent is not None and parent not in cache.nodes:
                break
            cache.on_insert(key, bb, parent)
