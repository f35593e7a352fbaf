"""LMCache: a kvpolicy publish filter as a store policy.

LMCache stores a request's KV in chunks (256 tokens by default) keyed by chained
chunk hashes; a store policy decides which chunks go to which backends. The
adapter's two methods have the shape of such a policy:

* ``select_store_targets(keys, backends)`` → ``{backend: [keys to store]}`` — the
  leading chunks the kvpolicy filter allows go to every given backend; the rest
  to none (publishing is prefix-closed);
* ``select_delete_targets(keys, backends)`` → ``{}`` — kvpolicy never asks LMCache
  to delete on store.

The request context the filter needs (token count, tenant, boundary) is given
once per request with :meth:`StorePolicyAdapter.begin_request`. Nothing from
LMCache is imported.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

from ..errors import ConfigError
from ..publish import PublishRequest


class StorePolicyAdapter:
    def __init__(self, publish_filter: Any, *, chunk_tokens: int = 256) -> None:
        if not hasattr(publish_filter, "publishable") or not hasattr(publish_filter, "observe"):
            raise ConfigError("publish_filter", "must implement kvpolicy's PublishFilter (observe, publishable)")
        if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens <= 0:
            raise ConfigError("chunk_tokens", f"must be a positive int, got {chunk_tokens!r}")
        self.filter = publish_filter
        self.chunk_tokens = chunk_tokens
        self._req: PublishRequest | None = None
        self.stored_chunks = 0
        self.skipped_chunks = 0

    def begin_request(self, request_id: Hashable, num_tokens: int, *, tenant: str = "default", boundary_tokens: int | None = None,
                      time_s: float = 0.0, reused_chunks: int = 0, data_class: str = "shared") -> None:
        self._req = PublishRequest(request_id=request_id, num_tokens=num_tokens, block_size_tokens=self.chunk_tokens, time_s=time_s,
                                   tenant=tenant, boundary_tokens=boundary_tokens, reused_blocks=reused_chunks, data_class=data_class)

    def select_store_targets(self, keys: Sequence[Hashable], backends: Sequence[Any]) -> dict[Any, list[Hashable]]:
        if self._req is None:
            raise ConfigError("request", "call begin_request(...) before select_store_targets")
        full = list(keys)[: self._req.full_blocks]  # only full chunks are ever published
        self.filter.observe(self._req, full)
        n = self.filter.publishable(self._req, full)
        self.stored_chunks += n
        self.skipped_chunks += len(keys) - n
        return {b: list(full[:n]) for b in backends} if n else {}

    def select_delete_targets(self, keys: Sequence[Hashable], backends: Sequence[Any]) -> dict[Any, list[Hashable]]:
        return {}
