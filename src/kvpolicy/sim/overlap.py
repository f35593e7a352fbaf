"""Computing while loading (issue #48's rooms).

A request that computes while it loads holds its prefill slot while its range arrives from the back; the GPU prefills
the range from the front, and the two meet where they cross (:meth:`ComputeWhileLoading._cake_schedule` plans that
point from the flows' current rates, and re-plans it whenever the rates change); the load is cut there and the rest of
the prompt follows. A plain load (no split) that has not arrived by its p95 prediction switches to this mode.
"""

from __future__ import annotations

import numpy as np

from ..admission.controller import LoadStatus
from .events import MEET, PREFILL_DONE, READY
from .pool import Pool
from .world import _Load, _Req


class ComputeWhileLoading(Pool):
    """The meeting point of a front computed and a back loaded."""

    #: requests computing while they load, in the order they took their slots: a dict, not a set — a set of objects
    #: iterates in address order, and _rates_changed re-plans each of them, pushing events in that order
    cake_in_slot: dict[_Req, None]
    _scale: np.ndarray | None
    bytes_read: int
    bytes_unused: int
    gpu_prefill_s: float
    prefill_per: np.ndarray

    def _rates_changed(self, now_s: float) -> None:
        """The network's rates changed: re-plan the meeting point of every request computing while it loads, in the
        order they took their slots."""
        for req in list(self.cake_in_slot):
            self._cake_schedule(req, now_s)

    def _k(self, req: _Req) -> float:
        """This request's compute over the cluster's model (``compute_scale``; 1 without one)."""
        return 1.0 if self._scale is None else float(self._scale[req.i])

    def _front_s(self, req: _Req, L: int, j: int) -> float:
        """GPU seconds to prefill blocks [L, L+j) with [0, L) cached (dispatch and fixed term included)."""
        if j <= 0:
            return 0.0
        c = self.c
        return c.dispatch_s + self._k(req) * c.prefill_s(L * self.B, (L + j) * self.B)

    def _tail_s(self, req: _Req, front_blocks: int, extent_blocks: int) -> float:
        """GPU seconds for the rest of the prompt after blocks [0, L + extent), given the front computed."""
        c = self.c
        k = self._k(req)
        start = (req.local + extent_blocks) * self.B
        T = self.p.input_tokens[req.i]
        rest = k * (c.prefill_s(start, T) - c.prefill_a_s)
        return rest + (c.dispatch_s + k * c.prefill_a_s if front_blocks == 0 else 0.0)

    def _cake_schedule(self, req: _Req, now: float) -> float:
        """Plan the meeting point: the front j minimising max(slot + front(j), arrival of the last k−j)."""
        load = req.xfer
        assert load is not None
        self.net.sync(now)  # the bytes moved by now, not by the network's last event (or every re-plan pushes the meeting later)
        L, K = req.local, req.load
        s_ = 0
        t_s = req.slot_s

        def meet(j: int) -> float:
            return max(t_s + self._front_s(req, L, j), self._arrival_s(load, K - j, now))

        lo, hi = s_, K
        while lo < hi:  # the first j where the front is no earlier than the arrivals
            mid = (lo + hi) // 2
            if t_s + self._front_s(req, L, mid) >= self._arrival_s(load, K - mid, now):
                hi = mid
            else:
                lo = mid + 1
        best = meet(lo)
        if lo > s_:
            best = min(best, meet(lo - 1))
        req.meet_ver += 1
        req.job_end_s = best + self._tail_s(req, K, K)
        when = max(best, now)
        self._push(when, MEET, (req, req.meet_ver))
        return when

    def _cake_load_end(self, load: _Load, t: float) -> None:
        req: _Req = load.payload
        if req in self.cake_in_slot:
            self._cake_schedule(req, t)
            return
        if not load.recorded:  # not computing yet: the outcome is known now
            self._cake_record(req, load, t)
        if req.waiting:  # a plain load that ended in time: now it queues, its bytes already here
            req.waiting = False
            req.reused = req.local  # it queues once its blocks are installed: an event then, not a queue entry stamped ahead of now
            self._push(t + self.c.install_s_per_block * load.arrived_blocks(self.block_bytes), READY, req)

    def _cake_record(self, req: _Req, load: _Load, t: float) -> int:
        status: LoadStatus = load.status
        if status == "ok" and load.hung:
            status = "timeout"
        m = load.arrived_blocks(self.block_bytes)
        self._release_leases(req)
        return self._record_outcome(req, load, status, m, t)

    def _meet(self, item: tuple[_Req, int], t: float) -> None:
        req, ver = item
        if ver != req.meet_ver or req not in self.cake_in_slot:
            return
        load = req.xfer
        assert load is not None
        self.net.sync(t)  # what has arrived by now
        L, K = req.local, req.load
        m = min(load.arrived_blocks(self.block_bytes), K)
        j = K - m
        front_done = req.slot_s + self._front_s(req, L, j)
        if front_done > t + 1e-9:  # the front has not reached what arrived: re-plan
            if self._cake_schedule(req, t) <= t:  # no later point to wait for: the front decides
                req.meet_ver += 1
                self._push(front_done, MEET, (req, req.meet_ver))
            return
        self.cake_in_slot.pop(req, None)
        if not load.ended:
            self._end_load(load, t, "failed" if any(load.fails) else "timeout" if load.hung else "ok")
        if not load.recorded:
            self._cake_record(req, load, t)
        self._cake_finish(req, m, t)

    def _cake_finish(self, req: _Req, m: int, t_front_done: float) -> None:
        """The range is covered: m blocks loaded from the back, the rest of it computed; the tail follows."""
        load = req.xfer
        assert load is not None
        K = req.load
        j = K - m
        keys = self.p.keys[req.i]
        L = req.local
        for key in keys[L + j:L + K]:
            self.ledger.record_read(key)
        if req.i >= self.judge_k:
            self.bytes_read += m * self.block_bytes
        self.bytes_unused += max(load.delivered_bytes() - m * self.block_bytes, 0)
        assert load.ended  # both callers end it first (_start: it had ended; _meet: cut where the front met it)
        if m:
            req.load_s = load.end_s - req.load_start_s
        tail = self._tail_s(req, j, K)
        busy = (t_front_done - req.slot_s) + tail
        req.prefill_s = busy
        self.prefill_per[req.i] += busy
        if req.i >= self.judge_k:
            self.gpu_prefill_s += busy
        req.job_end_s = t_front_done + tail
        # the ledger's view: the front [L, L+j) was found remotely and recomputed (the split), m blocks loaded
        req.split = j
        req.load = m
        self._push(t_front_done + tail, PREFILL_DONE, req)
