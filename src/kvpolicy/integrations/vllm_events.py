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
    if tokens and len(tokens) > len(hashes) * bs and len(tokens) % bs:
        # more tokens than blocks is vLLM's sliding-window group skipping (null) blocks: whole skipped blocks only
        raise EventFormatError(where, f"{len(tokens)} token ids for {len(hashes)} blocks of {bs}: more than the blocks hold, "
                                      "and not whole skipped blocks")
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


#: events one batch may carry: an engine step stores and removes at most its batch's blocks (tens of thousands at the
#: very most). A 3 MB message of 3 million nil events stalled ingestion for 8.6 s (issue #47): CPU is bounded, not only bytes
MAX_EVENTS_PER_BATCH = 1 << 16


#: malformed events logged one by one per batch; the rest of a batch's are summed in one line
MAX_LOGGED_PER_BATCH = 8


def decode_batch(payload: bytes) -> tuple[float, list[Any], int | None]:
    """``(ts, events, data_parallel_rank)`` of one msgpack KVEventBatch (at most MAX_EVENTS_PER_BATCH events)."""
    msgpack = _msgpack()
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises several unrelated types
        raise EventFormatError("payload", f"not msgpack: {e}") from None
    if not isinstance(raw, (list, tuple)) or len(raw) < 2 or isinstance(raw[0], bool) or not isinstance(raw[0], (int, float)) \
            or not isinstance(raw[1], (list, tuple)):
        raise EventFormatError("payload", "a KVEventBatch is [ts, [events...], data_parallel_rank?]")
    if len(raw[1]) > MAX_EVENTS_PER_BATCH:
        raise EventFormatError("payload", f"{len(raw[1]):,} events in one batch; an engine step makes at most {MAX_EVENTS_PER_BATCH:,}")
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
                   first_block_index: int = 0, mm_items: Any = (), block_size_tokens: int | None = None) -> list[tuple[Any, ...] | None]:
    """Per-block extra keys as vLLM publishes them in its events (untagged, in its order: the adapter name, then each
    multimodal item the block overlaps as ``(identifier, offset of the item from the block's first token)``, then the
    cache salt on absolute block 0) — what a request passes to ``BlockHasher.hash_blocks(extra_keys=...)`` so its keys
    match what :class:`KVEventIngestor` stored.

    ``mm_items``: the request's multimodal items as ``(identifier, offset, length)`` in prompt tokens — vLLM's
    ``mm_features[i].identifier`` and ``.mm_position`` — with ``block_size_tokens`` to place them."""
    if isinstance(n_blocks, bool) or not isinstance(n_blocks, int) or n_blocks < 0:
        raise ConfigError("n_blocks", f"must be a non-negative int, got {n_blocks!r}")
    items = []
    for i, it in enumerate(mm_items):
        if not isinstance(it, (tuple, list)) or len(it) != 3 or any(isinstance(x, bool) or not isinstance(x, int) for x in it[1:]) \
                or it[1] < 0 or it[2] <= 0 or not isinstance(it[0], (str, bytes)):
            raise ConfigError(f"mm_items[{i}]", f"must be (identifier, offset >= 0, length > 0), got {it!r:.80}")
        items.append((it[0], int(it[1]), int(it[2])))
    items.sort(key=lambda x: x[1])
    if items and (isinstance(block_size_tokens, bool) or not isinstance(block_size_tokens, int) or block_size_tokens <= 0):
        raise ConfigError("block_size_tokens", f"a positive int is needed to place mm_items in blocks, got {block_size_tokens!r}")
    out: list[tuple[Any, ...] | None] = []
    for j in range(n_blocks):
        parts: list[Any] = []
        if lora_name:
            parts.append(lora_name)
        if items:
            assert block_size_tokens is not None
            start = (first_block_index + j) * block_size_tokens
            end = start + block_size_tokens
            parts.extend((ident, off - start) for ident, off, length in items if end > off and start < off + length)
        if cache_salt and first_block_index + j == 0:
            parts.append(cache_salt)
        out.append(tuple(parts) if parts else None)
    return out


class KVEventIngestor:
    """Apply one engine's (``holder``'s) KV events to a directory, for one tenant.

    **Pages and blocks.** An engine's page (its ``block_size``) need not be kvpolicy's block: SGLang's default page is
    one token. The ingestor walks each event's pages along the chain, carrying the tokens since the last kvpolicy block
    boundary, and a kvpolicy block is stored when the page holding its last token is — its key is the one a request
    computes with ``BlockHasher.hash_blocks(prompt, extra_keys=...)``. Removing that page removes the block (the engines
    evict a chain from its tail, so a block's last page goes no later than the pages before it). Per-block extra keys
    other than an adapter name and a salt (multimodal items) need pages of exactly one kvpolicy block.

    **Tiers.** An entry is held per (key, medium, group): ``"{holder}/{tier}/g{group}"``. ``AllBlocksCleared`` clears
    the tier it names; without a ``medium`` it clears the GPU tier — both engines emit it from their GPU pool's reset
    (vLLM's ``BlockPool.reset_prefix_cache``, SGLang's ``RadixCache.reset``) and neither class has a ``medium`` field.
    :meth:`forget_all` drops every tier: what an engine restart calls for.
    """

    REASONS = ("malformed_frame", "malformed_event", "orphan", "incompatible_block_size", "mismatched_hash", "unverifiable",
               "unknown_removed", "partial_block", "unknown_tier_only", "directory_error")

    def __init__(self, directory: Any, tenant: str, hasher: BlockHasher, *, holder: str, bytes_per_token: int,
                 verify_algo: str | None = None, max_mapped_blocks: int = 4_000_000, none_hash_seed: str | None = None) -> None:
        if not isinstance(hasher, BlockHasher):
            raise ConfigError("hasher", "must be a kvpolicy BlockHasher for this deployment's namespace")
        if isinstance(bytes_per_token, bool) or not isinstance(bytes_per_token, int) or bytes_per_token <= 0:
            raise ConfigError("bytes_per_token", f"must be a positive int, got {bytes_per_token!r}")
        if not isinstance(holder, str) or not holder or "/" in holder:
            raise ConfigError("holder", f"must be a non-empty name without '/', got {holder!r}")
        if none_hash_seed is not None and (not isinstance(none_hash_seed, str) or verify_algo is None):
            raise ConfigError("none_hash_seed", "is the engine's PYTHONHASHSEED (a string), and only means something with verify_algo")
        self.directory = directory
        self.tenant = check_tenant(tenant)
        self.hasher = hasher
        self.holder = holder
        self.block_bytes = bytes_per_token * hasher.block_size_tokens
        self.verify_algo = verify_algo
        #: the engine's ``PYTHONHASHSEED``: vLLM derives the root of every hash chain from it when it is set
        self.none_hash_seed = none_hash_seed
        self.max_mapped_blocks = max_mapped_blocks
        # engine page hash -> [kvpolicy keys the page completes (tuple), chain state after the page: (key of the last
        # complete block, tokens since it), projected full hash (bytes) or None, {(tier, group)}]
        self._map: OrderedDict[Hashable, list[Any]] = OrderedDict()
        self._holders: set[str] = set()
        self.counts = {"batches": 0, "events": 0, "stored_blocks": 0, "removed_blocks": 0, "cleared": 0, "malformed_frames": 0,
                       "malformed_events": 0, "orphans": 0, "incompatible": 0, "mismatched": 0, "unknown_removed": 0, "missed_batches": 0,
                       "restarts": 0, "verified_blocks": 0, "forgotten_blocks": 0, "skipped_blocks": 0, "resyncs": 0}
        #: every block or frame refused, by reason (see REASONS)
        self.refused = {r: 0 for r in self.REASONS}

    def holder_for(self, medium: str | None, group_idx: int | None) -> str:
        """The directory holder of this engine's copies on ``medium`` in KV-cache group ``group_idx``."""
        tier = MEDIA.get((medium or "GPU").upper(), (medium or "gpu").lower())
        return f"{self.holder}/{tier}/g{group_idx or 0}"

    def key_of(self, engine_hash: Hashable) -> bytes | None:
        """The kvpolicy key of the block the engine's page completes (None if unknown, or if it completes none)."""
        rec = self._map.get(engine_hash)
        return None if rec is None or not rec[0] else rec[0][-1]

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
        malformed = 0
        for i, raw in enumerate(events):
            try:
                ev = decode_event(raw, i)
            except EventFormatError as e:
                self.counts["malformed_events"] += 1
                self._refuse("malformed_event")
                malformed += 1
                if malformed <= MAX_LOGGED_PER_BATCH:
                    log.warning("kvpolicy events: dropped a malformed event: %s", e)
                continue
            try:
                self.apply(ev)
            except KVPolicyError as e:  # what decode_event cannot see (a value the directory or the hasher refuses)
                self.counts["malformed_events"] += 1
                self._refuse("malformed_event")
                log.warning("kvpolicy events: dropped an event the directory refused: %s", e)
                continue
            except Exception as e:  # noqa: BLE001 - a directory that raised (kvpolicy's own count their failures instead)
                self._refuse("directory_error")
                log.error("kvpolicy events: the directory failed on an event (%s: %s); it is counted and ingestion goes on",
                          type(e).__name__, e)
                continue
            applied += 1
        if malformed > MAX_LOGGED_PER_BATCH:
            log.warning("kvpolicy events: ... and %d more malformed events in the same batch (counted, not logged)", malformed - MAX_LOGGED_PER_BATCH)
        return applied

    def apply(self, ev: BlockStored | BlockRemoved | AllBlocksCleared) -> None:
        self.counts["events"] += 1
        if isinstance(ev, BlockStored):
            self._stored(ev)
        elif isinstance(ev, BlockRemoved):
            self._removed(ev)
        else:
            self._cleared(ev)

    def forget_all(self) -> None:
        """Drop everything this engine was known to hold, on every tier (an engine restart: none of it exists now)."""
        self._map.clear()
        for h in sorted(self._holders):
            self.directory.clear_holder(self.tenant, h)

    def _removed(self, ev: BlockRemoved) -> None:
        where = self.holder_for(ev.medium, ev.group_idx)
        tg = where.split("/", 1)[1]
        keys = []
        for h in ev.block_hashes:
            rec = self._map.get(h)
            if rec is None or tg not in rec[3]:
                self.counts["unknown_removed"] += 1
                self._refuse("unknown_removed")
                continue
            rec[3].discard(tg)
            keys.extend(rec[0])
            if not rec[3]:  # no copy left anywhere: forget the mapping
                del self._map[h]
        if keys:
            self.counts["removed_blocks"] += self.directory.evict(self.tenant, keys, holder=where, force=True)

    def _cleared(self, ev: AllBlocksCleared) -> None:
        self.counts["cleared"] += 1
        tier = self.holder_for(ev.medium, 0).split("/")[1]
        targets = {h for h in self._holders if h.split("/")[1] == tier}
        for eh in list(self._map):
            rec = self._map[eh]
            rec[3] = {tg for tg in rec[3] if not tg.startswith(tier + "/")}
            if not rec[3]:
                del self._map[eh]
        for h in sorted(targets):
            self.directory.clear_holder(self.tenant, h)

    def _page_extras(self, ev: BlockStored, skip: int, n_pages: int) -> list[Any] | None:
        """Per-page extra keys: what vLLM folded into each block's hash (skipped blocks: the adapter name, all the
        event tells); SGLang: its adapter name on every page. None when no page has any."""
        base = (ev.lora_name,) if ev.lora_name else None
        if ev.extra_keys is not None:
            ex: list[Any] = [base] * skip + list(ev.extra_keys[: n_pages - skip])
        else:
            ex = [base] * n_pages
        return ex if any(e is not None for e in ex) else None

    def _stored(self, ev: BlockStored) -> None:
        B = self.hasher.block_size_tokens
        where = self.holder_for(ev.medium, ev.group_idx)
        tg = where.split("/", 1)[1]
        tier = tg.split("/")[0]
        digest = self.hasher.namespace.digest
        entries: list[Entry] = []
        if not ev.token_ids:  # a tier-only event: blocks already known by hash, now also held on this medium
            for h in ev.block_hashes:
                rec = self._map.get(h)
                if rec is None:
                    self._refuse("unknown_tier_only")
                    self.counts["orphans"] += 1
                    continue
                rec[3].add(tg)
                entries.extend(Entry(k, where, self.block_bytes, tier, digest) for k in rec[0])
            self._publish(where, entries)
            return
        P, m, T = ev.block_size, len(ev.block_hashes), len(ev.token_ids)
        if P != B and ev.extra_keys is not None and any(ev.extra_keys):
            # per-page multimodal keys cannot be regrouped into kvpolicy blocks of another size
            self.counts["incompatible"] += m
            self._refuse("incompatible_block_size", m)
            log.warning("kvpolicy events: pages of %d tokens with per-page extra keys, blocks of %d in the namespace: refused", P, B)
            return
        skip = T // P - m if T > m * P else 0  # vLLM's sliding window: skipped (null) blocks precede the stored ones
        n = min(m, T // P - skip)  # pages with all their tokens
        if n < m:
            self._refuse("partial_block", m - n)
        if n <= 0:
            return
        self.counts["skipped_blocks"] += skip
        hashes = ev.block_hashes[:n]
        if ev.parent_block_hash is not None:
            prec = self._map.get(ev.parent_block_hash)
            if prec is None:  # we never saw the parent: its chain (and so this key) cannot be known
                self.counts["orphans"] += n
                self._refuse("orphan", n)
                return
            state, parent_full = prec[1], prec[2]
        else:
            state, parent_full = (None, ()), None
        tokens = ev.token_ids[: (skip + n) * P]
        full: list[bytes | None] = [None] * n
        if self.verify_algo is not None:
            checked = self._verify(ev, hashes, list(tokens), parent_full, skip) if P == B else None
            if checked is False:
                self.counts["mismatched"] += n
                self._refuse("mismatched_hash", n)
                log.warning("kvpolicy events: %s", self.mismatch_hint(ev))
                return
            if checked is None:
                self._refuse("unverifiable", n)
            else:
                full = list(checked)
                self.counts["verified_blocks"] += n
        page_extras = self._page_extras(ev, skip, skip + n)
        entries = []
        j = 0
        while j < skip + n:
            h = hashes[j - skip] if j >= skip else None
            rec = self._map.get(h) if h is not None else None
            if rec is not None:  # a page the engine already reported (another tier, another group): keep its identity
                rec[3].add(tg)
                self._map.move_to_end(h)
                entries.extend(Entry(k, where, self.block_bytes, tier, digest) for k in rec[0])
                state = rec[1]
                j += 1
                continue
            run_end = j + 1  # a run of pages not seen before: their blocks in one call
            while run_end < skip + n and (run_end < skip or hashes[run_end - skip] not in self._map):
                run_end += 1
            state = self._walk(ev, tokens, j, run_end, state, page_extras, skip, hashes, full, tg, where, tier, digest, entries)
            j = run_end
        self.counts["stored_blocks"] += len(entries)
        self._publish(where, entries)
        self._forget_oldest()

    def _walk(self, ev: BlockStored, tokens: tuple[int, ...], j0: int, j1: int, state: tuple[bytes | None, tuple[int, ...]],
              page_extras: list[Any] | None, skip: int, hashes: tuple[Hashable, ...], full: list[bytes | None], tg: str, where: str,
              tier: str, digest: bytes, entries: list[Entry]) -> tuple[bytes | None, tuple[int, ...]]:
        """Pages ``j0``..``j1`` (not seen before) along the chain from ``state``: the kvpolicy blocks they complete, one
        record per page that has an engine hash. Returns the chain state after the last page."""
        B, P = self.hasher.block_size_tokens, ev.block_size
        parent_key, tail = state
        stream = tail + tuple(tokens[j0 * P: j1 * P])
        nb = len(stream) // B
        if nb:
            ex: list[Any] | None = None
            if page_extras is not None or (ev.cache_salt and parent_key is None):
                ex = []
                for b in range(nb):
                    if P == B and not tail:
                        e = page_extras[j0 + b] if page_extras is not None else None
                    else:  # blocks made of other pages: the adapter name, all the pages share
                        e = (ev.lora_name,) if ev.lora_name else None
                    if ev.cache_salt and parent_key is None and b == 0:  # SGLang's salt: on a chain's first block
                        e = (e or ()) + (ev.cache_salt,)
                    ex.append(e)
                if not any(e is not None for e in ex):
                    ex = None
            keys = list(self.hasher.hash_blocks(stream[: nb * B], parent=parent_key, extra_keys=ex))
        else:
            keys = []
        off = len(tail)
        for j in range(j0, j1):
            end = off + (j - j0 + 1) * P  # this page's end in the stream
            start = end - P
            done = tuple(keys[b] for b in range(start // B, end // B) if (b + 1) * B > start)
            last = end // B
            state = (keys[last - 1] if last else parent_key, stream[last * B: end])
            if j < skip:
                continue  # a skipped block: no engine hash, nothing held
            h = hashes[j - skip]
            rec = self._map[h] = [done, state, full[j - skip], {tg}]
            entries.extend(Entry(k, where, self.block_bytes, tier, digest) for k in rec[0])
        return state

    def _forget_oldest(self) -> None:
        """Past ``max_mapped_blocks``, drop the oldest mappings — and their directory entries: a block this ingestor
        can no longer map could not be removed when the engine drops it, and the directory would offer it forever."""
        by_holder: dict[str, list[Any]] = {}
        while len(self._map) > self.max_mapped_blocks:
            _, rec = self._map.popitem(last=False)
            for tg in rec[3]:
                by_holder.setdefault(f"{self.holder}/{tg}", []).extend(rec[0])
            self.counts["forgotten_blocks"] += 1
        for where, keys in by_holder.items():
            if keys:
                self.directory.evict(self.tenant, keys, holder=where, force=True)

    def _publish(self, where: str, entries: list[Entry]) -> None:
        if entries:
            self._holders.add(where)
            self.directory.publish(self.tenant, entries)

    def mismatch_hint(self, ev: BlockStored) -> str:
        """What a refusal for disagreeing hashes says: where the chain starts at the engine's root and no seed was given,
        the likely cause — an engine started with PYTHONHASHSEED roots every chain in it — and what to pass."""
        said = f"engine hashes disagree with the {self.verify_algo} projection: refused"
        if ev.parent_block_hash is None and self.none_hash_seed is None:
            said += (" (a chain from the root: if the engine runs with PYTHONHASHSEED set, vLLM roots every hash chain in it — "
                     "pass the same value as --verify-hash-seed SEED, or none_hash_seed=SEED)")
        elif ev.parent_block_hash is None:
            said += f" (a chain from the root under --verify-hash-seed {self.none_hash_seed!r}: is it the engine's PYTHONHASHSEED?)"
        return said

    def _verify(self, ev: BlockStored, hashes: tuple[Hashable, ...], tokens: list[int], parent_full: bytes | None,
                skip: int = 0) -> list[bytes] | Literal[False] | None:
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
                    (ev.extra_keys[0] and (ev.parent_block_hash is not None or skip)):
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
            expect = vllm_block_hashes(tokens, self.hasher.block_size_tokens, self.verify_algo, cache_salt=salt, parent=parent,  # type: ignore[arg-type]
                                       none_hash_seed=self.none_hash_seed)[skip:]
        except ConfigError:
            return None
        got = [e if isinstance(h, bytes) else int.from_bytes(e, "big") & _M64 for h, e in zip(hashes, expect)]
        return list(expect) if got == list(hashes) else False
