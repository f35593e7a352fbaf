"""A real engine behind kvpolicy's seams: paged KV cache, prefix reuse, remote loads, publishing.

:class:`ReferenceEngine` uses kvpolicy only through its public pieces: keys from
:class:`~kvpolicy.keys.BlockHasher` under the model's :class:`~kvpolicy.keys.Namespace`,
:func:`~kvpolicy.matching.match` over its own cache and its peers (any
``BlockIndex``), an :class:`~kvpolicy.eviction.base.EvictionPolicy` for its block
pool, an :class:`~kvpolicy.admission.AdmissionController` for every remote load
(fed with what each load really measured), a publish filter, and a
:class:`~kvpolicy.ledger.Ledger`.

The KV cache is paged: ``k_pool``/``v_pool`` hold ``capacity_blocks`` blocks of
``B`` tokens × layers × KV heads × head dim. A prefill reuses the leading local
blocks, loads the admitted remote ones (checksummed, namespace-checked, through a
staging buffer), computes the rest, caches every full block it made, and
publishes what the filter allows to its own :class:`~kvpolicy.reference.transport.BlockStore`
(served to peers when ``serve=True``). A failed, timed-out or corrupt load — any
error of the transport, ``MemoryError`` included — falls back to recompute, and
the admission controller always hears how the load ended: the output is the
same either way.

Serving peers (``serve=True``) or publishing into a shared server
(``publish_to``) needs the deployment ``secret``: keys then come from the
``keyed`` scheme and every connection is authenticated with it. The ``fast``
scheme is refused there — anyone who can guess a prompt can compute its keys.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Sequence
from typing import Any

import attrs
import numpy as np

from ..admission import AdmissionContext, AdmissionController, Decision, LoadOutcome
from ..admission.controller import LoadStatus
from ..errors import CapacityError, ConfigError
from ..eviction.base import EvictionPolicy
from ..eviction.policies import LRUPolicy
from ..keys import BlockHasher
from ..ledger import Ledger, NotLoaded, RequestRecord
from ..matching import match
from ..publish import PublishAll, PublishRequest
from .model import ModelConfig, Transformer
from .transport import BlockServer, BlockStore, CorruptBlockError, PeerClient, TransportLimits


@attrs.frozen(eq=False)
class PrefillResult:
    logits: np.ndarray
    local_blocks: int
    remote_found: int
    loaded_blocks: int
    computed_tokens: int
    load_status: str | None
    decision: Decision | None
    timings: dict[str, float]
    #: the prompt's full-block keys, in order (what :meth:`ReferenceEngine.publish` offers the filter)
    keys: tuple[bytes, ...] = ()
    prompt_tokens: int = 0
    #: of ``loaded_blocks``, those a peer sent into the store when asked (a pull, issue #44)
    pulled_blocks: int = 0


class _LocalIndex:
    name = "local"

    def __init__(self, engine: ReferenceEngine) -> None:
        self.engine = engine

    def match_prefix(self, keys: Sequence[bytes]) -> int:
        slots = self.engine.slot_of
        n = 0
        for k in keys:
            if k not in slots:
                break
            n += 1
        return n


class ReferenceEngine:
    def __init__(self, config: ModelConfig | None = None, *, block_size_tokens: int = 16, capacity_blocks: int = 2048, tenant: str = "default",
                 adapter: tuple[str, str] | None = None, eviction: EvictionPolicy | None = None, peers: Sequence[PeerClient] = (),
                 controller: AdmissionController | None = None, publish_filter: Any = None, ledger: Ledger | None = None,
                 replica: str = "replica-0", serve: bool = False, hasher: BlockHasher | None = None,
                 publish_to: PeerClient | None = None, secret: bytes | None = None, transport_limits: TransportLimits | None = None) -> None:
        self.config = config or ModelConfig()
        if isinstance(capacity_blocks, bool) or not isinstance(capacity_blocks, int) or capacity_blocks <= 0:
            raise ConfigError("capacity_blocks", f"must be a positive int, got {capacity_blocks!r}")
        c = self.config
        self.model = Transformer(c)
        self.B = block_size_tokens
        self.namespace = c.namespace(block_size_tokens, tenant=tenant, adapter=adapter)
        self.hasher = hasher or (BlockHasher(self.namespace, "keyed", secret) if secret is not None else BlockHasher(self.namespace, "fast"))
        if self.hasher.namespace != self.namespace:
            raise ConfigError("hasher", "must hash under this engine's namespace")
        if serve and secret is None:
            raise ConfigError("secret", "serving blocks to peers needs the deployment secret (16..64 bytes): peers authenticate with it")
        if (serve or publish_to is not None) and self.hasher.scheme != "keyed":
            raise ConfigError("hasher", "serving or publishing blocks to peers needs the keyed scheme: with 'fast' anyone who can "
                                        "guess a prompt can compute its keys (pass the deployment secret=)")
        shape = (capacity_blocks, c.num_layers, block_size_tokens, c.num_kv_heads, c.head_dim)
        try:
            self.k_pool = np.zeros(shape, dtype=c.dtype)
            self.v_pool = np.zeros(shape, dtype=c.dtype)
        except (MemoryError, ValueError) as exc:  # numpy's "maximum allowed dimension exceeded" past 2**63 elements
            per_block = 2 * c.num_layers * block_size_tokens * c.num_kv_heads * c.head_dim * np.dtype(c.dtype).itemsize
            raise ConfigError("capacity_blocks", f"{capacity_blocks:,} blocks of {per_block:,} KV bytes cannot be allocated ({exc})") from None
        self.block_bytes = int(self.k_pool[0].nbytes + self.v_pool[0].nbytes)
        self.capacity_blocks = capacity_blocks
        self.slot_of: dict[Hashable, int] = {}  # block key (bytes) -> slot; the policy names victims as Hashable
        self.free = list(range(capacity_blocks - 1, -1, -1))
        self.policy = eviction or LRUPolicy(capacity_blocks * self.block_bytes)
        self.peers = list(peers)
        self.controller = controller
        self.filter = publish_filter if publish_filter is not None else PublishAll()
        self.ledger = ledger
        self.replica = replica
        self.store = BlockStore(self.namespace.digest, self.block_bytes)
        self.server = BlockServer(self.store, secret=secret, limits=transport_limits) if serve and secret is not None else None  # serve needs it: checked above
        for p in [*self.peers, *([publish_to] if publish_to is not None else [])]:
            if p.block_bytes != self.block_bytes:
                raise ConfigError("peers", f"a peer client expects {p.block_bytes}-byte blocks, this engine's are {self.block_bytes}")
        self.local_index = _LocalIndex(self)
        #: a shared block server to publish into (in the background, as engines write back), besides the own store
        self.publish_to = publish_to
        self._outbox: Any = None
        if publish_to is not None:
            import queue
            import threading

            self._outbox = queue.Queue()
            threading.Thread(target=self._publisher, daemon=True).start()
        self.counts = {"loads_ok": 0, "loads_failed": 0, "loads_timeout": 0, "corrupt_refused": 0, "evicted_blocks": 0, "publish_failed": 0}

    # ------------------------------------------------------------------ cache

    def _publisher(self) -> None:
        while True:
            item = self._outbox.get()
            if item is None:
                return
            keys, payloads = item
            try:
                if self.publish_to.put(keys, payloads, 30.0) < len(keys):  # type: ignore[union-attr]
                    self.counts["publish_failed"] += 1
            except Exception:  # a publish is best effort: never let it stop the publisher
                self.counts["publish_failed"] += 1
            finally:
                self._outbox.task_done()

    def flush_publishes(self) -> None:
        """Wait until every background publish has been sent."""
        if self._outbox is not None:
            self._outbox.join()

    def allocated_kv_bytes(self) -> int:
        """Bytes of KV the paged cache holds right now (blocks in use × bytes per block)."""
        return (self.capacity_blocks - len(self.free)) * self.block_bytes

    def reset(self) -> None:
        """Drop every cached block (a cold cache)."""
        for key in list(self.slot_of):
            self.free.append(self.slot_of.pop(key))
        self.policy = type(self.policy)(self.policy.capacity_bytes)

    def _alloc(self, key: bytes, parent: bytes | None) -> int | None:
        if not self.free:
            try:
                victims = self.policy.victims(self.block_bytes, key)
            except CapacityError:
                return None
            for v in victims:
                self.free.append(self.slot_of.pop(v))
                self.counts["evicted_blocks"] += 1
        if parent is not None and parent not in self.slot_of:
            return None  # the parent went: keep the cache prefix-closed
        slot = self.free.pop()
        self.policy.on_insert(key, self.block_bytes, parent)
        self.slot_of[key] = slot
        return slot

    def payload(self, key: bytes) -> bytes:
        s = self.slot_of[key]
        return np.stack([self.k_pool[s], self.v_pool[s]]).tobytes()

    def _install(self, key: bytes, parent: bytes | None, payload: bytes) -> bool:
        c = self.config
        arr = np.frombuffer(payload, dtype=c.dtype)
        if arr.size * arr.itemsize != self.block_bytes:
            raise CorruptBlockError(f"block of {len(payload)} bytes, this engine's blocks are {self.block_bytes}")
        arr = arr.reshape(2, c.num_layers, self.B, c.num_kv_heads, c.head_dim)
        slot = self._alloc(key, parent)
        if slot is None:
            return False
        self.k_pool[slot] = arr[0]
        self.v_pool[slot] = arr[1]
        return True

    def _gather(self, keys: Sequence[bytes]) -> tuple[list[np.ndarray], list[np.ndarray]]:
        c = self.config
        if not keys:
            return [], []
        slots = [self.slot_of[k] for k in keys]
        K = self.k_pool[slots]  # (n, layers, B, Hkv, D)
        V = self.v_pool[slots]
        n = len(slots)
        pk = [K[:, li].reshape(n * self.B, c.num_kv_heads, c.head_dim) for li in range(c.num_layers)]
        pv = [V[:, li].reshape(n * self.B, c.num_kv_heads, c.head_dim) for li in range(c.num_layers)]
        return pk, pv

    # ------------------------------------------------------------------ remote

    def load_remote(self, peer: PeerClient, keys: Sequence[bytes], parent: bytes | None, timeout_s: float) -> dict[str, float]:
        """Fetch and install blocks from a peer (left pinned for the caller); returns the measured
        terms. Raises on failure, with nothing left pinned."""
        res = peer.fetch(keys, timeout_s)
        t0 = time.perf_counter()
        prev = parent
        done: list[bytes] = []
        try:
            for k, p in zip(keys, res.payloads):
                if k not in self.slot_of and not self._install(k, prev, p):
                    raise CapacityError("no room to install the loaded blocks")
                self.policy.pin(k)
                done.append(k)
                prev = k
        except BaseException:
            for k in done:
                self.policy.unpin(k)
            raise
        install_s = time.perf_counter() - t0
        return {"lookup_s": res.lookup_s, "transfer_s": res.transfer_s, "stage_s": res.stage_s, "install_s": install_s, "bytes": float(res.nbytes)}

    def _now_s(self) -> float:
        """The engine's time: its controller's clock, else monotonic seconds."""
        return self.controller.clock.now_s() if self.controller is not None else time.monotonic()

    # ------------------------------------------------------------------ prefill

    def prefill(self, tokens: Sequence[int], *, request_id: Any = None, publish: bool = True, boundary_tokens: int | None = None) -> PrefillResult:
        t_start = time.perf_counter()
        arrival_s = self._now_s()  # the ledger's windows and miss classes run on the request's time
        raw = np.asarray(tokens)
        if raw.size and (raw.dtype == np.bool_ or not np.issubdtype(raw.dtype, np.integer)):  # 1.5 was cut to 1 by the cast
            raise ConfigError("tokens", f"token ids must be integers, got an array of {raw.dtype}")
        toks = raw.astype(np.int64)
        T = int(toks.size)
        if T == 0:
            raise ConfigError("tokens", "an empty prompt has nothing to prefill")
        keys = list(self.hasher.hash_blocks(toks))
        B = self.B
        m = match(keys, T, self.local_index, *self.peers, block_size_tokens=B)
        timings: dict[str, float] = {"match_s": time.perf_counter() - t_start}  # hashing + the local and remote lookups
        L = m.local_blocks
        pinned = keys[:L]
        for k in pinned:
            self.policy.on_access(k)
            self.policy.pin(k)
        decision = None
        status: LoadStatus | None = None
        loaded = 0
        R = m.remote_total_blocks
        try:
            if R and self.controller is not None:
                peer = self.peers[next(i for i, r in enumerate(m.remote_blocks) if r)]
                decision = self.controller.decide(m, AdmissionContext(block_bytes=self.block_bytes, replica=self.replica, source=peer.name))
                if decision.loads:
                    n_load = decision.load_blocks
                    want = keys[L:L + n_load]
                    status = "failed"
                    try:
                        t = self.load_remote(peer, want, keys[L - 1] if L else None, decision.soft_timeout_s or 5.0)
                        timings.update(t)
                        status = "ok"
                        loaded = n_load
                        pinned = pinned + want
                        self.counts["loads_ok"] += 1
                    except TimeoutError:
                        status = "timeout"
                        self.counts["loads_timeout"] += 1
                    except CorruptBlockError:
                        self.counts["corrupt_refused"] += 1
                    except Exception:  # any transport error, MemoryError included: recompute
                        self.counts["loads_failed"] += 1
                    finally:  # the controller always hears how the load ended, so its slot is released
                        if status != "ok":  # nothing was installed: recompute
                            timings["lookup_s"] = peer.last_lookup_s
                        assert decision.load_id is not None and status is not None  # an admitted load has an id and an end
                        self.controller.record(LoadOutcome(decision.load_id, status, loaded, lookup_s=timings.get("lookup_s"),
                                                           transfer_s=timings.get("transfer_s"), stage_s=timings.get("stage_s"),
                                                           install_s=timings.get("install_s")))
            reused = L + loaded
            t0 = time.perf_counter()
            pk, pv = self._gather(keys[:reused])
            t1 = time.perf_counter()
            timings["gather_s"] = t1 - t0
            logits, nk, nv = self.model.forward(toks[reused * B:], reused * B, pk, pv)
            t0 = time.perf_counter()
            timings["prefill_s"] = t0 - t1
            # cache every full block computed here
            c = self.config
            parent = keys[reused - 1] if reused else None
            for j in range(reused, len(keys)):
                key = keys[j]
                if key in self.slot_of:
                    parent = key
                    continue
                slot = self._alloc(key, parent)
                if slot is None:
                    break
                a, b = (j - reused) * B, (j - reused + 1) * B
                for li in range(c.num_layers):
                    self.k_pool[slot, li] = nk[li][a:b]
                    self.v_pool[slot, li] = nv[li][a:b]
                parent = key
            timings["cache_s"] = time.perf_counter() - t0
        finally:
            for k in pinned:
                if k in self.policy.nodes and self.policy.nodes[k].pins:
                    self.policy.unpin(k)
        timings["ttft_s"] = time.perf_counter() - t_start  # the first token is ready: write-back comes after it
        if self.ledger is not None:
            not_loaded = R - loaded
            reason: NotLoaded | None = None if not not_loaded else ("declined" if status in (None, "ok") else ("timeout" if status == "timeout" else "transfer_error"))
            self.ledger.record(RequestRecord(prompt_tokens=T, block_size_tokens=B, local_blocks=L, remote_loaded_blocks=loaded,
                                             remote_not_loaded_blocks=not_loaded, not_loaded_reason=reason,
                                             ttft_s=timings["ttft_s"], prefill_s=timings["prefill_s"],
                                             load_s=(timings.get("transfer_s", 0) + timings.get("stage_s", 0) + timings.get("install_s", 0)) if loaded else None,
                                             predicted_recompute_s=decision.t_recompute_p50_s if decision is not None and loaded else None,
                                             load_attempted=status is not None, arrival_s=arrival_s))
        result = PrefillResult(logits, L, R, loaded, T - (L + loaded) * B, status, decision, timings, tuple(keys), T)
        if publish:
            self.publish(result, request_id=request_id if request_id is not None else id(toks), boundary_tokens=boundary_tokens)
        return result

    def publish(self, result: PrefillResult, *, request_id: Any = None, boundary_tokens: int | None = None) -> int:
        """Offer a finished prefill's cached blocks to the publish filter and serve what it allows (to the
        shared server in the background when there is one) — after the first token, as engines write
        back. ``prefill(publish=True)`` calls it; a caller that answers first calls it itself. Returns
        the blocks newly published; their time is ``result.timings["publish_s"]``."""
        if not isinstance(result, PrefillResult):
            raise ConfigError("result", f"must be the PrefillResult of this engine's prefill, got {type(result).__name__}")
        t0 = time.perf_counter()
        keys = list(result.keys)
        cached = keys[: self.local_index.match_prefix(keys)]  # publishing is prefix-closed
        now_s = self._now_s()
        req = PublishRequest(request_id=request_id if request_id is not None else id(result), num_tokens=result.prompt_tokens,
                             block_size_tokens=self.B, boundary_tokens=boundary_tokens, replica=self.replica,
                             reused_blocks=result.local_blocks + result.loaded_blocks, time_s=now_s)  # the filter's windows run on it
        self.filter.observe(req, cached)
        fresh = []
        for key in cached[: self.filter.publishable(req, cached)]:
            if key not in self.store.blocks:
                payload = self.payload(key)
                self.store.put(key, payload)
                fresh.append((key, payload))
        if fresh and self._outbox is not None:
            self._outbox.put(([k for k, _ in fresh], [p for _, p in fresh]))
        result.timings["publish_s"] = time.perf_counter() - t0
        return len(fresh)

    def generate(self, tokens: Sequence[int], max_new_tokens: int) -> list[int]:
        """Greedy decoding after a prefill; decode steps attend to the request's own KV."""
        res = self.prefill(tokens)
        out = [int(np.argmax(res.logits))]
        toks = np.asarray(tokens, dtype=np.int64)
        keys = list(self.hasher.hash_blocks(toks))
        n = self.local_index.match_prefix(keys)
        pk, pv = self._gather(keys[:n])
        start = n * self.B
        if start < toks.size:
            _, tk, tv = self.model.forward(toks[start:], start, pk, pv)
            K = [np.concatenate([a, b]) for a, b in zip(pk, tk)] if pk else tk
            V = [np.concatenate([a, b]) for a, b in zip(pv, tv)] if pv else tv
        else:
            K, V = pk, pv
        pos = int(toks.size)
        for _ in range(max_new_tokens - 1):
            logits, nk, nv = self.model.forward(np.asarray([out[-1]]), pos, K, V)
            K = [np.concatenate([a, b]) for a, b in zip(K, nk)]
            V = [np.concatenate([a, b]) for a, b in zip(V, nv)]
            out.append(int(np.argmax(logits)))
            pos += 1
        return out

    def close(self) -> None:
        if self._outbox is not None:
            self._outbox.put(None)
        if self.server is not None:
            self.server.close()
        for p in self.peers:
            p.close()
        if self.publish_to is not None:
            self.publish_to.close()
