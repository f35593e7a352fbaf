"""The pool: storage nodes, placement, publishing and writes (issue #48's rooms; a room of its own since #61).

The pool is a set of :class:`~kvpolicy.sim.world._Node`, each with its own eviction policy, and a directory ``where``
(block key → node). A chunk of a chain is placed by rendezvous hashing (kvpolicy skips nodes whose breaker is open);
after a request's prefill its blocks are offered to the publish filter, the write-admission gate cuts what would not
beat its victim, and the rest travel as write flows; a write that lands evicts what its node's policy names. The pool
owns its nodes, its directory, the blocks being written, the publish filter and the write gate; it hears WRITE_DONE and
WRITE_TIMEOUT, and the transfers room tells it what a relay pull passed through a node (:meth:`Pool.land_pull`). It
starts its write flows on the network it is handed and asks the load planner's breakers where not to place a chunk.
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
from .config import ClusterConfig, Degrade
from .events import EventLoop, _Clock
from .planner import LoadPlanner
from .policysets import PolicySet
from .tally import Tally
from ..write_admission import WriteAdmission, gate
from .events import WRITE_DONE, WRITE_TIMEOUT
from .network import Flow
from .transfers import Transfers
from .world import Prepared, _DictIndex, _mix, _Node, _Replica, _Req


#: a storage node's capacity under ``PolicySet.pool_capacity="unbounded"``: more than any trace can write (2**62 bytes)
UNBOUNDED_BYTES = 1 << 62


def cache_policy(name: str, capacity_bytes: int, clock: _Clock, oracle: TraceOracle | Any | None) -> Any:
    """An eviction policy by name, on the run's clock (Belady's with the run's next-use oracle)."""
    kw: dict[str, Any] = {}
    if name in ("belady", "belady-bypass"):
        kw["oracle"] = oracle
    return make_policy(name, capacity_bytes, clock=clock, **kw)


class Pool:
    """The storage nodes and what is written to them."""

    def __init__(self, prepared: Prepared, cluster: ClusterConfig, policy_set: PolicySet, *, loop: EventLoop, transfers: Transfers,
                 planner: LoadPlanner, tally: Tally, ledger: Ledger, oracle: TraceOracle | None, oracle_pub: list[int] | None,
                 degrade: tuple[Degrade, ...] = ()) -> None:
        self.p = prepared
        self.c = cluster
        self.ps = policy_set
        self.loop = loop
        self.transfers = transfers
        self.planner = planner
        self.tally = tally
        self.ledger = ledger
        self._oracle_pub = oracle_pub
        self.B = prepared.block_size_tokens
        self.block_bytes = cluster.block_bytes(self.B)
        net = transfers.net
        capacity = cluster.pool_capacity_bytes_per_node
        if policy_set.pool_capacity == "unbounded" and capacity >= self.block_bytes:  # a pool that never fills (the oracle's)
            capacity = UNBOUNDED_BYTES
        self.nodes = [_Node(j, cache_policy(policy_set.pool_eviction, capacity, loop.clock, oracle),
                            net.add_link(f"node-{j}.out", cluster.node_bandwidth_bytes_per_s),
                            net.add_link(f"node-{j}.in", cluster.node_bandwidth_bytes_per_s)) for j in range(cluster.storage_nodes)]
        for e in degrade:
            self.nodes[e.node].windows.append(e)
        #: the pool's directory: which node holds each block
        self.where: dict[int, _Node] = {}
        self.pool_index = _DictIndex(self.where, "pool")
        #: blocks with a write in flight (not written again meanwhile)
        self.writing: set[int] = set()
        self.write_priority = 1 if cluster.publish_priority == "background" else 0
        self.filter = self._make_filter()
        #: blocks written again off a node whose breaker was open (``PolicySet.republish_unhealthy``)
        self.republished_blocks = 0
        self.write_gate: WriteAdmission | None = None
        if policy_set.write_admission == "tinylfu" and policy_set.uses_pool:
            blocks_per_node = cluster.pool_capacity_bytes_per_node // self.block_bytes
            self.write_gate = WriteAdmission(capacity_blocks=max(blocks_per_node * cluster.storage_nodes, 1))

    def _make_filter(self) -> Any:
        spec = self.ps.publish
        if spec == "oracle" or not self.ps.uses_pool:
            return None
        if "+" not in spec and spec in ("all", "never", "boundary") or spec.startswith("threshold"):
            return make_filter(spec)
        if spec.startswith("boundary+") and self.p.boundary is None:
            spec = spec[len("boundary+"):]  # the trace marks no boundary: the reuse filter alone
        n = self.c.replicas  # the replicas the cluster starts with
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
                node = self.place(chain[j])
                self.write_done((node, chain[j:j + chunk], chain, "default"), 0.0)
        self.tally.bytes_written = 0
        self.ledger.clear_flow("write")
        return len(self.where)

    def _healthy(self, node: _Node, rep: _Replica | None = None) -> bool:
        """Whether ``node``'s breaker is closed — in ``rep``'s controller (the cluster's, or the first replica's
        when none is named)."""
        ctl = self.planner.ctl(rep)
        if ctl is None:
            return True
        b = ctl.breakers.get(node.name)
        return b is None or b.state == "closed"

    def place(self, chunk_key: int, rep: _Replica | None = None) -> _Node:
        """Rendezvous placement of a chunk; kvpolicy skips nodes whose breaker is open (in the writer's controller)."""
        mix = _mix
        order = sorted(self.nodes, key=lambda n: -mix((chunk_key * 0x9E3779B1) ^ mix(n.idx + 7)))
        if self.ps.load == "admission":
            for n in order:
                if self._healthy(n, rep):
                    return n
        return order[0]

    def groups(self, keys: list[int]) -> list[tuple[_Node, list[int]]]:
        out: list[tuple[_Node, list[int]]] = []
        where = self.where
        for k in keys:
            n = where[k]
            if out and out[-1][0] is n:
                out[-1][1].append(k)
            else:
                out.append((n, [k]))
        return out

    def publish(self, rep: _Replica, req: _Req, keys: list[int], t: float) -> None:
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
            util = self.transfers.util
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
        # bytes are a constraint: under a write budget a re-publication, which no rule in the budget's ghosts makes, spends
        # only the room the decisions left in it
        room = self.filter.budget_room_blocks - self.republished_blocks if moving and isinstance(self.filter, DuelingPublish) else math.inf
        again: list[int] = []  # the blocks written again, off an unhealthy node
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
                    if not ok and len(again) >= room:
                        ok = True  # no room left in the budget: it stays where it is
                if ok:
                    node.policy.on_access(key)
                    continue
            if key in writing:
                continue
            if target is None:
                target = self.place(keys[j - j % chunk], rep)
            if target is node:
                continue
            batches.setdefault(target, []).append(key)
            order.append((j, target))
            if node is not None:
                again.append(key)  # held by an unhealthy node: written again
        if self.write_gate is not None and batches:
            batches = self._gate_writes(batches, order)
            if again:  # what the gate cut is not written again
                sent = {k for todo in batches.values() for k in todo}
                again = [k for k in again if k in sent]
        self.republished_blocks += len(again)
        if not batches:
            return
        c = self.c
        cls = p.request_class[i] if p.request_class else "default"
        for node, todo in batches.items():
            nbytes = len(todo) * self.block_bytes
            writing.update(todo)
            path = (rep.out, node.inn) if rep.stage is None else (rep.stage, rep.out, node.inn)  # the staging copy carries both directions
            f = self.transfers.net.start(t, path, nbytes, priority=self.write_priority, latency_s=c.transfer_overhead_s,
                               payload=(node, todo, keys, cls), on_done=self._write_flow_end)
            self.loop.push(t + c.transport_timeout_s, WRITE_TIMEOUT, f)  # a write still moving then never lands
        self.transfers.net_changed()

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
        self.loop.push(t, WRITE_DONE, f.payload)

    def land_pull(self, load: Any, j: int, moved_bytes: float, t: float) -> None:
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
            if t >= self.tally.t_judge:
                self.tally.bytes_pulled += n * self.block_bytes

    def write_done(self, item: tuple[_Node, list[int], list[int], str], t: float) -> None:
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
        rho = min(self.transfers.util.get(node.inn.name, 0.0), 0.99)
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
            if t >= self.tally.t_judge:
                self.tally.bytes_written += bb
            self.ledger.record_write(key, t, bb, tier=node.name, request_class=cls, congestion=congestion)
        return n

    def write_timeout(self, f: Flow, t: float) -> None:
        """A write still moving ``transport_timeout_s`` after it was issued never lands."""
        if f.alive:
            self.transfers.net.cancel(t, f)
            self.writing.difference_update(f.payload[1])
            self.transfers.net_changed()
