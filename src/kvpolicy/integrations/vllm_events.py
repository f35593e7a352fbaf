"""KV events from vLLM and SGLang → the directory.

Both engines publish KV cache events as ZMQ multipart messages ``[topic, seq,
payload]`` (``seq`` an 8-byte big-endian counter, ``payload`` a msgpack batch
``[ts, [event, ...], data_parallel_rank]``). Each event is a **tagged map**
(vLLM ≥ 0.26, PR #42892; SGLang 0.5.x) — fields left at their default are
omitted::

    {"type": "BlockStored", "block_hashes": [...], "parent_block_hash": h | None, "token_ids": [...],
     "block_size": B, "lora_id": ..., "medium": "GPU" | "CPU" | "STORAGE" | "CPU_PINNED" | "DISK" | "EXTERNAL",
     "lora_name": ..., "extra_keys": [per block: [values...] | None], "group_idx": g,
     "kv_cache_spec_kind": ..., "kv_cache_spec_sliding_window": ..., "locality": ..., "ownership": ...,
     "session_id": ..., "lookahead_token_ids": ..., "cache_salt": ... (SGLang)}
    {"type": "BlockRemoved", "block_hashes": [...], "medium": ..., "group_idx": g, ...}
    {"type": "AllBlocksCleared"}

The older tagged-array form (``["BlockStored", block_hashes, parent, token_ids,
block_size, lora_id, medium]``) is decoded too. Block hashes are the engine's:
``bytes`` (a sha256 chain) or the 64-bit ``int`` vLLM emits by default (the low
64 bits of the bytes hash, ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``).

The :class:`KVEventIngestor` maps each engine hash to a **kvpolicy key**: a
stored block's key is built from its tokens and its per-block extra keys
(adapter name, multimodal ids, cache salt — folded in as vLLM folds them into
its own hash), chained from the kvpolicy key of its parent (found through the
parent's engine hash), under this deployment's namespace — so a request's own
key chain (``BlockHasher.hash_blocks(prompt, extra_keys=...)``) matches what the
engine stored, and nothing from another namespace ever does. An entry is held
per **(key, engine, medium, group)**: the directory holder is
``"{holder}/{medium}/g{group}"``, so removing a block from the GPU leaves its CPU
copy, and a sliding-window group's removal leaves the full-attention group's.
Tier-only events (no tokens: a block known under another medium) reuse the key
of the engine hash already seen; partial trailing blocks are skipped (only full
blocks count). Optionally the ingestor re-derives the engine hashes with
:func:`kvpolicy.keys.vllm_block_hashes` — comparing the low 64 bits when the
engine sends ints — and refuses blocks whose hashes disagree.

Malformed frames and events are counted (``counts`` and, per reason,
``refused``) and logged, never raised: a consumer must outlive a bad publisher.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Hashable
from typing import Any, Literal

import attrs

from ..directory.base import Entry, check_tenant
from ..errors import ConfigError, KVPolicyError
from ..keys import BlockHasher

log = logging.getLogger("kvpolicy.events")

#: the engines' medium names -> the directory's tier names
MEDIA = {"GPU": "gpu", "CPU": "cpu", "CPU_PINNED": "cpu", "STORAGE": "storage", "DISK": "disk", "EXTERNAL": "external", "LOCAL_FILE": "disk"}
_M64 = (1 << 64) - 1
_U32 = (1 << 32) - 1


@attrs.frozen
class BlockStored:
    block_hashes: tuple[Hashable, ...]
    parent_block_hash: Hashable | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    #: one entry per block: the untagged values vLLM folds into that block's hash (or None)
    extra_keys: tuple[tuple[Any, ...] | None, ...] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: tuple[tuple[int, ...], ...] | None = None
    #: SGLang's request-level salt (vLLM puts it in block 0's extra_keys)
    cache_salt: str | None = None


@attrs.frozen
class BlockRemoved:
    block_hashes: tuple[Hashable, ...]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


@attrs.frozen
class AllBlocksCleared:
    medium: str | None = None


class EventFormatError(ConfigError):
    """A batch or event does not have the engines' shape; ``field`` says where."""


def _hash(h: Any, where: str) -> Hashable:
    """A block hash as the engines send it: bytes, or a 64-bit int — unsigned (vLLM) or signed (SGLang builds its
    hashes with ``hash_str_to_int64``, so about half are negative). A signed one is taken as its 64 bits (two's
    complement), so a block and the parent hash naming it agree whichever way either was written."""
    if isinstance(h, bool) or not isinstance(h, (bytes, int)):
        raise EventFormatError(where, f"a block hash must be bytes or int, got {type(h).__name__}")
    if isinstance(h, int):
        if not -(1 << 63) <= h <= _M64:
            raise EventFormatError(where, f"an int block hash must fit in 64 bits (signed or unsigned), got {h}")
        return h & _M64
    return h


def _opt(v: Any, kind: type | tuple[type, ...], where: str) -> Any:
    if v is None:
        return None
    if isinstance(v, bool) and kind is not bool or not isinstance(v, kind):
        raise EventFormatError(where, f"must be {kind if isinstance(kind, type) else kind[0]}, got {type(v).__name__}")
    return v


def _tokens(v: Any, where: str) -> tuple[int, ...]:
    if not isinstance(v, (list, tuple)):
        raise EventFormatError(where, "must be an array of token ids")
    if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= _U32 for t in v):
        raise EventFormatError(where, "must be ints in [0, 2**32) (token ids)")
    return tuple(v)


def _medium(v: Any, where: str) -> str | None:
    """A medium name: it becomes part of the directory holder ``{holder}/{tier}/g{group}`` and a stored tier, so it is a
    short name without '/', '|' or NUL (a frame that says otherwise is malformed, not a holder to create)."""
    v = _opt(v, str, where)
    if v is not None and (not 1 <= len(v) <= 64 or any(c in v for c in "/|\x00")):
        raise EventFormatError(where, f"must be a medium name (1-64 characters, no '/', '|' or NUL), got {v!r:.80}")
    return v


def _extra(v: Any, n: int, where: str) -> tuple[tuple[Any, ...] | None, ...] | None:
    if v is None:
        return None
    if not isinstance(v, (list, tuple)) or len(v) != n:
        raise EventFormatError(where, f"must be one entry per block ({n}), got {v!r:.60}")
    out: list[tuple[Any, ...] | None] = []
    for e in v:
        if e is None:
            out.append(None)
        elif isinstance(e, (list, tuple)):
            out.append(tuple(tuple(x) if isinstance(x, list) else x for x in e))
        else:
            raise EventFormatError(where, f"each entry must be an array or null, got {type(e).__name__}")
    return tuple(out)


def _stored(f: dict[str, Any], where: str) -> BlockStored:
    for name in ("block_hashes", "token_ids", "block_size"):
        if name not in f:
            raise EventFormatError(f"{where}.{name}", "is required for BlockStored")
    hashes = f["block_hashes"]
    if not isinstance(hashes, (list, tuple)):
        raise EventFormatError(f"{where}.block_hashes", "must be an array")
    tokens = _tokens(f["token_ids"], f"{where}.token_ids")
    bs = f["block_size"]
    if isinstance(bs, bool) or not isinstance(bs, int) or bs < 0:
        raise EventFormatError(f"{where}.block_size", f"must be a non-negative int, got {bs!r}")
    if tokens and bs == 0:
        raise EventFormatError(f"{where}.block_size", "is 0 with token ids present")
    if tokens and len(tokens) > len(hashes) * bs:
        raise EventFormatError(where, f"{len(tokens)} token ids for {len(hashes)} blocks of {bs}")
    parent = f.get("parent_block_hash")
    look = f.get("lookahead_token_ids")
    return BlockStored(
        tuple(_hash(h, f"{where}.block_hashes") for h in hashes), None if parent is None else _hash(parent, f"{where}.parent_block_hash"),
        tokens, bs, _opt(f.get("lora_id"), int, f"{where}.lora_id"), _medium(f.get("medium"), f"{where}.medium"),
        _opt(f.get("lora_name"), str, f"{where}.lora_name"), _extra(f.get("extra_keys"), len(hashes), f"{where}.extra_keys"),
        _opt(f.get("group_idx"), int, f"{where}.group_idx"), _opt(f.get("kv_cache_spec_kind"), str, f"{where}.kv_cache_spec_kind"),
        _opt(f.get("kv_cache_spec_sliding_window"), int, f"{where}.kv_cache_spec_sliding_window"),
        _opt(f.get("locality"), str, f"{where}.locality"), _opt(f.get("ownership"), str, f"{where}.ownership"),
        _opt(f.get("session_id"), str, f"{where}.session_id"),
        None if look is None else tuple(_tokens(x, f"{where}.lookahead_token_ids") for x in (look if isinstance(look, (list, tuple)) else [look])),
        _opt(f.get("cache_salt"), str, f"{where}.cache_salt"),
    )


def decode_event(raw: Any, i: int = 0) -> BlockStored | BlockRemoved | AllBlocksCleared:
    """One event, in the tagged-map form (vLLM ≥ 0.26, SGLang) or the older tagged array."""
    where = f"events[{i}]"
    if isinstance(raw, dict):
        tag = raw.get("type")
        f = raw
    elif isinstance(raw, (list, tuple)) and raw and isinstance(raw[0], str):
        tag = raw[0]
        names = {"BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
                                 "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window"),
                 "BlockRemoved": ("block_hashes", "medium", "group_idx"), "AllBlocksCleared": ("medium",)}.get(tag, ())
        if tag == "BlockStored" and len(raw) < 5:
            raise EventFormatError(where, f"BlockStored needs block_hashes, parent_block_hash, token_ids, block_size; got {len(raw) - 1} fields")
        f = dict(zip(names, raw[1:]))
    else:
        raise EventFormatError(where, "must be a tagged map {\"type\": ...} or a tagged array [tag, fields...]")
    if tag == "BlockStored":
        return _stored(f, where)
    if tag == "BlockRemoved":
        hashes = f.get("block_hashes")
        if not isinstance(hashes, (list, tuple)):
            raise EventFormatError(f"{where}.block_hashes", "BlockRemoved needs an array of block hashes")
        return BlockRemoved(tuple(_hash(h, f"{where}.block_hashes") for h in hashes), _medium(f.get("medium"), f"{where}.medium"),
                            _opt(f.get("group_idx"), int, f"{where}.group_idx"), _opt(f.get("locality"), str, f"{where}.locality"),
                            _opt(f.get("ownership"), str, f"{where}.ownership"))
    if tag == "AllBlocksCleared":
        return AllBlocksCleared(_medium(f.get("medium"), f"{where}.medium"))
    raise EventFormatError(f"{where}.type", f"unknown event type {tag!r}")


def _msgpack() -> Any:
    try:
        import msgpack
    except ImportError:
        raise ConfigError("msgpack", "KV event ingestion needs msgpack: pip install 'kvpolicy[events]'") from None
    return msgpack


def decode_batch(payload: bytes) -> tuple[float, list[Any], int | None]:
    """``(ts, events, data_parallel_rank)`` of one msgpack KVEventBatch."""
    msgpack = _msgpack()
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises several unrelated types
        raise EventFormatError("payload", f"not msgpack: {e}") from None
    if not isinstance(raw, (list, tuple)) or len(raw) < 2 or isinstance(raw[0], bool) or not isinstance(raw[0], (int, float)) \
            or not isinstance(raw[1], (list, tuple)):
        raise EventFormatError("payload", "a KVEventBatch is [ts, [events...], data_parallel_rank?]")
    rank = raw[2] if len(raw) > 2 and isinstance(raw[2], int) and not isinstance(raw[2], bool) else None
    return float(raw[0]), list(raw[1]), rank


def _encode_event(e: Any) -> Any:
    if not isinstance(e, (BlockStored, BlockRemoved, AllBlocksCleared)):
        return e  # already raw
    d: dict[str, Any] = {"type": type(e).__name__}
    always = {"BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name"),
              "BlockRemoved": ("block_hashes", "medium"), "AllBlocksCleared": ()}[type(e).__name__]
    for a in attrs.fields(type(e)):
        v = getattr(e, a.name)
        if v is None and a.name not in always:
            continue  # msgspec's omit_defaults
        if isinstance(v, tuple):
            v = [list(x) if isinstance(x, tuple) else x for x in v]
        d[a.name] = v
    return d


def encode_batch(ts: float, events: list[Any], data_parallel_rank: int | None = None) -> bytes:
    """The engines' wire shape: ``[ts, [tagged maps...], data_parallel_rank]`` in msgpack."""
    return _msgpack().packb([ts, [_encode_event(e) for e in events], data_parallel_rank], use_bin_type=True)


def extra_keys_for(n_blocks: int, *, lora_name: str | None = None, cache_salt: str | None = None,
                   first_block_index: int = 0) -> list[tuple[Any, ...] | None]:
    """Per-block extra keys as vLLM publishes them (untagged): the adapter name on every block, the
    cache salt on absolute block 0 — what a request passes to ``BlockHasher.hash_blocks(extra_keys=...)``
    so its keys match what :class:`KVEventIngestor` stored."""
    out: list[tuple[Any, ...] | None] = []
    for j in range(n_blocks):
        parts: list[Any] = []
        if lora_name:
            parts.append(lora_name)
        if cache_salt and first_block_index + j == 0:
            parts.append(cache_salt)
        out.append(tuple(parts) if parts else None)
    return out


class KVEventIngestor:
    """Apply one engine's (``holder``'s) KV events to a directory, for one tenant."""

    REASONS = ("malformed_frame", "malformed_event", "orphan", "incompatible_block_size", "mismatched_hash", "unverifiable",
               "unknown_removed", "partial_block", "unknown_tier_only")

    def __init__(self, directory: Any, tenant: str, hasher: BlockHasher, *, holder: str, bytes_per_token: int,
                 verify_algo: str | None = None, max_mapped_blocks: int = 4_000_000) -> None:
        if not isinstance(hasher, BlockHasher):
            raise ConfigError("hasher", "must be a kvpolicy BlockHasher for this deployment's namespace")
        if isinstance(bytes_per_token, bool) or not isinstance(bytes_per_token, int) or bytes_per_token <= 0:
            raise ConfigError("bytes_per_token", f"must be a positive int, got {bytes_per_token!r}")
        if not isinstance(holder, str) or not holder or "/" in holder:
            raise ConfigError("holder", f"must be a non-empty name without '/', got {holder!r}")
        self.directory = directory
        self.tenant = check_tenant(tenant)
        self.hasher = hasher
        self.holder = holder
        self.block_bytes = bytes_per_token * hasher.block_size_tokens
        self.verify_algo = verify_algo
        self.max_mapped_blocks = max_mapped_blocks
        # engine hash -> [kvpolicy key, projected full hash (bytes) or None, {(tier, group)}]
        self._map: OrderedDict[Hashable, list[Any]] = OrderedDict()
        self._holders: set[str] = set()
        self.counts = {"batches": 0, "events": 0, "stored_blocks": 0, "removed_blocks": 0, "cleared": 0, "malformed_frames": 0,
                       "malformed_events": 0, "orphans": 0, "incompatible": 0, "mismatched": 0, "unknown_removed": 0, "missed_batches": 0,
                       "restarts": 0, "verified_blocks": 0, "forgotten_blocks": 0}
        #: every block or frame refused, by reason (see REASONS)
        self.refused = {r: 0 for r in self.REASONS}

    def holder_for(self, medium: str | None, group_idx: int | None) -> str:
        """The directory holder of this engine's copies on ``medium`` in KV-cache group ``group_idx``."""
        tier = MEDIA.get((medium or "GPU").upper(), (medium or "gpu").lower())
        return f"{self.holder}/{tier}/g{group_idx or 0}"

    def key_of(self, engine_hash: Hashable) -> bytes | None:
        """The kvpolicy key the engine's block hash maps to (None if unknown)."""
        rec = self._map.get(engine_hash)
        return None if rec is None else rec[0]

    def _refuse(self, reason: str, n: int = 1) -> None:
        self.refused[reason] += n

    # ------------------------------------------------------------------ ingest

    def ingest(self, payload: bytes) -> int:
        """Apply one batch; returns how many events were applied. Never raises on bad input."""
        try:
            _, events, _ = decode_batch(payload)
        except EventFormatError as e:
            self.counts["malformed_frames"] += 1
            self._refuse("malformed_frame")
            log.warning("kvpolicy events: dropped a malformed batch: %s", e)
            return 0
        self.counts["batches"] += 1
        applied = 0
        for i, raw in enumerate(events):
            try:
                ev = decode_event(raw, i)
            except EventFormatError as e:
                self.counts["malformed_events"] += 1
                self._refuse("malformed_event")
                log.warning("kvpolicy events: dropped a malformed event: %s", e)
                continue
            try:
                self.apply(ev)
            except KVPolicyError as e:  # what decode_event cannot see (a value the directory or the hasher refuses)
                self.counts["malformed_events"] += 1
                self._refuse("malformed_event")
                log.warning("kvpolicy events: dropped an event the directory refused: %s", e)
                continue
            applied += 1
        return applied

    def apply(self, ev: BlockStored | BlockRemoved | AllBlocksCleared) -> None:
        self.counts["events"] += 1
        if isinstance(ev, BlockStored):
            self._stored(ev)
        elif isinstance(ev, BlockRemoved):
            self._removed(ev)
        else:
            self._cleared(ev)

    def _removed(self, ev: BlockRemoved) -> None:
        where = self.holder_for(ev.medium, ev.group_idx)
        tg = where.split("/", 1)[1]
        keys = []
        for h in ev.block_hashes:
            rec = self._map.get(h)
            if rec is None or tg not in rec[2]:
                self.counts["unknown_removed"] += 1
                self._refuse("unknown_removed")
                continue
            rec[2].discard(tg)
            keys.append(rec[0])
            if not rec[2]:  # no copy left anywhere: forget the mapping
                del self._map[h]
        if keys:
            self.counts["removed_blocks"] += self.directory.evict(self.tenant, keys, holder=where, force=True)

    def _cleared(self, ev: AllBlocksCleared) -> None:
        self.counts["cleared"] += 1
        if ev.medium is None:
            targets = set(self._holders)
            self._map.clear()
        else:
            tier = self.holder_for(ev.medium, 0).split("/")[1]
            targets = {h for h in self._holders if h.split("/")[1] == tier}
            for eh in list(self._map):
                rec = self._map[eh]
                rec[2] = {tg for tg in rec[2] if not tg.startswith(tier + "/")}
                if not rec[2]:
                    del self._map[eh]
        for h in targets:
            self.directory.clear_holder(self.tenant, h)

    def _extras(self, ev: BlockStored, n: int) -> list[Any] | None:
        """Per-block extra keys: what vLLM folded into each block's hash (SGLang: its salt on a chain's first block)."""
        if ev.extra_keys is not None:
            ex: list[Any] = list(ev.extra_keys[:n])
        elif ev.lora_name:
            ex = [(ev.lora_name,)] * n
        else:
            ex = [None] * n
        if ev.cache_salt and ev.parent_block_hash is None and n:
            ex[0] = (ex[0] or ()) + (ev.cache_salt,)
        return ex if any(e is not None for e in ex) else None

    def _stored(self, ev: BlockStored) -> None:
        B = self.hasher.block_size_tokens
        where = self.holder_for(ev.medium, ev.group_idx)
        tg = where.split("/", 1)[1]
        tier = tg.split("/")[0]
        digest = self.hasher.namespace.digest
        if not ev.token_ids:  # a tier-only event: blocks already known by hash, now also held on this medium
            entries = []
            for h in ev.block_hashes:
                rec = self._map.get(h)
                if rec is None:
                    self._refuse("unknown_tier_only")
                    self.counts["orphans"] += 1
                    continue
                rec[2].add(tg)
                entries.append(Entry(rec[0], where, self.block_bytes, tier, digest))
            self._publish(where, entries)
            return
        if ev.block_size != B:
            self.counts["incompatible"] += len(ev.block_hashes)
            self._refuse("incompatible_block_size", len(ev.block_hashes))
            log.warning("kvpolicy events: block_size %d from the engine, %d in the namespace: refused", ev.block_size, B)
            return
        n = len(ev.token_ids) // B  # only full blocks count: a trailing partial block has no key
        if n < len(ev.block_hashes):
            self._refuse("partial_block", len(ev.block_hashes) - n)
        hashes = ev.block_hashes[:n]
        if not hashes:
            return
        parent_key = parent_full = None
        if ev.parent_block_hash is not None:
            prec = self._map.get(ev.parent_block_hash)
            if prec is None:  # we never saw the parent: its chain (and so this key) cannot be known
                self.counts["orphans"] += n
                self._refuse("orphan", n)
                return
            parent_key, parent_full = prec[0], prec[1]
        tokens = list(ev.token_ids[: n * B])
        full: list[bytes] | list[None] = [None] * n
        if self.verify_algo is not None:
            checked = self._verify(ev, hashes, tokens, parent_full)
            if checked is False:
                self.counts["mismatched"] += n
                self._refuse("mismatched_hash", n)
                log.warning("kvpolicy events: engine hashes disagree with the %s projection: refused", self.verify_algo)
                return
            if checked is None:
                self._refuse("unverifiable", n)
            else:
                full = checked
                self.counts["verified_blocks"] += n
        extras = self._extras(ev, n)
        if not any(h in self._map for h in hashes):
            keys = list(self.hasher.hash_blocks(tokens, parent=parent_key, extra_keys=extras))
        else:  # a block the engine already reported (another tier, another group): its hash is its identity, keep its key
            keys = []
            prev = parent_key
            for j, h in enumerate(hashes):
                rec = self._map.get(h)
                if rec is not None:
                    k = rec[0]
                else:
                    k = self.hasher.hash_blocks(tokens[j * B:(j + 1) * B], parent=prev, extra_keys=None if extras is None else [extras[j]])[0]
                keys.append(k)
                prev = k
        entries = []
        for h, k, fh in zip(hashes, keys, full):
            rec = self._map.get(h)
            if rec is None:
                rec = self._map[h] = [k, fh, set()]
            rec[2].add(tg)
            self._map.move_to_end(h)
            entries.append(Entry(k, where, self.block_bytes, tier, digest))
        self.counts["stored_blocks"] += len(entries)
        self._publish(where, entries)
        self._forget_oldest()

    def _forget_oldest(self) -> None:
        """Past ``max_mapped_blocks``, drop the oldest mappings — and their directory entries: a block this ingestor
        can no longer map could not be removed when the engine drops it, and the directory would offer it forever."""
        by_holder: dict[str, list[Any]] = {}
        while len(self._map) > self.max_mapped_blocks:
            _, rec = self._map.popitem(last=False)
            for tg in rec[2]:
                by_holder.setdefault(f"{self.holder}/{tg}", []).append(rec[0])
            self.counts["forgotten_blocks"] += 1
        for where, keys in by_holder.items():
            self.directory.evict(self.tenant, keys, holder=where, force=True)

    def _publish(self, where: str, entries: list[Entry]) -> None:
        if entries:
            self._holders.add(where)
            self.directory.publish(self.tenant, entries)

    def _verify(self, ev: BlockStored, hashes: tuple[Hashable, ...], tokens: list[int], parent_full: bytes | None) -> list[bytes] | Literal[False] | None:
        """The projection's full hashes if they agree with the engine's (bytes, or their low 64 bits for
        ints), False if they disagree, None if this event cannot be checked (a LoRA adapter, whose path
        vLLM hashes but does not publish; multimodal extras; an int-hash parent whose full hash we lack)."""
        from ..keys import vllm_block_hashes

        if ev.lora_name or ev.lora_id is not None or ev.lookahead_token_ids:
            return None
        salt = None
        if ev.extra_keys is not None:
            extras = [e for e in ev.extra_keys if e]
            if any(len(e) != 1 or not isinstance(e[0], str) for e in extras) or any(ev.extra_keys[1:]) or \
                    (ev.extra_keys[0] and ev.parent_block_hash is not None):
                return None
            salt = ev.extra_keys[0][0] if ev.extra_keys and ev.extra_keys[0] else None
        parent: bytes | None
        if ev.parent_block_hash is None:
            parent = None
        elif isinstance(ev.parent_block_hash, bytes):
            parent = ev.parent_block_hash
        elif parent_full is not None:
            parent = parent_full
        else:
            return None
        try:
            expect = vllm_block_hashes(tokens, self.hasher.block_size_tokens, self.verify_algo, cache_salt=salt, parent=parent)  # type: ignore[arg-type]
        except ConfigError:
            return None
        got = [e if isinstance(h, bytes) else int.from_bytes(e, "big") & _M64 for h, e in zip(hashes, expect)]
        return list(expect) if got == list(hashes) else False


def _connect(sock: Any, endpoint: str, field: str) -> None:
    """Connect, or close the socket and name the endpoint ZMQ refused (a port that is not a number, an unknown transport)."""
    import zmq

    try:
        sock.connect(endpoint)
    except (zmq.ZMQError, TypeError) as e:
        sock.close(linger=0)
        raise ConfigError(field, f"ZMQ cannot connect to {endpoint!r}: {e}") from None


#: the largest message a subscriber accepts (ZMQ ``MAXMSGSIZE``; a peer that sends more is disconnected): vLLM's event
#: batches are a step's events — kilobytes, a few megabytes with token ids of long prompts — so 64 MiB bounds the
#: memory one message from anything that can reach the port can take, far above what an engine sends
MAX_MESSAGE_BYTES = 64 << 20


def _bounded(sock: Any, zmq: Any, max_message_bytes: int, field: str) -> None:
    if isinstance(max_message_bytes, bool) or not isinstance(max_message_bytes, int) or max_message_bytes <= 0:
        sock.close(linger=0)
        raise ConfigError(field, f"must be a positive int (bytes), got {max_message_bytes!r}")
    sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)


class ZmqEventSubscriber:
    """A SUB socket on an engine's event endpoint feeding a :class:`KVEventIngestor`.

    ``run(stop)`` loops until ``stop`` (a ``threading.Event``) is set. Frames that
    are not ``[topic, 8-byte seq, payload]`` are counted as malformed; a jump in
    ``seq`` is counted in ``missed_batches`` and, with a ``replay_endpoint``, the
    gap is fetched from the engine's replay socket; a ``seq`` that goes back means
    the engine restarted: its entries are cleared (``restarts``) and ingestion
    starts over. vLLM with data parallelism publishes rank r on ``port + r``:
    :meth:`for_ranks` makes one subscriber per rank.
    """

    def __init__(self, ingestor: KVEventIngestor, endpoint: str, topic: str = "", *, poll_ms: int = 50,
                 replay_endpoint: str | None = None, max_message_bytes: int = MAX_MESSAGE_BYTES) -> None:
        try:
            import zmq
        except ImportError:
            raise ConfigError("pyzmq", "KV event ingestion needs pyzmq: pip install 'kvpolicy[events]'") from None
        self.ingestor = ingestor
        self._zmq = zmq
        self.ctx: Any = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        _bounded(self.sock, zmq, max_message_bytes, "max_message_bytes")
        self.sock.setsockopt_string(zmq.SUBSCRIBE, topic)
        _connect(self.sock, endpoint, "endpoint")
        self.poll_ms = poll_ms
        self.last_seq: int | None = None
        try:
            self.replay = ReplayClient(replay_endpoint, max_message_bytes=max_message_bytes) if replay_endpoint else None
        except ConfigError:
            self.sock.close(linger=0)
            raise

    @classmethod
    def for_ranks(cls, make_ingestor: Any, host: str, base_port: int, ranks: int, **kw: Any) -> list[ZmqEventSubscriber]:
        """One subscriber per data-parallel rank (rank r publishes on ``base_port + r``); ``make_ingestor(rank)``
        gives each its own ingestor (its own holder: each rank is its own engine)."""
        if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks <= 0:
            raise ConfigError("ranks", f"must be a positive int, got {ranks!r}")
        return [cls(make_ingestor(r), f"tcp://{host}:{base_port + r}", **kw) for r in range(ranks)]

    def handle(self, parts: list[bytes]) -> None:
        """One multipart message from the PUB socket."""
        c = self.ingestor.counts
        if len(parts) != 3 or len(parts[1]) != 8:
            c["malformed_frames"] += 1
            self.ingestor._refuse("malformed_frame")
            log.warning("kvpolicy events: dropped a frame of %d parts", len(parts))
            return
        seq = int.from_bytes(parts[1], "big")
        if self.last_seq is not None and seq == self.last_seq:
            c["duplicates"] = c.get("duplicates", 0) + 1
            return  # the same batch again
        if self.last_seq is not None and seq < self.last_seq:  # the engine restarted: what we knew of it is void
            c["restarts"] += 1
            log.warning("kvpolicy events: sequence went back (%d after %d): the engine restarted; clearing its entries", seq, self.last_seq)
            self.ingestor.apply(AllBlocksCleared())
        elif self.last_seq is not None and seq > self.last_seq + 1:
            missing = seq - self.last_seq - 1
            if self.replay is not None:
                got = self.replay.fetch(self.last_seq + 1, until=seq - 1)
                for s, payload in got:
                    self.ingestor.ingest(payload)
                missing -= len(got)
            c["missed_batches"] += max(missing, 0)
        self.last_seq = seq
        self.ingestor.ingest(parts[2])

    def poll_once(self) -> bool:
        """Handle at most one message; False if none arrived within ``poll_ms``."""
        if not self.sock.poll(self.poll_ms):
            return False
        self.handle(self.sock.recv_multipart())
        return True

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            self.poll_once()

    def close(self) -> None:
        self.sock.close(linger=0)
        if self.replay is not None:
            self.replay.close()


class ReplayClient:
    """The engine's replay socket (a ROUTER): send the 8-byte start sequence, receive
    ``[b"", topic, seq, payload]`` messages until ``seq`` = -1.

    A fetch ends at the end marker, when no message came for ``timeout_ms``, or after ``max_fetch_s`` in all — a
    replay socket that never sends its end marker cannot hold ingestion up — and keeps only ``start_seq`` ≤ seq ≤
    ``until``: what a fetch that ended early left queued is not taken for the next one's batches."""

    def __init__(self, endpoint: str, *, timeout_ms: int = 1000, max_fetch_s: float = 10.0,
                 max_message_bytes: int = MAX_MESSAGE_BYTES) -> None:
        import zmq

        if isinstance(max_fetch_s, bool) or not isinstance(max_fetch_s, (int, float)) or not 0 < max_fetch_s < float("inf"):
            raise ConfigError("max_fetch_s", f"must be a finite positive number of seconds, got {max_fetch_s!r}")
        self._zmq = zmq
        self.sock: Any = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        _bounded(self.sock, zmq, max_message_bytes, "max_message_bytes")
        _connect(self.sock, endpoint, "replay_endpoint")
        self.timeout_ms = timeout_ms
        self.max_fetch_s = float(max_fetch_s)

    def fetch(self, start_seq: int, until: int | None = None) -> list[tuple[int, bytes]]:
        """Batches from ``start_seq`` on (up to ``until``), as ``(seq, payload)``; stops at the end marker, a
        timeout, or ``max_fetch_s``."""
        self.sock.send_multipart([b"", start_seq.to_bytes(8, "big")])
        out: list[tuple[int, bytes]] = []
        deadline = time.monotonic() + self.max_fetch_s
        while time.monotonic() < deadline and self.sock.poll(self.timeout_ms):
            parts = self.sock.recv_multipart()
            if len(parts) != 4 or len(parts[2]) != 8:
                continue
            seq = int.from_bytes(parts[2], "big", signed=True)
            if seq == -1:
                break
            if start_seq <= seq and (until is None or seq <= until):
                out.append((seq, parts[3]))
        return out

    def close(self) -> None:
        self.sock.close(linger=0)
