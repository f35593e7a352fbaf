"""A replica in its own process: a serving :class:`ReferenceEngine` driven over a pipe.

``PeerReplica.start(config)`` spawns the process, which builds an engine with a
:class:`~kvpolicy.reference.transport.BlockServer` on a free loopback port and
answers commands: ``prefill(tokens)`` (computes — loading from its ``peer`` through an admission
controller when given one — answers, then publishes before it reads the next command), ``set_faults(...)`` (drop / delay /
corrupt its transfers, for tests), ``reset()`` (drop its cache), ``stats()``,
``ledger()``, ``close()``. Other replicas reach
its blocks only through TCP (:class:`~kvpolicy.reference.transport.PeerClient`),
authenticated with the deployment ``secret`` every replica is started with (it
travels over the process pipe, never on a command line).
"""

from __future__ import annotations

import multiprocessing as mp
from typing import Any

from .._validate import check_positive_int
from ..errors import ConfigError
from .model import ModelConfig


def _serve(conn: Any, config: ModelConfig, block_size_tokens: int, capacity_blocks: int, publish: str, name: str,
           peer: tuple[tuple[str, int], bytes] | None, opts: dict[str, Any], secret: bytes) -> None:
    import attrs

    from ..admission import AdmissionConfig, AdmissionController, CircuitBreaker, LatencyModel, LinkPrior
    from ..ledger import Ledger
    from ..publish import make_filter
    from ..publish_sim import DEFAULT_PREFILL
    from .engine import ReferenceEngine
    from .transport import PeerClient

    block_bytes = config.block_bytes(block_size_tokens)
    peers = [PeerClient(peer[0], peer[1], secret=secret, block_bytes=block_bytes, name="peer")] if peer else []
    # a shared block server (a pool node): this replica loads from it and publishes into it
    publish_to = PeerClient(peer[0], peer[1], secret=secret, block_bytes=block_bytes, name="publish") if peer and opts.get("shared") else None
    controller = None
    if peer:
        prefill = opts.get("prefill") or DEFAULT_PREFILL
        model = LatencyModel(LinkPrior(bandwidth_bytes_per_s=opts["link_bytes_per_s"], **opts.get("prior", {})), prefill, min_samples=opts["min_samples"],
                             window_s=opts["window_s"])
        controller = AdmissionController(model, AdmissionConfig(probe_interval_s=opts["probe_interval_s"]),
                                         breaker_factory=lambda: CircuitBreaker(failure_threshold=3, open_s=opts["breaker_open_s"]))
    eng = ReferenceEngine(config, block_size_tokens=block_size_tokens, capacity_blocks=capacity_blocks, serve=True, replica=name,
                          publish_filter=make_filter(publish), peers=peers, controller=controller, ledger=Ledger(config.geometry().bytes_per_token),
                          publish_to=publish_to, secret=secret)
    assert eng.server is not None
    conn.send(("ready", eng.server.address, eng.namespace.digest))
    while True:
        try:
            cmd, arg = conn.recv()
        except EOFError:
            break
        if cmd == "prefill":
            tokens, boundary, learn = arg
            r = eng.prefill(tokens, boundary_tokens=boundary, publish=False)
            if controller is not None and learn:  # feed the measured prefill back: the model learns this machine's speed
                controller.model.observe_prefill((r.local_blocks + r.loaded_blocks) * block_size_tokens, r.computed_tokens, r.timings["prefill_s"])
            # the first token goes out before the write-back, as an engine answers before it offloads;
            # the next command (a request, stats, flush) is read after the publish
            conn.send({"local_blocks": r.local_blocks, "remote_found": r.remote_found,
                       "loaded_blocks": r.loaded_blocks, "load_status": r.load_status, "reason": r.decision.reason if r.decision else None,
                       "ttft_ms": r.timings["ttft_s"] * 1e3, "prefill_ms": r.timings["prefill_s"] * 1e3,
                       "load_bytes": r.timings.get("bytes", 0.0), "timings": dict(r.timings)})
            eng.publish(r, boundary_tokens=boundary)
        elif cmd == "flush":
            eng.flush_publishes()
            conn.send(True)
        elif cmd == "faults":
            for k, v in arg.items():
                setattr(eng.server.faults, k, v)
            conn.send(True)
        elif cmd == "reset":
            eng.reset()
            conn.send(True)
        elif cmd == "stats":
            conn.send({"published_blocks": len(eng.store.blocks), "allocated_kv_bytes": eng.allocated_kv_bytes(), **eng.counts,
                       "server": dict(eng.server.stats), "peers": {p.name: dict(p.stats) for p in eng.peers},
                       # what its admission controller has learned of each source, at the quantiles the rule compares
                       "admission": {p.name: {"p50": attrs.asdict(controller.model.coefficients(0.5, p.name)),
                                              "p95": attrs.asdict(controller.model.coefficients(0.95, p.name))}
                                     for p in eng.peers} if controller is not None else {}})
        elif cmd == "ledger":
            conn.send(eng.ledger.to_dict() if eng.ledger is not None else {})
        elif cmd == "stop":
            conn.send(True)
            break
    eng.close()


class PeerReplica:
    def __init__(self, proc: Any, conn: Any, address: tuple[str, int], namespace_digest: bytes) -> None:
        self.proc = proc
        self.conn = conn
        self.address = address
        self.namespace_digest = namespace_digest

    @classmethod
    def start(cls, config: ModelConfig | None = None, *, secret: bytes, block_size_tokens: int = 16, capacity_blocks: int = 4096,
              publish: str = "all", name: str = "replica", peer: PeerReplica | None = None, link_bytes_per_s: float = 1e9,
              breaker_open_s: float = 10.0, window_s: float = 300.0, probe_interval_s: float = 30.0, timeout_s: float = 60.0,
              shared: tuple[tuple[str, int], bytes] | None = None, prefill: Any = None, prior: dict[str, float] | None = None,
              min_samples: int = 3) -> PeerReplica:
        """Spawn a replica process. With ``peer``, it loads from that replica through its
        admission controller (prior: ``link_bytes_per_s``), corrected by live measurements.
        With ``shared`` (a block server's address and namespace digest) instead, it loads from that
        server and publishes into it in the background — replicas sharing a pool node; ``prefill``
        (a PrefillModel) and ``prior`` (LinkPrior fields) configure its admission model, which trusts a term's own
        measurements from its ``min_samples``-th on (3: a short demo learns at once; the library's default is 20). ``secret``: the
        deployment secret (16..64 bytes) its keys and its peers' connections are authenticated with."""
        from .transport import TransportKeys

        TransportKeys.from_secret(secret)  # refuse a bad secret here, not in the child
        check_positive_int("min_samples", min_samples)
        ctx = mp.get_context("spawn")
        a, b = ctx.Pipe()
        peer_arg = (peer.address, peer.namespace_digest) if peer is not None else shared
        opts = {"link_bytes_per_s": link_bytes_per_s, "breaker_open_s": breaker_open_s, "window_s": window_s, "probe_interval_s": probe_interval_s,
                "shared": shared is not None, "prefill": prefill, "prior": prior or {}, "min_samples": min_samples}
        proc = ctx.Process(target=_serve, args=(b, config or ModelConfig(), block_size_tokens, capacity_blocks, publish, name, peer_arg, opts, bytes(secret)),
                           daemon=True)
        proc.start()
        if not a.poll(timeout_s):
            proc.kill()
            raise RuntimeError("the peer replica did not start")
        _, address, digest = a.recv()
        return cls(proc, a, tuple(address), digest)

    def _ask(self, cmd: str, arg: Any = None) -> Any:
        self.conn.send((cmd, arg))
        return self.conn.recv()

    def prefill(self, tokens: Any, boundary_tokens: int | None = None, *, wait_published: bool = False, learn: bool = True) -> dict[str, Any]:
        """Prefill on the replica; returns what happened (blocks found and loaded, TTFT, every timing) as
        soon as the first token is ready. The replica publishes after answering; any later command
        (``stats``, ``flush``, the next prefill) sees the blocks published, but another replica asking
        over TCP may not yet. ``wait_published=True`` returns only once the blocks are served (and, with a
        shared server, have reached it); the reply then also holds ``published_blocks``. ``learn=False``: the
        admission controller does not hear this prefill's time — a probe of the serving path, not traffic (a
        probe's short cold prompts run further from the profile than the traffic does)."""
        if not isinstance(learn, bool):
            raise ConfigError("learn", f"must be True or False, got {learn!r}")
        out = self._ask("prefill", (list(map(int, tokens)), boundary_tokens, learn))
        if wait_published:
            self.flush()
            out["published_blocks"] = self.stats()["published_blocks"]
        return out

    def reset(self) -> None:
        """Drop the replica's local cache (other traffic evicted it)."""
        self._ask("reset")

    def flush(self) -> None:
        """Wait until the replica's background publishes have reached the shared server."""
        self._ask("flush")

    def ledger(self) -> dict[str, Any]:
        return self._ask("ledger")

    def set_faults(self, **faults: Any) -> None:
        self._ask("faults", faults)

    def stats(self) -> dict[str, Any]:
        return self._ask("stats")

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self._ask("stop")
            except (EOFError, OSError, BrokenPipeError):
                pass
            self.proc.join(timeout=10)
            if self.proc.is_alive():
                self.proc.kill()

    def __enter__(self) -> PeerReplica:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
