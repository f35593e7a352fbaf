"""Transfers: the network's flows and the loads on them (issue #48's rooms).

A load is one :class:`~kvpolicy.sim.world._Load`: a flow per storage node holding part of a request's range, on the
path (node egress, replica ingress[, staging copy]) of the :class:`~kvpolicy.sim.network.FlowNetwork`. This room starts
loads with their seeded fates (hang, fail after a drawn share), ends them (done, failed, timed out), accounts the bytes
each moved, tells the admission controller how a load went, and wakes the loop at the network's next event. It also
samples every link for the report. What a load is *for* is decided above it (:mod:`.lifecycle`, :mod:`.replicas`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from ..admission import AdmissionController, LoadOutcome
from ..admission.controller import LoadStatus
from .config import ClusterConfig
from .events import LOAD_TIMEOUT, NET, SAMPLE, EventLoop
from .network import Flow, FlowNetwork
from .policysets import PolicySet
from .world import Prepared, _Load, _Node, _Replica, _Req, _unit


class Transfers(EventLoop):
    """Loads over the flow network, and the controllers that hear how they went."""

    p: Prepared
    c: ClusterConfig
    ps: PolicySet
    seed: int
    net: FlowNetwork
    nodes: list[_Node]
    block_bytes: int
    judge_k: int
    #: the cluster's admission controller (or replica 0's), None for a set without one
    controller: AdmissionController | None
    #: controller_scope "replica": each replica's own, by replica index (made when the replica first needs it)
    controllers: dict[int, AdmissionController]
    _make_controller: Callable[[], AdmissionController]
    _series: dict[str, tuple[list[float], list[float], list[float]]]
    _util: dict[str, float]
    _sample_s: float
    bytes_sent: int
    bytes_direct: int
    loads_ok: int
    loads_failed: int
    loads_timeout: int
    stall_s: float

    def _begin_read(self, rep: _Replica, groups: list[tuple[_Node, list[int]]], t0: float, req_i: int, attempt: int, *,
                    reverse: bool, on_end: Any, payload: Any, priority: int = 0, vias: list[_Replica | None] | None = None,
                    direct: bool = False) -> _Load:
        """Start reading ``groups`` into ``rep`` at t0: one flow per storage node, in parallel.

        Each node's draw (seed, request, attempt, node) decides whether its transfer
        hangs (delivers nothing until a timeout) or fails after a drawn share of its
        blocks arrived intact. ``on_end(load, t)`` runs once when every flow has ended
        or a timeout (transport or policy) gives up on the rest. ``vias[j]``, a replica: group j is pulled from that
        peer through its node — one relay flow over the peer's egress, the node's ingress and egress and ``rep``'s
        ingress, issued one directory round trip later (the peer is asked to send) and one block later still (the node
        stores a block before it forwards it: store and forward, pipelined by block); the node keeps what passes.
        ``direct``: those pulls go straight from the peer's egress to ``rep``'s ingress (llm-d's P2P tier), one round
        trip later and with no store and forward; no node is crossed or written, and no node's degradation or failure
        draw touches them (the draw is the peer's, at the cluster's base failure rate)."""
        c = self.c
        bb = self.block_bytes
        load = _Load(rep, groups, t0, reverse, on_end, payload, vias, direct)
        for j, ((node, ks), via) in enumerate(zip(groups, load.vias)):
            straight = direct and via is not None
            if straight:
                fail, who = c.failure_rate, len(self.nodes) + via.idx
            else:
                _, fail = node.state(t0, c.failure_rate)
                who = node.idx
            if c.timeout_rate and _unit(self.seed, req_i, attempt, who, 2) < c.timeout_rate:
                load.flows.append(None)
                load.fails.append(False)
                load.hung = True
                if via is not None and not straight:  # a hung relay will never write: its blocks are free to be written again now
                    self._land_pull(load, j, 0.0, t0)
                continue
            failed = _unit(self.seed, req_i, attempt, who, 1) < fail
            n = len(ks)
            if failed:  # blocks before the failure arrive intact
                n = int(_unit(self.seed, req_i, attempt, who, 3) * len(ks))
            path = self._read_path(node, rep, via, straight)
            now = self.clock.t  # issued at t0 (after the directory lookup): it moves bytes from t0 + overhead
            latency = max(t0 - now, 0.0) + c.transfer_overhead_s
            if straight:  # the peer is asked to send, and sends
                latency += c.lookup_s
            elif via is not None:  # the peer is asked to send; the node has a whole block before it forwards the first
                latency += c.lookup_s + bb / max(min(via.out.capacity_bytes_per_s, node.inn.capacity_bytes_per_s), 1e-9)
            f = self.net.start(now, path, n * bb, latency_s=latency, payload=(load, node, j), on_done=self._read_flow_end, priority=priority)
            load.flows.append(f)
            load.fails.append(failed)
            load.left += 1
        self._push(t0 + c.transport_timeout_s, LOAD_TIMEOUT, load)
        self._net_changed()
        return load

    @staticmethod
    def _read_path(node: _Node, rep: _Replica, via: _Replica | None = None, direct: bool = False) -> tuple[Any, ...]:
        """The links a read crosses: the node's egress and the replica's ingress (and its staging copy); a pull from
        ``via`` first crosses the peer's staging copy and egress and the node's ingress — or, ``direct``, the peer's
        staging copy and egress and then ``rep``'s ingress and staging copy, no node at all."""
        tail: tuple[Any, ...] = (rep.inn,) if rep.stage is None else (rep.inn, rep.stage)
        if via is None:
            return (node.out,) + tail
        head: tuple[Any, ...] = (via.out,) if via.stage is None else (via.stage, via.out)
        return head + tail if direct else head + (node.inn, node.out) + tail

    def _pull_direct(self, rep: _Replica, node: _Node, holder: _Replica, nbytes: float) -> bool:
        """Whether a pull of ``nbytes`` from ``holder`` goes straight (``PolicySet.pull_path``). "choose": straight when
        the relay's node is the bottleneck of its path now — the relay would finish later than the direct path, by the
        same count of bytes ahead a transport reports — else through the node, which keeps a copy for later readers at
        no extra wait. Seconds against seconds, measured on the links: no rate turns one resource into another."""
        mode = self.ps.pull_path
        if mode != "choose":
            return mode == "direct"
        self.net.sync(self.clock.t)

        def finish_s(path: tuple[Any, ...]) -> float:
            worst = 0.0
            for link in path:
                ahead = sum(r if r < nbytes else nbytes for r in self.net.flows_on(link, 0))
                worst = max(worst, (ahead + nbytes) / max(link.capacity_bytes_per_s, 1e-9))
            return worst

        return finish_s(self._read_path(node, rep, holder, True)) < finish_s(self._read_path(node, rep, holder, False))

    def _land_pull(self, load: _Load, j: int, moved_bytes: float, t: float) -> None:
        """Hook: group j of ``load`` was pulled from a peer and its flow ended having moved ``moved_bytes``; the node keeps
        the whole blocks that passed (:mod:`.pool` writes them). Nothing here stores blocks."""

    def _account_read(self, node: _Node | None, rep: _Replica, nbytes: float) -> None:
        nb = int(round(nbytes))
        if node is not None:
            node.bytes_out += nb
        else:  # a direct pull, which no node sent
            self.bytes_direct += nb
        rep.bytes_in += nb
        self.bytes_sent += nb

    def _read_flow_end(self, f: Flow, t: float) -> None:
        load, node, j = f.payload
        straight = load.direct and load.vias[j] is not None
        self._account_read(None if straight else node, load.rep, f.size_bytes)
        if load.vias[j] is not None and not straight:
            self._land_pull(load, j, f.size_bytes, t)
        load.left -= 1
        if load.left == 0 and not load.hung and not load.ended:
            self._end_load(load, t, "failed" if any(load.fails) else "ok")

    def _end_load(self, load: _Load, t: float, status: LoadStatus) -> None:
        """Stop whatever still moves (counting what it delivered) and report the load's end."""
        load.ended = True
        load.end_s = t
        load.status = status
        for j, (f, (node, _)) in enumerate(zip(load.flows, load.groups)):
            if f is not None and f.alive:
                moved = self.net.cancel(t, f)
                straight = load.direct and load.vias[j] is not None
                self._account_read(None if straight else node, load.rep, moved)
                if load.vias[j] is not None and not straight:
                    self._land_pull(load, j, moved, t)
        self._net_changed()
        load.on_end(load, t)

    def _net_changed(self) -> None:
        """After any change to the network: wake up at its next event; re-plan meeting points."""
        self._rates_changed(self.net.t)
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
        if t < self.p.arrival_s[-1] or self.heap or self._arrivals_left():
            step = self._sample_s
            if t >= self.p.arrival_s[-1] and (self.heap or self._arrivals_left()) and not self.net.active_flows():
                # past the last arrival with the network idle: until the next event every sample would record zeros.
                # Skip them, keeping the last 4 before it (what _util averages), so a long tail of decodes costs a few
                # samples, not (tail / step) of them — at --decode-tokens-per-s 1e-10, billions.
                idle = int((self._next_event_s() - t) / step) - 4
                if idle > 1:
                    step *= idle
            self._push(t + step, SAMPLE, None)

    def _path_flows(self, rep: _Replica, node: _Node, size_bytes: float, via: _Replica | None = None,
                    direct: bool = False) -> tuple[float, ...]:
        """What a transport reports of the path: the remaining bytes of the flows on its busiest
        link (the source's egress, this replica's ingress, or its staging copy, which write-backs share; a pull's
        peer egress and node ingress too) that a load would share with."""
        best: list[float] = []
        best_q = -1.0
        self.net.sync(self.clock.t)  # the flows as they stand now, not at the network's last event
        for link in self._read_path(node, rep, via, direct):
            flows = self.net.flows_on(link, 0)  # a load is foreground: background flows (warmup, background writes) never delay it
            q = sum(r if r < size_bytes else size_bytes for r in flows)
            if q > best_q:
                best, best_q = flows, q
        return tuple(best)

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

    def _ctl(self, rep: _Replica) -> AdmissionController | None:
        """The admission controller that decides for ``rep`` (None: the set does not use one)."""
        if self.controller is None or self.ps.controller_scope == "cluster" or rep.idx == 0:
            return self.controller
        ctl = self.controllers.get(rep.idx)
        if ctl is None:
            ctl = self.controllers[rep.idx] = self._make_controller()
        return ctl

    def _release_leases(self, req: _Req) -> None:
        for (node, gk), via in zip(req.load_groups, req.load_vias):
            pol = node.policy if via is None else via.cache  # a pull held the peer's copy
            for key in gk:
                pol.unpin(key)
        req.load_groups = []
        req.load_vias = []

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

    def _load_timeout(self, load: _Load, t: float) -> None:
        """The transport (``transport_timeout_s``) or the policy (a soft timeout) gives up on what has not arrived."""
        if not load.ended:
            self._end_load(load, t, "timeout")

    def _rates_changed(self, now_s: float) -> None:
        """Hook: the flows' rates changed at ``now_s``. A room that plans on them (:mod:`.overlap`, the meeting points of
        computing while loading) overrides it; nothing here plans on rates."""
