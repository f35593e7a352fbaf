"""Replicas: routing, prefill slots, local caches, scale-out and warmup (issue #48's rooms).

Each :class:`~kvpolicy.sim.world._Replica` has ``prefill_slots`` GPU slots fed from a FIFO queue, a local cache (an
eviction policy over a resident prefix tree, blocks pinned while a request uses them) and its NIC's links. The router
picks a replica per attempt; a scale-out adds empty replicas, and the warmup planner fills them from the pool in the
background class.
"""

from __future__ import annotations

import numpy as np

from ..errors import CapacityError
from ..eviction.replay import make_policy
from ..warmup import WarmupConfig, hot_prefixes_from_trace, plan_warmup
from .config import Degrade, ScaleOut
from .events import PREFILL_DONE, WARM_DONE
from .overlap import ComputeWhileLoading
from .world import STATIC_ROUTERS, _DictIndex, _Load, _mix, _Replica, _ReplicaOracle, _Req, _unit


class Replicas(ComputeWhileLoading):
    """The serving replicas and their GPUs."""

    events: tuple[ScaleOut | Degrade, ...]
    pool_index: _DictIndex
    n_arrived: int
    _rr: int
    _local_oracles: dict[int, _ReplicaOracle] | None
    warmup_bytes: int
    warm_loads: int
    warm_loads_ok: int
    warm_loads_failed: int
    warm_loads_timeout: int

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

    def _queue_wait_s(self, rep: _Replica, t: float) -> float:
        """What the replica's scheduler knows: predicted seconds before a new prefill could start."""
        slots = self.c.prefill_slots
        if rep.free_slots > 0 and not rep.queue:
            return 0.0
        running = min((max(r.job_end_s - t, 0.0) for r in rep.running), default=0.0)
        return running + rep.queued_s / slots

    def _install(self, rep: _Replica, req: _Req, keys: list[int], start: int, end: int) -> None:
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

    def _unpin(self, rep: _Replica, req: _Req) -> None:
        rep.cache.unpin_all(req.pinned)
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
