"""Moving KV blocks between replica processes over TCP — authenticated, bounded, closable.

**Who may talk.** Every connection starts with a mutual handshake under the
deployment secret (16–64 bytes, the same secret the ``keyed`` key scheme uses;
the transport derives its own keys from it). The client speaks first::

    client -> server   "KVP3" · nonce_c (16 B) · HMAC-SHA256(k_auth, "hello" · nonce_c)
    server -> client   "KVP3" · nonce_s (16 B) · HMAC-SHA256(k_auth, "server" · nonce_s · nonce_c)
    client -> server   HMAC-SHA256(k_auth, "client" · nonce_s · nonce_c)

so a process without the secret can neither ask nor answer (a listener that
took a restarted peer's port fails the client's check; a client without it is
dropped on its first message, having learnt nothing). Both sides then derive
``k_session = HMAC(k_auth, "session" · nonce_s · nonce_c)``. Why the client
first: its hello reaches the server with the TCP handshake's last packet, so the
server never waits a round trip on a connection that has not shown the secret —
with the server speaking first, a peer 200 ms away needed its unproven connection
kept 200 ms, and a flood of silent connections shed it first (0 of 21 served).
A replayed hello (an on-path attacker's) gets only the server's nonce: the last
message and every frame need the secret.

**Frames.** ``4-byte big-endian length · JSON header · 16-byte tag`` where the
tag is keyed BLAKE2b over (direction, sequence number, header) under
``k_session``: a header cannot be altered, replayed or reordered. Requests::

    {"op": "match", "namespace": <hex>, "keys": [<hex>, ...]}            -> {"n": leading keys held}
    {"op": "get",   "namespace": <hex>, "keys": [<hex>, ...]}            -> {"blocks": [{"key", "nbytes", "mac"}...]} + payloads
    {"op": "put",   "namespace": <hex>, "blocks": [{"key", "nbytes", "mac"}...]} + payloads -> {"stored": n}

**Blocks.** A block's payload is its K and V for every layer (``layers × 2 × B
× Hkv × D`` elements of the model dtype); its ``mac`` is keyed BLAKE2b-128
under ``k_block`` (derived from the deployment secret) over the namespace
digest, the key and the payload. A block whose MAC fails is refused — never
installed, never stored — and counted. ``put`` is how a replica publishes into a
shared block server (a pool node); the server checks every MAC and refuses the
whole message on a mismatch. A server answers only for its own namespace.

**Bounds** (:class:`TransportLimits`). Nothing is read before the handshake but
its fixed 52 + 32 bytes, under ``handshake_timeout_s``. Headers are capped at what
``max_blocks_per_message`` keys need; every block's ``nbytes`` must equal the
store's block size (the engine's geometry) *before* anything is allocated, so a
peer claiming 100 GiB is refused, not allocated. Every read has a deadline
(``io_timeout_s`` within a message, ``idle_timeout_s`` between them), at most
``max_connections`` connections are served at once (more wait in a
``backlog``-deep accept queue), and :meth:`BlockServer.close` closes every
open connection.

The client measures every term of ``T_remote``: ``lookup_s`` (the match round
trip), ``transfer_s`` (the get round trip, bytes into a staging buffer),
``stage_s`` (MAC checks and the copy out of the staging buffer into per-block
arrays) — and the engine measures ``install_s`` (placing blocks into its paged
cache). Payloads are authenticated, not encrypted: see docs/security.md.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import socket
import struct
import threading
import time
from collections.abc import Sequence
from typing import Any

import attrs

from .._io import json_loads
from .._validate import non_negative_number, positive_int, positive_number
from ..errors import ConfigError

MAGIC = b"KVP3"
NONCE_BYTES = 16
AUTH_TAG_BYTES = 32
FRAME_TAG_BYTES = 16
#: bytes of JSON one block's entry may take in a header (a 64-hex-digit key, a 32-digit MAC, the size, the punctuation)
HEADER_BYTES_PER_BLOCK = 192


class TransportError(ConnectionError):
    """A peer broke the protocol (a size over the caps, a malformed header): the connection is dropped."""


class AuthError(TransportError):
    """A peer failed the handshake or a frame's tag did not verify: not a member of this deployment."""


class CorruptBlockError(TransportError):
    """A fetched block's MAC does not match: it is refused, never installed."""


def _secret_bytes(secret: Any) -> bytes:
    if not isinstance(secret, (bytes, bytearray)) or not 16 <= len(secret) <= 64:
        raise ConfigError("secret", "the block transport needs the deployment secret: 16..64 bytes (see docs/security.md)")
    return bytes(secret)


@attrs.frozen(repr=False)
class TransportKeys:
    """The transport's keys, derived from the deployment secret (never the secret itself)."""

    auth: bytes
    block: bytes

    @classmethod
    def from_secret(cls, secret: bytes) -> TransportKeys:
        s = _secret_bytes(secret)
        return cls(hmac.new(s, b"kvpolicy transport auth v2", hashlib.sha256).digest(),
                   hmac.new(s, b"kvpolicy block mac v2", hashlib.sha256).digest())

    def __repr__(self) -> str:
        return "TransportKeys(<derived from the deployment secret>)"


def block_mac(block_key: bytes, namespace_digest: bytes, key: bytes, payload: bytes | memoryview) -> str:
    """Keyed BLAKE2b-128 over (namespace digest, key, payload): who holds the deployment secret made this block."""
    h = hashlib.blake2b(key=block_key, digest_size=16, person=b"kvpolicy-blkmac")
    h.update(len(namespace_digest).to_bytes(2, "big"))
    h.update(namespace_digest)
    h.update(len(key).to_bytes(2, "big"))
    h.update(key)
    h.update(payload)
    return h.hexdigest()


@attrs.frozen
class TransportLimits:
    """What a server (or client) accepts from a peer, checked before anything is allocated.

    Defaults: 4,096 blocks per message, a 2 s handshake, 10 s to finish a message
    once started, 60 s idle between messages, 256 connections served at once, at
    most 64 connections still in the handshake (a new one sheds the oldest of them:
    connections that never prove the secret cannot crowd out those that do), an
    accept backlog of 1,024."""

    max_blocks_per_message: int = attrs.field(default=4096, validator=positive_int)
    handshake_timeout_s: float = attrs.field(default=2.0, validator=positive_number)
    io_timeout_s: float = attrs.field(default=10.0, validator=positive_number)
    idle_timeout_s: float = attrs.field(default=60.0, validator=positive_number)
    max_connections: int = attrs.field(default=256, validator=positive_int)
    backlog: int = attrs.field(default=1024, validator=positive_int)
    max_handshakes: int = attrs.field(default=64, validator=positive_int)

    @property
    def max_header_bytes(self) -> int:
        return 1024 + self.max_blocks_per_message * HEADER_BYTES_PER_BLOCK


def _recv_exact(sock: socket.socket, n: int, deadline: float, into: memoryview | None = None) -> memoryview:
    """Read exactly ``n`` bytes before ``deadline`` (a ``time.monotonic()`` instant)."""
    buf = into if into is not None else memoryview(bytearray(n))
    got = 0
    while got < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise socket.timeout("read deadline passed")
        sock.settimeout(left)
        k = sock.recv_into(buf[got:n], n - got)
        if k == 0:
            raise ConnectionError("peer closed the connection")
        got += k
    return buf[:n]


def _tag(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


def server_handshake(sock: socket.socket, keys: TransportKeys, timeout_s: float, admit: Any = None) -> bytes:
    """The server's half of the handshake; returns the session key. Raises :class:`AuthError`. ``admit`` (if given)
    is called once the client's hello has shown the secret, before the server answers: False aborts (the connection
    was shed meanwhile)."""
    deadline = time.monotonic() + timeout_s
    msg = bytes(_recv_exact(sock, len(MAGIC) + NONCE_BYTES + AUTH_TAG_BYTES, deadline))
    if msg[:4] != MAGIC:
        raise AuthError("not a kvpolicy peer")
    nonce_c, tag_c = msg[4:4 + NONCE_BYTES], msg[4 + NONCE_BYTES:]
    if not hmac.compare_digest(tag_c, _tag(keys.auth, b"hello", nonce_c)):
        raise AuthError("the client does not hold the deployment secret")
    if admit is not None and not admit():
        raise ConnectionError("shed while its hello was in flight")
    nonce_s = os.urandom(NONCE_BYTES)
    sock.sendall(MAGIC + nonce_s + _tag(keys.auth, b"server", nonce_s, nonce_c))
    proof = bytes(_recv_exact(sock, AUTH_TAG_BYTES, deadline))
    if not hmac.compare_digest(proof, _tag(keys.auth, b"client", nonce_s, nonce_c)):
        raise AuthError("the client does not hold the deployment secret (its hello was replayed?)")
    return _tag(keys.auth, b"session", nonce_s, nonce_c)


def client_handshake(sock: socket.socket, keys: TransportKeys, timeout_s: float) -> bytes:
    """The client's half: it speaks first, and the server must prove it holds the secret too. Returns the session key."""
    deadline = time.monotonic() + timeout_s
    nonce_c = os.urandom(NONCE_BYTES)
    sock.sendall(MAGIC + nonce_c + _tag(keys.auth, b"hello", nonce_c))
    try:
        reply = bytes(_recv_exact(sock, len(MAGIC) + NONCE_BYTES + AUTH_TAG_BYTES, deadline))
    except ConnectionError:  # the server hung up on our hello: it does not take this deployment's secret
        raise AuthError("the server refused this client's proof of the deployment secret") from None
    if reply[:4] != MAGIC:
        raise AuthError("not a kvpolicy block server")
    nonce_s, tag_s = reply[4:4 + NONCE_BYTES], reply[4 + NONCE_BYTES:]
    if not hmac.compare_digest(tag_s, _tag(keys.auth, b"server", nonce_s, nonce_c)):
        raise AuthError("the server does not hold the deployment secret")
    sock.sendall(_tag(keys.auth, b"client", nonce_s, nonce_c))
    return _tag(keys.auth, b"session", nonce_s, nonce_c)


class Channel:
    """One authenticated connection: tagged, sequenced frames within the header cap."""

    def __init__(self, sock: socket.socket, session_key: bytes, *, is_server: bool, limits: TransportLimits) -> None:
        self.sock = sock
        self._key = session_key
        self._out, self._in = (b"S", b"C") if is_server else (b"C", b"S")
        self._send_seq = 0
        self._recv_seq = 0
        self.limits = limits

    def _frame_tag(self, direction: bytes, seq: int, header: bytes) -> bytes:
        h = hashlib.blake2b(key=self._key, digest_size=FRAME_TAG_BYTES, person=b"kvpolicy-frame")
        h.update(direction + seq.to_bytes(8, "big"))
        h.update(header)
        return h.digest()

    def send(self, header: dict[str, Any], payloads: Sequence[bytes | memoryview] = ()) -> None:
        h = json.dumps(header, separators=(",", ":")).encode()
        self.sock.settimeout(self.limits.io_timeout_s)  # a peer that stops reading cannot hold this thread
        self.sock.sendall(struct.pack(">I", len(h)) + h + self._frame_tag(self._out, self._send_seq, h))
        self._send_seq += 1
        for p in payloads:
            self.sock.sendall(p)

    def recv(self, first_byte_timeout_s: float) -> dict[str, Any]:
        """The next header: its first bytes within ``first_byte_timeout_s``, the rest within ``io_timeout_s``."""
        (n,) = struct.unpack(">I", _recv_exact(self.sock, 4, time.monotonic() + first_byte_timeout_s))
        if n > self.limits.max_header_bytes:
            raise TransportError(f"header of {n} bytes is over the cap of {self.limits.max_header_bytes}")
        deadline = time.monotonic() + self.limits.io_timeout_s
        raw = bytes(_recv_exact(self.sock, n + FRAME_TAG_BYTES, deadline))
        h, tag = raw[:n], raw[n:]
        if not hmac.compare_digest(tag, self._frame_tag(self._in, self._recv_seq, h)):
            raise AuthError("a frame's tag does not verify")
        self._recv_seq += 1
        try:
            obj = json_loads(h)
        except (ValueError, UnicodeDecodeError) as e:
            raise TransportError(f"malformed header: {e}") from None
        if not isinstance(obj, dict):
            raise TransportError("malformed header: not an object")
        return obj

    def recv_payloads(self, count: int, block_bytes: int, into: memoryview | None = None) -> memoryview:
        return _recv_exact(self.sock, count * block_bytes, time.monotonic() + self.limits.io_timeout_s, into)


def _hex_keys(values: Any, limits: TransportLimits) -> list[bytes]:
    if not isinstance(values, list) or len(values) > limits.max_blocks_per_message:
        raise TransportError(f"keys: must be a list of at most {limits.max_blocks_per_message}")
    try:
        return [bytes.fromhex(k) for k in values]
    except (TypeError, ValueError):
        raise TransportError("keys: not hex strings") from None


_MAC_RE = re.compile(r"[0-9a-f]{32}")


def _is_mac(v: Any) -> bool:
    """A block MAC as block_mac writes it: 32 lowercase hex digits. A non-ASCII one made hmac.compare_digest raise
    TypeError, an uncaught error in the server's thread and in PeerClient (issue #47)."""
    return isinstance(v, str) and _MAC_RE.fullmatch(v) is not None


def _block_meta(meta: Any, block_bytes: int, limits: TransportLimits) -> list[tuple[bytes, str]]:
    """(key, mac) per block, after checking every size equals the block size: nothing is allocated before."""
    if not isinstance(meta, list) or len(meta) > limits.max_blocks_per_message:
        raise TransportError(f"blocks: must be a list of at most {limits.max_blocks_per_message}")
    out = []
    for m in meta:
        if not isinstance(m, dict) or m.get("nbytes") != block_bytes or not _is_mac(m.get("mac")):
            raise TransportError(f"blocks: every block must be {block_bytes} bytes with a 32-hex-digit mac, got {str(m)[:80]}")
        try:
            out.append((bytes.fromhex(m["key"]), m["mac"]))
        except (KeyError, TypeError, ValueError):
            raise TransportError("blocks: a key is not a hex string") from None
    return out


class BlockStore:
    """What a replica has published: key -> payload bytes (K and V of the block), all ``block_bytes`` long."""

    def __init__(self, namespace_digest: bytes, block_bytes: int) -> None:
        if isinstance(block_bytes, bool) or not isinstance(block_bytes, int) or block_bytes < 1:
            raise ConfigError("block_bytes", f"must be a positive int, got {block_bytes!r}")
        self.namespace_digest = namespace_digest
        self.block_bytes = block_bytes
        self.blocks: dict[bytes, bytes] = {}
        self.lock = threading.Lock()

    def put(self, key: bytes, payload: bytes) -> None:
        if len(payload) != self.block_bytes:
            raise ConfigError("payload", f"a block is {self.block_bytes} bytes, got {len(payload)}")
        with self.lock:
            self.blocks[key] = payload


def _flag(inst: Any, a: attrs.Attribute, v: Any) -> None:
    if not isinstance(v, bool):
        raise ConfigError(a.name, f"must be True or False, got {v!r}")


@attrs.define
class Faults:
    """Faults a test can inject into a server's transfers: drop the connection, delay the answer, corrupt a byte.
    Checked when built and on every assignment (``attrs.define`` validates on set: a test flips them on a live server)."""

    drop: bool = attrs.field(default=False, validator=_flag)
    delay_s: float = attrs.field(default=0.0, validator=non_negative_number)
    corrupt: bool = attrs.field(default=False, validator=_flag)


class BlockServer:
    """Serves a :class:`BlockStore` on ``host:port`` (port 0 = any free one) to peers holding ``secret``.

    ``stats`` counts connections (and the most served at once, ``peak_connections``), ``auth_failed`` (handshakes or frames that did
    not verify), ``protocol_errors`` (sizes over the caps, malformed headers,
    timeouts), ``mac_refused`` (put messages refused for a bad block MAC),
    ``served_blocks`` and ``stored_blocks``."""

    def __init__(self, store: BlockStore, *, secret: bytes, limits: TransportLimits | None = None, host: str = "127.0.0.1", port: int = 0) -> None:
        self.store = store
        self.keys = TransportKeys.from_secret(secret)
        self.limits = limits or TransportLimits()
        self.faults = Faults()
        self.stats = {"connections": 0, "peak_connections": 0, "auth_failed": 0, "protocol_errors": 0, "mac_refused": 0, "served_blocks": 0,
                      "stored_blocks": 0, "shed_handshakes": 0}
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        #: connections still in the handshake, oldest first: at most limits.max_handshakes, a new one sheds the oldest
        self._pending: dict[socket.socket, None] = {}
        self._slots = threading.BoundedSemaphore(self.limits.max_connections)
        self._closed = threading.Event()
        self._listener = socket.create_server((host, port), backlog=self.limits.backlog, reuse_port=False)
        self._listener.settimeout(0.2)
        self.address: tuple[str, int] = self._listener.getsockname()[:2]
        self._thread = threading.Thread(target=self._accept_loop, name=f"kvpolicy-blockserver-{self.address[1]}", daemon=True)
        self._thread.start()

    def _count(self, what: str, n: int = 1) -> None:
        with self._lock:
            self.stats[what] += n

    @property
    def open_connections(self) -> int:
        with self._lock:
            return len(self._conns)

    def _accept_loop(self) -> None:
        # Accepting never waits for a served slot: a connection first proves the secret under its own, smaller budget
        # (max_handshakes), and the oldest unproven one is shed to make room — 600 connections that send nothing used
        # to hold every slot while honest peers waited behind them in the backlog until their own handshakes expired.
        while not self._closed.is_set():
            try:
                sock, _ = self._listener.accept()
            except (socket.timeout, OSError):
                continue
            shed = None
            with self._lock:
                if self._closed.is_set():
                    sock.close()
                    return
                if len(self._pending) >= self.limits.max_handshakes:
                    shed = next(iter(self._pending))
                    del self._pending[shed]
                    self.stats["shed_handshakes"] += 1
                self._pending[sock] = None
                self._conns.add(sock)
                self.stats["connections"] += 1
                self.stats["peak_connections"] = max(self.stats["peak_connections"], len(self._conns))
            if shed is not None:
                try:
                    shed.shutdown(socket.SHUT_RDWR)  # its thread's read ends at once
                except OSError:
                    pass
            threading.Thread(target=self._serve_conn, args=(sock,), daemon=True).start()

    def _serve_conn(self, sock: socket.socket) -> None:
        slot = False
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            def admit() -> bool:  # the hello showed the secret: out of the unproven connections' budget
                with self._lock:
                    if sock not in self._pending:  # shed while its hello was in flight: too late
                        return False
                    del self._pending[sock]
                    return True

            try:
                session = server_handshake(sock, self.keys, self.limits.handshake_timeout_s, admit)
            except AuthError:
                self._count("auth_failed")
                return
            except (OSError, ConnectionError):
                self._count("protocol_errors")
                return
            while not self._closed.is_set() and not slot:  # proven: wait for one of max_connections served slots
                slot = self._slots.acquire(timeout=0.2)
            if not slot:
                return
            ch = Channel(sock, session, is_server=True, limits=self.limits)
            while not self._closed.is_set():
                try:
                    req = ch.recv(self.limits.idle_timeout_s)
                    if not self._answer(ch, req):
                        return
                except AuthError:
                    self._count("auth_failed")
                    return
                except TransportError:
                    self._count("protocol_errors")
                    return
                except socket.timeout:  # idle past the limit, or a message left unfinished
                    return
                except (ConnectionError, OSError):
                    return
        finally:
            with self._lock:
                self._conns.discard(sock)
                self._pending.pop(sock, None)
            try:
                sock.close()
            finally:
                if slot:
                    self._slots.release()

    def _answer(self, ch: Channel, req: dict[str, Any]) -> bool:
        """Answer one request; False = drop the connection."""
        store, f, op = self.store, self.faults, req.get("op")
        if op not in ("match", "get", "put"):
            raise TransportError(f"op: unknown {str(op)[:20]!r}")
        if op == "get":  # faults hit the transfer; the directory answer stays honest
            if f.drop:
                return False
            if f.delay_s:
                time.sleep(f.delay_s)
        if op == "put":
            meta = _block_meta(req.get("blocks"), store.block_bytes, self.limits)
            data = bytes(ch.recv_payloads(len(meta), store.block_bytes))  # read even when refused, so the stream stays in step
            if req.get("namespace") != store.namespace_digest.hex():
                ch.send({"stored": 0, "error": "namespace"})
                return True
            B = store.block_bytes
            payloads = [data[i * B:(i + 1) * B] for i in range(len(meta))]
            if any(not hmac.compare_digest(mac, block_mac(self.keys.block, store.namespace_digest, k, p)) for (k, mac), p in zip(meta, payloads)):
                self._count("mac_refused")
                ch.send({"stored": 0, "error": "mac"})
                return True
            for (k, _), p in zip(meta, payloads):
                store.put(k, p)
            self._count("stored_blocks", len(meta))
            ch.send({"stored": len(meta)})
            return True
        keys = _hex_keys(req.get("keys", []), self.limits)
        if req.get("namespace") != store.namespace_digest.hex():
            ch.send({"n": 0, "blocks": [], "error": "namespace"})
            return True
        with store.lock:
            if op == "match":
                n = 0
                for k in keys:
                    if k not in store.blocks:
                        break
                    n += 1
                ch.send({"n": n})
                return True
            found = [store.blocks.get(k) for k in keys]
        payloads = [p for p in found if p is not None]
        if len(payloads) < len(found):
            ch.send({"blocks": [], "error": "missing"})
            return True
        meta_out = [{"key": k.hex(), "nbytes": len(p), "mac": block_mac(self.keys.block, store.namespace_digest, k, p)}
                    for k, p in zip(keys, payloads)]
        if f.corrupt and payloads:
            bad = bytearray(payloads[0])
            bad[len(bad) // 2] ^= 0xFF
            payloads[0] = bytes(bad)
        ch.send({"blocks": meta_out}, payloads)
        self._count("served_blocks", len(payloads))
        return True

    def close(self) -> None:
        """Stop accepting and close every open connection (their threads end on the next read)."""
        self._closed.set()
        try:
            self._listener.close()
        finally:
            with self._lock:
                conns = list(self._conns)
            for s in conns:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            self._thread.join(timeout=5)


@attrs.frozen
class FetchResult:
    payloads: tuple[bytes, ...]
    lookup_s: float
    transfer_s: float
    stage_s: float
    nbytes: int


class PeerClient:
    """One authenticated connection to a peer's :class:`BlockServer`: a ``BlockIndex`` and a block source.

    ``block_bytes`` is this engine's block size: an answer with any other size is
    refused before a byte of it is allocated."""

    def __init__(self, address: tuple[str, int], namespace_digest: bytes, *, secret: bytes, block_bytes: int,
                 limits: TransportLimits | None = None, timeout_s: float = 5.0, name: str = "peer") -> None:
        if isinstance(block_bytes, bool) or not isinstance(block_bytes, int) or block_bytes < 1:
            raise ConfigError("block_bytes", f"must be a positive int, got {block_bytes!r}")
        self.address: tuple[Any, ...] = tuple(address)  # (host, port), or IPv6's four
        self.namespace_digest = namespace_digest
        self.keys = TransportKeys.from_secret(secret)
        self.block_bytes = block_bytes
        self.limits = limits or TransportLimits()
        self.timeout_s = timeout_s
        self.name = name
        self._ch: Channel | None = None
        self._last_used = 0.0
        self.last_lookup_s = 0.0
        self._staging = bytearray(0)
        self.lock = threading.Lock()
        self.stats = {"auth_failed": 0, "mac_refused": 0, "protocol_errors": 0}

    def _conn(self, timeout_s: float) -> Channel:
        # a connection idle for more than half the server's idle limit may be closed under us: start afresh
        if self._ch is not None and time.monotonic() - self._last_used > self.limits.idle_timeout_s / 2:
            self._reset()
        if self._ch is None:
            s = socket.create_connection(self.address, timeout=timeout_s)
            try:
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                session = client_handshake(s, self.keys, min(timeout_s, self.limits.handshake_timeout_s))
            except BaseException:
                s.close()
                raise
            self._ch = Channel(s, session, is_server=False, limits=self.limits)
        self._last_used = time.monotonic()
        return self._ch

    def _reset(self) -> None:
        if self._ch is not None:
            try:
                self._ch.sock.close()
            finally:
                self._ch = None

    def _note(self, e: BaseException) -> None:
        if isinstance(e, CorruptBlockError):
            self.stats["mac_refused"] += 1
        elif isinstance(e, AuthError):
            self.stats["auth_failed"] += 1
        elif isinstance(e, TransportError):
            self.stats["protocol_errors"] += 1

    def match_prefix(self, keys: Sequence[bytes]) -> int:
        """Leading keys the peer holds (one round trip); 0 if the peer cannot be reached or is not trusted."""
        if not keys:
            return 0
        keys = list(keys)[: self.limits.max_blocks_per_message]
        t0 = time.perf_counter()
        n = 0
        with self.lock:
            try:
                ch = self._conn(self.timeout_s)
                ch.send({"op": "match", "namespace": self.namespace_digest.hex(), "keys": [k.hex() for k in keys]})
                got = ch.recv(self.timeout_s).get("n", 0)
                n = got if isinstance(got, int) and not isinstance(got, bool) else 0
            except (OSError, ConnectionError, ValueError) as e:
                self._note(e)
                self._reset()
        self.last_lookup_s = time.perf_counter() - t0
        return max(0, min(n, len(keys)))

    def fetch(self, keys: Sequence[bytes], timeout_s: float) -> FetchResult:
        """Fetch blocks through a staging buffer. Raises ``TimeoutError``, :class:`CorruptBlockError`,
        :class:`AuthError` or another ``ConnectionError`` — the engine turns each into a recompute."""
        keys = list(keys)
        if len(keys) > self.limits.max_blocks_per_message:
            raise TransportError(f"{len(keys)} blocks in one fetch, the limit is {self.limits.max_blocks_per_message}")
        B = self.block_bytes
        with self.lock:
            t0 = time.perf_counter()
            try:
                ch = self._conn(timeout_s)
                ch.send({"op": "get", "namespace": self.namespace_digest.hex(), "keys": [k.hex() for k in keys]})
                hdr = ch.recv(timeout_s)
                if hdr.get("error"):
                    raise ConnectionError(f"peer refused: {str(hdr['error'])[:40]}")
                meta = _block_meta(hdr.get("blocks"), B, self.limits)  # every size checked before the buffer grows
                if len(meta) != len(keys) or any(k != mk for k, (mk, _) in zip(keys, meta)):
                    raise TransportError("the answer does not list the blocks asked for")
                total = len(meta) * B
                if len(self._staging) < total:
                    self._staging = bytearray(total)
                view = memoryview(self._staging)
                ch.recv_payloads(len(meta), B, view)
            except socket.timeout:
                self._reset()
                raise TimeoutError(f"fetch of {len(keys)} blocks from {self.address} timed out after {timeout_s:.3f}s") from None
            except TransportError as e:
                self._note(e)
                self._reset()
                raise
            except (OSError, ConnectionError, ValueError, MemoryError) as e:
                self._reset()
                raise ConnectionError(f"fetch from {self.address} failed: {e}") from None
            t1 = time.perf_counter()
            out = []
            for i, (k, (_, mac)) in enumerate(zip(keys, meta)):
                chunk = view[i * B:(i + 1) * B]
                if not hmac.compare_digest(mac, block_mac(self.keys.block, self.namespace_digest, k, chunk)):
                    self.stats["mac_refused"] += 1
                    raise CorruptBlockError(f"block {k.hex()[:12]}… failed its MAC: refused")
                out.append(bytes(chunk))  # the copy out of the staging buffer
            t2 = time.perf_counter()
        return FetchResult(tuple(out), self.last_lookup_s, t1 - t0, t2 - t1, total)

    def put(self, keys: Sequence[bytes], payloads: Sequence[bytes], timeout_s: float) -> int:
        """Publish blocks to the peer's store (a shared block server); returns how many it stored."""
        stored = 0
        step = self.limits.max_blocks_per_message
        for i in range(0, len(keys), step):
            ks, ps = list(keys[i:i + step]), list(payloads[i:i + step])
            if any(len(p) != self.block_bytes for p in ps):
                raise ConfigError("payloads", f"every block must be {self.block_bytes} bytes")
            meta = [{"key": k.hex(), "nbytes": len(p), "mac": block_mac(self.keys.block, self.namespace_digest, k, p)} for k, p in zip(ks, ps)]
            with self.lock:
                try:
                    ch = self._conn(timeout_s)
                    ch.send({"op": "put", "namespace": self.namespace_digest.hex(), "blocks": meta}, ps)
                    got = ch.recv(timeout_s).get("stored", 0)
                except (OSError, ConnectionError, ValueError) as e:
                    self._note(e)
                    self._reset()
                    return stored
            stored += got if isinstance(got, int) and not isinstance(got, bool) else 0
        return stored

    def close(self) -> None:
        with self.lock:
            self._reset()
