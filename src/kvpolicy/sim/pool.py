"""The pool: storage nodes, placement, publishing and writes (issue #48's rooms).

The pool is a set of :class:`~kvpolicy.sim.world._Node`, each with its own eviction policy, and a directory ``where``
(block key → node). A chunk of a chain is placed by rendezvous hashing (kvpolicy skips nodes whose breaker is open);
after a request's prefill its blocks are offered to the publish filter, the write-admission gate cuts what would not
beat its victim, and the rest travel as write flows; a write that lands evicts what its node's policy names.
"""

from __future__ import annotations

import math
from typing import Any

from ..errors import CapacityError
from ..eviction.policies import TraceOracle
from ..eviction.replay import make_policy
from ..ledger import Ledger
from ..publish import DuelingPublish, PublishRequest, make_filter
from ..publish_sim import block_recompute_s
from ..write_admission import WriteAdmission, gate
from .events import WRITE_DONE, WRITE_TIMEOUT
from .network import Flow
from .transfers import Transfers
from .world import _mix, _Node, _Replica, _Req


class Pool(Transfers):
    """The storage nodes and what is written to them."""

    B: int
    nodes: list[_Node]
    replicas: list[_Replica]
    #: the pool's directory: which node holds each block
    where: dict[int, _Node]
    #: blocks with a write in flight (not written again meanwhile)
    writing: set[int]
    filter: Any
    write_gate: WriteAdmission | None
    write_priority: int
    ledger: Ledger
    t_judge: float
    bytes_written: int
    #: of bytes_written, what pulls from peers wrote (published on demand)
    bytes_pulled: int
    _oracle: TraceOracle | None
    _oracle_pub: list[int] | None

    def _policy(self, name: str, capacity_bytes: int) -> Any:
        kw: dict[str, Any] = {}
        if name in ("belady", "belady-bypass"):
            kw["oracle"] = self._oracle
        return make_policy(name, capacity_bytes, clock=self.clock, **kw)

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
        c = self.c
        read_bw = min(c.node_bandwidth_bytes_per_s, c.replica_bandwidth_bytes_per_s, c.stage_bytes_per_s or math.inf)  # the read path's slowest link
        # with pulls from peers, dueling writes no more than SGLang's count-2 rule would: a pull serves the second sighting
        budget = "threshold-2" if self.ps.pull_from_peers and "threshold-2" in DuelingPublish.CANDIDATES else None
        return make_filter(spec, block_bytes=self.block_bytes, recompute_s=block_recompute_s(c.prefill, self.B),
                           write_bytes_per_s=max(c.node_bandwidth_bytes_per_s, 1e-3), read_bytes_per_s=max(read_bw, 1e-3),
                           cross_replica_share=cross, pool_capacity_blocks=max(pool_blocks, 1), write_budget_rule=budget)

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
                                  replica=rep.name, reused_blocks=req.local + req.load, local_blocks=req.local, peer_blocks=req.peer_run,
                                  write_path_utilisation=max(util.get(rep.out.name, 0.0), pool_in), prefill_utilisation=rep.util)
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
        healthy: dict[_Node, bool] = {}  # per node, asked once: nothing in this loop opens or closes a breaker
        for j, key in enumerate(keys[:n]):
            if j % chunk == 0:
                target = None
            node = where.get(key)
            if node is not None:
                ok = True
                if moving:
                    ok = healthy.get(node)  # type: ignore[assignment]
                    if ok is None:
                        ok = healthy[node] = self._healthy(node, rep)
                if ok:
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
            self._push(t + c.transport_timeout_s, WRITE_TIMEOUT, f)  # a write still moving then never lands
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
        self._push(t, WRITE_DONE, f.payload)

    def _land_pull(self, load: Any, j: int, moved_bytes: float, t: float) -> None:
        """A pull's relay flow through its node ended: the node keeps the whole blocks that passed (in transfer order:
        the group's leading blocks, or its trailing ones for a load from the back) — written as a publish would write
        them, counted as bytes written; the rest are free to be written again."""
        node, ks = load.groups[j]
        n = min(int((moved_bytes + 1.0) // self.block_bytes), len(ks))
        landed = ks[len(ks) - n:] if load.reverse else ks[:n]
        self.writing.difference_update(ks)
        if landed:
            req = load.payload
            p = self.p
            n = self._land((node, landed, p.keys[req.i], p.request_class[req.i] if p.request_class else "default"), t)
            if t >= self.t_judge:
                self.bytes_pulled += n * self.block_bytes

    def _write_done(self, item: tuple[_Node, list[int], list[int], str], t: float) -> None:
        self._land(item, t)

    def _land(self, item: tuple[_Node, list[int], list[int], str], t: float) -> int:
        """The blocks of a write (or a pull) land in their node: each not there already is inserted (evicting what the
        node's policy names), counted and logged. Returns how many were inserted."""
        node, todo, chain, cls = item
        pol = node.policy
        where = self.where
        bb = self.block_bytes
        pos = {k: j for j, k in enumerate(chain)}
        for key in todo:
            self.writing.discard(key)
        rho = min(self._util.get(node.inn.name, 0.0), 0.99)
        congestion = rho / (1.0 - rho)  # the write's shadow price: the delay it imposed on its node's ingress (ledger P_write)
        n = 0
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
            n += 1
            if t >= self.t_judge:
                self.bytes_written += bb
            self.ledger.record_write(key, t, bb, tier=node.name, request_class=cls, congestion=congestion)
        return n

    def _write_timeout(self, f: Flow, t: float) -> None:
        """A write still moving ``transport_timeout_s`` after it was issued never lands."""
        if f.alive:
            self.net.cancel(t, f)
            self.writing.difference_update(f.payload[1])
            self._net_changed()
