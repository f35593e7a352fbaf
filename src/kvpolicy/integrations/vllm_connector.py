"""kvpolicy's decisions behind vLLM's KV connector seam (``KVConnectorBase_V1``).

kvpolicy does not import vLLM. A connector keeps a :class:`VllmConnectorPolicy`
and forwards its scheduler-side hooks to it, in the order vLLM 0.33's scheduler
calls them (``vllm/v1/core/sched/scheduler.py``):

1. ``get_num_new_matched_tokens(request, num_computed_tokens)`` — possibly several
   times for one request (a request that does not fit this step is asked again
   next step). It must be **side-effect free**: the helper keys the prompt (with
   the request's LoRA and ``cache_salt`` folded in as vLLM folds them), matches
   the remote index after the local blocks and asks the controller for a
   :meth:`~kvpolicy.admission.AdmissionController.propose` — no slot is taken.
   A load answer is one promise per request (asked again, it replaces its own),
   counted against the caps until the load is admitted: vLLM may answer several
   requests before it admits any (it defers an async load's admission while a
   step is in flight).
   Answer: ``(load_blocks × B, load_async)``; 0 = recompute.
2. ``update_state_after_alloc(request, blocks, num_external_tokens)`` — the
   scheduler allocated blocks; ``num_external_tokens`` may be *trimmed* or zeroed
   (a partial local tail, a cap). Only now is the load admitted
   (:meth:`~kvpolicy.admission.AdmissionController.admit`, at most the trimmed
   count) and its slot taken; the physical block ids it will fill are remembered.
3. ``build_connector_meta(scheduler_output)`` — the loads admitted and the store
   verdicts decided since the last step travel to the worker in the metadata
   (``{"loads": {req_id: {...}}, "stores": {req_id: n_blocks}}``), which the
   connector attaches to its own ``KVConnectorMetadata``.
4. ``update_connector_output(connector_output)`` — the worker's
   ``finished_recving`` (loads done), ``invalid_block_ids`` (blocks that failed to
   load: physical ids, mapped back to positions — the leading blocks before the
   first failed one stay usable) and ``failed_recving`` reach the controller: its
   breaker and latency model learn (an async load's time from admission to its
   ``finished_recving``, on the scheduler's clock), and the slot is released.
5. ``request_finished(request, block_ids)`` — the publish filter's verdict on how
   many leading full blocks to store goes into the next metadata (not into the
   API response); a load still holding a slot is released.

``request`` only needs what vLLM's ``Request`` has: ``request_id``,
``prompt_token_ids`` (or ``all_token_ids``), optionally ``cache_salt`` and
``lora_request`` (with ``lora_name``).
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any, TypeGuard

from ..admission import AdmissionContext, AdmissionController, LoadOutcome
from ..admission.steps import StepTimer
from ..errors import ConfigError
from ..keys import BlockHasher
from ..ledger import Ledger, RequestRecord
from ..matching import InMemoryBlockIndex, match
from ..protocols import BlockIndex
from ..publish import PublishRequest
from .vllm_events import extra_keys_for


def _tokens(request: Any) -> list[int]:
    toks = getattr(request, "prompt_token_ids", None)
    if toks is None:
        toks = getattr(request, "all_token_ids", None)
    if toks is None:
        raise ConfigError("request", "needs prompt_token_ids (vLLM Request shape)")
    return list(toks)


def _extras(request: Any, n_blocks: int) -> list[Any] | None:
    lora = getattr(request, "lora_request", None)
    name = getattr(lora, "lora_name", None) if lora is not None else None
    salt = getattr(request, "cache_salt", None) or None  # vLLM drops an empty salt
    if not name and not salt:
        return None
    return extra_keys_for(n_blocks, lora_name=name, cache_salt=salt)


def _step_chunks(scheduler_output: Any) -> list[tuple[int, int]]:
    """``(tokens computed before, tokens scheduled)`` per request in a step, from vLLM's ``SchedulerOutput``
    (``num_scheduled_tokens``, ``scheduled_new_reqs[].num_computed_tokens``, ``scheduled_cached_reqs.req_ids`` /
    ``.num_computed_tokens``). A field it lacks, or a count that is not a non-negative int, leaves its request out:
    this runs inside vLLM's scheduler, and timing is never worth stopping it for."""
    n = getattr(scheduler_output, "num_scheduled_tokens", None)
    if not isinstance(n, dict):
        return []
    pairs = [(getattr(nr, "req_id", None), getattr(nr, "num_computed_tokens", None))
             for nr in getattr(scheduler_output, "scheduled_new_reqs", None) or ()]
    cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
    pairs += zip(getattr(cached, "req_ids", None) or (), getattr(cached, "num_computed_tokens", None) or ())
    out = []
    for rid, before in pairs:
        try:
            k = n.get(rid)
        except TypeError:  # an unhashable id
            continue
        if _count_ok(k) and k > 0 and _count_ok(before):
            out.append((int(before), int(k)))
    return out


def _count_ok(v: Any) -> TypeGuard[int]:
    """A token count: a non-negative integral (numpy's too), never a bool."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool) and int(v) >= 0


def _block_ids(blocks: Any) -> list[int]:
    """The physical block ids of a vLLM ``KVCacheBlocks`` (first group), or of a plain list."""
    if blocks is None:
        return []
    if hasattr(blocks, "get_block_ids"):
        groups = blocks.get_block_ids()
        return list(groups[0]) if groups else []
    return [int(b) for b in blocks]


class VllmConnectorPolicy:
    def __init__(self, hasher: BlockHasher, remote: BlockIndex, controller: AdmissionController, publish_filter: Any, *,
                 bytes_per_token: int, replica: str = "replica-0", source: str = "pool", ledger: Ledger | None = None,
                 tenant: str = "default", load_async: bool = False, learn_prefill_from_steps: bool = True,
                 steps_in_flight: int = 1) -> None:
        if not isinstance(hasher, BlockHasher):
            raise ConfigError("hasher", "must be a kvpolicy BlockHasher")
        if not isinstance(controller, AdmissionController):
            raise ConfigError("controller", "must be a kvpolicy AdmissionController")
        if isinstance(bytes_per_token, bool) or not isinstance(bytes_per_token, int) or bytes_per_token <= 0:
            raise ConfigError("bytes_per_token", f"must be a positive int, got {bytes_per_token!r}")
        if not isinstance(load_async, bool):
            raise ConfigError("load_async", f"must be true or false, got {load_async!r}")
        if not isinstance(learn_prefill_from_steps, bool):
            raise ConfigError("learn_prefill_from_steps", f"must be true or false, got {learn_prefill_from_steps!r}")
        #: whether your worker loads between steps (vLLM's ``load_kv_async``: the request waits for its
        #: ``finished_recving``) or inside the step's forward pass (False, the default)
        self.load_async = load_async
        self.hasher = hasher
        self.remote = remote
        self.controller = controller
        self.filter = publish_filter
        self.B = hasher.block_size_tokens
        self.block_bytes = bytes_per_token * self.B
        self.replica = replica
        self.source = source
        self.ledger = ledger
        self.tenant = tenant
        self.active_decodes = 0
        # req -> (proposal, match, keys, when the scheduler first asked about it: its ledger time)
        self._proposals: dict[str, tuple[Any, Any, Any, float]] = {}
        self._loads: dict[str, dict[str, Any]] = {}  # req -> admitted load: decision, block ids, ...
        self._pending_meta: dict[str, dict[str, Any]] = {"loads": {}, "stores": {}}
        #: requests answered "load" whose load is not admitted yet: vLLM may answer several before it admits any
        #: (it defers an async load's update_state_after_alloc to a later step); the caps count them as in flight
        self._promised: set[str] = set()
        self._admitted: dict[str, int] = {}  # req -> blocks its admitted load brings (what it will not compute)
        self._step = 0  # scheduling steps so far (build_connector_meta calls)
        #: the deployment's compute, learned from the scheduler's steps (None: off — with pipeline parallelism the gap
        #: between step outputs is one stage's time, not a step's)
        self.step_timer = (StepTimer(controller.model, lambda: self.controller.clock.now_s(), prefill_min_tokens=self.B,
                                     steps_in_flight=steps_in_flight) if learn_prefill_from_steps else None)

    def _ctx(self) -> AdmissionContext:
        return AdmissionContext(block_bytes=self.block_bytes, replica=self.replica, source=self.source, active_decodes=self.active_decodes,
                                promised_loads=len(self._promised))

    def _promise(self, rid: str, loads: bool) -> None:
        """The answer to vLLM for ``rid`` is (``loads``) or is not a load: the caps count it until it is admitted."""
        if loads:
            self._promised.add(rid)
        else:
            self._promised.discard(rid)

    # ---------------------------------------------------------------- scheduler side

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens to load beyond the ``num_computed_tokens`` found locally. Pure: ask as often as you like."""
        if isinstance(num_computed_tokens, bool) or not isinstance(num_computed_tokens, int) or num_computed_tokens < 0:
            raise ConfigError("num_computed_tokens", f"must be a non-negative int, got {num_computed_tokens!r}")
        toks = _tokens(request)
        n_blocks = len(toks) // self.B
        keys = self.hasher.hash_blocks(toks, extra_keys=_extras(request, n_blocks))
        local = InMemoryBlockIndex(list(keys)[: num_computed_tokens // self.B])  # vLLM already found these locally
        m = match(keys, len(toks), local, self.remote, block_size_tokens=self.B)
        rid = str(request.request_id)
        self._promised.discard(rid)  # asked again: its earlier answer is not another load
        d = self.controller.propose(m, self._ctx())
        self._remember(rid, d, m, keys)
        self._promise(rid, d.loads)
        return (d.load_blocks * self.B, self.load_async) if d.loads else (0, False)

    def _remember(self, rid: str, proposal: Any, match: Any, keys: Any) -> None:
        """Keep the newest proposal for a request, and the time it was first asked about (asked again: still its arrival)."""
        prev = self._proposals.get(rid)
        self._proposals[rid] = (proposal, match, keys, prev[3] if prev else self.controller.clock.now_s())

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int, *, sync: bool | None = None) -> int:
        """The scheduler allocated blocks; admit the load (trimmed to ``num_external_tokens``) and take its slot.
        Returns the blocks admitted (0: recompute). ``sync`` (default: not ``load_async``): the load runs inside the
        step's forward pass (vLLM's ``load_kv_async`` False, as LMCache's connector loads); vLLM reports no
        ``finished_recving`` for it, so its slot is released two steps on, once that forward has run (see
        :meth:`build_connector_meta`). An async load is released by its ``finished_recving``."""
        if isinstance(num_external_tokens, bool) or not isinstance(num_external_tokens, numbers.Integral):
            raise ConfigError("num_external_tokens", f"must be an int (the tokens vLLM allocated for the load), got {num_external_tokens!r}")
        if sync is None:
            sync = not self.load_async
        rid = str(request.request_id)
        self._promised.discard(rid)  # admitted below, or not a load: no longer only promised
        n = max(int(num_external_tokens), 0) // self.B
        old = self._loads.get(rid)
        if old is not None:
            if n == 0:  # vLLM's call for a request resuming after its async load (0 external tokens): nothing new
                return old["decision"].load_blocks
            # preempted after its synchronous load ran (its slot is released two steps on) and admitted again with a
            # new load: the old one has ended — until 2026-12-01 the new load was taken for the old and never sent to
            # the worker, which then computed on blocks nothing filled
            self.load_finished(rid)
        prop = self._proposals.get(rid)
        if prop is None or not prop[0].loads or n == 0:
            self._admitted.pop(rid, None)
            return 0
        d, m, keys, _ = prop
        # vLLM counts the tokens get_num_new_matched_tokens answered as loaded from here on: a guard rail that filled
        # since (another request of this step took the last slot) must not refuse the load now — vLLM would compute on
        # unfilled blocks (a sync load) or wait forever for the request (an async one)
        admitted = self.controller.admit(d, self._ctx(), load_blocks=min(n, d.load_blocks), committed=True)
        if not admitted.loads:
            self._admitted.pop(rid, None)
            return 0
        start = m.local_blocks
        ids = _block_ids(blocks)
        self._admitted[rid] = admitted.load_blocks
        self._loads[rid] = {"decision": admitted, "block_ids": ids[start:start + admitted.load_blocks], "start_block": start,
                            "sync": bool(sync), "step": self._step + 1, "admitted_s": self.controller.clock.now_s()}
        self._pending_meta["loads"][rid] = {"load_id": admitted.load_id, "start_block": start, "blocks": admitted.load_blocks,
                                            "block_ids": ids[start:start + admitted.load_blocks]}
        return admitted.load_blocks

    def build_connector_meta(self, scheduler_output: Any = None) -> dict[str, Any]:
        """What the worker side needs this step: the admitted loads and the store verdicts. Resets them.

        A new step also ends the synchronous loads admitted two steps ago or more: their forward pass has run — vLLM
        schedules step k + 2 only after step k's output came back, even with async scheduling — and a failure would
        have come back in that output (``invalid_block_ids``, :meth:`update_connector_output`). Until this was done
        such a load held its slot until its request finished, decode included: with the default cap of 4 loads per
        replica, four decoding requests refused every later load behind LMCache's (synchronous) connector."""
        self._step += 1
        for rid in [r for r, ld in self._loads.items() if ld["sync"] and ld["step"] <= self._step - 2]:
            self.load_finished(rid)
        meta, self._pending_meta = self._pending_meta, {"loads": {}, "stores": {}}
        if self.step_timer is not None and scheduler_output is not None:
            # the step is timed from here to its update_connector_output; a synchronous load runs inside its forward
            # pass, so such a step's time says nothing about the compute alone
            sync_load = (getattr(scheduler_output, "has_sync_kv_loads", False) is True  # vLLM 0.33 says so itself
                         or any(self._loads.get(rid, {}).get("sync") for rid in meta["loads"]))
            self.step_timer.scheduled(_step_chunks(scheduler_output), left_out=sync_load)
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        """The worker's report (vLLM's ``KVConnectorOutput``): finished loads, failed block ids, failed requests.
        vLLM 0.33 calls it once per executed step, in order: it also ends the step the timer is timing."""
        if self.step_timer is not None:
            is_empty = getattr(connector_output, "is_empty", None)  # vLLM's: nothing finished, failed, counted or logged
            self.step_timer.finished(carries=not is_empty() if callable(is_empty) else True)
        invalid = set(getattr(connector_output, "invalid_block_ids", None) or ())
        failed_reqs = {str(r) for r in (getattr(connector_output, "failed_recving", None) or ())}
        done = {str(r) for r in (getattr(connector_output, "finished_recving", None) or ())}
        for rid in list(self._loads):
            ids = self._loads[rid]["block_ids"]
            bad = [j for j, b in enumerate(ids) if b in invalid]
            if bad or rid in failed_reqs:
                self.load_failed(rid, ok_blocks=min(bad) if bad else 0)
            elif rid in done:
                # an async load's time as the scheduler sees it — admitted here, reported done here: what the request
                # waited, step boundaries included — so the model learns the deployment's real link (a sync load's
                # time is inside its forward pass, not visible from here)
                ld = self._loads[rid]
                elapsed = None if ld["sync"] else max(self.controller.clock.now_s() - ld["admitted_s"], 0.0)
                self.load_finished(rid, transfer_s=elapsed)

    def request_finished(self, request: Any, block_ids: Sequence[int]) -> tuple[bool, dict[str, Any] | None]:
        """The publish verdict goes to the worker with the next metadata; a load still holding a slot is released."""
        toks = _tokens(request)
        rid = str(request.request_id)
        prop = self._proposals.pop(rid, None)
        self._promised.discard(rid)
        self._admitted.pop(rid, None)
        now_s = self.controller.clock.now_s()
        keys = prop[2] if prop and prop[2] is not None else self.hasher.hash_blocks(toks, extra_keys=_extras(request, len(toks) // self.B))
        load = self._loads.pop(rid, None)
        if load is not None:  # never reported back: the request ended first (aborted, preempted)
            self.controller.cancel(load["decision"].load_id)
        loaded = load["decision"].load_blocks if load else 0
        local = prop[1].local_blocks if prop else 0
        preq = PublishRequest(request_id=rid, num_tokens=len(toks), block_size_tokens=self.B, tenant=self.tenant, replica=self.replica,
                              reused_blocks=local + loaded, time_s=now_s)
        ks = list(keys)
        self.filter.observe(preq, ks)
        self._pending_meta["stores"][rid] = self.filter.publishable(preq, ks)
        if self.ledger is not None and prop is not None:
            m = prop[1]
            found = m.remote_total_blocks
            self.ledger.record(RequestRecord(prompt_tokens=len(toks), block_size_tokens=self.B, local_blocks=m.local_blocks,
                                             remote_loaded_blocks=loaded, remote_not_loaded_blocks=found - loaded,
                                             not_loaded_reason="declined" if found > loaded else None,
                                             predicted_recompute_s=prop[0].t_recompute_p50_s if loaded else None, arrival_s=prop[3]))
        return False, None

    # ---------------------------------------------------------------- outcomes (worker reports)

    def load_finished(self, request_id: str, *, transfer_s: float | None = None, lookup_s: float | None = None,
                      install_s: float | None = None) -> int:
        """A load completed intact: releases its slot; returns the usable blocks."""
        load = self._take(request_id)
        d = load["decision"]
        return self.controller.record(LoadOutcome(d.load_id, "ok", d.load_blocks, lookup_s=lookup_s, transfer_s=transfer_s,
                                                  install_s=install_s)).usable_blocks

    def load_failed(self, request_id: str, *, ok_blocks: int = 0, timeout: bool = False, elapsed_s: float | None = None) -> int:
        """A load failed after its first ``ok_blocks`` arrived intact: releases its slot, feeds the breaker
        (and, for a timeout with ``elapsed_s``, the model); returns the usable blocks."""
        load = self._take(request_id)
        d = load["decision"]
        return self.controller.record(LoadOutcome(d.load_id, "timeout" if timeout else "failed", min(max(ok_blocks, 0), d.load_blocks),
                                                  transfer_s=elapsed_s)).usable_blocks

    def prefill_timed(self, request: Any, seconds: float) -> None:
        """Your engine timed this request's prefill — the forward passes over the tokens it computed, in seconds.
        The controller learns this deployment's compute from it (the ratio to the profile its prior came from), as
        kvpolicy's reference engine and simulator do: a profile off by 2x otherwise stays off (docs/sim.md, "When the
        profile is wrong"). vLLM gives a connector no such time; a model runner that has it calls this before
        :meth:`request_finished`."""
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds < float("inf"):
            raise ConfigError("seconds", f"must be a finite positive number of seconds, got {seconds!r}")
        rid = str(request.request_id)
        prop = self._proposals.get(rid)
        if prop is None:
            raise ConfigError("request_id", f"{rid!r} was not asked about (get_num_new_matched_tokens), or has finished")
        before = (prop[1].local_blocks + self._admitted.get(rid, 0)) * self.B
        computed = len(_tokens(request)) - before
        if computed > 0:
            self.controller.model.observe_prefill(before, computed, float(seconds))

    def loads_in_flight(self) -> int:
        return len(self._loads)

    def _take(self, request_id: str) -> dict[str, Any]:
        load = self._loads.pop(str(request_id), None)
        if load is None:
            raise ConfigError("request_id", f"{request_id!r} has no admitted load in flight")
        return load
