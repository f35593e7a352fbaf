"""Computing while loading (issue #48's rooms; a room of its own since #61).

A request that computes while it loads holds its prefill slot while its range arrives from the back; the GPU prefills
the range from the front, and the two meet where they cross (:meth:`ComputeWhileLoading.schedule` plans that
point from the flows' current rates, and re-plans it whenever the rates change); the load is cut there and the rest of
the prompt follows. A plain load (no split) that has not arrived by its p95 prediction switches to this mode.

The room owns the requests computing in a slot while they load (``in_slot``) and hears MEET; the transfers room calls
:meth:`ComputeWhileLoading.rates_changed` whenever the flows' rates change. It reads the flows through the transfers
room, tells the load planner how a load went, and counts the GPU seconds and bytes it settles.
"""

from __future__ import annotations


import numpy as np

from ..admission.controller import LoadStatus
from ..ledger import Ledger
from .config import ClusterConfig
from .events import MEET, PREFILL_DONE, READY, EventLoop
from .planner import LoadPlanner
from .tally import Tally
from .transfers import Transfers
from .world import Prepared, _Load, _Req, release_leases


class ComputeWhileLoading:
    """The meeting point of a front computed and a back loaded."""

    def __init__(self, prepared: Prepared, cluster: ClusterConfig, *, loop: EventLoop, transfers: Transfers, planner: LoadPlanner,
                 tally: Tally, ledger: Ledger, compute_scale: np.ndarray | None) -> None:
        self.p = prepared
        self.c = cluster
        self.loop = loop
        self.transfers = transfers
        self.planner = planner
        self.tally = tally
        self.ledger = ledger
        self.B = prepared.block_size_tokens
        self.block_bytes = cluster.block_bytes(self.B)
        self._scale = compute_scale
        #: requests computing while they load, in the order they took their slots: a dict, not a set — a set of objects
        #: iterates in address order, and rates_changed re-plans each of them, pushing events in that order
        self.in_slot: dict[_Req, None] = {}

    def rates_changed(self, now_s: float) -> None:
        """The network's rates changed: re-plan the meeting point of every request computing while it loads, in the
        order they took their slots."""
        for req in list(self.in_slot):
            self.schedule(req, now_s)

    def k(self, req: _Req) -> float:
        """This request's compute over the cluster's model (``compute_scale``; 1 without one)."""
        return 1.0 if self._scale is None else float(self._scale[req.i])

    def front_s(self, req: _Req, L: int, j: int) -> float:
        """GPU seconds to prefill blocks [L, L+j) with [0, L) cached (dispatch and fixed term included)."""
        if j <= 0:
            return 0.0
        c = self.c
        return c.dispatch_s + self.k(req) * c.prefill_s(L * self.B, (L + j) * self.B)

    def _tail_s(self, req: _Req, front_blocks: int, extent_blocks: int) -> float:
        """GPU seconds for the rest of the prompt after blocks [0, L + extent), given the front computed."""
        c = self.c
        k = self.k(req)
        start = (req.local + extent_blocks) * self.B
        T = self.p.input_tokens[req.i]
        rest = k * (c.prefill_s(start, T) - c.prefill_a_s)
        return rest + (c.dispatch_s + k * c.prefill_a_s if front_blocks == 0 else 0.0)

    def schedule(self, req: _Req, now: float) -> float:
        """Plan the meeting point: the front j minimising max(slot + front(j), arrival of the last k−j)."""
        load = req.xfer
        assert load is not None
        self.transfers.net.sync(now)  # the bytes moved by now, not by the network's last event (or every re-plan pushes the meeting later)
        L, K = req.local, req.load
        s_ = 0
        t_s = req.slot_s

        def meet(j: int) -> float:
            return max(t_s + self.front_s(req, L, j), self.transfers.arrival_s(load, K - j, now))

        lo, hi = s_, K
        while lo < hi:  # the first j where the front is no earlier than the arrivals
            mid = (lo + hi) // 2
            if t_s + self.front_s(req, L, mid) >= self.transfers.arrival_s(load, K - mid, now):
                hi = mid
            else:
                lo = mid + 1
        best = meet(lo)
        if lo > s_:
            best = min(best, meet(lo - 1))
        req.meet_ver += 1
        req.job_end_s = best + self._tail_s(req, K, K)
        when = max(best, now)
        self.loop.push(when, MEET, (req, req.meet_ver))
        return when

    def load_end(self, load: _Load, t: float) -> None:
        req: _Req = load.payload
        if req in self.in_slot:
            self.schedule(req, t)
            return
        if not load.recorded:  # not computing yet: the outcome is known now
            self._record(req, load, t)
        if req.waiting:  # a plain load that ended in time: now it queues, its bytes already here
            req.waiting = False
            req.reused = req.local  # it queues once its blocks are installed: an event then, not a queue entry stamped ahead of now
            self.loop.push(t + self.c.install_s_per_block * load.arrived_blocks(self.block_bytes), READY, req)

    def _record(self, req: _Req, load: _Load, t: float) -> int:
        status: LoadStatus = load.status
        if status == "ok" and load.hung:
            status = "timeout"
        m = load.arrived_blocks(self.block_bytes)
        release_leases(req)
        return self.planner.record_outcome(req, load, status, m, t)

    def meet(self, item: tuple[_Req, int], t: float) -> None:
        req, ver = item
        if ver != req.meet_ver or req not in self.in_slot:
            return
        load = req.xfer
        assert load is not None
        self.transfers.net.sync(t)  # what has arrived by now
        L, K = req.local, req.load
        m = min(load.arrived_blocks(self.block_bytes), K)
        j = K - m
        front_done = req.slot_s + self.front_s(req, L, j)
        if front_done > t + 1e-9:  # the front has not reached what arrived: re-plan
            if self.schedule(req, t) <= t:  # no later point to wait for: the front decides
                req.meet_ver += 1
                self.loop.push(front_done, MEET, (req, req.meet_ver))
            return
        self.in_slot.pop(req, None)
        if not load.ended:
            self.transfers.end_load(load, t, "failed" if any(load.fails) else "timeout" if load.hung else "ok")
        if not load.recorded:
            self._record(req, load, t)
        self.finish(req, m, t)

    def finish(self, req: _Req, m: int, t_front_done: float) -> None:
        """The range is covered: m blocks loaded from the back, the rest of it computed; the tail follows."""
        load = req.xfer
        assert load is not None
        K = req.load
        j = K - m
        keys = self.p.keys[req.i]
        L = req.local
        for key in keys[L + j:L + K]:
            self.ledger.record_read(key)
        if req.i >= self.tally.judge_k:
            self.tally.bytes_read += m * self.block_bytes
        self.tally.bytes_unused += max(load.delivered_bytes() - m * self.block_bytes, 0)
        assert load.ended  # both callers end it first (the replica's start: it had ended; meet: cut where the front met it)
        if m:
            req.load_s = load.end_s - req.load_start_s
        tail = self._tail_s(req, j, K)
        busy = (t_front_done - req.slot_s) + tail
        req.prefill_s = busy
        self.tally.prefill_per[req.i] += busy
        if req.i >= self.tally.judge_k:
            self.tally.gpu_prefill_s += busy
        req.job_end_s = t_front_done + tail
        # the ledger's view: the front [L, L+j) was found remotely and recomputed (the split), m blocks loaded
        req.split = j
        req.load = m
        self.loop.push(t_front_done + tail, PREFILL_DONE, req)
