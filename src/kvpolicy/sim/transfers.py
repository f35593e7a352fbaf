"""Transfers: the network's flows and the loads on them (issue #48's rooms; a room of its own since #61).

A load is one :class:`~kvpolicy.sim.world._Load`: a flow per storage node holding part of a request's range, on the
path (node egress, replica ingress[, staging copy]) of the :class:`~kvpolicy.sim.network.FlowNetwork`. This room owns
the network: it starts loads with their seeded fates (hang, fail after a drawn share), ends them (done, failed, timed
out), accounts the bytes each moved, wakes the loop at the network's next event (NET), opens and closes degradation
windows (CAPACITY) and samples every link for the report (SAMPLE). What a load is *for* is decided elsewhere (the
request's lifecycle, the replicas, the load planner); two rooms hear from it through hooks handed in when the world is
built: the pool keeps what a relay pull passed through a node (``land_pull``), and computing-while-loading re-plans its
meeting points when the rates change (``rates_changed``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from ..admission.controller import LoadStatus
from .config import ClusterConfig
from .events import LOAD_TIMEOUT, NET, SAMPLE, EventLoop
from .network import Flow, FlowNetwork
from .tally import Tally
from .world import _Load, _Node, _Replica, _unit


def _no_pull_landing(load: _Load, j: int, moved_bytes: float, t: float) -> None:
    """No pool keeps a relay pull's blocks (a world built without one)."""


def _no_replanning(now_s: float) -> None:
    """Nothing plans on the flows' rates."""


class Transfers:
    """Loads over the flow network, the network's events and its samples."""

    def __init__(self, loop: EventLoop, cluster: ClusterConfig, tally: Tally, *, seed: int, n_nodes: int, block_bytes: int,
                 pull_path: str, last_arrival_s: float, hindsight: bool = False) -> None:
        self.loop = loop
        #: the oracle's loads: it knows which transfers would fail or hang, and none of its own does
        self.hindsight = hindsight
        self.c = cluster
        self.tally = tally
        self.seed = seed
        self.n_nodes = n_nodes
        self.block_bytes = block_bytes
        self.pull_path = pull_path
        self.last_arrival_s = last_arrival_s
        self.net = FlowNetwork()
        #: per link: (sample times, utilisation, flows) for the report
        self.series: dict[str, tuple[list[float], list[float], list[float]]] = {}
        #: per link: its recent mean utilisation (what an engine's NIC counters give)
        self.util: dict[str, float] = {}
        self.sample_s = 1e-3
        #: hooks: the pool keeps what a relay pull passed (``land_pull(load, j, moved_bytes, t)``); computing while
        #: loading re-plans its meeting points (``rates_changed(now_s)``)
        self.land_pull: Callable[[_Load, int, float, float], None] = _no_pull_landing
        self.rates_changed: Callable[[float], None] = _no_replanning

    def begin_read(self, rep: _Replica, groups: list[tuple[_Node, list[int]]], t0: float, req_i: int, attempt: int, *,
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
                fail, who = c.failure_rate, self.n_nodes + via.idx
            else:
                _, fail = node.state(t0, c.failure_rate)
                who = node.idx
            if self.hindsight:
                fail = 0.0
            elif c.timeout_rate and _unit(self.seed, req_i, attempt, who, 2) < c.timeout_rate:
                load.flows.append(None)
                load.fails.append(False)
                load.hung = True
                if via is not None and not straight:  # a hung relay will never write: its blocks are free to be written again now
                    self.land_pull(load, j, 0.0, t0)
                continue
            failed = _unit(self.seed, req_i, attempt, who, 1) < fail
            n = len(ks)
            if failed:  # blocks before the failure arrive intact
                n = int(_unit(self.seed, req_i, attempt, who, 3) * len(ks))
            path = self.read_path(node, rep, via, straight)
            now = self.loop.clock.t  # issued at t0 (after the directory lookup): it moves bytes from t0 + overhead
            latency = max(t0 - now, 0.0) + c.transfer_overhead_s
            if straight:  # the peer is asked to send, and sends
                latency += c.lookup_s
            elif via is not None:  # the peer is asked to send; the node has a whole block before it forwards the first
                latency += c.lookup_s + self.store_and_forward_s(via, node)
            f = self.net.start(now, path, n * bb, latency_s=latency, payload=(load, node, j), on_done=self._read_flow_end, priority=priority)
            load.flows.append(f)
            load.fails.append(failed)
            load.left += 1
        self.loop.push(t0 + c.transport_timeout_s, LOAD_TIMEOUT, load)
        self.net_changed()
        return load

    @staticmethod
    def read_path(node: _Node, rep: _Replica, via: _Replica | None = None, direct: bool = False) -> tuple[Any, ...]:
        """The links a read crosses: the node's egress and the replica's ingress (and its staging copy); a pull from
        ``via`` first crosses the peer's staging copy and egress and the node's ingress — or, ``direct``, the peer's
        staging copy and egress and then ``rep``'s ingress and staging copy, no node at all."""
        tail: tuple[Any, ...] = (rep.inn,) if rep.stage is None else (rep.inn, rep.stage)
        if via is None:
            return (node.out,) + tail
        head: tuple[Any, ...] = (via.out,) if via.stage is None else (via.stage, via.out)
        return head + tail if direct else head + (node.inn, node.out) + tail

    def store_and_forward_s(self, holder: _Replica, node: _Node) -> float:
        """What a relay through ``node`` adds before its first byte moves on: one whole block at the slower of the
        holder's egress and the node's ingress (the node stores a block before it forwards it)."""
        return self.block_bytes / max(min(holder.out.capacity_bytes_per_s, node.inn.capacity_bytes_per_s), 1e-9)

    def pull_direct(self, rep: _Replica, node: _Node, holder: _Replica, nbytes: float) -> bool:
        """Whether a pull of ``nbytes`` from ``holder`` goes straight (``PolicySet.pull_path``). "choose": the relay never
        lands first — its links are the direct path's and the node's, and the node stores a block before it forwards
        it — so it goes through the node, which keeps a copy for later readers, only while that costs this request
        nothing: the relay lands before the replica could start the prefill anyway (its queue's predicted wait). The
        relay's finish: one block at the slower of the peer's egress and the node's ingress (the store and forward),
        then its busiest link's bytes ahead of the pull (what a transport reports, read as of now, of the traffic a read
        waits behind, each flow capped at the pull's size) and the pull, over that link's capacity. Seconds against
        seconds, measured on the links and the queue: no rate turns one resource into another."""
        mode = self.pull_path
        if mode != "choose":
            return mode == "direct"
        t = self.loop.clock.t
        self.net.sync(t)
        worst = 0.0
        for link in self.read_path(node, rep, holder):
            ahead = sum(r if r < nbytes else nbytes for r in self.net.flows_on(link, 0))
            worst = max(worst, (ahead + nbytes) / max(link.capacity_bytes_per_s, 1e-9))
        relay_s = self.store_and_forward_s(holder, node) + worst
        return relay_s > rep.queue_wait_s(t)

    def _account_read(self, node: _Node | None, rep: _Replica, nbytes: float) -> None:
        nb = int(round(nbytes))
        if node is not None:
            node.bytes_out += nb
        else:  # a direct pull, which no node sent
            self.tally.bytes_direct += nb
        rep.bytes_in += nb
        self.tally.bytes_sent += nb

    def _read_flow_end(self, f: Flow, t: float) -> None:
        load, node, j = f.payload
        straight = load.direct and load.vias[j] is not None
        self._account_read(None if straight else node, load.rep, f.size_bytes)
        if load.vias[j] is not None and not straight:
            self.land_pull(load, j, f.size_bytes, t)
        load.left -= 1
        if load.left == 0 and not load.hung and not load.ended:
            self.end_load(load, t, "failed" if any(load.fails) else "ok")

    def end_load(self, load: _Load, t: float, status: LoadStatus) -> None:
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
                    self.land_pull(load, j, moved, t)
        self.net_changed()
        load.on_end(load, t)

    def net_changed(self) -> None:
        """After any change to the network: wake up at its next event; re-plan meeting points."""
        self.rates_changed(self.net.t)
        nxt = self.net.next_event_s()
        if nxt < math.inf:
            self.loop.push(nxt, NET, self.net.version)

    def net_event(self, version: int, t: float) -> None:
        if version != self.net.version:
            return  # a newer wake-up exists
        self.net.advance(t)
        self.net_changed()

    def capacity(self, node: _Node, t: float) -> None:
        """A degradation window opens or closes on a node: both directions of its port change."""
        factor, _ = node.state(t, self.c.failure_rate)
        self.net.set_capacity(t, node.out, self.c.node_bandwidth_bytes_per_s * factor)
        self.net.set_capacity(t, node.inn, self.c.node_bandwidth_bytes_per_s * factor)
        self.net_changed()

    def sample(self, _: Any, t: float) -> None:
        """Per-link utilisation and flows, for the report's plot of where queues come from."""
        for name, (_, util, nflows) in self.net.link_state().items():
            series = self.series.get(name)
            if series is None:
                series = self.series[name] = ([], [], [])
            series[0].append(t)
            series[1].append(util)
            series[2].append(nflows)
            recent = series[1][-4:]  # what an engine's NIC counters give: the recent mean
            self.util[name] = sum(recent) / len(recent)
        loop = self.loop
        if t < self.last_arrival_s or loop.heap or loop.arrivals_left():
            step = self.sample_s
            if t >= self.last_arrival_s and (loop.heap or loop.arrivals_left()) and not self.net.active_flows():
                # past the last arrival with the network idle: until the next event every sample would record zeros.
                # Skip them, keeping the last 4 before it (what util averages), so a long tail of decodes costs a few
                # samples, not (tail / step) of them — at --decode-tokens-per-s 1e-10, billions.
                idle = int((loop.next_event_s() - t) / step) - 4
                if idle > 1:
                    step *= idle
            loop.push(t + step, SAMPLE, None)

    def path_flows(self, rep: _Replica, node: _Node, size_bytes: float, via: _Replica | None = None,
                   direct: bool = False) -> tuple[float, ...]:
        """What a transport reports of the path: the remaining bytes of the flows on its busiest
        link (the source's egress, this replica's ingress, or its staging copy, which write-backs share; a pull's
        peer egress and node ingress too) that a load would share with."""
        best: list[float] = []
        best_q = -1.0
        self.net.sync(self.loop.clock.t)  # the flows as they stand now, not at the network's last event
        for link in self.read_path(node, rep, via, direct):
            flows = self.net.flows_on(link, 0)  # a load is foreground: background flows (warmup, background writes) never delay it
            q = sum(r if r < size_bytes else size_bytes for r in flows)
            if q > best_q:
                best, best_q = flows, q
        return tuple(best)

    def arrival_s(self, load: _Load, m: int, now: float) -> float:
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

    def load_timeout(self, load: _Load, t: float) -> None:
        """The transport (``transport_timeout_s``) or the policy (a soft timeout) gives up on what has not arrived."""
        if not load.ended:
            self.end_load(load, t, "timeout")

