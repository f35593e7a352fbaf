"""A helper for authors of vLLM KV connectors (``KVConnectorBase_V1``).

kvpolicy does not import vLLM. A connector keeps a :class:`VllmConnectorPolicy`
and forwards three of its scheduler/worker hooks to it:

* ``get_num_new_matched_tokens(request, num_computed_tokens)`` → ``(tokens, False)``:
  how many tokens *beyond* the locally computed ones to load. The helper keys the
  prompt, matches the remote index after the local blocks, asks the
  :class:`~kvpolicy.admission.AdmissionController`, and answers the admitted
  ``load_blocks × B`` (0 = recompute); the decision is kept per request id.
* ``request_finished(request, block_ids)`` → ``(False, {"kvpolicy_publish_blocks": n})``:
  the publish filter's verdict on how many leading full blocks to store.
* ``get_block_ids_with_load_errors()`` on the worker: report them with
  :meth:`VllmConnectorPolicy.load_failed` (the breaker and the ledger learn of it);
  successful loads with :meth:`VllmConnectorPolicy.load_finished` (the latency
  model learns the measured times).

``request`` only needs the attributes vLLM's ``Request`` has: ``request_id``,
``prompt_token_ids`` (or ``all_token_ids``) and, optionally, ``cache_salt``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..admission import AdmissionContext, AdmissionController, LoadOutcome
from ..errors import ConfigError
from ..keys import BlockHasher
from ..ledger import Ledger, RequestRecord
from ..matching import match
from ..protocols import BlockIndex
from ..publish import PublishRequest


def _tokens(request: Any) -> list[int]:
    toks = getattr(request, "prompt_token_ids", None)
    if toks is None:
        toks = getattr(request, "all_token_ids", None)
    if toks is None:
        raise ConfigError("request", "needs prompt_token_ids (vLLM Request shape)")
    return list(toks)


class VllmConnectorPolicy:
    def __init__(self, hasher: BlockHasher, remote: BlockIndex, controller: AdmissionController, publish_filter: Any, *,
                 bytes_per_token: int, replica: str = "replica-0", source: str = "pool", ledger: Ledger | None = None,
                 tenant: str = "default") -> None:
        if not isinstance(hasher, BlockHasher):
            raise ConfigError("hasher", "must be a kvpolicy BlockHasher")
        if not isinstance(controller, AdmissionController):
            raise ConfigError("controller", "must be a kvpolicy AdmissionController")
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
        self._decisions: dict[str, Any] = {}
        self._keys: dict[str, Any] = {}

    # ---------------------------------------------------------------- scheduler side

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        toks = _tokens(request)
        keys = self.hasher.hash_blocks(toks)
        rid = str(request.request_id)
        self._keys[rid] = keys
        local_blocks = num_computed_tokens // self.B
        from ..matching import InMemoryBlockIndex

        local = InMemoryBlockIndex(list(keys)[:local_blocks])  # vLLM already found these locally
        m = match(keys, len(toks), local, self.remote, block_size_tokens=self.B)
        d = self.controller.decide(m, AdmissionContext(block_bytes=self.block_bytes, replica=self.replica, source=self.source,
                                                       active_decodes=self.active_decodes))
        self._decisions[rid] = (d, m)
        if d.loads:
            return d.load_blocks * self.B, False
        return 0, False

    def request_finished(self, request: Any, block_ids: Sequence[int]) -> tuple[bool, dict[str, Any] | None]:
        toks = _tokens(request)
        rid = str(request.request_id)
        keys = self._keys.pop(rid, None) or self.hasher.hash_blocks(toks)
        dm = self._decisions.pop(rid, None)
        reused = dm[1].local_blocks + (dm[0].load_blocks if dm and dm[0].loads else 0) if dm else 0
        preq = PublishRequest(request_id=rid, num_tokens=len(toks), block_size_tokens=self.B, tenant=self.tenant, replica=self.replica,
                              reused_blocks=reused)
        ks = list(keys)
        self.filter.observe(preq, ks)
        n = self.filter.publishable(preq, ks)
        if self.ledger is not None and dm is not None:
            d, m = dm
            self.ledger.record(RequestRecord(prompt_tokens=len(toks), block_size_tokens=self.B, local_blocks=m.local_blocks,
                                             remote_loaded_blocks=d.load_blocks if d.loads else 0,
                                             remote_not_loaded_blocks=m.remote_total_blocks - (d.load_blocks if d.loads else 0),
                                             not_loaded_reason="declined" if m.remote_total_blocks > (d.load_blocks if d.loads else 0) else None,
                                             predicted_recompute_s=d.t_recompute_p50_s if d.loads else None))
        return False, {"kvpolicy_publish_blocks": n}

    # ---------------------------------------------------------------- worker side

    def load_finished(self, request_id: str, *, transfer_s: float, lookup_s: float | None = None, install_s: float | None = None) -> int:
        """A load completed intact: returns the usable blocks."""
        d, _ = self._decision(request_id)
        return self.controller.record(LoadOutcome(d.load_id, "ok", d.load_blocks, lookup_s=lookup_s, transfer_s=transfer_s,
                                                  install_s=install_s)).usable_blocks

    def load_failed(self, request_id: str, failed_block_ids: set[int], first_block_id: int, *, timeout: bool = False) -> int:
        """``get_block_ids_with_load_errors`` reported blocks of this request's load:
        the leading blocks before the first failed one stay usable. Returns them."""
        d, _ = self._decision(request_id)
        ok = d.load_blocks
        for b in failed_block_ids:
            ok = min(ok, max(int(b) - first_block_id, 0))
        return self.controller.record(LoadOutcome(d.load_id, "timeout" if timeout else "failed", ok)).usable_blocks

    def _decision(self, request_id: str) -> Any:
        dm = self._decisions.get(str(request_id))
        if dm is None or not dm[0].loads:
            raise ConfigError("request_id", f"{request_id!r} has no admitted load")
        return dm
