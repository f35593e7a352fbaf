"""Moving KV blocks between replica processes over TCP on loopback.

Wire format — each message is ``4-byte big-endian header length · JSON header ·
payloads`` (the header lists payload sizes). Requests::

    {"op": "match", "namespace": <hex>, "keys": [<hex>, ...]}            -> {"n": leading keys held}
    {"op": "get",   "namespace": <hex>, "keys": [<hex>, ...]}            -> {"blocks": [{"key", "nbytes", "checksum"}...]} + payloads
    {"op": "put",   "namespace": <hex>, "blocks": [{"key", "nbytes", "checksum"}...]} + payloads -> {"stored": n}

``put`` is how a replica publishes into a shared block server (a pool node):
the server checks every block's checksum and refuses the whole message on a
mismatch.

A block's payload is its K and V for every layer (``layers × 2 × B × Hkv × D``
elements of the model dtype); its checksum is BLAKE2b-128 over the namespace
digest, the key and the payload, so a corrupted or foreign block is refused by
the reader. The server answers only for its own namespace: a request under
another namespace matches nothing.

The client measures every term of ``T_remote``: ``lookup_s`` (the match round
trip), ``transfer_s`` (the get round trip, bytes into a staging buffer),
``stage_s`` (the copy out of the staging buffer into per-block arrays) — and the
engine measures ``install_s`` (placing blocks into its paged cache).
"""

from __future__ import annotations

import hashlib
import json
import socket
import socketserver
import struct
import threading
import time
from collections.abc import Sequence
from typing import Any

import attrs



def checksum(namespace_digest: bytes, key: bytes, payload: bytes | memoryview) -> str:
    h = hashlib.blake2b(digest_size=16, person=b"kvpolicy-block")
    h.update(namespace_digest)
    h.update(key)
    h.update(payload)
    return h.hexdigest()


def _recv_exact(sock: socket.socket, n: int, into: memoryview | None = None) -> bytes | memoryview:
    buf = into if into is not None else memoryview(bytearray(n))
    got = 0
    while got < n:
        k = sock.recv_into(buf[got:n], n - got)
        if k == 0:
            raise ConnectionError("peer closed the connection")
        got += k
    return buf[:n] if into is not None else bytes(buf)


def send_msg(sock: socket.socket, header: dict[str, Any], payloads: Sequence[bytes | memoryview] = ()) -> None:
    h = json.dumps(header, separators=(",", ":")).encode()
    sock.sendall(struct.pack(">I", len(h)) + h)
    for p in payloads:
        sock.sendall(p)


def recv_header(sock: socket.socket) -> dict[str, Any]:
    (n,) = struct.unpack(">I", _recv_exact(sock, 4))
    if n > 64 << 20:
        raise ConnectionError(f"header of {n} bytes refused")
    return json.loads(_recv_exact(sock, n))


class BlockStore:
    """What a replica has published: key -> payload bytes (K and V of the block)."""

    def __init__(self, namespace_digest: bytes) -> None:
        self.namespace_digest = namespace_digest
        self.blocks: dict[bytes, bytes] = {}
        self.lock = threading.Lock()

    def put(self, key: bytes, payload: bytes) -> None:
        with self.lock:
            self.blocks[key] = payload


@attrs.define
class Faults:
    """Faults a test can inject into a server's transfers: drop the connection, delay the answer, corrupt a byte."""

    drop: bool = False
    delay_s: float = 0.0
    corrupt: bool = False


class _Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:  # pragma: no cover - exercised through the client in another thread/process
        srv: BlockServer = self.server.owner  # type: ignore[attr-defined]
        sock: socket.socket = self.request
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while True:
            try:
                req = recv_header(sock)
            except (ConnectionError, OSError, ValueError):
                return
            f = srv.faults
            if req.get("op") == "get":  # faults hit the transfer; the directory answer stays honest
                if f.drop:
                    sock.close()
                    return
                if f.delay_s:
                    time.sleep(f.delay_s)
            store = srv.store
            keys = [bytes.fromhex(k) for k in req.get("keys", [])]
            if req.get("namespace") != store.namespace_digest.hex():
                send_msg(sock, {"n": 0, "blocks": [], "error": "namespace"})
                continue
            if req.get("op") == "put":
                try:
                    stored = _receive_put(sock, store, req)
                except (ConnectionError, OSError, ValueError, KeyError, TypeError):
                    return
                send_msg(sock, {"stored": stored} if stored >= 0 else {"stored": 0, "error": "checksum"})
                continue
            with store.lock:
                if req.get("op") == "match":
                    n = 0
                    for k in keys:
                        if k not in store.blocks:
                            break
                        n += 1
                    send_msg(sock, {"n": n})
                    continue
                payloads = [store.blocks.get(k) for k in keys]
            if any(p is None for p in payloads):
                send_msg(sock, {"blocks": [], "error": "missing"})
                continue
            meta = [{"key": k.hex(), "nbytes": len(p), "checksum": checksum(store.namespace_digest, k, p)} for k, p in zip(keys, payloads)]
            if f.corrupt and payloads:
                bad = bytearray(payloads[0])
                bad[len(bad) // 2] ^= 0xFF
                payloads[0] = bytes(bad)
            try:
                send_msg(sock, {"blocks": meta}, payloads)  # type: ignore[arg-type]
            except OSError:  # the reader gave up (timeout) and closed: nothing to do
                return


def _receive_put(sock: socket.socket, store: BlockStore, req: dict[str, Any]) -> int:
    """Read a put's payloads; store them if every checksum holds (returns how many), else -1."""
    meta = req["blocks"]
    sizes = [int(m["nbytes"]) for m in meta]
    if any(n < 0 or n > 1 << 30 for n in sizes):
        raise ValueError("block size out of range")
    payloads = [bytes(_recv_exact(sock, n)) for n in sizes]
    keys = [bytes.fromhex(m["key"]) for m in meta]
    if any(checksum(store.namespace_digest, k, p) != m["checksum"] for k, p, m in zip(keys, payloads, meta)):
        return -1
    for k, p in zip(keys, payloads):
        store.put(k, p)
    return len(keys)


class _TCPServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def handle_error(self, request: Any, client_address: Any) -> None:  # pragma: no cover - a client vanished mid-answer
        pass


class BlockServer:
    """Serves a :class:`BlockStore` on ``host:port`` (port 0 = any free one) from a thread."""

    def __init__(self, store: BlockStore, host: str = "127.0.0.1", port: int = 0) -> None:
        self.store = store
        self.faults = Faults()
        self._srv = _TCPServer((host, port), _Handler)
        self._srv.owner = self  # type: ignore[attr-defined]
        self.address = self._srv.server_address
        self._thread = threading.Thread(target=self._srv.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._srv.shutdown()
        self._srv.server_close()


@attrs.frozen
class FetchResult:
    payloads: tuple[bytes, ...]
    lookup_s: float
    transfer_s: float
    stage_s: float
    nbytes: int


class PeerClient:
    """One connection to a peer's :class:`BlockServer`: a ``BlockIndex`` and a block source."""

    def __init__(self, address: tuple[str, int], namespace_digest: bytes, *, timeout_s: float = 5.0, name: str = "peer") -> None:
        self.address = tuple(address)
        self.namespace_digest = namespace_digest
        self.timeout_s = timeout_s
        self.name = name
        self._sock: socket.socket | None = None
        self.last_lookup_s = 0.0
        self._staging = bytearray(0)
        self.lock = threading.Lock()

    def _conn(self, timeout_s: float) -> socket.socket:
        if self._sock is None:
            s = socket.create_connection(self.address, timeout=timeout_s)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sock = s
        self._sock.settimeout(timeout_s)
        return self._sock

    def _reset(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            finally:
                self._sock = None

    def match_prefix(self, keys: Sequence[bytes]) -> int:
        """Leading keys the peer holds (one round trip); 0 if the peer cannot be reached."""
        if not keys:
            return 0
        t0 = time.perf_counter()
        with self.lock:
            try:
                s = self._conn(self.timeout_s)
                send_msg(s, {"op": "match", "namespace": self.namespace_digest.hex(), "keys": [k.hex() for k in keys]})
                n = int(recv_header(s).get("n", 0))
            except (OSError, ConnectionError, ValueError):
                self._reset()
                n = 0
        self.last_lookup_s = time.perf_counter() - t0
        return max(0, min(n, len(keys)))

    def fetch(self, keys: Sequence[bytes], timeout_s: float) -> FetchResult:
        """Fetch blocks through a staging buffer. Raises ``TimeoutError`` / ``ConnectionError``
        / :class:`CorruptBlockError` — the engine turns each into a recompute."""
        with self.lock:
            t0 = time.perf_counter()
            try:
                s = self._conn(timeout_s)
                send_msg(s, {"op": "get", "namespace": self.namespace_digest.hex(), "keys": [k.hex() for k in keys]})
                hdr = recv_header(s)
                meta = hdr.get("blocks", [])
                if hdr.get("error") or len(meta) != len(keys):
                    raise ConnectionError(f"peer refused: {hdr.get('error', 'short answer')}")
                total = sum(int(m["nbytes"]) for m in meta)
                if len(self._staging) < total:
                    self._staging = bytearray(total)
                view = memoryview(self._staging)
                _recv_exact(s, total, view)
            except socket.timeout:
                self._reset()
                raise TimeoutError(f"fetch of {len(keys)} blocks from {self.address} timed out after {timeout_s:.3f}s") from None
            except (OSError, ConnectionError, ValueError, KeyError) as e:
                self._reset()
                raise ConnectionError(f"fetch from {self.address} failed: {e}") from None
            t1 = time.perf_counter()
            out = []
            off = 0
            for k, m in zip(keys, meta):
                n = int(m["nbytes"])
                chunk = view[off:off + n]
                if m["key"] != k.hex() or checksum(self.namespace_digest, k, chunk) != m["checksum"]:
                    raise CorruptBlockError(f"block {k.hex()[:12]}… failed its checksum: refused")
                out.append(bytes(chunk))  # the copy out of the staging buffer
                off += n
            t2 = time.perf_counter()
        return FetchResult(tuple(out), self.last_lookup_s, t1 - t0, t2 - t1, total)

    def put(self, keys: Sequence[bytes], payloads: Sequence[bytes], timeout_s: float) -> int:
        """Publish blocks to the peer's store (a shared block server); returns how many it stored."""
        meta = [{"key": k.hex(), "nbytes": len(p), "checksum": checksum(self.namespace_digest, k, p)} for k, p in zip(keys, payloads)]
        with self.lock:
            try:
                s = self._conn(timeout_s)
                send_msg(s, {"op": "put", "namespace": self.namespace_digest.hex(), "blocks": meta}, payloads)
                hdr = recv_header(s)
            except (OSError, ConnectionError, ValueError):
                self._reset()
                return 0
        return int(hdr.get("stored", 0))

    def close(self) -> None:
        with self.lock:
            self._reset()


class CorruptBlockError(ConnectionError):
    """A fetched block's checksum does not match: it is refused, never installed."""
