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

The simulator is a world of rooms, each an object that owns its state and is handed, when the world is built, the
rooms it may call: :class:`~.events.EventLoop` (the clock and the event queue), :class:`~.tally.Tally` (the run's
figures), :class:`~.transfers.Transfers` (the network: flows and the loads on them), :class:`~.planner.LoadPlanner`
(the load rule and the controllers that hear how loads went), :class:`~.pool.Pool` (storage nodes, placement,
publishing, writes), :class:`~.overlap.ComputeWhileLoading` (the meeting points of a front computed and a back loaded),
:class:`~.replicas.Replicas` (routing, prefill slots, local caches, scale-out, warmup) and
:class:`~.lifecycle.RequestLifecycle` (a request's own events). :class:`Simulator` builds them (:mod:`.world` holds the
things they move) and the loop hands each event to the room that owns its kind (:meth:`Simulator.handlers`). The
decisions are made by the same online objects an engine calls, through the same protocols: a load rule
(:class:`kvpolicy.protocols.LoadRule`), a publish filter, an eviction policy, the write-admission gate.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np

from .._validate import check_non_negative_int, check_split
from ..errors import ConfigError
from ..eviction.policies import TraceOracle
from ..ledger import Ledger, PublicationLog
from .config import ClusterConfig, Degrade, ScaleOut
from .events import CAPACITY, SAMPLE, SCALE_OUT, EventLoop
from .lifecycle import RequestLifecycle
from .overlap import ComputeWhileLoading
from .planner import LoadPlanner
from .policysets import PolicySet
from .pool import Pool
from .replicas import Replicas, new_replica, static_routes
from .tally import Tally
from .transfers import Transfers
from .world import MAX_RETRIES, STATIC_ROUTERS, UTIL_WINDOW_S, Prepared, SimResult, _replica_oracles, _ReplicaOracle, apply_spike

__all__ = ["MAX_RETRIES", "STATIC_ROUTERS", "UTIL_WINDOW_S", "Prepared", "SimResult", "Simulator", "apply_spike"]


class Simulator:
    """One run: a trace × a cluster × a policy set. Builds the rooms, hands each event to its room, returns a SimResult."""

    def __init__(self, prepared: Prepared | Any, cluster: ClusterConfig, policy_set: PolicySet, *,
                 events: tuple[ScaleOut | Degrade, ...] = (), seed: int = 0, compute_scale: Any = None, judge_from_request: int = 0,
                 pause_gc: bool = True, routes: Any = None) -> None:
        """``compute_scale``: optional, one positive number per request (trace order) multiplying ``compute_factor``
        for that request's own prefill — the compute a real run measured, replayed (e.g. each request's measured
        forward pass over the profile's). The router's and the oracles' predictions keep the cluster's model: an
        engine does not know a request's compute before it runs; kvpolicy's controller hears it afterwards.

        ``judge_from_request`` = k > 0 is a held-out split: every policy runs (and learns) over the whole trace, but the
        result counts only requests k onwards — their TTFTs, prefill seconds, loads and reads — and the bytes written or
        replicated from request k's arrival on (the ledger likewise). Bytes sent and unused stay whole-run figures.

        ``routes``: optional, one replica index per request (trace order): every attempt of request i goes to replica
        ``routes[i]``, whatever the router — another run's ``SimResult.routes`` replayed. The bound of hindsight is
        over cache decisions on the same routes: give the oracle a set's own routes, and a set whose failed loads moved
        its retries elsewhere (changing every queue behind them) is bounded on the routing it had.

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
        self._routes: np.ndarray | None = None
        if routes is not None:
            n_max = cluster.replicas + sum(e.replicas for e in self.events if isinstance(e, ScaleOut))
            try:
                rr = np.asarray(routes)
            except (TypeError, ValueError) as err:
                raise ConfigError("routes", f"needs one replica index per request: {err}") from None
            if rr.ndim != 1 or rr.size != len(self.p.trace) or (rr.size and rr.dtype.kind not in "iu"):
                raise ConfigError("routes", f"needs one int replica index per request ({len(self.p.trace)}), got shape {rr.shape}, dtype {rr.dtype}")
            bad = np.flatnonzero((rr < 0) | (rr >= n_max))
            if bad.size:
                raise ConfigError("routes", f"request {int(bad[0])} names replica {int(rr[bad[0]])}; the cluster has at most {n_max}")
            self._routes = rr.astype(np.int64)
        B = self.p.block_size_tokens
        p = self.p
        ps = policy_set
        oracle: TraceOracle | None = None
        oracle_pub: list[int] | None = None
        local_oracles: dict[int, _ReplicaOracle] | None = None
        if "belady" in (ps.local_eviction, ps.pool_eviction) or ps.publish == "oracle" or ps.load == "oracle":
            oracle, oracle_pub = p.oracle()
            if ps.local_eviction == "belady":
                routes = self.static_routes()
                if routes is not None:  # a local cache's Belady ranks by the next use on *that* replica
                    local_oracles = _replica_oracles(p, routes, oracle)
        trace = p.trace
        # the rooms, each handed what it may call
        self.loop = loop = EventLoop()
        self.tally = tally = Tally(len(trace), self.judge_k, self.t_judge)
        self.ledger = ledger = Ledger(cluster.bytes_per_token, publication_log=PublicationLog(max_exact_keys=max(trace.num_block_ids + 1, 1024)),
                                      judge_from_s=self.t_judge if self.judge_k else None,
                                      write_cost_s_per_byte=(1.0 / cluster.node_bandwidth_bytes_per_s) if cluster.node_bandwidth_bytes_per_s > 0 else None,
                                      eviction_cost_s_per_token=cluster.compute_factor * cluster.prefill.b_s_per_token)
        self.transfers = transfers = Transfers(loop, cluster, tally, seed=seed, n_nodes=cluster.storage_nodes, block_bytes=cluster.block_bytes(B),
                                               pull_path=ps.pull_path, last_arrival_s=p.arrival_s[-1], hindsight=ps.load == "oracle")
        self.planner = planner = LoadPlanner(cluster, ps, tally, loop.clock, block_size_tokens=B)
        replicas = [new_replica(i, cluster, ps.local_eviction, transfers.net, loop.clock, oracle, local_oracles) for i in range(cluster.replicas)]
        self.pool = pool = Pool(p, cluster, ps, loop=loop, transfers=transfers, planner=planner, tally=tally, ledger=ledger, oracle=oracle,
                                oracle_pub=oracle_pub, degrade=tuple(e for e in events if isinstance(e, Degrade)))
        self.overlap = overlap = ComputeWhileLoading(p, cluster, loop=loop, transfers=transfers, planner=planner, tally=tally, ledger=ledger,
                                                     compute_scale=self._scale)
        self.fleet = fleet = Replicas(p, cluster, ps, replicas, seed=seed, loop=loop, transfers=transfers, pool=pool, overlap=overlap,
                                      planner=planner, tally=tally, ledger=ledger, oracle=oracle, local_oracles=local_oracles,
                                      routes=self._routes)
        self.lifecycle = RequestLifecycle(p, cluster, ps, loop=loop, transfers=transfers, pool=pool, fleet=fleet, overlap=overlap,
                                          planner=planner, tally=tally, ledger=ledger, oracle=oracle)
        transfers.land_pull = pool.land_pull  # a relay pull's blocks stay in the node they passed
        transfers.rates_changed = overlap.rates_changed  # the meeting points move with the rates

    def static_routes(self) -> np.ndarray | None:
        """Every request's replica when the router ignores replica state (round-robin, random,
        prefix-affinity) and no request is retried, or the routes replayed — what the oracle may know in hindsight."""
        if self._routes is not None:
            return self._routes
        return static_routes(self.p, self.c, self.events, self.seed)

    def seed_pool(self, chains: Any) -> int:
        """Start with the pool already holding these key chains (:meth:`Pool.seed_pool`); returns the blocks held."""
        return self.pool.seed_pool(chains)

    def run(self) -> SimResult:
        p = self.p
        loop = self.loop
        loop.arrivals_from(p.arrival_s)  # a stream beside the heap; a request's state is made when it arrives
        for e in self.events:
            if isinstance(e, ScaleOut):
                loop.push(e.t_s, SCALE_OUT, e)
            elif isinstance(e, Degrade):
                loop.push(e.t1_s, CAPACITY, self.pool.nodes[e.node])
                loop.push(e.t2_s, CAPACITY, self.pool.nodes[e.node])
        t_first, t_end = p.arrival_s[0], p.arrival_s[-1]
        self.transfers.sample_s = max((t_end - t_first) / 200.0, 1e-3)
        loop.push(t_first, SAMPLE, None)
        loop.run(self.handlers(), pause_gc=self.pause_gc)
        if any(ctl.loads_in_flight() for ctl in self.planner.all_controllers()):
            raise AssertionError("loads still in flight at the end of the run")  # pragma: no cover - conservation
        t0 = p.arrival_s[0]
        tl = self.tally
        return SimResult(
            policy=self.ps.name, n_requests=len(p.arrival_s), ttft_s=tl.ttft.copy(), gpu_prefill_s=tl.gpu_prefill_s,
            bytes_read=tl.bytes_read, bytes_written=tl.bytes_written, bytes_sent=tl.bytes_sent, bytes_pulled=tl.bytes_pulled, bytes_direct=tl.bytes_direct,
            loads=tl.loads,
            loads_ok=tl.loads_ok, loads_failed=tl.loads_failed, loads_timeout=tl.loads_timeout, retries=tl.retries,
            warmup_bytes=tl.warmup_bytes, stall_s=tl.stall_s, makespan_s=tl.t_last - t0, replicas_final=len(self.fleet.replicas), ledger=self.ledger,
            node_bytes_out=tuple(n.bytes_out for n in self.pool.nodes), replica_bytes_in=tuple(r.bytes_in for r in self.fleet.replicas),
            completed=tl.completed.copy(), routes=tl.routes.copy(), bytes_unused=tl.bytes_unused,
            warm_loads=(tl.warm_loads, tl.warm_loads_ok, tl.warm_loads_failed, tl.warm_loads_timeout),
            link_series={k: (np.asarray(a), np.asarray(b), np.asarray(c)) for k, (a, b, c) in self.transfers.series.items()},
            queue_s=tl.queue.copy(), judge_from_request=self.judge_k, prefill_s=tl.prefill_per.copy(),
        )

    def handlers(self) -> tuple[Callable[[Any, float], None], ...]:
        """Each event kind's handler, in the order of the kinds in :mod:`.events`: the room that owns the kind."""
        life, fleet, pool, net, overlap = self.lifecycle, self.fleet, self.pool, self.transfers, self.overlap
        return (life.arrive, life.load_done, life.prefill_done, life.decode_done, pool.write_done, fleet.warm_done, fleet.scale_out,
                life.ready, net.net_event, net.load_timeout, overlap.meet, net.capacity, net.sample, life.switch, pool.write_timeout,
                life.new_request)
