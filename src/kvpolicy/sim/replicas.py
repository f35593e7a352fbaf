"""Replicas: routing, prefill slots, local caches, scale-out and warmup (issue #48's rooms; a room of its own since #61).

Each :class:`~kvpolicy.sim.world._Replica` has ``prefill_slots`` GPU slots fed from a FIFO queue, a local cache (an
eviction policy over a resident prefix tree, blocks pinned while a request uses them) and its NIC's links. The router
picks a replica per attempt; a scale-out adds empty replicas, and the warmup planner fills them from the pool in the
background class. The room owns the replicas and the router's state; it hears SCALE_OUT and WARM_DONE, starts prefills
(handing a request that computes while it loads to that room), asks the pool what it holds for warmup and reads it
through the transfers room.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import CapacityError, ConfigError
from ..eviction.policies import TraceOracle
from ..eviction.replay import make_policy
from ..ledger import Ledger
from ..warmup import WarmupConfig, hot_prefixes_from_trace, plan_warmup
from .config import ClusterConfig, ScaleOut
from .events import PREFILL_DONE, WARM_DONE, EventLoop, _Clock
from .network import FlowNetwork
from .overlap import ComputeWhileLoading
from .planner import LoadPlanner
from .policysets import PolicySet
from .pool import Pool, cache_policy
from .tally import Tally
from .transfers import Transfers
from .world import STATIC_ROUTERS, Prepared, _Load, _mix, _Replica, _ReplicaOracle, _Req, _unit


def new_replica(idx: int, cluster: ClusterConfig, local_eviction: str, net: FlowNetwork, clock: _Clock, oracle: TraceOracle | None,
                local_oracles: dict[int, _ReplicaOracle] | None) -> _Replica:
    """Replica ``idx``: an empty local cache under ``local_eviction`` (Belady's ranks by the next use on this replica when
    the routes are known), its prefill slots and its NIC's links on ``net``."""
    c = cluster
    if local_oracles is not None:
        own = local_oracles.get(idx) or _ReplicaOracle({}, oracle)
        cache = make_policy("belady", c.local_capacity_bytes, clock=clock, oracle=own)
    else:
        cache = cache_policy(local_eviction, c.local_capacity_bytes, clock, oracle)
    stage = net.add_link(f"replica-{idx}.stage", c.stage_bytes_per_s) if c.stage_bytes_per_s else None
    return _Replica(idx, cache, c.prefill_slots, net.add_link(f"replica-{idx}.in", c.replica_bandwidth_bytes_per_s),
                    net.add_link(f"replica-{idx}.out", c.replica_bandwidth_bytes_per_s), stage)


def static_pick(prepared: Prepared, cluster: ClusterConfig, seed: int, i: int, attempt: int, n_replicas: int, rr: int) -> int:
    """Replica index for the routers that do not look at replica state."""
    kind = cluster.router
    if kind == "round-robin":
        return rr % n_replicas
    if kind == "random":
        return int(_unit(seed, i, attempt, 17) * n_replicas)
    keys = prepared.keys[i]  # prefix-affinity: rendezvous hash of the first k blocks' chain id
    k = min(len(keys), cluster.affinity_blocks)
    h = keys[k - 1] if k else (1 << 40) + prepared.partial[i]
    return max(range(n_replicas), key=lambda x: _mix((h * 1000003) ^ _mix(x + seed)))


def static_routes(prepared: Prepared, cluster: ClusterConfig, events: tuple[Any, ...], seed: int) -> np.ndarray | None:
    """Every request's replica when the router ignores replica state (round-robin, random,
    prefix-affinity) and no request is retried — what the oracle may know in hindsight."""
    if cluster.router not in STATIC_ROUTERS:
        return None
    outs = sorted((e for e in events if isinstance(e, ScaleOut)), key=lambda e: e.t_s)
    n, k = cluster.replicas, 0
    out = np.empty(len(prepared.arrival_s), dtype=np.int64)
    for i, t in enumerate(prepared.arrival_s):
        while k < len(outs) and outs[k].t_s < t:  # on a tie the arrival is handled first
            n += outs[k].replicas
            k += 1
        out[i] = static_pick(prepared, cluster, seed, i, 0, n, i)
    return out


class Replicas:
    """The serving replicas and their GPUs."""

    def __init__(self, prepared: Prepared, cluster: ClusterConfig, policy_set: PolicySet, replicas: list[_Replica], *, seed: int,
                 loop: EventLoop, transfers: Transfers, pool: Pool, overlap: ComputeWhileLoading, planner: LoadPlanner, tally: Tally,
                 ledger: Ledger, oracle: TraceOracle | None, local_oracles: dict[int, _ReplicaOracle] | None,
                 routes: np.ndarray | None = None) -> None:
        self.p = prepared
        self.c = cluster
        self.ps = policy_set
        self.seed = seed
        self.loop = loop
        self.transfers = transfers
        self.pool = pool
        self.overlap = overlap
        self.planner = planner
        self.tally = tally
        self.ledger = ledger
        self._oracle = oracle
        self._local_oracles = local_oracles
        self.B = prepared.block_size_tokens
        self.block_bytes = cluster.block_bytes(self.B)
        self.replicas = replicas
        self._rr = 0
        self._routes = routes  # replayed: request i's every attempt goes to replica routes[i]

    def route(self, req: _Req, t: float) -> _Replica:
        """The replica for this attempt of ``req`` (the cluster's router; a warming replica passes repeating requests on)."""
        reps = self.replicas
        c = self.c
        kind = c.router
        keys = self.p.keys[req.i]
        routed = None  # kv-overlap: the prefill tokens its own count carries for this attempt on the replica it is sent to
        if self._routes is not None:
            j = int(self._routes[req.i])
            if j >= len(reps):
                raise ConfigError("routes", f"request {req.i} names replica {j}, which a scale-out has not added yet at {t:.3f} s")
            r = reps[j]
        elif kind in STATIC_ROUTERS:
            r = reps[static_pick(self.p, c, self.seed, req.i, req.attempt, len(reps), self._rr)]
            self._rr += 1
        elif kind == "least-loaded":
            r = min(reps, key=lambda x: (x.load_tokens, x.idx))
        else:  # kv-overlap (Dynamo-style): prefill tokens still needed + the prefill it has sent each replica + decode load
            T = self.p.input_tokens[req.i]
            m = self.p.matchable[req.i]
            best = None
            for x in reps:
                new = T - x.index.match_prefix(keys[:m]) * self.B
                cost = new + x.routed_tokens + c.decode_weight * x.decode_tokens
                if best is None or cost < best[0]:
                    best = (cost, x, new)
            assert best is not None
            _, r, routed = best
        if self.ps.warmup and t < r.warming_until_s and keys and keys[0] in self.pool.where and keys[0] not in r.cache.nodes:
            warm = [x for x in reps if t >= x.warming_until_s]
            if warm:  # rule 2: repeating requests go to warm replicas while this one warms
                r = min(warm, key=lambda x: (x.load_tokens, x.idx))
                if routed is not None:  # counted where it goes, at what that replica holds
                    routed = T - r.index.match_prefix(keys[:m]) * self.B
        if routed is not None:  # off the count at its prefill's end (RequestLifecycle.prefill_done) or as it retries
            req.routed_tokens = routed
            r.routed_tokens += routed
        return r

    def install(self, rep: _Replica, req: _Req, keys: list[int], start: int, end: int) -> None:
        """Insert keys[start:end] into the local cache (pinned for this request); stop at the first that does not fit
        (its parent missing, no room, refused)."""
        cache = rep.cache
        nodes = cache.nodes
        pinned = req.pinned
        j = start
        while j < end:
            key = keys[j]
            if key in nodes:
                if j >= len(pinned):
                    cache.pin(key)
                    pinned.append(key)
                j += 1
                continue
            stop = cache.place_pinned_chain(keys, j, end, self.block_bytes)  # room made, admitted, inserted pinned
            pinned.extend(keys[j:stop])
            if stop == end or keys[stop] not in nodes:  # its parent missing, no room, or refused
                return
            j = stop

    def unpin(self, rep: _Replica, req: _Req) -> None:
        rep.cache.unpin_all(req.pinned)
        req.pinned = []

    def enqueue(self, rep: _Replica, req: _Req, t: float, reused_blocks: int) -> None:
        req.reused = reused_blocks
        req.queue_enter_s = t
        rep.queue.append(req)
        T = self.p.input_tokens[req.i]
        expect = reused_blocks + (req.load - req.split if req.cake else 0)  # what it expects to skip
        req.queued_tokens = T - expect * self.B
        req.queued_pred_s = self.c.dispatch_s + self.c.prefill_s(expect * self.B, T)
        rep.load_tokens += req.queued_tokens
        rep.queued_s += req.queued_pred_s
        self.start(rep, t)

    def start(self, rep: _Replica, t: float) -> None:
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
                    self.overlap.in_slot[req] = None
                    self.overlap.schedule(req, t)
                    continue
                m = min(load.arrived_blocks(self.block_bytes), req.load)
                self.overlap.finish(req, m, req.slot_s + self.overlap.front_s(req, req.local, req.load - m))
                continue
            T = self.p.input_tokens[req.i]
            k = self.overlap.k(req)
            dur = c.dispatch_s + k * c.prefill_s(req.reused * self.B, T)
            req.prefill_s = dur
            self.tally.prefill_per[req.i] += dur
            if req.i >= self.tally.judge_k:
                self.tally.gpu_prefill_s += dur
            ctl = self.planner.ctl(rep)
            if ctl is not None and self.ps.learn_compute:  # the engine times its prefill: the controller learns the real compute
                start = req.reused * self.B
                ctl.model.observe_prefill(start, T - start, k * c.compute_factor * float(c.prefill.marginal_s(start, T)))
            req.job_end_s = t + dur + debt
            self.loop.push(t + dur + debt, PREFILL_DONE, req)

    def scale_out(self, ev: ScaleOut, t: float) -> None:
        start = len(self.replicas)
        new = [new_replica(start + j, self.c, self.ps.local_eviction, self.transfers.net, self.loop.clock, self._oracle, self._local_oracles)
               for j in range(ev.replicas)]
        self.replicas.extend(new)
        if not self.ps.warmup:
            return
        c = self.c
        n_seen = max(self.loop.arrivals_seen(), 1)  # the requests that have arrived: what the warmup planner has seen
        seen = self.p.trace.head(n_seen)  # its block ids renumbered densely (canonical): mapped back to the run's own below
        own = self.p.trace.block_ids[: int(self.p.trace.block_offsets[min(n_seen, len(self.p.trace))])].tolist()
        back = dict(zip(seen.block_ids.tolist(), own))
        hot = hot_prefixes_from_trace(seen, bytes_per_token=c.bytes_per_token, recompute_s=lambda tok: c.prefill_s(0, int(tok)))
        bw = min(c.node_bandwidth_bytes_per_s * c.storage_nodes, c.replica_bandwidth_bytes_per_s * ev.replicas)
        plan = plan_warmup(hot, WarmupConfig(replicas=ev.replicas, window_s=c.warmup_window_s, bandwidth_bytes_per_s=max(bw, 1e-3),
                                             current_load_bytes_per_s=min(self.tally.bytes_read / max(t, 1.0), bw * 0.5)))
        chains = {h.prefix: tuple(back[b] for b in h.blocks) for h in hot}
        for j, r in enumerate(new):
            ready = plan.ready_at_s.get(j)
            r.warming_until_s = t + (ready if ready is not None else c.warmup_window_s)
        for load in plan.schedule:
            new[load.replica].warm_left += 1
            self.loop.push(t + load.start_s, WARM_DONE, ("start", new[load.replica], chains[load.prefix]))

    def _warm_step_done(self, rep: _Replica, t: float) -> None:
        """Readiness is what the replica holds, not a predicted time: once its last planned warmup
        load has ended (whatever happened to it), it serves repeating requests like any other."""
        rep.warm_left -= 1
        if rep.warm_left <= 0:
            rep.warming_until_s = min(rep.warming_until_s, t)

    def _warm_load_end(self, load: _Load, t: float) -> None:
        rep, chain, have = load.payload
        got = load.arrived_blocks(self.block_bytes)  # a warm load that ran out of time still keeps its leading blocks
        self.tally.bytes_unused += max(load.delivered_bytes() - got * self.block_bytes, 0)
        self.loop.push(t, WARM_DONE, (load.status, rep, chain[:have + got], have))

    def warm_done(self, item: tuple, t: float) -> None:
        phase, rep, chain = item[:3]
        if phase == "start":
            run = self.pool.pool_index.match_prefix(list(chain))  # only what the pool holds can be warmed
            have = rep.index.match_prefix(list(chain))
            if run <= have:
                self._warm_step_done(rep, t)
                return
            ks = list(chain[have:run])
            self.tally.warm_loads += 1
            # warming is bulk work in the background class: it takes only what serving traffic leaves
            self.transfers.begin_read(rep, self.pool.groups(ks), t, -1 - rep.idx, len(ks) + have, reverse=False, on_end=self._warm_load_end,
                                     payload=(rep, chain[:run], have), priority=1)
            return
        self._warm_step_done(rep, t)
        if phase == "ok":
            self.tally.warm_loads_ok += 1
        elif phase == "timeout":
            self.tally.warm_loads_timeout += 1
        else:
            self.tally.warm_loads_failed += 1
        cache = rep.cache
        bb = self.block_bytes
        sent = (len(chain) - item[3]) * bb if len(item) > 3 else 0  # type: ignore[misc]
        if t >= self.tally.t_judge:
            self.tally.bytes_read += sent
            self.tally.warmup_bytes += sent
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
