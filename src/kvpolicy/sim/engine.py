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

The simulator is built in rooms, one module each, every room a class that stands on the one below it and sees only
what lies beneath: :mod:`.events` (the clock and the event queue) → :mod:`.transfers` (flows and loads) →
:mod:`.pool` (storage nodes, placement, publishing, writes) → :mod:`.overlap` (computing while loading) →
:mod:`.replicas` (routing, prefill slots, local caches, scale-out, warmup) → :mod:`.lifecycle` (a request's events);
:class:`Simulator` builds the world (:mod:`.world`) and runs the loop. The decisions are made by the same online
objects an engine calls, through the same protocols: a load rule (:class:`kvpolicy.protocols.LoadRule`), a publish
filter, an eviction policy, the write-admission gate.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np

from .._own import is_own
from .._validate import check_non_negative_int, check_split
from ..admission import AdmissionConfig, AdmissionController, LatencyModel, LinkPrior
from ..errors import ConfigError
from ..eviction.policies import TraceOracle
from ..ledger import Ledger, PublicationLog
from ..write_admission import WriteAdmission
from .config import ClusterConfig, Degrade, ScaleOut
from .events import CAPACITY, SAMPLE, SCALE_OUT, _Clock
from .lifecycle import RequestLifecycle
from .network import FlowNetwork
from .policysets import PolicySet, load_own_rule
from .world import (MAX_RETRIES, STATIC_ROUTERS, UTIL_WINDOW_S, Prepared, SimResult, _DictIndex, _Node, _Replica, _replica_oracles,
                    _ReplicaOracle, _Req, apply_spike)

__all__ = ["MAX_RETRIES", "STATIC_ROUTERS", "UTIL_WINDOW_S", "Prepared", "SimResult", "Simulator", "apply_spike"]


class Simulator(RequestLifecycle):
    def __init__(self, prepared: Prepared | Any, cluster: ClusterConfig, policy_set: PolicySet, *,
                 events: tuple[ScaleOut | Degrade, ...] = (), seed: int = 0, compute_scale: Any = None, judge_from_request: int = 0,
                 pause_gc: bool = True) -> None:
        """``compute_scale``: optional, one positive number per request (trace order) multiplying ``compute_factor``
        for that request's own prefill — the compute a real run measured, replayed (e.g. each request's measured
        forward pass over the profile's). The router's and the oracles' predictions keep the cluster's model: an
        engine does not know a request's compute before it runs; kvpolicy's controller hears it afterwards.

        ``judge_from_request`` = k > 0 is a held-out split: every policy runs (and learns) over the whole trace, but the
        result counts only requests k onwards — their TTFTs, prefill seconds, loads and reads — and the bytes written or
        replicated from request k's arrival on (the ledger likewise). Bytes sent and unused stay whole-run figures.

        ``pause_gc`` (default True): :meth:`run` holds Python's cyclic garbage collector while its events run and gives
        it back as it found it (a sixth of a run's time went to the collector's passes over short-lived objects). The
        few reference cycles a run makes are collected afterwards. False leaves the collector alone (a host that must
        never see it paused, even for a run)."""
        if not isinstance(pause_gc, bool):
            raise ConfigError("pause_gc", f"must be True or False, got {pause_gc!r}")
        self.pause_gc = pause_gc
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
        if policy_set.router is not None and policy_set.router != cluster.router:  # the set is deployed with its own router
            cluster = attrs.evolve(cluster, router=policy_set.router)
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
        #: pulls from peers: they write into the pool, so a pool that can hold no block has none
        self.pulls = ps.pull_from_peers and cluster.pool_capacity_bytes_per_node >= self.block_bytes
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
        self.heap = []
        self.n_arrived = -1
        # counters
        self.gpu_prefill_s = 0.0
        self.bytes_read = self.bytes_written = self.bytes_sent = self.bytes_pulled = self.bytes_direct = 0
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

    def run(self) -> SimResult:
        p = self.p
        self._arrivals_from(p.arrival_s)  # a stream beside the heap; a request's state is made when it arrives
        for e in self.events:
            if isinstance(e, ScaleOut):
                self._push(e.t_s, SCALE_OUT, e)
            elif isinstance(e, Degrade):
                self._push(e.t1_s, CAPACITY, self.nodes[e.node])
                self._push(e.t2_s, CAPACITY, self.nodes[e.node])
        t_first, t_end = p.arrival_s[0], p.arrival_s[-1]
        self._sample_s = max((t_end - t_first) / 200.0, 1e-3)
        self._push(t_first, SAMPLE, None)
        self._loop(self._handlers(), pause_gc=self.pause_gc)
        if any(ctl.loads_in_flight() for ctl in (self.controller, *self.controllers.values()) if ctl is not None):
            raise AssertionError("loads still in flight at the end of the run")  # pragma: no cover - conservation
        t0 = p.arrival_s[0]
        return SimResult(
            policy=self.ps.name, n_requests=len(p.arrival_s), ttft_s=self.ttft.copy(), gpu_prefill_s=self.gpu_prefill_s,
            bytes_read=self.bytes_read, bytes_written=self.bytes_written, bytes_sent=self.bytes_sent, bytes_pulled=self.bytes_pulled, bytes_direct=self.bytes_direct,
            loads=self.loads,
            loads_ok=self.loads_ok, loads_failed=self.loads_failed, loads_timeout=self.loads_timeout, retries=self.retries,
            warmup_bytes=self.warmup_bytes, stall_s=self.stall_s, makespan_s=self.t_last - t0, replicas_final=len(self.replicas), ledger=self.ledger,
            node_bytes_out=tuple(n.bytes_out for n in self.nodes), replica_bytes_in=tuple(r.bytes_in for r in self.replicas),
            completed=self.completed.copy(), routes=self.routes.copy(), bytes_unused=self.bytes_unused,
            warm_loads=(self.warm_loads, self.warm_loads_ok, self.warm_loads_failed, self.warm_loads_timeout),
            link_series={k: (np.asarray(a), np.asarray(b), np.asarray(c)) for k, (a, b, c) in self._series.items()},
            queue_s=self.queue.copy(), judge_from_request=self.judge_k, prefill_s=self.prefill_per.copy(),
        )

    def _handlers(self) -> tuple[Callable[[Any, float], None], ...]:
        """Each event kind's handler, in the order of the kinds in :mod:`.events`."""
        return (self._arrive, self._load_done, self._prefill_done, self._decode_done, self._write_done, self._warm_done, self._scale_out,
                self._ready, self._net_event, self._load_timeout, self._meet, self._capacity, self._sample, self._switch, self._write_timeout,
                self._new_request)
