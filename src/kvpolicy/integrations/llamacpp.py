"""llama.cpp replicas that share prefix KV through kvpolicy (``llama-cpp-python``'s :class:`Llama`).

The seam a llama.cpp-based engine calls: :class:`LlamaCppReplica` wraps one ``Llama`` context and, for each
prompt, builds the keys, matches the context's own tokens and the shared store (or the directory), asks the
admission controller, loads the admitted blocks into the context, prefills the rest, and publishes what the
filter allows. kvpolicy never imports llama.cpp: the replica takes the ``Llama`` object it is given and reaches
its context through llama.cpp's state API (``llama_state_seq_get_data`` / ``llama_state_seq_set_data``).

**Storage layout: fixed-size blocks.** A llama.cpp sequence state is ``magic · seq_id · n_stream · cell_count ·
(pos, n_seq, seq)`` cell records, then every layer's K rows (one per cell), then every layer's V rows — or, when V is stored
transposed (no flash attention), one run of cells per V element. :func:`parse_seq_state` reads that into
per-layer, cell-major arrays ordered by position; a block's payload is its ``B`` cells of every layer's K rows,
then of every layer's V rows (cell-major whatever the engine's V layout)::

    block b = K_0[bB:(b+1)B] · … · K_{L-1}[…] · V_0[bB:(b+1)B] · … · V_{L-1}[…]      (B × bytes_per_token bytes)

so every block has the same size (what the transport and the directory expect), any block-aligned prefix is
a concatenation of its blocks, and :func:`build_seq_state` turns ``n`` blocks back into a state llama.cpp
imports as positions ``0 … nB−1``. Publishing costs one export of the sequence (milliseconds) and a copy.

**Correctness.** A load replaces the context's sequence with the local blocks it already held (exported from
it) followed by the fetched ones, then prefills the rest: the logits equal a cold prefill's (tested at several
block boundaries). Every fetched block carries a keyed MAC over (namespace, key, payload) checked by the
transport; a forged, truncated or foreign block is refused and the request recomputes. llama.cpp refusing an
import (a state of another geometry) also recomputes, from nothing if the context was cleared.

**Publishing on demand** (issue #44). With ``advertise=True`` a replica tells the directory which blocks its context
holds (holder ``"{replica}/gpu/g0"``, tier ``gpu``: what an engine's KV events say), and keeps it current as its
context changes. With ``peers`` (a :class:`~kvpolicy.protocols.PeerSender`), a request whose chain goes on past the
store's run in another replica's context asks that replica to send those blocks into the store (``send_blocks``),
then loads them with the rest: the blocks are published when a second replica asks for them. The admission
controller decides on the store's blocks and the peer's together.
"""

from __future__ import annotations

import ctypes
import importlib
import struct
import threading
import time
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np

from ..admission import AdmissionContext, AdmissionController, Decision, LoadOutcome
from ..admission.controller import LoadStatus
from ..errors import ConfigError
from ..gguf import GGML_TYPE_IDS, GGUFModel
from ..keys import BlockHasher
from ..ledger import Ledger, NotLoaded, RequestRecord
from ..matching import match
from ..publish import PublishAll, PublishRequest
from ..reference.engine import PrefillResult  # one prefill's outcome, the same for every engine kvpolicy drives
from ..reference.transport import CorruptBlockError, PeerClient
from ..protocols import PeerSender

#: what ``llama_state_seq_get_data`` writes first (llama.cpp's ``io_magic``), then the sequence id
STATE_MAGIC = 0xAF143CD8
_CELL = np.dtype([("pos", "<i4"), ("n_seq", "<u4"), ("seq", "<i4")])


class StateFormatError(ValueError):
    """A llama.cpp state export this codec does not read (several streams, extended cells, a size that does not add up)."""


@attrs.frozen
class StateLayout:
    """What one llama.cpp context's sequence state looks like, per layer: K and V types and bytes per cell."""

    k_types: tuple[int, ...]
    k_row_bytes: tuple[int, ...]
    v_types: tuple[int, ...]
    v_row_bytes: tuple[int, ...]
    #: V stored one run of cells per element (no flash attention): its element size and elements per cell
    v_trans: bool
    v_elem_bytes: tuple[int, ...] = ()
    v_elems: tuple[int, ...] = ()

    @property
    def num_layers(self) -> int:
        return len(self.k_types)

    @property
    def bytes_per_token(self) -> int:
        return sum(self.k_row_bytes) + sum(self.v_row_bytes)


@attrs.frozen(eq=False)
class SeqState:
    layout: StateLayout
    positions: np.ndarray
    #: per layer, (cells, row bytes) uint8, ordered by position
    k: tuple[np.ndarray, ...]
    v: tuple[np.ndarray, ...]

    @property
    def num_cells(self) -> int:
        return int(self.positions.size)


def parse_seq_state(blob: bytes | memoryview) -> SeqState:
    """Read a ``llama_state_seq_get_data`` export of one sequence (one stream, plain cells) into cell-major arrays
    ordered by position. Raises :class:`StateFormatError` on anything else."""
    buf = memoryview(blob).cast("B")
    off = 0

    def take(n: int, what: str) -> memoryview:
        nonlocal off
        if n < 0 or off + n > len(buf):
            raise StateFormatError(f"llama.cpp state: {what} runs past the end ({off + n:,} > {len(buf):,} bytes)")
        out = buf[off:off + n]
        off += n
        return out

    def u32(what: str) -> int:
        return int(struct.unpack("<I", take(4, what))[0])

    if u32("magic") != STATE_MAGIC:
        raise StateFormatError("llama.cpp state: not a sequence state (its magic number differs)")
    take(4, "seq_id")
    n_stream = u32("n_stream")
    if n_stream < 1 or n_stream > 64:
        raise StateFormatError(f"llama.cpp state: {n_stream} streams")
    found: SeqState | None = None
    for _ in range(n_stream):
        cells = u32("cell_count")
        if cells == 0:
            continue
        if found is not None:
            raise StateFormatError("llama.cpp state: the sequence spans several streams")
        meta = np.frombuffer(take(cells * _CELL.itemsize, "cell records"), dtype=_CELL)
        if np.any(meta["n_seq"] != 1):
            raise StateFormatError("llama.cpp state: cells of several sequences, or extended cells (M-RoPE): not one plain sequence")
        v_trans, n_layer = u32("v_trans"), u32("n_layer")
        if n_layer < 1 or n_layer > 4096:
            raise StateFormatError(f"llama.cpp state: {n_layer} layers")
        k_types, k_rows, ks = [], [], []
        for _ in range(n_layer):
            t, row = struct.unpack("<iQ", take(12, "K header"))
            k_types.append(int(t))
            k_rows.append(int(row))
            ks.append(np.frombuffer(take(cells * row, "K rows"), dtype=np.uint8).reshape(cells, row))
        v_types, v_rows, v_el, v_n, vs = [], [], [], [], []
        for _ in range(n_layer):
            if not v_trans:
                t, row = struct.unpack("<iQ", take(12, "V header"))
                v_types.append(int(t))
                v_rows.append(int(row))
                vs.append(np.frombuffer(take(cells * row, "V rows"), dtype=np.uint8).reshape(cells, row))
            else:
                t, el, n = struct.unpack("<iII", take(12, "V header"))
                v_types.append(int(t))
                v_el.append(int(el))
                v_n.append(int(n))
                v_rows.append(int(el * n))
                raw = np.frombuffer(take(cells * el * n, "V elements"), dtype=np.uint8).reshape(n, cells, el)
                vs.append(raw.transpose(1, 0, 2).reshape(cells, n * el))
        order = np.argsort(meta["pos"], kind="stable")
        layout = StateLayout(tuple(k_types), tuple(k_rows), tuple(v_types), tuple(v_rows), bool(v_trans), tuple(v_el), tuple(v_n))
        found = SeqState(layout, meta["pos"][order].copy(), tuple(a[order] for a in ks), tuple(a[order] for a in vs))
    if off != len(buf):
        raise StateFormatError(f"llama.cpp state: {len(buf) - off:,} bytes left over (another state format)")
    if found is None:
        raise StateFormatError("llama.cpp state: the sequence holds no cells")
    return found


def block_payloads(state: SeqState, n_blocks: int, block_size_tokens: int) -> list[bytes]:
    """The first ``n_blocks`` blocks of a parsed state as fixed-size payloads. Needs positions ``0 … nB−1`` exactly."""
    B = block_size_tokens
    n = n_blocks * B
    if n > state.num_cells or not np.array_equal(state.positions[:n], np.arange(n)):
        raise StateFormatError(f"the context does not hold positions 0…{n - 1} once each: cannot cut {n_blocks} blocks of {B}")
    out = []
    for b in range(n_blocks):
        s = slice(b * B, (b + 1) * B)
        out.append(b"".join([a[s].tobytes() for a in state.k] + [a[s].tobytes() for a in state.v]))
    return out


def build_seq_state(layout: StateLayout, payloads: Sequence[bytes], block_size_tokens: int, seq_id: int = 0) -> bytes:
    """A ``llama_state_seq_set_data`` input holding ``payloads`` (blocks in order) as positions ``0 … nB−1``."""
    B = block_size_tokens
    per = B * layout.bytes_per_token
    for i, p in enumerate(payloads):
        if len(p) != per:
            raise CorruptBlockError(f"block {i} has {len(p)} bytes; this context's blocks are {per}")
    nb = len(payloads)
    cells = nb * B
    arr = np.frombuffer(b"".join(payloads), dtype=np.uint8).reshape(nb, per) if nb else np.zeros((0, per), np.uint8)
    meta = np.empty(cells, dtype=_CELL)
    meta["pos"] = np.arange(cells)
    meta["n_seq"] = 1
    meta["seq"] = seq_id
    parts = [struct.pack("<IiII", STATE_MAGIC, seq_id, 1, cells), meta.tobytes(), struct.pack("<II", int(layout.v_trans), layout.num_layers)]
    off = 0
    for t, row in zip(layout.k_types, layout.k_row_bytes):
        parts += [struct.pack("<iQ", t, row), np.ascontiguousarray(arr[:, off:off + B * row]).tobytes()]
        off += B * row
    for i, (t, row) in enumerate(zip(layout.v_types, layout.v_row_bytes)):
        data = np.ascontiguousarray(arr[:, off:off + B * row]).reshape(cells, row)
        off += B * row
        if layout.v_trans:
            el, n = layout.v_elem_bytes[i], layout.v_elems[i]
            parts += [struct.pack("<iII", t, el, n), np.ascontiguousarray(data.reshape(cells, n, el).transpose(1, 0, 2)).tobytes()]
        else:
            parts += [struct.pack("<iQ", t, row), data.tobytes()]
    return b"".join(parts)


#: pulls one replica may have waiting on their senders at once (each in a thread of its own)
MAX_PULLS_IN_FLIGHT = 8


class _ContextIndex:
    """The context's own cached tokens as a BlockIndex: the leading blocks it holds, token for token."""

    name = "local"

    def __init__(self, replica: LlamaCppReplica, tokens: np.ndarray) -> None:
        self.replica, self.tokens = replica, tokens

    def match_prefix(self, keys: Sequence[bytes]) -> int:
        return min(len(keys), self.replica.cached_tokens(self.tokens) // self.replica.B)


class LlamaCppReplica:
    """One llama.cpp context behind kvpolicy's seams (keys, match, admission, load, publish, ledger).

    ``store`` is the shared block server (a :class:`~kvpolicy.reference.transport.PeerClient`): loads fetch from it
    and publishes go into it. ``directory`` (a :class:`~kvpolicy.directory.TenantScopedDirectory`, in memory or on
    Redis) answers the remote match in one round trip and records what was published; without it the store is
    asked. Without a ``controller`` every remote match is loaded (the always-load baseline); without a ``store``
    nothing is shared (recompute-only)."""

    def __init__(self, llm: Any, gguf: GGUFModel | str, *, block_size_tokens: int = 16, secret: bytes | None = None,
                 store: PeerClient | None = None, directory: Any = None, controller: AdmissionController | None = None,
                 publish_filter: Any = None, ledger: Ledger | None = None, replica: str = "llamacpp-0", tenant: str = "default",
                 type_k: str = "f16", type_v: str = "f16", file_digest: str | None = None, load_timeout_s: float = 5.0,
                 advertise: bool = False, peers: PeerSender | None = None) -> None:
        if isinstance(block_size_tokens, bool) or not isinstance(block_size_tokens, int) or block_size_tokens <= 0:
            raise ConfigError("block_size_tokens", f"must be a positive int, got {block_size_tokens!r}")
        self.llm = llm
        self.lib = importlib.import_module(type(llm).__module__.split(".")[0])  # the llama_cpp bindings the Llama came from
        self.model = gguf if isinstance(gguf, GGUFModel) else GGUFModel.read(gguf)
        self.B = block_size_tokens
        self.namespace = self.model.namespace(block_size_tokens, type_k=type_k, type_v=type_v, tenant=tenant, file_digest=file_digest)
        if store is not None and secret is None:
            raise ConfigError("secret", "sharing blocks through a store needs the deployment secret (16..64 bytes): keys are keyed under it")
        self.hasher = BlockHasher(self.namespace, "keyed", secret) if secret is not None else BlockHasher(self.namespace, "fast")
        #: (K row, V row) bytes per token of each layer: what the engine's export must show
        self.layer_row_bytes = self.model.layer_row_bytes(type_k, type_v)
        self.bytes_per_token = sum(k + v for k, v in self.layer_row_bytes)
        self.block_bytes = self.B * self.bytes_per_token
        if store is not None and store.block_bytes != self.block_bytes:
            raise ConfigError("store", f"the store client expects {store.block_bytes:,}-byte blocks; this model's are {self.block_bytes:,}")
        if store is not None and store.namespace_digest != self.namespace.digest:
            raise ConfigError("store", "the store client speaks for another namespace (model file, tokenizer, cache types, block size "
                                       "or tenant): make it with namespace_digest=replica.namespace.digest")
        if not isinstance(advertise, bool):
            raise ConfigError("advertise", f"must be True or False, got {advertise!r}")
        if (advertise or peers is not None) and (store is None or directory is None):
            raise ConfigError("peers" if peers is not None else "advertise",
                              "publishing on demand needs a store (where a peer sends its blocks) and a directory (who holds what)")
        if peers is not None and not callable(getattr(peers, "send", None)):
            raise ConfigError("peers", "must have send(engine, keys) -> int (kvpolicy.protocols.PeerSender)")
        self.store = store
        self.directory = directory
        self.advertise = advertise
        self.peers = peers
        #: the keys of the full blocks the context holds, in chain order, as last advertised (or seen)
        self._held: list[bytes] = []
        self.controller = controller
        self.filter = publish_filter if publish_filter is not None else PublishAll()
        self.ledger = ledger
        self.replica = replica
        self.load_timeout_s = load_timeout_s
        self.layout: StateLayout | None = None
        self.published: set[bytes] = set()
        #: the last load or publish error (they are counted, never raised): for logs and ``stats``
        self.last_error: str | None = None
        self.counts = {"loads_ok": 0, "loads_failed": 0, "loads_timeout": 0, "corrupt_refused": 0, "import_refused": 0,
                       "published_blocks": 0, "publish_failed": 0, "pulled_blocks": 0, "sent_blocks": 0, "pulls_timeout": 0,
                       "pulls_short": 0, "sends_refused_busy": 0}
        #: held while the context changes (a prefill) and while a peer's send reads it: a send exports only what the
        #: context holds for the keys' own tokens. Use the Llama through this replica, or hold this lock around your own use
        self.lock = threading.RLock()
        #: how long a peer's send waits for this context's prefill to finish before refusing (the asker recomputes)
        self.send_wait_s = 1.0
        #: pulls whose sender has not answered yet (each waits in a thread of its own); past MAX_PULLS_IN_FLIGHT a pull is
        #: not asked for (a hung peer cannot pile up threads)
        self._pull_slots = threading.BoundedSemaphore(MAX_PULLS_IN_FLIGHT)

    # ------------------------------------------------------------------ the context

    @property
    def _ctx(self) -> Any:
        return self.llm._ctx.ctx

    def cached_tokens(self, tokens: np.ndarray) -> int:
        """Leading tokens of ``tokens`` the context holds now."""
        n = min(int(self.llm.n_tokens), int(tokens.size))
        if n == 0:
            return 0
        held = np.asarray(self.llm.input_ids[:n])
        diff = np.nonzero(held != tokens[:n])[0]
        return int(diff[0]) if diff.size else n

    def export_state(self) -> SeqState:
        """The context's sequence 0, parsed; checks its layout against the GGUF's geometry once."""
        lib = self.lib
        size = int(lib.llama_state_seq_get_size(self._ctx, 0))
        buf = (ctypes.c_uint8 * size)()
        got = int(lib.llama_state_seq_get_data(self._ctx, buf, size, 0))
        state = parse_seq_state(memoryview(buf)[:got])
        if self.layout is None:
            lay = state.layout
            want = self.layer_row_bytes
            if lay.num_layers != len(want) or [(k, v) for k, v in zip(lay.k_row_bytes, lay.v_row_bytes)] != want:
                raise ConfigError("gguf", f"the context's KV rows {list(zip(lay.k_row_bytes, lay.v_row_bytes))[:2]}… per layer differ from "
                                          f"the GGUF's {want[:2]}… (another model, or other cache types than type_k/type_v)")
            for t in lay.k_types + lay.v_types:
                if t not in GGML_TYPE_IDS:
                    raise ConfigError("type_k", f"the context's cache holds ggml type {t}, which kvpolicy does not know")
            self.layout = lay
        elif state.layout != self.layout:
            raise StateFormatError("the context's state layout changed between exports")
        return state

    def export_blocks(self, n_blocks: int) -> list[bytes]:
        """The context's first ``n_blocks`` blocks as payloads."""
        if n_blocks <= 0:
            return []
        return block_payloads(self.export_state(), n_blocks, self.B)

    def import_blocks(self, payloads: Sequence[bytes], tokens: np.ndarray) -> None:
        """Replace the context's sequence with these blocks (positions ``0 … nB−1`` of ``tokens``). On refusal the
        context may be empty: the caller recomputes from what :meth:`cached_tokens` says."""
        if self.layout is None:
            self._probe_layout()
        assert self.layout is not None
        blob = build_seq_state(self.layout, payloads, self.B)
        n = len(payloads) * self.B
        arr = (ctypes.c_uint8 * len(blob)).from_buffer_copy(blob)
        read = int(self.lib.llama_state_seq_set_data(self._ctx, arr, len(blob), 0))
        if read != len(blob):
            self.llm.n_tokens = 0  # llama.cpp cleared the sequence
            raise StateFormatError(f"llama.cpp refused the imported state ({read} of {len(blob)} bytes read)")
        self.llm.input_ids[:n] = tokens[:n]
        self.llm.n_tokens = n

    def _probe_layout(self) -> None:
        """Learn the state layout from the engine itself: one token evaluated, exported, dropped."""
        self.llm.n_tokens = 0
        self.llm.eval([0])
        self.export_state()
        self.llm.n_tokens = 0
        self.llm._ctx.kv_cache_seq_rm(-1, 0, -1)

    def _logits(self) -> np.ndarray:
        lib = self.lib
        ptr = lib.llama_get_logits_ith(self._ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(int(self.llm.n_vocab()),)).copy()

    # ------------------------------------------------------------------ a request

    def _remote_index(self) -> Any:
        if self.store is None:
            return None
        if self.directory is None or self.advertise or self.peers is not None:
            return self.store  # a directory that also holds engines' own blocks cannot say what the store holds
        return self.directory.index()

    @property
    def holder_name(self) -> str:
        """This context's holder in the directory when it advertises (what an engine's KV events would name)."""
        return f"{self.replica}/gpu/g0"

    def _advertise(self, keys: list[bytes]) -> None:
        """The context now holds the full blocks ``keys`` (chain order): record them, and tell the directory what
        changed when advertising. Failures are counted in ``last_error``, never raised."""
        old = self._held
        keep = 0
        while keep < min(len(old), len(keys)) and old[keep] == keys[keep]:
            keep += 1
        self._held = list(keys)
        if not self.advertise or (keep == len(old) and keep == len(keys)):
            return
        from ..directory import Entry

        try:
            if len(old) > keep:
                self.directory.evict(old[keep:], holder=self.holder_name, force=True)
            if len(keys) > keep:
                self.directory.publish([Entry(k, self.holder_name, self.block_bytes, "gpu", self.namespace.digest) for k in keys[keep:]])
        except Exception as e:  # advertising is best effort: a peer then finds less
            self.last_error = f"advertise: {e!r}"

    def send_blocks(self, keys: Sequence[bytes]) -> int:
        """A peer asks for blocks this context holds (its pull): the leading run of ``keys`` the context holds, in chain
        order, goes into the store and the directory. Returns how many (0 when the context no longer holds the first).

        A block's bytes are bound to what its key names: under :attr:`lock`, the keys of the tokens the context holds
        *now* are computed again and the run exported is the one they match, key for key — so a context that moved on
        (another prompt, the Llama used outside :meth:`prefill`) sends nothing rather than other KV under these keys
        (it sent whatever it held, labelled with the keys it last advertised). While a prefill holds the context, the
        send waits up to :attr:`send_wait_s`, then refuses (``sends_refused_busy``)."""
        if self.store is None or not keys:
            return 0
        if not self.lock.acquire(timeout=self.send_wait_s):
            self.counts["sends_refused_busy"] += 1
            return 0
        try:
            held_tokens = np.asarray(self.llm.input_ids[:int(self.llm.n_tokens)], dtype=np.int64)
            held = list(self.hasher.hash_blocks(held_tokens)) if held_tokens.size >= self.B else []
            try:
                start = held.index(keys[0])
            except ValueError:
                return 0
            n = 0
            while n < len(keys) and start + n < len(held) and held[start + n] == keys[n]:
                n += 1
            payloads = self.export_blocks(start + n)[start:]
        except Exception as e:  # a peer's request is best effort: counted, the asker recomputes
            self.last_error = f"send: {e!r}"
            return 0
        finally:
            self.lock.release()
        try:
            stored = self.store.put(list(keys[:n]), payloads, 30.0)
            if stored and self.directory is not None:
                from ..directory import Entry

                self.directory.publish([Entry(k, self.store.name, self.block_bytes, namespace_digest=self.namespace.digest) for k in keys[:stored]])
        except Exception as e:  # a peer's request is best effort: counted, the asker recomputes
            self.last_error = f"send: {e!r}"
            return 0
        self.published.update(keys[:stored])
        self.counts["sent_blocks"] += stored
        return int(stored)

    def prefill(self, tokens: Sequence[int] | np.ndarray, *, request_id: Any = None, publish: bool = True) -> PrefillResult:
        """Prefill one prompt, reusing what the context and the shared store hold; returns the last token's logits.
        Holds :attr:`lock` throughout: a peer's send reads the context only between prefills."""
        with self.lock:
            return self._prefill(tokens, request_id=request_id, publish=publish)

    def _prefill(self, tokens: Sequence[int] | np.ndarray, *, request_id: Any, publish: bool) -> PrefillResult:
        t_start = time.perf_counter()
        arrival_s = self.controller.clock.now_s() if self.controller is not None else time.monotonic()
        raw = np.asarray(tokens)
        if raw.ndim != 1 or (raw.size and (raw.dtype == np.bool_ or not np.issubdtype(raw.dtype, np.integer))):
            raise ConfigError("tokens", f"must be a flat sequence of integer token ids, got an array of {raw.dtype} and shape {raw.shape}")
        toks = raw.astype(np.int64)
        T = int(toks.size)
        vocab = int(self.llm.n_vocab())
        if T == 0:
            raise ConfigError("tokens", "an empty prompt has nothing to prefill")
        if T > int(self.llm.n_ctx()):
            raise ConfigError("tokens", f"{T:,} tokens do not fit this context's {int(self.llm.n_ctx()):,}")
        if toks.min() < 0 or toks.max() >= vocab:
            raise ConfigError("tokens", f"token ids must lie in [0, {vocab}), got {int(toks.min())}..{int(toks.max())}")
        keys = list(self.hasher.hash_blocks(toks))
        B = self.B
        remote = self._remote_index()
        tiers: list[Any] = [remote] if remote is not None else []
        peer_index = None
        if self.peers is not None:
            peer_index = self.directory.peers(exclude=self.replica)
            tiers.append(peer_index)
        try:
            m = match(keys, T, _ContextIndex(self, toks), *tiers, block_size_tokens=B)
        except OSError:  # the store or directory is unreachable: a miss
            m = match(keys, T, _ContextIndex(self, toks), block_size_tokens=B)
            peer_index = None
        timings: dict[str, float] = {"match_s": time.perf_counter() - t_start}
        L, R = m.local_blocks, m.remote_total_blocks
        in_store = m.remote_blocks[0] if m.remote_blocks else 0
        decision: Decision | None = None
        status: LoadStatus | None = None
        loaded = pulled = 0
        if R and self.store is not None:
            want_blocks = R
            if self.controller is not None:
                decision = self.controller.decide(m, AdmissionContext(block_bytes=self.block_bytes, replica=self.replica, source=self.store.name))
                want_blocks = decision.load_blocks if decision.loads else 0
            pull_timed_out = False
            if want_blocks > in_store:  # blocks past the store's run: only the peer tier finds those
                assert peer_index is not None and peer_index.holder is not None
                t_ask = time.perf_counter()
                deadline_s = self.load_timeout_s if decision is None else (decision.soft_timeout_s or self.load_timeout_s)
                pulled, pull_timed_out = self._ask(peer_index.holder, keys[L + in_store:L + want_blocks], deadline_s)
                timings["pull_s"] = time.perf_counter() - t_ask
                want_blocks = in_store + pulled
                self.counts["pulled_blocks"] += pulled
            if want_blocks:
                loaded, status = self._load(keys, L, want_blocks, toks, decision, timings)
            elif decision is not None and decision.load_id is not None and self.controller is not None:
                if pull_timed_out:  # the admitted load spent its deadline waiting on the peer: the controller learns it
                    status = "timeout"
                    self.controller.record(LoadOutcome(decision.load_id, "timeout", 0))
                else:
                    self.controller.cancel(decision.load_id)  # the peer sent nothing: the admitted load never starts
        reused = min(L + loaded, self.cached_tokens(toks) // B)  # fewer only when a refused import emptied the context
        t0, c0 = time.perf_counter(), time.process_time()
        self.llm.n_tokens = reused * B  # eval drops every cell past it, then computes the rest
        self.llm.eval(toks[reused * B:].tolist())
        logits = self._logits()
        timings["prefill_s"] = time.perf_counter() - t0
        timings["prefill_cpu_s"] = time.process_time() - c0  # every thread of this process: llama.cpp's workers too
        timings["load_bytes"] = float(loaded * self.block_bytes)
        timings["ttft_s"] = time.perf_counter() - t_start
        if self.controller is not None:
            self.controller.model.observe_prefill(reused * B, T - reused * B, timings["prefill_s"])
            self.controller.observe_ttft(timings["ttft_s"])
        if self.ledger is not None:
            not_loaded = R - loaded
            reason: NotLoaded | None = None if not not_loaded else (
                "declined" if status in (None, "ok") else ("timeout" if status == "timeout" else "transfer_error"))
            self.ledger.record(RequestRecord(prompt_tokens=T, block_size_tokens=B, local_blocks=L, remote_loaded_blocks=loaded,
                                             remote_not_loaded_blocks=not_loaded, not_loaded_reason=reason, ttft_s=timings["ttft_s"],
                                             prefill_s=timings["prefill_s"], load_s=timings.get("load_s") if loaded else None,
                                             predicted_recompute_s=decision.t_recompute_p50_s if decision is not None and loaded else None,
                                             load_attempted=status is not None, arrival_s=arrival_s))
        self._advertise(keys)  # the context now holds the prompt's full blocks
        res = PrefillResult(logits, L, R, loaded, T - reused * B, status, decision, timings, tuple(keys), T, pulled_blocks=pulled)
        if publish:
            self.publish(res, request_id=request_id)
        return res

    def _ask(self, engine: str, keys: list[bytes], deadline_s: float) -> tuple[int, bool]:
        """Ask ``engine`` to send ``keys`` into the store, waiting at most ``deadline_s`` for the whole exchange; answers
        (blocks the store now holds of ``keys``' leading run — what the peer claims is checked, never taken on its word
        —, whether the deadline passed). Any error is 0, counted in ``last_error``, never raised."""
        assert self.peers is not None and self.store is not None
        if not self._pull_slots.acquire(blocking=False):  # hung senders hold that many threads already
            self.last_error = f"pull from {engine}: {MAX_PULLS_IN_FLIGHT} pulls still unanswered; not asking"
            return 0, False
        answer: list[Any] = []
        done = threading.Event()
        peers = self.peers

        def ask() -> None:
            try:
                answer.append(peers.send(engine, keys))
            except Exception as e:  # the peer is gone, or refused: recompute
                answer.append(e)
            finally:
                self._pull_slots.release()
                done.set()

        threading.Thread(target=ask, name=f"kvpolicy-pull-{engine}", daemon=True).start()
        if not done.wait(deadline_s):
            self.counts["pulls_timeout"] += 1
            self.last_error = f"pull from {engine}: no answer within its {deadline_s:g} s deadline"
            return 0, True
        got = answer[0]
        if isinstance(got, Exception):
            self.last_error = f"pull from {engine}: {got!r}"
            return 0, False
        if isinstance(got, bool) or not isinstance(got, int) or got < 0:
            self.last_error = f"pull from {engine}: send answered {got!r}, not a count of blocks"
            return 0, False
        if got == 0:
            return 0, False
        claimed = min(got, len(keys))
        try:
            there = int(self.store.match_prefix(keys[:claimed]))
        except Exception as e:  # the store cannot say: nothing is taken as pulled
            self.last_error = f"pull from {engine}: the store could not confirm it ({e!r})"
            return 0, False
        if there < got:
            self.counts["pulls_short"] += 1
            self.last_error = f"pull from {engine}: it claimed {got} blocks; the store holds {there} of them"
        return there, False

    def _load(self, keys: list[bytes], L: int, n: int, toks: np.ndarray, decision: Decision | None,
              timings: dict[str, float]) -> tuple[int, LoadStatus]:
        """Fetch blocks L..L+n and import them behind the context's own L; returns (blocks loaded, status)."""
        assert self.store is not None
        status: LoadStatus = "failed"
        loaded = 0
        t0 = time.perf_counter()
        try:
            own = self.export_blocks(L)
            res = self.store.fetch(keys[L:L + n], self.load_timeout_s if decision is None else (decision.soft_timeout_s or self.load_timeout_s))
            t1 = time.perf_counter()
            self.import_blocks(own + list(res.payloads), toks)
            timings.update(lookup_s=res.lookup_s, transfer_s=res.transfer_s, stage_s=res.stage_s,
                           install_s=time.perf_counter() - t1, load_s=time.perf_counter() - t0)
            status, loaded = "ok", n
            self.counts["loads_ok"] += 1
            self.published.update(keys[L:L + n])  # they are in the store: publishing them again would copy them for nothing
        except TimeoutError:
            status = "timeout"
            self.counts["loads_timeout"] += 1
        except CorruptBlockError:
            self.counts["corrupt_refused"] += 1
        except StateFormatError:
            self.counts["import_refused"] += 1
        except Exception as e:  # any transport error: recompute
            self.counts["loads_failed"] += 1
            self.last_error = f"load: {e!r}"
        finally:
            if decision is not None and decision.load_id is not None and self.controller is not None:
                self.controller.record(LoadOutcome(decision.load_id, status, loaded, lookup_s=timings.get("lookup_s"),
                                                   transfer_s=timings.get("transfer_s"), stage_s=timings.get("stage_s"),
                                                   install_s=timings.get("install_s")))
        return loaded, status

    def publish(self, result: PrefillResult, *, request_id: Any = None) -> int:
        """Offer the prompt's full blocks to the publish filter; put the allowed ones not yet published into the store
        (and the directory). Returns the blocks newly published; the time is ``result.timings["publish_s"]``."""
        t0 = time.perf_counter()
        if self.store is None:
            return 0
        keys = list(result.keys)
        req = PublishRequest(request_id=request_id if request_id is not None else id(result), num_tokens=result.prompt_tokens,
                             block_size_tokens=self.B, replica=self.replica, reused_blocks=result.local_blocks + result.loaded_blocks,
                             time_s=self.controller.clock.now_s() if self.controller is not None else time.monotonic())
        self.filter.observe(req, keys)
        n = self.filter.publishable(req, keys)
        todo = [j for j in range(n) if keys[j] not in self.published]
        if not todo:
            result.timings["publish_s"] = time.perf_counter() - t0
            return 0
        try:
            payloads = self.export_blocks(todo[-1] + 1)
            stored = self.store.put([keys[j] for j in todo], [payloads[j] for j in todo], 30.0)
            if stored < len(todo):  # refused whole (a MAC or namespace the server does not share) or cut short
                self.counts["publish_failed"] += 1
                self.last_error = f"publish: the store kept {stored} of {len(todo)} blocks (another secret or namespace?)"
            done = todo[:stored] if stored == len(todo) else []
            if self.directory is not None and done:
                from ..directory import Entry

                self.directory.publish([Entry(keys[j], self.store.name, self.block_bytes, namespace_digest=self.namespace.digest) for j in done])
        except Exception as e:  # a publish is best effort: counted, and the last error kept for the operator
            self.counts["publish_failed"] += 1
            self.last_error = f"publish: {e!r}"
            done = []
        self.published.update(keys[j] for j in done)
        self.counts["published_blocks"] += len(done)
        result.timings["publish_s"] = time.perf_counter() - t0
        return len(done)


def load_llama_cpp(field: str = "--gguf") -> Any:
    """The ``llama_cpp`` bindings, or a ConfigError naming ``field`` that says how to install them."""
    try:
        return importlib.import_module("llama_cpp")
    except ImportError:
        raise ConfigError(field, "needs llama-cpp-python: CMAKE_ARGS=\"-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON\" "
                                 "pip install llama-cpp-python==0.3.36") from None


class LlamaCppProfileTarget:
    """llama.cpp as a :class:`~kvpolicy.protocols.ProfileTarget` (``kvpolicy profile --gguf FILE``).

    Each measuring thread gets its own context. The remote load is real: a publisher context prefills the longest
    prefix and puts its blocks into a :class:`~kvpolicy.reference.transport.BlockServer` (authenticated TCP on
    loopback, in this process); a load matches, fetches (MACs checked), and imports them into the measuring context.
    KV bytes are what the engine's own export holds for the prefix's cells."""

    has_remote = True

    def __init__(self, gguf_path: str, *, block_size_tokens: int = 64, max_prefix_tokens: int = 4096, max_tail_tokens: int = 256,
                 seed: int = 0, n_threads: int = 2) -> None:
        import secrets
        import threading

        from ..reference.transport import BlockServer, BlockStore

        self.lib = load_llama_cpp()
        self.path = gguf_path
        self.model = GGUFModel.read(gguf_path)
        self.B = block_size_tokens
        self.n_threads = n_threads
        self.n_ctx = max_prefix_tokens + 2 * max_tail_tokens + 16
        self.ns = self.model.namespace(block_size_tokens)
        self._secret = secrets.token_bytes(32)  # this measurement's own deployment
        self.block_bytes = block_size_tokens * self.model.bytes_per_token()
        self.server = BlockServer(BlockStore(self.ns.digest, self.block_bytes), secret=self._secret)
        self._local = threading.local()
        self._lock = threading.Lock()
        self._seed, self._n = seed, 0
        pub = self._replicas()[1]
        vocab = int(pub.llm.n_vocab())
        self.vocab = vocab
        self.base = np.random.default_rng(seed).integers(16, vocab, max_prefix_tokens).astype(np.int64)
        pub.llm.reset()
        pub.prefill(self.base[: max_prefix_tokens // block_size_tokens * block_size_tokens + 1])  # publishes every full block

    def _replicas(self) -> tuple[LlamaCppReplica, LlamaCppReplica]:
        """This thread's (plain, shared) replicas over one context: the plain one never looks remote."""
        from ..reference.transport import PeerClient

        got = getattr(self._local, "replicas", None)
        if got is None:
            llm = self.lib.Llama(model_path=self.path, n_ctx=self.n_ctx, n_threads=self.n_threads, n_threads_batch=self.n_threads, n_batch=512, verbose=False)
            store = PeerClient(self.server.address, self.ns.digest, secret=self._secret, block_bytes=self.block_bytes, name="peer", timeout_s=60.0)
            kw: dict[str, Any] = dict(block_size_tokens=self.B, file_digest=self.ns.model_revision)
            got = (LlamaCppReplica(llm, self.model, **kw), LlamaCppReplica(llm, self.model, secret=self._secret, store=store, **kw))
            self._local.replicas = got
            with self._lock:
                self._n += 1
                self._local.rng = np.random.default_rng(self._seed + 1000 * self._n)
        return got

    def _prefix(self, prefix_tokens: int) -> np.ndarray:
        if prefix_tokens % self.B or not 0 < prefix_tokens <= self.base.size:
            raise ConfigError("--lengths", f"{prefix_tokens}: prefix lengths must be multiples of the block size {self.B} up to {self.base.size}")
        return self.base[:prefix_tokens]

    def _tail(self, n: int) -> np.ndarray:
        return self._local.rng.integers(16, self.vocab, n).astype(np.int64)

    @property
    def cache_granule_tokens(self) -> int:
        return self.B

    def kv_bytes(self, prefix_tokens: int) -> int:
        plain, _ = self._replicas()
        plain.llm.reset()
        plain.llm.eval(self._prefix(prefix_tokens).tolist())
        state = plain.export_state()
        if state.num_cells != prefix_tokens:
            raise RuntimeError(f"the context holds {state.num_cells} cells after a {prefix_tokens}-token prefill")
        return int(sum(a.nbytes for a in state.k + state.v))

    def cold_prefill_s(self, prefix_tokens: int, tail_tokens: int) -> float:
        plain, _ = self._replicas()
        plain.llm.reset()
        prompt = np.concatenate([self._prefix(prefix_tokens), self._tail(tail_tokens)])
        t0 = time.perf_counter()
        plain.prefill(prompt, publish=False)
        return time.perf_counter() - t0

    def local_hit_ttft_s(self, prefix_tokens: int, tail_tokens: int, cached_tokens: int | None = None) -> float:
        plain, _ = self._replicas()
        plain.llm.reset()
        pre = self._prefix(prefix_tokens)
        cached = prefix_tokens if cached_tokens is None else cached_tokens
        if cached % self.B or not 0 <= cached <= prefix_tokens:
            raise ConfigError("cached_tokens", f"{cached}: must be whole blocks of {self.B} tokens, at most the prefix's {prefix_tokens}")
        if cached:
            plain.prefill(np.concatenate([pre[:cached], self._tail(tail_tokens)]), publish=False)
        t0 = time.perf_counter()
        r = plain.prefill(np.concatenate([pre, self._tail(tail_tokens)]), publish=False)
        dt = time.perf_counter() - t0
        if r.local_blocks != cached // self.B:
            raise RuntimeError(f"expected a local hit of {cached // self.B} blocks, got {r.local_blocks}")
        return dt

    def remote_load(self, prefix_tokens: int) -> dict[str, float]:
        _, shared = self._replicas()
        shared.llm.reset()
        pre = self._prefix(prefix_tokens)
        keys = list(shared.hasher.hash_blocks(pre))
        store = shared.store
        assert store is not None
        t0 = time.perf_counter()
        n = store.match_prefix(keys)
        lookup = time.perf_counter() - t0
        if n != len(keys):
            raise RuntimeError(f"the block server holds {n} of {len(keys)} blocks")
        res = store.fetch(keys, 60.0)
        t1 = time.perf_counter()
        shared.import_blocks(list(res.payloads), pre)
        install = time.perf_counter() - t1
        return {"lookup_s": lookup, "transfer_s": res.transfer_s, "stage_s": res.stage_s, "install_s": install,
                "total_s": lookup + res.transfer_s + res.stage_s + install}

    def close(self) -> None:
        self.server.close()
