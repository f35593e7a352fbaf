"""vLLM's KV-event transport: :class:`ZmqEventSubscriber` (the ZMQ SUB socket an engine publishes on, with
its replay of missed sequence numbers) and :class:`ReplayClient`. The events themselves, and the ingestor that turns
them into directory entries, are :mod:`.vllm_events`."""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict
from typing import Any

from ..errors import ConfigError
from .vllm_events import KVEventIngestor, log


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

    ``run(stop)`` loops until ``stop`` (a ``threading.Event``) is set. Frames that are not ``[topic, 8-byte seq,
    payload]`` are counted as malformed. vLLM with data parallelism publishes rank r on ``port + r``: :meth:`for_ranks`
    makes one subscriber per rank.

    **Restarts and stale entries.** The directory must not claim blocks the engine no longer holds. The subscriber
    never trusts the sequence number alone:

    - it watches its own connection (a ZMQ socket monitor, with ZMQ heartbeats every ``heartbeat_s``): when the
      engine's socket goes away — the process exited, or its host stopped answering for ``3 × heartbeat_s`` — everything
      this engine was known to hold is forgotten at once (``disconnects``). A dead engine holds nothing;
    - a batch whose seq equals the last one is a duplicate only if its payload is the same; another payload, or a
      seq that goes back, is a restart (``restarts``): everything is forgotten;
    - a jump in seq is fetched from the replay socket, and the batches there that were already seen must be the same
      bytes (a digest of the last ``remember_batches`` is kept), else it is a restart. A gap nothing can fill (no replay
      socket, or the replay no longer holds what was seen) may have hidden removals: with ``on_gap="forget"`` (the
      default) everything is forgotten (``resyncs``); ``"keep"`` keeps it and only counts ``missed_batches``.

    - with a replay socket, every ``check_every_s`` (30 s) the batches seen last are compared with the ones the
      replay socket holds (:meth:`check_continuity`): a new engine whose seq ran on from the old one's is caught even
      when its disconnect was not seen.

    After forgetting, the first batch of the (new) engine is preceded by what its replay socket still holds from seq 0.

    **The bound.** A dead or restarted engine's entries leave the directory when its disconnect is seen (at once when
    its process exits; within ``3 × heartbeat_s`` for a host that stopped answering). Where the connection drop cannot
    be seen (a proxy in between), a restart is caught at the new engine's first batch whose seq does not follow on, or
    else within ``check_every_s`` with a replay socket; without a replay socket and with the seq running on, it cannot
    be told from the same engine.
    """

    def __init__(self, ingestor: KVEventIngestor, endpoint: str, topic: str = "", *, poll_ms: int = 50,
                 replay_endpoint: str | None = None, max_message_bytes: int = MAX_MESSAGE_BYTES, on_gap: str = "forget",
                 heartbeat_s: float = 1.0, remember_batches: int = 1024, replay: Any = None, check_every_s: float | None = 30.0) -> None:
        try:
            import zmq
        except ImportError:
            raise ConfigError("pyzmq", "KV event ingestion needs pyzmq: pip install 'kvpolicy[events]'") from None
        if on_gap not in ("forget", "keep"):
            raise ConfigError("on_gap", f"must be 'forget' or 'keep', got {on_gap!r}")
        if isinstance(heartbeat_s, bool) or not isinstance(heartbeat_s, (int, float)) or not 0 < heartbeat_s <= 3600:
            raise ConfigError("heartbeat_s", f"must be a number of seconds in (0, 3600], got {heartbeat_s!r}")
        if isinstance(remember_batches, bool) or not isinstance(remember_batches, int) or remember_batches < 1:
            raise ConfigError("remember_batches", f"must be a positive int, got {remember_batches!r}")
        if replay is not None and replay_endpoint is not None:
            raise ConfigError("replay", "give replay_endpoint or a replay client, not both")
        self.ingestor = ingestor
        self._zmq = zmq
        self.on_gap = on_gap
        self.ctx: Any = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        _bounded(self.sock, zmq, max_message_bytes, "max_message_bytes")
        ivl_ms = max(int(heartbeat_s * 1000), 1)
        self.sock.setsockopt(zmq.HEARTBEAT_IVL, ivl_ms)
        self.sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3 * ivl_ms)
        self.sock.setsockopt_string(zmq.SUBSCRIBE, topic)
        self.monitor: Any = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            _connect(self.sock, endpoint, "endpoint")
        except ConfigError:
            self.monitor.close(linger=0)
            raise
        self._poller = zmq.Poller()  # the event socket and its connection monitor, read together
        self._poller.register(self.sock, zmq.POLLIN)
        self._poller.register(self.monitor, zmq.POLLIN)
        self.poll_ms = poll_ms
        self.last_seq: int | None = None
        self._seen: OrderedDict[int, bytes] = OrderedDict()  # seq -> digest of its payload, the last remember_batches
        self._remember_n = remember_batches
        if check_every_s is not None and (isinstance(check_every_s, bool) or not isinstance(check_every_s, (int, float)) or not 0 < check_every_s < float("inf")):
            raise ConfigError("check_every_s", f"must be a finite positive number of seconds or None, got {check_every_s!r}")
        self.check_every_s = check_every_s
        self._checked_at = time.monotonic()
        try:
            self.replay = ReplayClient(replay_endpoint, max_message_bytes=max_message_bytes) if replay_endpoint else replay
        except ConfigError:
            self.monitor.close(linger=0)
            self.sock.close(linger=0)
            raise

    @classmethod
    def for_ranks(cls, make_ingestor: Any, host: str, base_port: int, ranks: int, *, replay_base_port: int | None = None,
                  **kw: Any) -> list[ZmqEventSubscriber]:
        """One subscriber per data-parallel rank (rank r publishes on ``base_port + r``, its replay socket on
        ``replay_base_port + r``); ``make_ingestor(rank)`` gives each its own ingestor (its own holder: each rank is its
        own engine). The two port ranges must not overlap: vLLM offsets both by the rank, so events on 5557 and replay
        on 5558 put rank 1's events on rank 0's replay port."""
        if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks <= 0:
            raise ConfigError("ranks", f"must be a positive int, got {ranks!r}")
        if "replay_endpoint" in kw:
            raise ConfigError("replay_endpoint", "one endpoint cannot serve every rank: give replay_base_port (rank r: + r)")
        if replay_base_port is not None and not (replay_base_port + ranks <= base_port or base_port + ranks <= replay_base_port):
            raise ConfigError("replay_base_port", f"ranks' event ports {base_port}-{base_port + ranks - 1} and replay ports "
                                                  f"{replay_base_port}-{replay_base_port + ranks - 1} overlap: the engine's "
                                                  "ranks would bind the same port (e.g. replay on base_port + ranks)")
        subs: list[ZmqEventSubscriber] = []
        try:
            for r in range(ranks):
                replay = None if replay_base_port is None else f"tcp://{host}:{replay_base_port + r}"
                subs.append(cls(make_ingestor(r), f"tcp://{host}:{base_port + r}", replay_endpoint=replay, **kw))
        except BaseException:
            for sub in subs:
                sub.close()
            raise
        return subs

    # ------------------------------------------------------------------ continuity

    @staticmethod
    def _digest(payload: bytes) -> bytes:
        return hashlib.blake2b(payload, digest_size=16).digest()

    def _remember(self, seq: int, payload: bytes) -> None:
        self._seen[seq] = self._digest(payload)
        self._seen.move_to_end(seq)
        while len(self._seen) > self._remember_n:
            self._seen.popitem(last=False)

    def _apply(self, seq: int, payload: bytes) -> None:
        self._remember(seq, payload)
        self.last_seq = seq
        self.ingestor.ingest(payload)

    def _forget(self, counter: str, why: str) -> None:
        c = self.ingestor.counts
        c[counter] = c.get(counter, 0) + 1
        log.warning("kvpolicy events: %s: forgetting what %s was known to hold", why, self.ingestor.holder)
        self.ingestor.forget_all()
        self._seen.clear()
        self.last_seq = None

    def _prefill(self, seq: int) -> None:
        """Starting over at ``seq``: what the replay socket still holds before it (the engine's batches from seq 0)."""
        got = self.replay.fetch(0, until=seq - 1) if self.replay is not None and seq > 0 else []
        for s, payload in sorted(got, key=lambda x: x[0]):
            self._apply(s, payload)

    def on_disconnect(self) -> None:
        """The engine's socket went away (the monitor saw it): a dead engine holds nothing."""
        self._forget("disconnects", "the engine's event socket disconnected")

    def handle(self, parts: list[bytes]) -> None:
        """One multipart message from the PUB socket."""
        c = self.ingestor.counts
        if len(parts) != 3 or len(parts[1]) != 8:
            c["malformed_frames"] += 1
            self.ingestor._refuse("malformed_frame")
            log.warning("kvpolicy events: dropped a frame of %d parts", len(parts))
            return
        seq, payload = int.from_bytes(parts[1], "big"), parts[2]
        last = self.last_seq
        if last is not None and seq == last and self._seen.get(seq) == self._digest(payload):
            c["duplicates"] = c.get("duplicates", 0) + 1
            return  # the same batch again
        if last is not None and seq <= last:  # the seq went back, or the same seq with other bytes: a new engine
            self._forget("restarts", f"sequence {seq} after {last} with another payload: the engine restarted")
        elif last is not None and seq > last + 1:
            self._gap(last, seq)
        if self.last_seq is None:
            self._prefill(seq)
        self._apply(seq, payload)

    def _same_engine(self, got: list[tuple[int, bytes]], last: int) -> bool:
        """Whether the replay socket's batches (``got``) are those of the engine this subscriber has been hearing: the
        ones it has already seen must be the same bytes, and there must be some. Otherwise what it knows is forgotten
        (a restart, or a replay that no longer holds anything seen: either way it may be stale)."""
        seen = [(s, p) for s, p in got if s in self._seen]
        if any(self._digest(p) != self._seen[s] for s, p in seen):
            self._forget("restarts", f"the replay socket's batches up to {last} are not the ones seen: the engine restarted")
            return False
        if not seen:
            self._forget("resyncs", f"the replay socket holds nothing seen up to {last}")
            return False
        return True

    def check_continuity(self) -> bool:
        """Ask the replay socket whether the engine is still the one heard (the periodic check, every ``check_every_s``):
        a restarted engine whose new seq ran on from the old one's — its disconnect unseen — is caught here. After a
        restart, what the new engine published (its replay buffer) is applied. True if nothing had to be forgotten."""
        if self.replay is None or self.last_seq is None:
            return True
        last = self.last_seq
        self._checked_at = time.monotonic()
        if self._same_engine(self.replay.fetch(min(self._seen, default=last), until=last), last):
            return True
        got = self.replay.fetch(0)
        for s, payload in sorted(got, key=lambda x: x[0]):
            self._apply(s, payload)
        return False

    def _gap(self, last: int, seq: int) -> None:
        c = self.ingestor.counts
        got = self.replay.fetch(min(self._seen, default=last), until=seq - 1) if self.replay is not None else []
        if self.replay is not None and not self._same_engine(got, last):
            return
        fill = sorted((s, p) for s, p in got if last < s < seq)
        for s, p in fill:
            self._apply(s, p)
        missed = seq - last - 1 - len({s for s, _ in fill})
        if missed > 0:
            c["missed_batches"] += missed
            if self.on_gap == "forget":  # a missed batch may have removed blocks we still claim
                self._forget("resyncs", f"{missed} batch(es) before seq {seq} are lost")

    def poll_once(self) -> bool:
        """Handle at most one message (and any connection event); False if none arrived within ``poll_ms``."""
        zmq = self._zmq
        ready = dict(self._poller.poll(self.poll_ms))
        if self.monitor in ready:
            from zmq.utils.monitor import recv_monitor_message

            while self.monitor.poll(0):
                if recv_monitor_message(self.monitor)["event"] == zmq.EVENT_DISCONNECTED:
                    self.on_disconnect()
        if self.check_every_s is not None and self.replay is not None and time.monotonic() - self._checked_at >= self.check_every_s:
            self.check_continuity()
        if self.sock not in ready:
            return False
        self.handle(self.sock.recv_multipart())
        return True

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            self.poll_once()

    def close(self) -> None:
        try:
            self.sock.disable_monitor()
        except Exception:  # already closed, or a libzmq without monitors
            pass
        self.monitor.close(linger=0)
        self.sock.close(linger=0)
        if self.replay is not None and hasattr(self.replay, "close"):
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
