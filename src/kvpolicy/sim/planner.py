"""The load planner (issue #61's rooms): how many of a request's remote blocks to load, and what the rule hears back.

The planner owns the load rule of a policy set — a preset's (``always``, ``never``, ``min-tokens``, the oracle's), the
:class:`~kvpolicy.admission.AdmissionController` (one for the cluster, or one per replica), or a
:class:`~kvpolicy.protocols.LoadRule` of your own — and calls it through the same protocol an engine does: a
:class:`~kvpolicy.matching.PrefixMatch` and an :class:`~kvpolicy.admission.AdmissionContext` in, a block count out. When
a load ends it charges the receiving replica the load's interference and tells the controller how the load went.
It moves no bytes and touches no cache.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from .._own import is_own
from ..admission import AdmissionConfig, AdmissionContext, AdmissionController, LatencyModel, LinkPrior, LoadOutcome
from ..admission.controller import LoadStatus
from ..errors import ConfigError
from .config import ClusterConfig
from .events import _Clock
from .policysets import PolicySet, load_own_rule
from .tally import Tally
from .world import PeerCopy, _Load, _Replica, _Req


class LoadPlanner:
    """A policy set's load rule, and the controllers that hear how each load went."""

    def __init__(self, cluster: ClusterConfig, policy_set: PolicySet, tally: Tally, clock: _Clock, *, block_size_tokens: int) -> None:
        self.c = cluster
        self.ps = policy_set
        self.tally = tally
        self.B = block_size_tokens
        ps = policy_set
        self.controller: AdmissionController | None = None
        self.load_rule: Any = load_own_rule(ps.load) if is_own(ps.load) else None  # one per run: its state is this run's
        self._make_controller: Callable[[], AdmissionController] | None = None
        if ps.load == "admission":
            c = cluster
            # the prior is the deployment's own figures: the path's slowest link (the staging copy is a
            # link of the path, pipelined with the network leg)
            bw = min(c.node_bandwidth_bytes_per_s, c.replica_bandwidth_bytes_per_s, c.stage_bytes_per_s or math.inf)
            prior = LinkPrior(bandwidth_bytes_per_s=max(bw * c.link_prior_factor, 1e-3), lookup_s=c.lookup_s, transfer_overhead_s=c.transfer_overhead_s,
                              stage_bytes_per_s=None, install_s_per_block=c.install_s_per_block,
                              dispatch_s=c.dispatch_s, interference_s_per_byte=c.interference_s_per_byte)

            # without guard rails: no cap on loads in flight or on the bytes a load waits behind (the breaker stays)
            caps: dict[str, Any] = {} if ps.guard_rails else {"max_loads_per_replica": sys.maxsize, "max_loads_per_source": sys.maxsize,
                                                             "max_queue_bytes_per_source": sys.float_info.max}

            def make_controller() -> AdmissionController:
                return AdmissionController(LatencyModel(prior, c.prefill), AdmissionConfig(compute_while_loading=ps.compute_while_loading,
                                                                                            gpu_s_price=ps.gpu_s_price, **caps),
                                           clock=clock)

            self._make_controller = make_controller
            #: the cluster's controller (controller_scope "cluster"), or replica 0's ("replica": each replica has its own)
            self.controller = make_controller()
        #: controller_scope "replica": each replica's own, by replica index (made when the replica first needs it)
        self.controllers: dict[int, AdmissionController] = {}

    def ctl(self, rep: _Replica | None) -> AdmissionController | None:
        """The admission controller that decides for ``rep`` (None: the set does not use one; ``rep`` None: the
        cluster's, or the first replica's)."""
        if self.controller is None or rep is None or self.ps.controller_scope == "cluster" or rep.idx == 0:
            return self.controller
        ctl = self.controllers.get(rep.idx)
        if ctl is None:
            assert self._make_controller is not None
            ctl = self.controllers[rep.idx] = self._make_controller()
        return ctl

    def all_controllers(self) -> tuple[AdmissionController, ...]:
        return tuple(ctl for ctl in (self.controller, *self.controllers.values()) if ctl is not None)

    def plan(self, req: _Req, rep: _Replica, pm: Any, R: int, context: Callable[[], AdmissionContext],
             from_peer: Callable[[], PeerCopy] | None = None) -> tuple[int, int, PeerCopy | None]:
        """(blocks to load, of them the front to compute instead, the peer's copy they come from or None) for
        ``req``'s R remote blocks. ``context()`` builds what a rule is told (asked only by the rules that read it). The
        controller's decision and its recompute prediction are kept on ``req``.

        ``from_peer()`` (the admission controller only): the same request matched against the peers alone — a
        :class:`~kvpolicy.sim.world.PeerCopy` — for when the pool's copy is on a path too slow to load. Where the controller would compute
        some of what the pool offers (a decline, a partial load, a split), it proposes the peer's copy too and admits
        the proposal that saves more GPU seconds (``gpu_saved_s``; the pool's on a tie). Both are side-effect-free
        proposals of the same controller, each on what its own path measures."""
        ps = self.ps
        load = ps.load
        if load == "admission" and from_peer is not None:
            return self._plan_two_sources(req, rep, pm, context, from_peer)
        k = s_ = 0
        if load == "always":
            k = R
        elif load == "never":  # a pool that is written and never read (recompute-only has no pool, so never got here)
            k = 0
        elif load == "min-tokens":
            k = R if R * self.B >= ps.min_load_tokens else 0
        elif load == "admission":
            ctl = self.ctl(rep)
            assert ctl is not None
            d = ctl.decide(pm, context())
            req.decision = d
            k = d.load_blocks
            s_ = d.split_blocks
            if k:
                req.predicted_s = d.t_recompute_p50_s
        elif load == "oracle":
            k = self._oracle_k(R)
        else:  # a rule of your own (kvpolicy.protocols.LoadRule), on what the admission controller is told
            k = self.load_rule.blocks_to_load(pm, context())
            if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 0 <= k <= R:
                raise ConfigError("load", f"{load!r}.blocks_to_load answered {k!r} for {R} remote blocks: it must be an int in [0, {R}]")
            k = int(k)
        return k, s_, None

    def _plan_two_sources(self, req: _Req, rep: _Replica, pm: Any, context: Callable[[], AdmissionContext],
                          from_peer: Callable[[], PeerCopy]) -> tuple[int, int, PeerCopy | None]:
        ctl = self.ctl(rep)
        assert ctl is not None
        ctx = context()
        d = ctl.propose(pm, ctx)
        peer = None
        if not d.loads or d.load_blocks - d.split_blocks < pm.remote_total_blocks:  # it computes some of what it found
            copy = from_peer()
            if copy.match.remote_total_blocks:
                ctx2 = copy.context()
                d2 = ctl.propose(copy.match, ctx2)
                if d2.loads and d2.terms["gpu_saved_s"] > (d.terms["gpu_saved_s"] if d.loads else 0.0):
                    d, ctx, peer = d2, ctx2, copy
        if d.loads:
            d = ctl.admit(d, ctx)
        req.decision = d
        k = d.load_blocks
        if k:
            req.predicted_s = d.t_recompute_p50_s
        return k, d.split_blocks, peer

    @staticmethod
    def _oracle_k(R: int) -> int:
        """Every block it finds — in the pool, or pulled from a peer as any set's pull. The oracle is the bound on GPU
        seconds saved, not on TTFT: a block loaded is a block not computed, and a load that fails is retried by the
        client (its preset's ``failure="fail"``), which costs time, never GPU seconds — recomputing it would."""
        return R

    def _charge_interference(self, rep: _Replica, req: _Req, nbytes: float) -> float:
        stall = self.c.interference_s_per_byte * nbytes
        rep.debt_s += stall
        total_stall = stall * (1 + rep.active)
        if req.i >= self.tally.judge_k:
            self.tally.stall_s += total_stall
        req.stall_s += total_stall
        return stall

    def record_outcome(self, req: _Req, load: _Load, status: LoadStatus, ok_blocks: int, t: float) -> int:
        """Charge the load's interference and tell the controller how the load went (once); returns the usable blocks."""
        load.recorded = True
        tally = self.tally
        judged = req.i >= tally.judge_k
        if status == "ok":
            tally.loads_ok += judged
        elif status == "timeout":
            tally.loads_timeout += judged
        else:
            tally.loads_failed += judged
        delivered = load.delivered_bytes()
        stall = self._charge_interference(req.replica, req, delivered)
        ctl = self.ctl(req.replica)
        if ctl is None or req.decision is None:
            return ok_blocks
        n = req.load
        out = LoadOutcome(load_id=req.decision.load_id, status=status, ok_blocks=min(ok_blocks, n), lookup_s=self.c.lookup_s,
                          transfer_s=(load.end_s if load.ended else t) - load.t0, install_s=self.c.install_s_per_block * ok_blocks if status == "ok" else None,
                          stall_s=stall if status == "ok" else None, bytes_delivered=delivered)
        return ctl.record(out).usable_blocks
