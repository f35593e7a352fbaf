"""The engine-facing seams, in one short file.

Engines implement or call these; kvpolicy never imports an engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class BlockIndex(Protocol):
    """Anything that can say how many *leading* keys of a chain it holds.

    Prefix semantics (like SGLang's ``batch_exists``): return ``n`` such that
    ``keys[:n]`` are all present and ``keys[n]`` is not (or ``n == len(keys)``).
    A local cache, a remote pool and a directory all look like this.
    """

    def match_prefix(self, keys: Sequence[bytes]) -> int: ...


@runtime_checkable
class Clock(Protocol):
    """Injectable time source in seconds, so time-dependent policies are testable."""

    def now_s(self) -> float: ...


@runtime_checkable
class Directory(Protocol):
    """Where published blocks live, shared by every replica (``kvpolicy.directory``).

    Every call is scoped to one tenant: a tenant can neither list nor match
    another tenant's keys. ``match_prefix`` answers in one round trip.
    """

    def publish(self, tenant: str, entries: Sequence[Any]) -> int: ...

    def match_prefix(self, tenant: str, keys: Sequence[bytes]) -> int: ...

    def lookup(self, tenant: str, keys: Sequence[bytes]) -> list[list[Any]]: ...

    def evict(self, tenant: str, keys: Sequence[bytes], holder: str | None = None, force: bool = False) -> int: ...

    def lease(self, tenant: str, keys: Sequence[bytes], ttl_s: float) -> Any: ...

    def release(self, lease: Any) -> None: ...


@runtime_checkable
class ProfileTarget(Protocol):
    """What ``kvpolicy profile`` measures on an engine (seconds, bytes).

    ``prefix_tokens`` of a fixed prefix followed by ``tail_tokens`` of new text:
    cold (nothing cached), with the prefix cached locally, and the prefix's blocks
    loaded from another replica (``lookup_s``, ``transfer_s``, ``stage_s``,
    ``install_s``, ``total_s``). Calls may come from several threads at once
    (the concurrency levels).

    A target that also has an int ``cache_granule_tokens`` (what its cache holds
    whole: its block size, or a multiple of it) is measured with half hits too:
    ``local_hit_ttft_s(prefix, tail, cached_tokens=r)`` with only the prefix's
    first r tokens (a multiple of the granule) cached — what fits the cross term
    of the prefill model.
    """

    def kv_bytes(self, prefix_tokens: int) -> int: ...

    def cold_prefill_s(self, prefix_tokens: int, tail_tokens: int) -> float: ...

    def local_hit_ttft_s(self, prefix_tokens: int, tail_tokens: int, cached_tokens: int | None = None) -> float: ...

    def remote_load(self, prefix_tokens: int) -> dict[str, float]: ...


@runtime_checkable
class PeerSender(Protocol):
    """Asks another engine to send blocks it holds in its own cache into the shared store — the engine side of a pull
    (issue #44: publish on demand; :class:`kvpolicy.directory.PeerIndex` says which engine holds the run). ``send``
    answers how many of the leading ``keys`` that engine put into the store (0 when it no longer holds them)."""

    def send(self, engine: str, keys: Sequence[bytes]) -> int: ...


@runtime_checkable
class LoadRule(Protocol):
    """How many of a request's remotely found blocks to load (the rest are recomputed): what the simulator asks a
    policy set's ``load`` of your own (``PolicySet(load="mine.py:MyRule")``, built once per run with no arguments), on
    the same two objects :meth:`kvpolicy.admission.AdmissionController.decide` takes — ``match`` (local and remote
    blocks, block size, prompt tokens) and ``ctx`` (block bytes, replica, source, queue wait, the path's flows, ...).
    Answer an int in ``[0, match.remote_total_blocks]``: the leading remote blocks to load."""

    def blocks_to_load(self, match: Any, ctx: Any) -> int: ...

