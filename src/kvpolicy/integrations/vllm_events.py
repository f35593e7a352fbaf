"""vLLM KV events → the directory.

vLLM publishes KV cache events as ZMQ multipart messages ``[topic, seq, payload]``
(``seq`` an 8-byte big-endian counter, ``payload`` a msgpack ``KVEventBatch``).
A batch is the array ``[ts, [event, ...], data_parallel_rank?]``; each event is a
tagged array (msgspec ``array_like``, ``tag=True``)::

    ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id?, medium?, ...]
    ["BlockRemoved", block_hashes, medium?, ...]
    ["AllBlocksCleared"]

Block hashes are the engine's (``bytes`` — a sha256 chain — or the 64-bit ``int``
vLLM emits when it converts them). The :class:`KVEventIngestor` maps each engine
hash to a **kvpolicy key** the way llm-d's indexer does: a stored block's key is
built from its tokens, chained from the kvpolicy key of its parent (found
through the parent's engine hash), under this deployment's namespace — so a
request's own key chain (``BlockHasher.hash_blocks(prompt)``) matches what the
engine stored, and nothing from another namespace ever does. Optionally the
ingestor re-derives the engine hashes with :func:`kvpolicy.keys.vllm_block_hashes`
and refuses blocks whose hashes disagree (a different model, salt or hash
function upstream).

Malformed frames and events are counted and logged, never raised: a consumer
must outlive a bad publisher.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Hashable
from typing import Any

import attrs

from ..directory.base import Entry, check_tenant
from ..errors import ConfigError
from ..keys import BlockHasher

log = logging.getLogger("kvpolicy.events")


@attrs.frozen
class BlockStored:
    block_hashes: tuple[Hashable, ...]
    parent_block_hash: Hashable | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None


@attrs.frozen
class BlockRemoved:
    block_hashes: tuple[Hashable, ...]
    medium: str | None = None


@attrs.frozen
class AllBlocksCleared:
    pass


class EventFormatError(ConfigError):
    """A batch or event does not have vLLM's shape; ``field`` says where."""


def _hash(h: Any, where: str) -> Hashable:
    if isinstance(h, bool) or not isinstance(h, (bytes, int)):
        raise EventFormatError(where, f"a block hash must be bytes or int, got {type(h).__name__}")
    return h


def decode_event(raw: Any, i: int = 0) -> BlockStored | BlockRemoved | AllBlocksCleared:
    where = f"events[{i}]"
    if not isinstance(raw, (list, tuple)) or not raw or not isinstance(raw[0], str):
        raise EventFormatError(where, "must be a tagged array [tag, fields...]")
    tag, fields = raw[0], list(raw[1:])
    if tag == "BlockStored":
        if len(fields) < 4:
            raise EventFormatError(where, f"BlockStored needs block_hashes, parent_block_hash, token_ids, block_size; got {len(fields)} fields")
        hashes, parent, tokens, bs = fields[:4]
        if not isinstance(hashes, (list, tuple)) or not isinstance(tokens, (list, tuple)):
            raise EventFormatError(where, "block_hashes and token_ids must be arrays")
        if isinstance(bs, bool) or not isinstance(bs, int) or bs <= 0:
            raise EventFormatError(where + ".block_size", f"must be a positive int, got {bs!r}")
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in tokens):
            raise EventFormatError(where + ".token_ids", "must be non-negative ints")
        if len(tokens) != len(hashes) * bs:
            raise EventFormatError(where, f"{len(tokens)} token ids for {len(hashes)} blocks of {bs}")
        lora = fields[4] if len(fields) > 4 else None
        medium = fields[5] if len(fields) > 5 else None
        return BlockStored(tuple(_hash(h, where + ".block_hashes") for h in hashes), None if parent is None else _hash(parent, where + ".parent"),
                           tuple(tokens), bs, lora if isinstance(lora, int) else None, medium if isinstance(medium, str) else None)
    if tag == "BlockRemoved":
        if not fields or not isinstance(fields[0], (list, tuple)):
            raise EventFormatError(where, "BlockRemoved needs block_hashes")
        medium = fields[1] if len(fields) > 1 else None
        return BlockRemoved(tuple(_hash(h, where + ".block_hashes") for h in fields[0]), medium if isinstance(medium, str) else None)
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    raise EventFormatError(where, f"unknown event tag {tag!r}")


def decode_batch(payload: bytes) -> tuple[float, list[Any], int | None]:
    """``(ts, events, data_parallel_rank)`` of one msgpack KVEventBatch."""
    try:
        import msgpack
    except ImportError:
        raise ConfigError("msgpack", "KV event ingestion needs msgpack: pip install 'kvpolicy[events]'") from None
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises several unrelated types
        raise EventFormatError("payload", f"not msgpack: {e}") from None
    if not isinstance(raw, (list, tuple)) or len(raw) < 2 or not isinstance(raw[0], (int, float)) or not isinstance(raw[1], (list, tuple)):
        raise EventFormatError("payload", "a KVEventBatch is [ts, [events...], data_parallel_rank?]")
    rank = raw[2] if len(raw) > 2 and isinstance(raw[2], int) else None
    return float(raw[0]), list(raw[1]), rank


def encode_batch(ts: float, events: list[Any], data_parallel_rank: int | None = None) -> bytes:
    """The inverse of :func:`decode_batch` (vLLM's wire shape), for tests and tools."""
    import msgpack

    def enc(e: Any) -> list[Any]:
        if isinstance(e, BlockStored):
            return ["BlockStored", list(e.block_hashes), e.parent_block_hash, list(e.token_ids), e.block_size, e.lora_id, e.medium]
        if isinstance(e, BlockRemoved):
            return ["BlockRemoved", list(e.block_hashes), e.medium]
        if isinstance(e, AllBlocksCleared):
            return ["AllBlocksCleared"]
        return e  # already raw

    body: list[Any] = [ts, [enc(e) for e in events]]
    if data_parallel_rank is not None:
        body.append(data_parallel_rank)
    return msgpack.packb(body, use_bin_type=True)


class KVEventIngestor:
    """Apply vLLM KV events of one engine (``holder``) to a directory, for one tenant."""

    def __init__(self, directory: Any, tenant: str, hasher: BlockHasher, *, holder: str, bytes_per_token: int,
                 verify_algo: str | None = None, max_mapped_blocks: int = 4_000_000) -> None:
        if not isinstance(hasher, BlockHasher):
            raise ConfigError("hasher", "must be a kvpolicy BlockHasher for this deployment's namespace")
        if isinstance(bytes_per_token, bool) or not isinstance(bytes_per_token, int) or bytes_per_token <= 0:
            raise ConfigError("bytes_per_token", f"must be a positive int, got {bytes_per_token!r}")
        self.directory = directory
        self.tenant = check_tenant(tenant)
        self.hasher = hasher
        self.holder = holder
        self.block_bytes = bytes_per_token * hasher.block_size_tokens
        self.verify_algo = verify_algo
        self.max_mapped_blocks = max_mapped_blocks
        self._map: OrderedDict[Hashable, bytes] = OrderedDict()  # engine hash -> kvpolicy key
        self.counts = {"batches": 0, "events": 0, "stored_blocks": 0, "removed_blocks": 0, "cleared": 0, "malformed_frames": 0,
                       "malformed_events": 0, "orphans": 0, "incompatible": 0, "mismatched": 0, "unknown_removed": 0, "missed_batches": 0}

    def key_of(self, engine_hash: Hashable) -> bytes | None:
        """The kvpolicy key the engine's block hash maps to (None if unknown)."""
        return self._map.get(engine_hash)

    # ------------------------------------------------------------------ ingest

    def ingest(self, payload: bytes) -> int:
        """Apply one batch; returns how many events were applied. Never raises on bad input."""
        try:
            _, events, _ = decode_batch(payload)
        except EventFormatError as e:
            self.counts["malformed_frames"] += 1
            log.warning("kvpolicy events: dropped a malformed batch: %s", e)
            return 0
        self.counts["batches"] += 1
        applied = 0
        for i, raw in enumerate(events):
            try:
                ev = decode_event(raw, i)
            except EventFormatError as e:
                self.counts["malformed_events"] += 1
                log.warning("kvpolicy events: dropped a malformed event: %s", e)
                continue
            self.apply(ev)
            applied += 1
        return applied

    def apply(self, ev: BlockStored | BlockRemoved | AllBlocksCleared) -> None:
        self.counts["events"] += 1
        if isinstance(ev, BlockStored):
            self._stored(ev)
        elif isinstance(ev, BlockRemoved):
            keys = []
            for h in ev.block_hashes:
                k = self._map.pop(h, None)
                if k is None:
                    self.counts["unknown_removed"] += 1
                else:
                    keys.append(k)
            if keys:
                self.counts["removed_blocks"] += self.directory.evict(self.tenant, keys, holder=self.holder, force=True)
        else:
            self.counts["cleared"] += 1
            self._map.clear()
            self.directory.clear_holder(self.tenant, self.holder)

    def _stored(self, ev: BlockStored) -> None:
        B = self.hasher.block_size_tokens
        if ev.block_size != B:
            self.counts["incompatible"] += len(ev.block_hashes)
            log.warning("kvpolicy events: block_size %d from the engine, %d in the namespace: refused", ev.block_size, B)
            return
        parent_key = None
        if ev.parent_block_hash is not None:
            parent_key = self._map.get(ev.parent_block_hash)
            if parent_key is None:  # we never saw the parent: its chain (and so this key) cannot be known
                self.counts["orphans"] += len(ev.block_hashes)
                return
        if self.verify_algo is not None and all(isinstance(h, bytes) for h in ev.block_hashes):
            from ..keys import vllm_block_hashes

            parent = ev.parent_block_hash if isinstance(ev.parent_block_hash, bytes) else None
            expect = vllm_block_hashes(list(ev.token_ids), B, self.verify_algo, parent=parent)  # type: ignore[arg-type]
            if list(expect) != list(ev.block_hashes):
                self.counts["mismatched"] += len(ev.block_hashes)
                log.warning("kvpolicy events: engine hashes disagree with the %s projection: refused", self.verify_algo)
                return
        keys = self.hasher.hash_blocks(list(ev.token_ids), parent=parent_key)
        entries = []
        digest = self.hasher.namespace.digest
        tier = ev.medium or "gpu"
        for h, k in zip(ev.block_hashes, keys):
            self._map[h] = k
            self._map.move_to_end(h)
            entries.append(Entry(k, self.holder, self.block_bytes, tier.lower(), digest))
        while len(self._map) > self.max_mapped_blocks:
            self._map.popitem(last=False)
        self.counts["stored_blocks"] += len(entries)
        self.directory.publish(self.tenant, entries)


class ZmqEventSubscriber:
    """A SUB socket on vLLM's event endpoint feeding a :class:`KVEventIngestor`.

    ``run(stop)`` loops until ``stop`` (a ``threading.Event``) is set; frames that
    are not ``[topic, 8-byte seq, payload]`` are counted as malformed; a jump in
    ``seq`` is counted in ``missed_batches`` (vLLM's replay socket can refill it).
    """

    def __init__(self, ingestor: KVEventIngestor, endpoint: str, topic: str = "", *, poll_ms: int = 50) -> None:
        try:
            import zmq
        except ImportError:
            raise ConfigError("pyzmq", "KV event ingestion needs pyzmq: pip install 'kvpolicy[events]'") from None
        self.ingestor = ingestor
        self._zmq = zmq
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt_string(zmq.SUBSCRIBE, topic)
        self.sock.connect(endpoint)
        self.poll_ms = poll_ms
        self.last_seq: int | None = None

    def poll_once(self) -> bool:
        """Handle at most one message; False if none arrived within ``poll_ms``."""
        if not self.sock.poll(self.poll_ms):
            return False
        parts = self.sock.recv_multipart()
        c = self.ingestor.counts
        if len(parts) != 3 or len(parts[1]) != 8:
            c["malformed_frames"] += 1
            log.warning("kvpolicy events: dropped a frame of %d parts", len(parts))
            return True
        seq = int.from_bytes(parts[1], "big")
        if self.last_seq is not None and seq > self.last_seq + 1:
            c["missed_batches"] += seq - self.last_seq - 1
        self.last_seq = seq
        self.ingestor.ingest(parts[2])
        return True

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            self.poll_once()

    def close(self) -> None:
        self.sock.close(linger=0)
