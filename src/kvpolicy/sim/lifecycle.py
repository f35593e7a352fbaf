"""A request's life, from arrival to its last decoded token (issue #48's rooms; a room of its own since #61).

ARRIVE: route, match the local cache then the pool, ask the load rule (the admission controller, a preset rule, the
oracle, or a :class:`~kvpolicy.protocols.LoadRule` of your own) how many remote blocks to load, and start that load.
LOAD_DONE: install what arrived (or retry, or recompute). PREFILL_DONE: the first token — record the TTFT and the
ledger's record, cache the computed blocks, publish. DECODE_DONE: unpin.

The lifecycle owns the requests' own events (NEW_REQUEST, ARRIVE, LOAD_DONE, READY, SWITCH, PREFILL_DONE, DECODE_DONE)
and nothing else: it asks the replicas room to route, queue and install, the pool what it holds, the load planner how
much to load, and the transfers room to move it.
"""

from __future__ import annotations

import functools
import math
from typing import Any

from ..admission import AdmissionContext
from ..eviction.policies import TraceOracle
from ..ledger import Ledger, RequestRecord
from ..matching import match
from .config import ClusterConfig
from .events import ARRIVE, DECODE_DONE, LOAD_DONE, LOAD_TIMEOUT, READY, SWITCH, EventLoop
from .overlap import ComputeWhileLoading
from .planner import LoadPlanner
from .policysets import PolicySet
from .pool import Pool
from .replicas import Replicas
from .tally import Tally
from .transfers import Transfers
from .world import MAX_RETRIES, PeerCopy, Prepared, _Load, _Node, _PeerIndex, _Replica, _Req, release_leases


class RequestLifecycle:
    """What happens to each request, event by event."""

    def __init__(self, prepared: Prepared, cluster: ClusterConfig, policy_set: PolicySet, *, loop: EventLoop, transfers: Transfers,
                 pool: Pool, fleet: Replicas, overlap: ComputeWhileLoading, planner: LoadPlanner, tally: Tally, ledger: Ledger,
                 oracle: TraceOracle | None) -> None:
        self.p = prepared
        self.c = cluster
        self.ps = policy_set
        self.loop = loop
        self.transfers = transfers
        self.pool = pool
        self.fleet = fleet
        self.overlap = overlap
        self.planner = planner
        self.tally = tally
        self.ledger = ledger
        self._oracle = oracle
        self.B = prepared.block_size_tokens
        self.block_bytes = cluster.block_bytes(self.B)
        #: pulls from peers: they write into the pool, so a pool that can hold no block has none
        self.pulls = policy_set.pull_from_peers and cluster.pool_capacity_bytes_per_node >= self.block_bytes

    def new_request(self, i: int, t: float) -> None:
        """Request ``i`` arrives for the first time: its state begins here (a retry arrives again as ARRIVE). First
        arrivals come in index order: ``i`` is the hindsight oracle's "now"."""
        if self._oracle is not None:
            self._oracle.now = i
        self.arrive(_Req(i, t), t)

    def arrive(self, req: _Req, t: float) -> None:
        p = self.p
        i = req.i
        rep = self.fleet.route(req, t)
        req.replica = rep
        self.tally.routes[i] = rep.idx
        keys = p.keys[i]
        m = p.matchable[i]
        T = p.input_tokens[i]
        ps = self.ps
        holder = None
        if self.pulls:  # the pool's run, then what one peer holds after it
            peers = _PeerIndex(self.fleet.replicas, rep, self.pool.writing, self.transfers.net.flow_count)
            pm = match(keys[:m], T, rep.index, self.pool.pool_index, peers, block_size_tokens=self.B)
            R = pm.remote_total_blocks
            if pm.remote_blocks[1]:
                holder = peers.holder
            req.peer_run = peers.held_run(keys[pm.local_blocks:m])  # for the publish filter: what pulls serve anyway
        elif ps.uses_pool:
            pm = match(keys[:m], T, rep.index, self.pool.pool_index, block_size_tokens=self.B)
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
        req.pull_direct = False
        if holder is not None:  # how the peer's blocks would travel (PolicySet.pull_path), known before the load rule asks
            req.pull_direct = self._pull_direct(rep, keys, L + pm.remote_blocks[0], holder, pm.remote_blocks[1])
        t0 = t + (self.c.lookup_s if ps.uses_pool else 0.0)
        k = 0
        s_ = 0
        pool_blocks = pm.remote_blocks[0] if R else 0  # of the run, the leading blocks read from the pool
        if R:
            from_peer = None
            if self.pulls and req.peer_run and pm.remote_blocks[0]:  # the pool's copy on a slow path: a peer's may be faster
                from_peer = functools.partial(self._peer_source, rep, keys, m, T, t)
            k, s_, peer = self.planner.plan(req, rep, pm, R, functools.partial(self._load_ctx, rep, keys, L, R, t, holder, req.pull_direct),
                                            from_peer)
            if peer is not None:  # the peer's copy, from its first block
                holder, req.pull_direct = peer.holder, peer.direct
                pool_blocks = 0
        if k < R:
            req.not_loaded = R - k
            req.not_loaded_reason = "declined"
        if k == 0:
            if ps.uses_pool and t0 > t:  # the directory lookup happens before the prefill is queued
                req.reused = L
                self.loop.push(t0, READY, req)
            else:
                self.fleet.enqueue(rep, req, t, L)
            return
        # start the load of blocks [L+s, L+k)
        req.load = k
        req.split = s_
        req.load_attempted = True
        req.load_start_s = t0
        # computing while loading, the whole range is requested from the back and cut where the GPU's
        # front meets it (s is only the controller's prediction of that point)
        groups, vias = self._load_groups(rep, keys, L, k, pool_blocks, holder)
        req.load_groups = groups
        req.load_vias = vias
        for (node, gk), via in zip(groups, vias):
            if via is None:
                pol = node.policy
                for key in gk:
                    pol.on_access(key)
                    pol.pin(key)  # a lease: not evicted under the reader
            else:  # a pull: the peer's copy is held until it has passed, and (a relay) nobody else writes these blocks meanwhile
                held = via.cache
                for key in gk:
                    held.pin(key)
                if not req.pull_direct:
                    self.pool.writing.update(gk)
        if req.predicted_s is None:
            req.predicted_s = self.c.dispatch_s + self.c.prefill_s(L * self.B, (L + k) * self.B) - self.c.prefill_a_s
        self.tally.loads += i >= self.tally.judge_k
        if ps.compute_while_loading:
            # the load runs from the back; a split plan queues for its prefill slot now (the GPU computes
            # the front meanwhile), a plain load waits for its bytes until its p95 prediction has passed
            req.cake = True
            req.xfer = self.transfers.begin_read(rep, groups, t0, i, req.attempt, reverse=True, on_end=self.overlap.load_end,
                                                 payload=req, vias=vias, direct=req.pull_direct)
            req.reused = L
            after = req.decision.compute_after_s if req.decision is not None else 0.0
            if not after:
                self.loop.push(t0, READY, req)
            else:
                req.waiting = True
                self.loop.push(t0 + after, SWITCH, req)
            return
        req.xfer = self.transfers.begin_read(rep, groups, t0, i, req.attempt, reverse=False, on_end=self._req_load_end, payload=req,
                                             vias=vias, direct=req.pull_direct)
        limit = math.inf
        if ps.timeout == "admission" and req.decision is not None and req.decision.soft_timeout_s is not None:
            limit = req.decision.soft_timeout_s
        elif ps.timeout == "sglang":
            limit = 1.0 + 0.25 * k * self.B / 1024
        if limit < self.c.transport_timeout_s:
            self.loop.push(t + limit, LOAD_TIMEOUT, req.xfer)

    def _pull_direct(self, rep: _Replica, keys: Any, j0: int, holder: _Replica, n_blocks: int) -> bool:
        """Whether ``n_blocks`` pulled from ``holder`` starting at ``keys[j0]`` go straight from the peer
        (``PolicySet.pull_path``), judged against the node the first block's placement chunk passes through."""
        chunk = self.c.placement_chunk_blocks
        return self.transfers.pull_direct(rep, self.pool.place(keys[j0 - j0 % chunk], rep), holder, n_blocks * self.block_bytes)

    def _peer_source(self, rep: _Replica, keys: Any, m: int, T: int, t: float) -> PeerCopy:
        """The request matched against its replica and the peers alone (no pool), and what its load rule would be told
        of that run."""
        peers = _PeerIndex(self.fleet.replicas, rep, self.pool.writing, self.transfers.net.flow_count)
        pm = match(keys[:m], T, rep.index, peers, block_size_tokens=self.B)
        L, R = pm.local_blocks, pm.remote_total_blocks
        holder = peers.holder if R else None
        direct = self._pull_direct(rep, keys, L, holder, R) if holder is not None else False
        return PeerCopy(pm, holder, direct, functools.partial(self._load_ctx, rep, keys, L, R, t, holder, direct, True))

    def _load_ctx(self, rep: _Replica, keys: list[int], L: int, R: int, t: float, holder: _Replica | None = None,
                  direct: bool = False, peer_only: bool = False) -> AdmissionContext:
        """What a load rule is told of a request's R remote blocks starting at ``keys[L]``: the replica, the node that
        holds them (or, for blocks only a peer holds, the node they would pass through), the path's flows, the replica's
        queue and utilisation — the same for the admission controller and a rule of your own. ``peer_only``: the run
        is pulled from ``holder`` from its first block, whether the pool holds it too or not."""
        src = None if peer_only else self.pool.where.get(keys[L])
        via = None
        if src is None:  # the run starts with blocks a peer holds: the node the pull passes through
            chunk = self.c.placement_chunk_blocks
            src = self.pool.place(keys[L - L % chunk], rep)
            via = holder
        source = via.name if direct and via is not None else src.name  # a direct pull's source is the peer itself
        return AdmissionContext(block_bytes=self.block_bytes, replica=rep.name, source=source, active_decodes=rep.active,
                                warming=t < rep.warming_until_s, path_flows_bytes=self.transfers.path_flows(rep, src, R * self.block_bytes, via, direct),
                                queue_wait_s=rep.queue_wait_s(t), prefill_queue_requests=len(rep.queue),
                                prefill_utilisation=rep.utilisation(t))

    def _load_groups(self, rep: _Replica, keys: list[int], L: int, k: int, pool_blocks: int,
                     holder: _Replica | None) -> tuple[list[tuple[_Node, list[int]]], list[_Replica | None]]:
        """The groups of a load of keys[L:L+k]: the pool's blocks by the node holding them, then the blocks pulled from
        ``holder`` by the node each placement chunk would be written to (as a publish places it)."""
        n_pool = min(k, pool_blocks)
        groups = self.pool.groups(keys[L:L + n_pool])
        vias: list[_Replica | None] = [None] * len(groups)
        if k > n_pool:
            assert holder is not None
            chunk = self.c.placement_chunk_blocks
            node = None
            for j in range(L + n_pool, L + k):
                if node is None or j % chunk == 0:
                    nxt = self.pool.place(keys[j - j % chunk], rep)
                    if nxt is not node or vias[-1] is None:
                        groups.append((nxt, []))
                        vias.append(holder)
                    node = nxt
                groups[-1][1].append(keys[j])
        return groups, vias

    def _req_load_end(self, load: _Load, t: float) -> None:
        req: _Req = load.payload
        end = t + (self.c.install_s_per_block * req.load if load.status == "ok" else 0.0)
        self.loop.push(end, LOAD_DONE, req)

    def load_done(self, req: _Req, t: float) -> None:
        rep: _Replica = req.replica
        load = req.xfer
        assert load is not None
        status = load.status
        release_leases(req)
        arrived = load.arrived_blocks(self.block_bytes)
        k = req.load
        usable = self.planner.record_outcome(req, load, status, arrived, t)
        if self.planner.controller is None or req.decision is None:
            usable = k if status == "ok" else 0  # the baselines use a load whole or not at all
        self.tally.bytes_unused += max(load.delivered_bytes() - usable * self.block_bytes, 0)
        keys = self.p.keys[req.i]
        L = req.local
        if usable:
            req.load_s = t - req.load_start_s
            if req.i >= self.tally.judge_k:
                self.tally.bytes_read += usable * self.block_bytes
            for key in keys[L:L + usable]:
                self.ledger.record_read(key)
            if usable < k:
                req.not_loaded += k - usable
                req.not_loaded_reason = "timeout" if status == "timeout" else "transfer_error"
                req.load = usable
            self.fleet.install(rep, req, keys, L, L + usable)
            self.fleet.enqueue(rep, req, t, L + usable)
            return
        if self.ps.failure == "fail" and req.attempt < MAX_RETRIES:
            # the error surfaces to the client, which resubmits at once
            self.tally.retries += req.i >= self.tally.judge_k
            self.fleet.unpin(rep, req)
            rep.routed_tokens -= req.routed_tokens  # the router's count: the retry is routed afresh
            req.attempt += 1
            self.loop.push(t, ARRIVE, req)
            return
        req.not_loaded += req.load
        req.not_loaded_reason = "timeout" if status == "timeout" else "transfer_error"
        req.load = 0
        self.fleet.enqueue(rep, req, t, L)

    def ready(self, req: _Req, t: float) -> None:
        self.fleet.enqueue(req.replica, req, t, req.reused)

    def prefill_done(self, req: _Req, t: float) -> None:
        p = self.p
        rep: _Replica = req.replica
        i = req.i
        rep.utilisation(t)
        rep.free_slots += 1
        rep.running.discard(req)
        T = p.input_tokens[i]
        rep.load_tokens -= req.queued_tokens
        rep.routed_tokens -= req.routed_tokens
        self.tally.ttft[i] = t - req.first_arrival_s
        ctl = self.planner.ctl(rep)
        if ctl is not None:  # the engine reports every request's TTFT: the controller's derived p95 target
            ctl.observe_ttft(t - req.first_arrival_s)
        self.tally.queue[i] = req.slot_s - req.queue_enter_s
        self.tally.completed[i] += 1
        self.tally.t_last = max(self.tally.t_last, t)
        keys = p.keys[i]
        self.fleet.install(rep, req, keys, req.reused, len(keys))
        m = p.matchable[i]
        used = req.local + req.split + req.load + req.not_loaded
        cls = p.request_class[i] if p.request_class else "default"
        if req.load and req.predicted_s is not None:
            rep.note_hit(t, req.predicted_s)
        rec = RequestRecord(
            prompt_tokens=T, block_size_tokens=self.B, local_blocks=req.local, remote_loaded_blocks=req.load,
            remote_not_loaded_blocks=req.not_loaded, not_loaded_reason=req.not_loaded_reason if req.not_loaded else None,
            missing_keys=tuple(keys[used:m]), request_class=cls, arrival_s=req.first_arrival_s, ttft_s=t - req.first_arrival_s,
            prefill_s=req.prefill_s, load_s=req.load_s, queue_s=self.tally.queue[i], predicted_recompute_s=req.predicted_s if req.load else None,
            load_attempted=req.load_attempted, stall_s=req.stall_s if self.ps.uses_pool else None, split_blocks=req.split,
            prefill_utilisation=rep.util, prefill_utilisation_without_hits=rep.utilisation_without_hits(t),
        )
        self.ledger.record(rec)
        self.pool.publish(rep, req, keys, t)
        rep.active += 1
        out = p.output_tokens[i]
        rep.decode_tokens += T + out
        self.loop.push(t + out / self.c.decode_tokens_per_s, DECODE_DONE, req)
        self.fleet.start(rep, t)

    def decode_done(self, req: _Req, t: float) -> None:
        rep: _Replica = req.replica
        rep.active -= 1
        rep.decode_tokens -= self.p.input_tokens[req.i] + self.p.output_tokens[req.i]
        self.fleet.unpin(rep, req)

    def switch(self, req: _Req, t: float) -> None:
        """A plain load (compute while loading) ran past its p95 prediction: wait on while the controller's rule says its
        bytes still come in time (checked once more at its limit), else compute from the front while it goes on."""
        if req.waiting and not req.rechecked and req.decision is not None and req.xfer is not None:
            ctl = self.planner.ctl(req.replica)
            assert ctl is not None
            self.transfers.net.sync(t)
            elapsed = t - req.load_start_s
            if ctl.keep_waiting(req.decision, elapsed, self.transfers.arrival_s(req.xfer, req.load, t) - t):
                req.rechecked = True
                self.loop.push(req.load_start_s + ctl.wait_limit_s(req.decision), SWITCH, req)
                return
        if req.waiting:
            req.waiting = False
            self.fleet.enqueue(req.replica, req, t, req.local)
