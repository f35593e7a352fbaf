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

Network: a transfer occupies its storage node's link and the replica's NIC from
``max(ready, both links free)`` for ``overhead + bytes / min(bandwidths)``
(degradation windows scale a node's bandwidth); reads and writes share a node's
link. A staging leg through CPU memory adds ``bytes / stage_bandwidth``;
installing adds a per-block time. Failures are drawn from a hash of (seed,
request, attempt, node), so every policy set sees the same failures.
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

from ..admission import AdmissionConfig, AdmissionContext, AdmissionController, LatencyModel, LinkPrior, LoadOutcome
from ..errors import CapacityError, ConfigError
from ..eviction.kernels import next_use_per_ref
from ..eviction.policies import TraceOracle
from ..eviction.replay import make_policy
from ..ledger import Ledger, PublicationLog, RequestRecord
from ..matching import match
from ..publish import PublishRequest, make_filter
from ..publish_sim import block_recompute_s
from ..warmup import WarmupConfig, hot_prefixes_from_trace, plan_warmup
from .config import ClusterConfig, Degrade, ScaleOut, Spike
from .policysets import PolicySet

ARRIVE, LOAD_DONE, PREFILL_DONE, DECODE_DONE, WRITE_DONE, WARM_DONE, SCALE_OUT, READY = range(8)
STATIC_ROUTERS = ("round-robin", "random", "prefix-affinity")
MAX_RETRIES = 3
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
                 "pinned", "stall_s", "load_attempted", "decision")
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

    def __init__(self, i: int, t: float) -> None:
        self.i = i
        self.attempt = 0
        self.first_arrival_s = t
        self.pinned: list[int] = []
        self.load_attempted = False
        self.stall_s = 0.0


class _Replica:
    __slots__ = ("idx", "name", "cache", "index", "free_slots", "queue", "load_tokens", "active", "decode_tokens", "in_free_s", "out_free_s",
                 "debt_s", "warming_until_s", "bytes_in")

    def __init__(self, idx: int, cache: Any, slots: int) -> None:
        self.idx = idx
        self.name = f"replica-{idx}"
        self.cache = cache
        self.index = _DictIndex(cache.nodes, "local")
        self.free_slots = slots
        self.queue: deque[_Req] = deque()
        self.load_tokens = 0
        self.active = 0
        self.decode_tokens = 0
        self.in_free_s = 0.0
        self.out_free_s = 0.0
        self.debt_s = 0.0
        self.warming_until_s = -1.0
        self.bytes_in = 0


class _Node:
    __slots__ = ("idx", "name", "policy", "free_s", "windows", "bytes_out", "bytes_in")

    def __init__(self, idx: int, policy: Any) -> None:
        self.idx = idx
        self.name = f"node-{idx}"
        self.policy = policy
        self.free_s = 0.0
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

    def quantile_ms(self, q: float) -> float:
        return float(np.quantile(self.ttft_s, q) * 1e3) if self.ttft_s.size else float("nan")

    def row(self) -> dict[str, Any]:
        led = self.ledger.to_dict()
        flows = led["flows"]
        return {
            "policy": self.policy,
            "requests": self.n_requests,
            "ttft_p50_ms": self.quantile_ms(0.5),
            "ttft_p95_ms": self.quantile_ms(0.95),
            "ttft_p99_ms": self.quantile_ms(0.99),
            "ttft_mean_ms": float(self.ttft_s.mean() * 1e3),
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
            "replicas_final": self.replicas_final,
            "ledger": {"requests": led["requests"], "tokens": led["tokens"], "bytes": led["bytes"], "flows": flows,
                       "distributions": {k: v["ttft_s"] for k, v in led["distributions"].items()}},
            "e_benefit_s_per_s": led["expected_benefit"]["e_benefit_s_per_s"],
        }


class Simulator:
    def __init__(self, prepared: Prepared | Any, cluster: ClusterConfig, policy_set: PolicySet, *,
                 events: tuple[ScaleOut | Degrade, ...] = (), seed: int = 0) -> None:
        self.p = prepared if isinstance(prepared, Prepared) else Prepared(prepared)
        if not isinstance(cluster, ClusterConfig):
            raise ConfigError("cluster", "must be a kvpolicy.sim.ClusterConfig")
        if not isinstance(policy_set, PolicySet):
            raise ConfigError("policy_set", "must be a kvpolicy.sim.PolicySet")
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
        self.replicas: list[_Replica] = [self._new_replica(i) for i in range(cluster.replicas)]
        self.nodes = [_Node(j, self._policy(ps.pool_eviction, cluster.pool_capacity_bytes_per_node)) for j in range(cluster.storage_nodes)]
        for e in events:
            if isinstance(e, Degrade):
                self.nodes[e.node].windows.append(e)
        self.where: dict[int, _Node] = {}
        self.pool_index = _DictIndex(self.where, "pool")
        self.writing: set[int] = set()
        trace = self.p.trace
        self.ledger = Ledger(cluster.bytes_per_token, publication_log=PublicationLog(max_exact_keys=max(trace.num_block_ids + 1, 1024)),
                             write_cost_s_per_byte=(1.0 / cluster.node_bandwidth_bytes_per_s) if cluster.node_bandwidth_bytes_per_s > 0 else None,
                             eviction_cost_s_per_token=cluster.prefill.b_s_per_token)
        self.filter = self._make_filter()
        self.controller: AdmissionController | None = None
        if ps.load == "admission":
            bw = min(cluster.node_bandwidth_bytes_per_s, cluster.replica_bandwidth_bytes_per_s)
            prior = LinkPrior(bandwidth_bytes_per_s=max(bw, 1e-3), lookup_s=cluster.lookup_s, transfer_overhead_s=cluster.transfer_overhead_s,
                              stage_bytes_per_s=cluster.stage_bytes_per_s, install_s_per_block=cluster.install_s_per_block,
                              dispatch_s=cluster.dispatch_s, interference_s_per_byte=cluster.interference_s_per_byte)
            self.controller = AdmissionController(LatencyModel(prior, cluster.prefill), AdmissionConfig(), clock=self.clock)
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
        n = len(trace)
        self.ttft = np.full(n, np.nan)
        self.completed = np.zeros(n, dtype=np.int64)
        self.routes = np.full(n, -1, dtype=np.int64)
        self.t_last = 0.0

    # ------------------------------------------------------------------ construction

    def _policy(self, name: str, capacity_bytes: int) -> Any:
        kw: dict[str, Any] = {}
        if name in ("belady", "belady-bypass"):
            kw["oracle"] = self._oracle
        return make_policy(name, capacity_bytes, clock=self.clock, **kw)  # type: ignore[arg-type]

    def _new_replica(self, idx: int) -> _Replica:
        if self._local_oracles is not None:
            oracle = self._local_oracles.get(idx) or _ReplicaOracle({}, self._oracle)
            cache = make_policy("belady", self.c.local_capacity_bytes, clock=self.clock, oracle=oracle)
        else:
            cache = self._policy(self.ps.local_eviction, self.c.local_capacity_bytes)
        return _Replica(idx, cache, self.c.prefill_slots)

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
        return make_filter(spec, block_bytes=self.block_bytes, recompute_s=block_recompute_s(self.c.prefill, self.B),
                           write_bytes_per_s=max(self.c.node_bandwidth_bytes_per_s, 1e-3), cross_replica_share=cross)

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
        self.ledger.flows["write"].t.clear()
        self.ledger.flows["write"].b.clear()
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
        heap = self.heap
        clock = self.clock
        handlers = (self._arrive, self._load_done, self._prefill_done, self._decode_done, self._write_done, self._warm_done, self._scale_out,
                    self._ready)
        while heap:
            t, _, kind, obj = heapq.heappop(heap)
            clock.t = t
            handlers[kind](obj, t)
        if self.controller is not None and self.controller.loads_in_flight():
            raise AssertionError("loads still in flight at the end of the run")  # pragma: no cover - conservation
        t0 = p.arrival_s[0]
        return SimResult(
            policy=self.ps.name, n_requests=len(p.arrival_s), ttft_s=self.ttft.copy(), gpu_prefill_s=self.gpu_prefill_s,
            bytes_read=self.bytes_read, bytes_written=self.bytes_written, bytes_sent=self.bytes_sent, loads=self.loads,
            loads_ok=self.loads_ok, loads_failed=self.loads_failed, loads_timeout=self.loads_timeout, retries=self.retries,
            warmup_bytes=self.warmup_bytes, stall_s=self.stall_s, makespan_s=self.t_last - t0, replicas_final=len(self.replicas), ledger=self.ledger,
            node_bytes_out=tuple(n.bytes_out for n in self.nodes), replica_bytes_in=tuple(r.bytes_in for r in self.replicas),
            completed=self.completed.copy(), routes=self.routes.copy(),
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

    def _healthy(self, node: _Node) -> bool:
        if self.controller is None:
            return True
        b = self.controller.breakers.get(node.name)
        return b is None or b.state == "closed"

    def _place(self, chunk_key: int) -> _Node:
        """Rendezvous placement of a chunk; kvpolicy skips nodes whose breaker is open."""
        mix = _mix
        order = sorted(self.nodes, key=lambda n: -mix((chunk_key * 0x9E3779B1) ^ mix(n.idx + 7)))
        if self.ps.load == "admission":
            for n in order:
                if self._healthy(n):
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

    def _plan_read(self, rep: _Replica, groups: list[tuple[_Node, list[int]]], t0: float, req_i: int, attempt: int,
                   commit: bool) -> tuple[float, str, float, float]:
        """(end time, status, transfer seconds, stage seconds) of reading ``groups`` into ``rep`` from t0.

        The transfer seconds are the time bytes were moving (the sum of the legs' own
        durations): waiting for a busy link is the queue term, which the admission
        model predicts from the bytes ahead on the source — counting it again in
        B_eff would charge every queue twice."""
        c = self.c
        t_rep = max(t0, rep.in_free_s)
        status = "ok"
        total = 0
        moving = 0.0
        for node, ks in groups:
            nbytes = len(ks) * self.block_bytes
            factor, fail = node.state(t0, c.failure_rate)
            bw = min(c.node_bandwidth_bytes_per_s * factor, c.replica_bandwidth_bytes_per_s)
            start = max(t_rep, node.free_s)
            end = start + c.transfer_overhead_s + (nbytes / bw if bw > 0 else math.inf)
            if end - t0 > c.transport_timeout_s or (c.timeout_rate and _unit(self.seed, req_i, attempt, node.idx, 2) < c.timeout_rate):
                end = t0 + c.transport_timeout_s  # no answer: the transport gives up (a policy timeout may fire first)
                status = "timeout"
            elif _unit(self.seed, req_i, attempt, node.idx, 1) < fail:
                status = "failed"
            if commit:
                node.free_s = max(node.free_s, end)
                node.bytes_out += nbytes
                rep.in_free_s = max(rep.in_free_s, end)
                rep.bytes_in += nbytes
                self.bytes_sent += nbytes
            t_rep = end
            total += nbytes
            moving += end - start
            if status != "ok":
                return end, status, moving, 0.0
        stage = total / c.stage_bytes_per_s if c.stage_bytes_per_s else 0.0
        return t_rep + stage, status, moving, stage

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
        req.not_loaded = 0
        req.not_loaded_reason = None
        req.predicted_s = None
        req.load_s = None
        req.decision = None
        t0 = t + (self.c.lookup_s if ps.uses_pool else 0.0)
        k = 0
        if R:
            load = ps.load
            if load == "always":
                k = R
            elif load == "min-tokens":
                k = R if R * self.B >= ps.min_load_tokens else 0
            elif load == "admission":
                assert self.controller is not None
                src = self.where[keys[L]].name
                ctx = AdmissionContext(block_bytes=self.block_bytes, replica=rep.name, source=src, active_decodes=rep.active,
                                       warming=t < rep.warming_until_s)
                d = self.controller.decide(pm, ctx)
                req.decision = d
                k = d.load_blocks
                if k:
                    req.predicted_s = d.t_recompute_p50_s
            elif load == "oracle":
                k = self._oracle_k(rep, keys, L, R, t0, req)
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
        # start the load
        req.load = k
        req.load_attempted = True
        req.load_start_s = t
        ks = keys[L:L + k]
        groups = self._groups(ks)
        req.load_groups = groups
        for node, gk in groups:
            pol = node.policy
            for key in gk:
                pol.on_access(key)
                pol.pin(key)  # a lease: not evicted under the reader
        end, status, xfer_s, stage_s = self._plan_read(rep, groups, t0, i, req.attempt, commit=True)
        if status == "ok":
            end += self.c.install_s_per_block * k
        limit = math.inf
        if ps.timeout == "admission" and req.decision is not None and req.decision.soft_timeout_s is not None:
            limit = req.decision.soft_timeout_s
        elif ps.timeout == "sglang":
            limit = 1.0 + 0.25 * k * self.B / 1024
        if end - t > limit and status == "ok":
            status, end = "timeout", t + limit
        req.status = (status, xfer_s, stage_s)
        if req.predicted_s is None:
            req.predicted_s = self.c.dispatch_s + self.c.prefill_s(L * self.B, (L + k) * self.B) - self.c.prefill.a_s
        self.loads += 1
        self._push(end, LOAD_DONE, req)

    def _oracle_k(self, rep: _Replica, keys: list[int], L: int, R: int, t0: float, req: _Req) -> int:
        """Hindsight: the k whose real load (this link state, this failure draw) beats recomputing most."""
        best_k, best = 0, 0.0
        k = 1
        c = self.c
        while True:
            kk = min(k, R)
            end, status, _, _ = self._plan_read(rep, self._groups(keys[L:L + kk]), t0, req.i, req.attempt, commit=False)
            if status == "ok":
                gain = c.prefill_s(L * self.B, (L + kk) * self.B) - c.prefill.a_s - (end + c.install_s_per_block * kk - t0)
                if gain > best:
                    best_k, best = kk, gain
            if kk == R:
                return best_k
            k *= 2

    def _load_done(self, req: _Req, t: float) -> None:
        rep: _Replica = req.replica
        status, xfer_s, stage_s = req.status
        k = req.load
        for node, gk in req.load_groups:
            pol = node.policy
            for key in gk:
                pol.unpin(key)
        nbytes = k * self.block_bytes
        stall = self.c.interference_s_per_byte * nbytes
        usable = 0
        if self.controller is not None and req.decision is not None:
            out = LoadOutcome(load_id=req.decision.load_id, status=status, ok_blocks=k if status == "ok" else 0,
                              lookup_s=self.c.lookup_s, transfer_s=xfer_s if status == "ok" else None,
                              stage_s=stage_s if status == "ok" and self.c.stage_bytes_per_s else None,
                              install_s=self.c.install_s_per_block * k if status == "ok" else None, stall_s=stall if status == "ok" else None)
            usable = self.controller.record(out).usable_blocks
        elif status == "ok":
            usable = k
        if status == "ok":
            self.loads_ok += 1
        elif status == "timeout":
            self.loads_timeout += 1
        else:
            self.loads_failed += 1
        # interference: the transfer moved bytes into this replica whatever its outcome
        rep.debt_s += stall
        total_stall = stall * (1 + rep.active)
        self.stall_s += total_stall
        req.stall_s += total_stall
        keys = self.p.keys[req.i]
        L = req.local
        if usable:
            req.load_s = t - req.load_start_s
            self.bytes_read += usable * self.block_bytes
            for key in keys[L:L + usable]:
                self.ledger.record_read(key)
            self._install(rep, req, keys, L, L + usable)
            self._enqueue(rep, req, t, L + usable)
            return
        if self.ps.failure == "fail" and req.attempt < MAX_RETRIES:
            # the error surfaces to the client, which resubmits at once
            self.retries += 1
            self._unpin(rep, req)
            req.attempt += 1
            self._push(t, ARRIVE, req)
            return
        req.not_loaded += req.load
        req.not_loaded_reason = "timeout" if status == "timeout" else "transfer_error"
        req.load = 0
        self._enqueue(rep, req, t, L)

    def _install(self, rep: _Replica, req: _Req, keys: list[int], start: int, end: int) -> int:
        """Insert keys[start:end] into the local cache (pinned for this request). Returns how many fit."""
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
                return j - start
            try:
                cache.victims(bb, key)
            except CapacityError:
                return j - start
            if not cache.admit(key, bb, parent):
                return j - start
            cache.on_insert(key, bb, parent)
            cache.pin(key)
            req.pinned.append(key)
        return end - start

    def _unpin(self, rep: _Replica, req: _Req) -> None:
        cache = rep.cache
        for key in req.pinned:
            cache.unpin(key)
        req.pinned = []

    def _enqueue(self, rep: _Replica, req: _Req, t: float, reused_blocks: int) -> None:
        req.reused = reused_blocks
        req.queue_enter_s = t
        rep.queue.append(req)
        rep.load_tokens += self.p.input_tokens[req.i] - reused_blocks * self.B
        self._start(rep, t)

    def _start(self, rep: _Replica, t: float) -> None:
        c = self.c
        while rep.free_slots > 0 and rep.queue:
            req = rep.queue.popleft()
            rep.free_slots -= 1
            T = self.p.input_tokens[req.i]
            dur = c.dispatch_s + c.prefill_s(req.reused * self.B, T)
            req.prefill_s = dur
            self.gpu_prefill_s += dur
            debt, rep.debt_s = rep.debt_s, 0.0
            self._push(t + dur + debt, PREFILL_DONE, req)

    def _ready(self, req: _Req, t: float) -> None:
        self._enqueue(req.replica, req, t, req.reused)

    def _prefill_done(self, req: _Req, t: float) -> None:
        p = self.p
        rep: _Replica = req.replica
        i = req.i
        rep.free_slots += 1
        T = p.input_tokens[i]
        rep.load_tokens -= T - req.reused * self.B
        self.ttft[i] = t - req.first_arrival_s
        self.completed[i] += 1
        self.t_last = max(self.t_last, t)
        keys = p.keys[i]
        self._install(rep, req, keys, req.reused, len(keys))
        m = p.matchable[i]
        used = req.local + req.load + req.not_loaded
        cls = p.request_class[i] if p.request_class else "default"
        rec = RequestRecord(
            prompt_tokens=T, block_size_tokens=self.B, local_blocks=req.local, remote_loaded_blocks=req.load,
            remote_not_loaded_blocks=req.not_loaded, not_loaded_reason=req.not_loaded_reason if req.not_loaded else None,
            missing_keys=tuple(keys[used:m]), request_class=cls, arrival_s=req.first_arrival_s, ttft_s=t - req.first_arrival_s,
            prefill_s=req.prefill_s, load_s=req.load_s, queue_s=None, predicted_recompute_s=req.predicted_s if req.load else None,
            load_attempted=req.load_attempted, stall_s=req.stall_s if self.ps.uses_pool else None,
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
            preq = PublishRequest(request_id=(i, req.attempt), num_tokens=p.input_tokens[i], block_size_tokens=self.B, time_s=t,
                                  tenant=p.tenant[i] if p.tenant else "default", boundary_tokens=p.boundary[i] if p.boundary else None,
                                  replica=rep.name, reused_blocks=req.local + req.load)
            f.observe(preq, keys)
            n = f.publishable(preq, keys)
        if n <= 0:
            return
        where = self.where
        writing = self.writing
        moving = self.ps.load == "admission"  # kvpolicy re-publishes blocks held by an unhealthy node elsewhere
        chunk = self.c.placement_chunk_blocks
        batches: dict[_Node, list[int]] = {}
        target: _Node | None = None
        for j, key in enumerate(keys[:n]):
            if j % chunk == 0:
                target = None
            node = where.get(key)
            if node is not None and not (moving and not self._healthy(node)):
                node.policy.on_access(key)
                continue
            if key in writing:
                continue
            if target is None:
                target = self._place(keys[j - j % chunk])
            if target is node:
                continue
            batches.setdefault(target, []).append(key)
        if not batches:
            return
        c = self.c
        cls = p.request_class[i] if p.request_class else "default"
        for node, todo in batches.items():
            nbytes = len(todo) * self.block_bytes
            factor, _ = node.state(t, c.failure_rate)
            bw = min(c.node_bandwidth_bytes_per_s * factor, c.replica_bandwidth_bytes_per_s)
            start = max(t, rep.out_free_s, node.free_s)
            end = start + c.transfer_overhead_s + (nbytes / bw if bw > 0 else math.inf)
            if end - t > c.transport_timeout_s:  # the write never lands
                end = t + c.transport_timeout_s
                node.free_s = max(node.free_s, end)
                rep.out_free_s = max(rep.out_free_s, end)
                continue
            node.free_s = end
            rep.out_free_s = end
            node.bytes_in += nbytes
            writing.update(todo)
            self._push(end, WRITE_DONE, (node, todo, keys, cls))

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
        seen = self.p.trace.head(max(self.n_arrived + 1, 1))
        hot = hot_prefixes_from_trace(seen, bytes_per_token=c.bytes_per_token, recompute_s=lambda tok: c.prefill_s(0, int(tok)))
        bw = min(c.node_bandwidth_bytes_per_s * c.storage_nodes, c.replica_bandwidth_bytes_per_s * ev.replicas)
        plan = plan_warmup(hot, WarmupConfig(replicas=ev.replicas, window_s=c.warmup_window_s, bandwidth_bytes_per_s=max(bw, 1e-3),
                                             current_load_bytes_per_s=min(self.bytes_read / max(t, 1.0), bw * 0.5)))
        chains = {h.prefix: h.blocks for h in hot}
        for j, r in enumerate(new):
            ready = plan.ready_at_s.get(j)
            r.warming_until_s = t + (ready if ready is not None else c.warmup_window_s)
        for load in plan.schedule:
            self._push(t + load.start_s, WARM_DONE, ("start", new[load.replica], chains[load.prefix]))

    def _warm_done(self, item: tuple, t: float) -> None:
        phase, rep, chain = item[:3]
        if phase == "start":
            run = self.pool_index.match_prefix(list(chain))  # only what the pool holds can be warmed
            have = rep.index.match_prefix(list(chain))
            if run <= have:
                return
            ks = list(chain[have:run])
            groups = self._groups(ks)
            end, status, _, _ = self._plan_read(rep, groups, t, -1 - rep.idx, len(ks) + have, commit=True)
            self.loads += 1
            self._push(end, WARM_DONE, ("end" if status == "ok" else status, rep, chain[:run], have))
            return
        if phase != "end":
            if phase == "timeout":
                self.loads_timeout += 1
            else:
                self.loads_failed += 1
            return
        self.loads_ok += 1
        cache = rep.cache
        bb = self.block_bytes
        sent = (len(chain) - item[3]) * bb if len(item) > 3 else 0  # type: ignore[misc]
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
