"""KV events made by the engines' own code, with what each engine holds at the end: the ground truth for kvpolicy's
event ingestion (tests/test_engine_events.py, and ``tools/check_engine_bases.py``).

vLLM 0.33's ``BlockPool`` (``vllm/v1/core/block_pool.py``) with its hasher (``kv_cache_utils``: ``init_none_hash``,
``get_request_block_hasher``, the extra keys for LoRA, cache salt and multimodal items) and its event classes
(``vllm/distributed/kv_events.py``); SGLang 0.5.23's ``RadixCache`` with its ``KVCacheEventRecorder``
(``mem_cache/events.py``), its event classes (``disaggregation/kv_events.py``) and its native hash
(``mem_cache/cpp_utils/hash_binding.cpp``, compiled here with pybind11 and OpenSSL exactly as SGLang's loader compiles
it). All of it is read out of the downloaded wheels; only heavy imports the event paths do not use are stubbed (torch,
the engines' configs and loggers, PIL). Each run is its own process (the stubs live in ``sys.modules``)::

    pip download vllm==0.33.0 sglang==0.5.23 --no-deps -d wheels/
    python tools/engine_events.py --vllm wheels/vllm-0.33.0-*.whl --sglang wheels/sglang-0.5.23-*.whl --out cases.json

Each case: ``frames`` (``[seq, payload]`` per published batch, payload the engine's own msgpack encoding, per
``stream``: one engine lifetime or DP rank), ``replay`` (what the engine's replay socket holds, per stream), and
``held``: every block the engine holds at the end, as the prompt prefix it ends (``tokens``), its namespace
(``lora_name``, ``cache_salt``, ``mm_items``) and where (``medium``, ``group``, ``stream``). A consumer that got it
right has exactly these blocks in its directory: no block missing, none stale.
"""

from __future__ import annotations

import argparse
import ast
import base64
import enum
import hashlib
import json
import logging
import os
import subprocess
import sys
import sysconfig
import tempfile
import types
from typing import Any


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # its sibling, tools/engine_wheels.py
from engine_wheels import _module, _source  # noqa: E402


def _load(wheel: str, path: str, name: str) -> types.ModuleType:
    """As engine_wheels' ``_load``, into the module already there when there is one."""
    mod = sys.modules.get(name) or _module(name)
    exec(compile(_source(wheel, path), f"{wheel}!{path}", "exec"), mod.__dict__)
    return mod


def _load_functions(wheel: str, path: str, names: tuple[str, ...], into: types.ModuleType) -> None:
    """Only the named top-level functions of a module whose other imports are heavy (``vllm/multimodal/utils.py``
    imports PIL): their own source, compiled into ``into``."""
    tree = ast.parse(_source(wheel, path))
    body = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names]
    assert {n.name for n in body} == set(names), f"{path} lacks {set(names) - {n.name for n in body}}"
    exec(compile(ast.Module(body=body, type_ignores=[]), f"{wheel}!{path}", "exec"), into.__dict__)


def _encode(enc: Any, batch: Any) -> str:
    return base64.b64encode(enc.encode(batch)).decode()


# --------------------------------------------------------------------------- vLLM


class _Stream:
    """One engine lifetime's publisher: seq from 0, the engine's own batch class and encoder, and its replay buffer."""

    def __init__(self, name: str, make_batch: Any, enc: Any, dp_rank: int | None = None) -> None:
        self.name, self.make_batch, self.enc, self.dp_rank = name, make_batch, enc, dp_rank
        self.seq = 0
        self.frames: list[list[Any]] = []

    def publish(self, events: list[Any], ts: float = 0.0) -> None:
        if not events:
            return
        self.frames.append([self.seq, _encode(self.enc, self.make_batch(ts=ts + self.seq, events=events, data_parallel_rank=self.dp_rank))])
        self.seq += 1


def load_vllm(wheel: str, *, int_hashes: bool = True) -> types.SimpleNamespace:
    """vLLM 0.33's block pool, hasher and event classes out of the wheel."""
    for n in ("vllm", "vllm.distributed", "vllm.v1", "vllm.v1.core", "vllm.utils", "vllm.multimodal", "vllm.config"):
        _module(n)
    _module("torch", Tensor=object)
    _module("vllm.envs", VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=int_hashes)
    sys.modules["vllm"].envs = sys.modules["vllm.envs"]  # type: ignore[attr-defined]
    _module("vllm.config", VllmConfig=object)
    _module("vllm.config.kv_events", KVEventsConfig=object)
    _module("vllm.logger", init_logger=logging.getLogger)
    mm = _module("vllm.multimodal.utils")
    import bisect

    mm.bisect = bisect  # type: ignore[attr-defined]
    _load_functions(wheel, "vllm/multimodal/utils.py", ("get_mm_features_in_window",), mm)
    _load(wheel, "vllm/utils/hashing.py", "vllm.utils.hashing")
    _load(wheel, "vllm/utils/math_utils.py", "vllm.utils.math_utils")
    _module("vllm.utils.network_utils", get_ip=None, get_tcp_uri=None, is_valid_ipv6_address=None, split_zmq_path=None)
    _module("vllm.v1.kv_cache_interface", **dict.fromkeys(("KVCacheConfig", "KVCacheGroupSpec", "KVCacheSpec", "MambaSpec",
                                                           "UniformTypeKVCacheSpecs", "iter_layer_specs"), object))
    _module("vllm.v1.kv_cache_spec_registry", KVCacheSpecRegistry=object)
    _module("vllm.v1.request", Request=object)
    _module("vllm.v1.utils", tensor_data=lambda t: bytes(t))
    _module("vllm.v1.core.kv_cache_metrics", KVCacheMetricsCollector=object)
    # kv_events imports kv_cache_utils' ExternalBlockHash, and kv_cache_utils nothing of kv_events: utils first
    kcu = _load(wheel, "vllm/v1/core/kv_cache_utils.py", "vllm.v1.core.kv_cache_utils")
    ev = _load(wheel, "vllm/distributed/kv_events.py", "vllm.distributed.kv_events")
    bp = _load(wheel, "vllm/v1/core/block_pool.py", "vllm.v1.core.block_pool")
    import msgspec

    return types.SimpleNamespace(kcu=kcu, ev=ev, bp=bp, hashing=sys.modules["vllm.utils.hashing"], enc=msgspec.msgpack.Encoder())


class VllmRequest:
    """What the block pool and the hasher read of vLLM's ``Request`` (the real class pulls in torch and the
    sampler): token ids, block hashes appended by vLLM's own request hasher, LoRA, salt, multimodal features."""

    def __init__(self, tokens: list[int], hasher: Any, *, lora: tuple[str, str] | None = None, cache_salt: str | None = None,
                 mm_items: list[tuple[str, int, int]] = ()) -> None:  # type: ignore[assignment]
        self.all_token_ids = list(tokens)
        self.num_tokens = len(tokens)
        self.lora_request = None if lora is None else types.SimpleNamespace(lora_name=lora[0], lora_path=lora[1], adapter_id=1, name=lora[0])
        self.cache_salt = cache_salt
        self.mm_features = [types.SimpleNamespace(identifier=i, mm_position=types.SimpleNamespace(offset=o, length=n)) for i, o, n in mm_items] or None
        self.prompt_embeds = None
        self._prompt_embeds_per_block_hashes: dict[Any, bytes] = {}
        self.session_id = None
        self.block_hashes: list[Any] = []
        self.block_hashes.extend(hasher(self))
        self.meta = {"lora_name": lora[0] if lora else None, "cache_salt": cache_salt, "mm_items": [list(x) for x in mm_items]}


class VllmEngine:
    """One KV-cache group's block pool the way vLLM's scheduler drives it: a request's full blocks are cached
    (``cache_full_blocks``), freed when it finishes (they stay cached, evictable), evicted when a new allocation
    pops them off the free queue; ``reset_prefix_cache`` on a GPU reset. ``truth`` maps each cached block hash to the
    prefix it ends, for the ground truth."""

    def __init__(self, v: types.SimpleNamespace, stream: _Stream, *, blocks: int = 64, block_size: int = 16, medium: str = "GPU",
                 group: int = 0, algo: str = "sha256") -> None:
        self.v, self.stream, self.B, self.group = v, stream, block_size, group
        self.hash_fn = getattr(v.hashing, algo)
        v.kcu.init_none_hash(self.hash_fn)
        self.hasher = v.kcu.get_request_block_hasher(block_size, self.hash_fn)
        self.pool = v.bp.BlockPool(blocks, True, block_size, enable_kv_cache_events=True, medium=medium)
        self.truth: dict[bytes, dict[str, Any]] = {}

    def request(self, tokens: list[int], **kw: Any) -> VllmRequest:
        return VllmRequest(tokens, self.hasher, **kw)

    def run(self, req: VllmRequest, *, null_leading: int = 0, publish: bool = True) -> list[Any]:
        """Prefill ``req``: blocks for its full blocks (the first ``null_leading`` of them the pool's null block, as a
        sliding-window group leaves blocks outside its window), cached, then freed. Returns its blocks."""
        n = len(req.all_token_ids) // self.B
        hit = 0
        for h in req.block_hashes[:n]:  # the prefix-cache hit, as find_longest_cache_hit walks it
            if self.pool.get_cached_block(h, [self.group]) is None:
                break
            hit += 1
        cached = [self.pool.get_cached_block(h, [self.group])[0] for h in req.block_hashes[:hit]]
        self.pool.touch(cached)
        new = self.pool.get_new_blocks(n - hit)
        blocks = cached + new
        for i in range(min(null_leading, n)):
            if i >= hit:
                blocks[i] = self.pool.null_block
        self.pool.cache_full_blocks(req, blocks, hit, n, self.B, self.group)
        for i, h in enumerate(req.block_hashes[:n]):
            if not blocks[i].is_null:
                self.truth[bytes(h)] = {"tokens": req.all_token_ids[: (i + 1) * self.B], **req.meta}
        self.pool.free_blocks(b for b in reversed(blocks) if not b.is_null)
        if publish:
            self.flush()
        return blocks

    def flush(self) -> None:
        self.stream.publish(self.pool.take_events())

    def held(self, medium: str) -> list[dict[str, Any]]:
        out = []
        for key in list(self.pool.cached_block_hash_to_block._cache):
            h = bytes(self.v.kcu.get_block_hash(key))
            out.append({**self.truth[h], "medium": medium, "group": self.v.kcu.get_group_id(key), "stream": self.stream.name})
        return out


def vllm_cases(wheel: str, *, int_hashes: bool = True) -> dict[str, Any]:
    v = load_vllm(wheel, int_hashes=int_hashes)
    B = 16
    tag = "int" if int_hashes else "bytes"

    def stream(name: str, dp: int | None = None) -> _Stream:
        return _Stream(name, v.ev.KVEventBatch, v.enc, dp)

    def case(streams: list[_Stream], held: list[dict[str, Any]], **meta: Any) -> dict[str, Any]:
        return {"engine": "vllm", "block_size": B, "int_hashes": int_hashes, **meta,
                "frames": {s.name: list(s.frames) for s in streams}, "replay": {s.name: list(s.frames) for s in streams}, "held": held}

    cases: dict[str, Any] = {}
    base = list(range(1000, 1000 + 5 * B + 3))

    # a chain across two batches, a LoRA request with a salt, multimodal items; then evictions from a small pool
    s = stream("e0")
    e = VllmEngine(v, s, blocks=64)
    e.run(e.request(base[: 3 * B + 2]))
    e.run(e.request(base))
    e.run(e.request(base[: 2 * B] + [7] * (2 * B), lora=("sql-adapter", "/adapters/sql"), cache_salt="tenant-salt"))
    e.run(e.request([5] * 3 + list(range(50, 50 + 3 * B)), mm_items=[("img-9f2", 3, 20), ("img-77a", 30, 4)]))
    cases[f"vllm-{tag}-chain-lora-salt-mm"] = case([s], e.held("GPU"))
    s = stream("e0")
    e = VllmEngine(v, s, blocks=12)
    e.run(e.request(base))
    for i in range(3):  # new prompts: the pool (11 usable blocks) evicts cached ones, in its free queue's order
        e.run(e.request(list(range(9000 + 100 * i, 9000 + 100 * i + 3 * B))))
    cases[f"vllm-{tag}-evictions"] = case([s], e.held("GPU"))

    # a GPU reset (reset_prefix_cache: AllBlocksCleared, no medium) while the CPU tier still holds its copies
    s = stream("e0")
    gpu, cpu = VllmEngine(v, s), VllmEngine(v, s, medium="CPU")
    gpu.run(gpu.request(base))
    cpu.run(cpu.request(base))
    assert gpu.pool.reset_prefix_cache()
    gpu.flush()
    cases[f"vllm-{tag}-gpu-reset-cpu-kept"] = case([s], gpu.held("GPU") + cpu.held("CPU"))

    # a hybrid model: full attention in group 0, a sliding-window group 1 whose event skips null blocks
    s = stream("e0")
    full, swa = VllmEngine(v, s, group=0), VllmEngine(v, s, group=1)
    full.run(full.request(base), publish=False)
    swa.run(swa.request(base), null_leading=2, publish=False)
    s.publish(full.pool.take_events() + swa.pool.take_events())
    cases[f"vllm-{tag}-sliding-window-null-blocks"] = case([s], full.held("GPU") + swa.held("GPU"))

    # data parallelism: two ranks, each its own engine and stream (its own holder)
    r0, r1 = stream("dp0", 0), stream("dp1", 1)
    e0, e1 = VllmEngine(v, r0), VllmEngine(v, r1)
    e0.run(e0.request(base[: 4 * B]))
    e1.run(e1.request(list(range(3000, 3000 + 3 * B))))
    e0.run(e0.request(base[: 2 * B] + [11] * B))
    cases[f"vllm-{tag}-data-parallel"] = case([r0, r1], e0.held("GPU") + e1.held("GPU"))

    # restarts: the old engine's lifetime, then a new one whose seq starts over
    old, new = stream("old"), stream("new")
    eo = VllmEngine(v, old)
    eo.run(eo.request(base[: 3 * B]))
    en = VllmEngine(v, new)
    en.run(en.request(list(range(4000, 4000 + 2 * B))))
    cases[f"vllm-{tag}-restart-same-first-seq"] = case([old, new], en.held("GPU"), order=[["old", 0], ["new", 0]])
    old, new = stream("old"), stream("new")
    eo = VllmEngine(v, old)
    for i in range(3):
        eo.run(eo.request(base[: (i + 2) * B]))
    en = VllmEngine(v, new)
    for i in range(6):
        en.run(en.request(list(range(5000 + 100 * i, 5000 + 100 * i + 2 * B))))
    # the subscriber heard the old engine's 0..2, then (late) only the new one's seq 5
    cases[f"vllm-{tag}-restart-noticed-late"] = case([old, new], en.held("GPU"), order=[["old", 0], ["old", 1], ["old", 2], ["new", 5]])

    # the goal's replay: a DP deployment of two ranks; rank 0 resets its GPU cache with its CPU tier full, rank 1
    # restarts and the new lifetime's seq runs on from the old one's (old 0..2, then new 3: no gap) with the disconnect
    # unseen, so only the periodic check against the replay socket can tell; evictions throughout
    r0, r1o, r1n = stream("dp0", 0), stream("dp1-old", 1), stream("dp1-new", 1)
    g0, c0 = VllmEngine(v, r0, blocks=16), VllmEngine(v, r0, blocks=32, medium="CPU")
    for i in range(4):
        p = base[: (i % 3 + 2) * B] if i % 2 == 0 else list(range(6000 + 100 * i, 6000 + 100 * i + 3 * B))
        g0.run(g0.request(p))
        c0.run(c0.request(p))
    assert g0.pool.reset_prefix_cache()
    g0.flush()
    g0.run(g0.request(list(range(8000, 8000 + 2 * B))))
    e1 = VllmEngine(v, r1o, blocks=12)
    for i in range(3):
        e1.run(e1.request(list(range(3000 + 100 * i, 3000 + 100 * i + 4 * B))))
    e1n = VllmEngine(v, r1n, blocks=12)
    for i in range(4):
        e1n.run(e1n.request(list(range(4000 + 100 * i, 4000 + 100 * i + 3 * B))))
    plan = {"pod-dp0": [["dp0", s] for s, _ in r0.frames], "pod-dp1": [["dp1-old", 0], ["dp1-old", 1], ["dp1-old", 2], ["dp1-new", 3], ["check", 0]]}
    cases[f"vllm-{tag}-dp-gpu-reset-restart"] = {**case([r0, r1o, r1n], g0.held("GPU") + c0.held("CPU") + e1n.held("GPU")), "plan": plan}
    return cases


def vllm_seeded_case(wheel: str, seed: str) -> dict[str, Any]:
    """An engine started with ``PYTHONHASHSEED=seed``: vLLM roots every chain in ``hash_fn(seed)``."""
    os.environ["PYTHONHASHSEED"] = seed
    v = load_vllm(wheel, int_hashes=True)
    s = _Stream("e0", v.ev.KVEventBatch, v.enc)
    e = VllmEngine(v, s)
    e.run(e.request(list(range(1000, 1000 + 3 * 16))))
    e.run(e.request(list(range(1000, 1000 + 5 * 16))))
    return {f"vllm-int-pythonhashseed-{seed}": {"engine": "vllm", "block_size": 16, "int_hashes": True, "python_hash_seed": seed,
                                                "frames": {"e0": s.frames}, "replay": {"e0": s.frames}, "held": e.held("GPU")}}


# --------------------------------------------------------------------------- SGLang


def build_sglang_hash(wheel: str, build_dir: str) -> str:
    """SGLang's native hash (``hash_binding.cpp``) compiled as its loader compiles it (``-O3 -std=c++17``, OpenSSL's
    libcrypto, the module named by ``TORCH_EXTENSION_NAME`` as torch's loader names it), with pybind11; returns the directory holding ``hicache_hash_cpp``."""
    os.makedirs(build_dir, exist_ok=True)
    src = os.path.join(build_dir, "hash_binding.cpp")
    code = _source(wheel, "sglang/srt/mem_cache/cpp_utils/hash_binding.cpp")
    out = os.path.join(build_dir, "hicache_hash_cpp" + sysconfig.get_config_var("EXT_SUFFIX"))
    stamp = os.path.join(build_dir, "source.sha256")
    digest = hashlib.sha256(code.encode() + b"TORCH_EXTENSION_NAME=hicache_hash_cpp").hexdigest()
    if os.path.exists(out) and os.path.exists(stamp) and open(stamp).read() == digest:
        return build_dir
    with open(src, "w") as f:
        f.write(code)
    import pybind11

    subprocess.run(["g++", "-O3", "-std=c++17", "-DNDEBUG", "-DTORCH_EXTENSION_NAME=hicache_hash_cpp", "-shared", "-fPIC", "-w", f"-I{pybind11.get_include()}",
                    f"-I{sysconfig.get_paths()['include']}", src, "-o", out, "-lcrypto"], check=True)
    with open(stamp, "w") as f:
        f.write(digest)
    return build_dir


def load_sglang(wheel: str, build_dir: str) -> types.SimpleNamespace:
    build_sglang_hash(wheel, build_dir)
    sys.path.insert(0, build_dir)
    import importlib

    native = importlib.import_module("hicache_hash_cpp")
    sys.path.pop(0)
    from engine_wheels import load_sglang_radix

    for n in ("sglang", "sglang.srt", "sglang.srt.mem_cache", "sglang.srt.disaggregation", "sglang.srt.utils",
              "sglang.srt.mem_cache.cpp_utils"):
        if n not in sys.modules:
            _module(n)
    _module("sglang.srt.runtime_context", get_observability=None, get_parallel=None)
    _module("sglang.srt.utils.network", NetworkAddress=object)
    _module("pydantic", BaseModel=object)
    kve = _load(wheel, "sglang/srt/disaggregation/kv_events.py", "sglang.srt.disaggregation.kv_events")
    nh = _module("sglang.srt.mem_cache.cpp_utils.native_hash")
    src = _source(wheel, "sglang/srt/mem_cache/cpp_utils/native_hash.py")
    exec(compile(src, "native_hash.py", "exec"), nh.__dict__)
    nh._load_native_hash_module = lambda: native  # the module SGLang's loader would build from the same source
    radix, params, _ = _load_radix(wheel, load_sglang_radix)
    import msgspec

    return types.SimpleNamespace(kve=kve, radix=radix, params=params, enc=msgspec.msgpack.Encoder(),
                                 events=sys.modules["sglang.srt.mem_cache.events"])


def _load_radix(wheel: str, loader: Any) -> Any:
    """check_engine_bases' loader stubs the event classes (it has no use for them): put SGLang's real ones back
    around it, so the recorder it loads builds the engine's own events with its own hash."""
    real = sys.modules["sglang.srt.disaggregation.kv_events"]
    nh = sys.modules["sglang.srt.mem_cache.cpp_utils.native_hash"]
    out = loader(wheel)  # its _module() replaces these two with stubs: the real ones go back below
    sys.modules["sglang.srt.disaggregation.kv_events"] = real
    sys.modules["sglang.srt.mem_cache.cpp_utils.native_hash"] = nh
    for name in ("sglang/srt/mem_cache/utils.py", "sglang/srt/mem_cache/events.py"):
        _load(wheel, name, name[:-3].replace("/", "."))
    _load(wheel, "sglang/srt/mem_cache/radix_cache.py", "sglang.srt.mem_cache.radix_cache")
    return sys.modules["sglang.srt.mem_cache.radix_cache"], out[1], out[2]


class SglangEngine:
    """SGLang's own RadixCache (``create_simulated``: no memory pools) with KV events on: requests insert their
    page-aligned prompt, eviction frees leaves, ``reset`` clears it. The host tier is the recorder's own
    ``record_store(node, medium=CPU_PINNED)``, as HiRadixCache calls it on write-back."""

    def __init__(self, s: types.SimpleNamespace, stream: _Stream, *, page_size: int) -> None:
        self.s, self.stream, self.P = s, stream, page_size
        self.names = s.events.KvEventLoraNames()
        allocator = types.SimpleNamespace(device="cpu", free_segment=lambda *a, **k: None, free=lambda *a: None)  # no memory pools
        self.cache = s.radix.RadixCache.create_simulated(mock_allocator=allocator, page_size=page_size, enable_kv_cache_events=True,
                                                         kv_event_lora_names=self.names)
        self.host: dict[int, Any] = {}  # id(node) -> node written back to the host tier
        self.meta: dict[tuple[Any, Any], dict[str, Any]] = {}

    def insert(self, tokens: list[int], *, extra_key: str | None = None, lora: tuple[str, str] | None = None, cache_salt: str | None = None) -> None:
        from array import array

        torch = sys.modules["torch"]  # check_engine_bases' numpy torch: the tree only moves token indices around
        radix, params = self.s.radix, self.s.params
        if lora is not None:  # SGLang's Req: extra_key ends with the adapter's 32-character id
            lora_id = hashlib.md5(lora[0].encode()).hexdigest()
            extra_key = (extra_key or "") + lora_id
            self.names.register(types.SimpleNamespace(lora_id=lora_id, extra_key=extra_key), lora[1])
        key = radix.RadixKey(array("q", tokens), extra_key=extra_key, cache_salt=cache_salt).page_aligned(self.P)
        self.cache.insert(params.InsertParams(key=key, value=torch.tensor(list(range(len(key))), dtype=torch.int64)))
        self.meta[(extra_key, cache_salt or None)] = {"lora_name": lora[1] if lora else None, "cache_salt": cache_salt or None, "mm_items": []}

    def write_back(self) -> None:
        """Every node now in the tree written back to host memory (CPU_PINNED), the way HiCache records it."""
        cpu = self.s.kve.StorageMedium.CPU
        for node in self._nodes():
            if id(node) not in self.host:
                self.cache.kv_events.record_store(node, medium=cpu)
                self.host[id(node)] = node

    def evict(self, num_tokens: int) -> None:
        self.cache.evict(self.s.params.EvictParams(num_tokens=num_tokens))

    def flush(self) -> None:
        self.stream.publish(self.cache.take_events())

    def _nodes(self) -> list[Any]:
        out, todo = [], [self.cache.root_node]
        while todo:
            n = todo.pop()
            for c in n.children.values():
                out.append(c)
                todo.append(c)
        return out

    @staticmethod
    def _path(node: Any) -> tuple[list[int], int]:
        parts, start = [], 0
        n = node
        while n.parent is not None:
            parts.append(list(n.key.token_ids[: len(n.key)]))
            n = n.parent
        toks = [t for p in reversed(parts) for t in p]
        return toks, len(toks) - len(node.key)

    def held(self, block_size: int) -> list[dict[str, Any]]:
        """The kvpolicy blocks (``block_size`` tokens) whose last token is in a page the tree (GPU) or the host holds."""
        out = []
        tiers = [("GPU", n) for n in self._nodes()] + [("CPU_PINNED", n) for n in self.host.values()]
        for medium, node in tiers:
            toks, start = self._path(node)
            meta = self.meta[(node.key.extra_key, node.key.cache_salt)]
            for b in range(start // block_size, len(toks) // block_size):
                if (b + 1) * block_size > start:
                    out.append({"tokens": toks[: (b + 1) * block_size], **meta, "medium": medium, "group": 0, "stream": self.stream.name})
        return out


def sglang_cases(wheel: str, build_dir: str) -> dict[str, Any]:
    s = load_sglang(wheel, build_dir)
    cases: dict[str, Any] = {}

    def stream(name: str) -> _Stream:
        return _Stream(name, lambda ts, events, data_parallel_rank: s.kve.KVEventBatch(ts=ts, events=events, attn_dp_rank=data_parallel_rank),
                       s.enc)

    B = 16
    for page in (16, 1):
        def case(st: _Stream, held: list[dict[str, Any]], page: int = page) -> dict[str, Any]:
            return {"engine": "sglang", "block_size": B, "page_size": page, "frames": {st.name: list(st.frames)},
                    "replay": {st.name: list(st.frames)}, "held": held}

        base = list(range(2000, 2000 + 4 * B + 5))
        st = stream("e0")
        e = SglangEngine(s, st, page_size=page)
        e.insert(base[: 2 * B + 3])
        e.flush()
        e.insert(base)  # extends the chain: a child node whose parent is the first
        e.insert(base[: B] + [9] * (2 * B))  # splits the first node at B
        e.flush()
        cases[f"sglang-p{page}-chain"] = case(st, e.held(B))
        e.insert(base[: 3 * B], cache_salt="tenant-salt")
        e.insert(base[: 2 * B] + [4] * B, lora=("sql-adapter", "sql-adapter"))
        e.flush()
        cases[f"sglang-p{page}-salt-lora"] = case(st, e.held(B))
        e.write_back()
        e.flush()
        e.evict(3 * B)  # leaves go first: the GPU copies of some chains' tails, the host copies stay
        e.flush()
        cases[f"sglang-p{page}-cpu-pinned-and-evict"] = case(st, e.held(B))
        gpu_reset = [h for h in e.held(B) if h["medium"] != "GPU"]
        e.cache.reset()  # AllBlocksCleared: the GPU tree; the host tier keeps its copies
        e.flush()
        cases[f"sglang-p{page}-reset"] = case(st, gpu_reset)
    return cases


# --------------------------------------------------------------------------- a case through kvpolicy


class Replay:
    """The engine's replay socket as vLLM's and SGLang's publishers serve it: the batches it still buffers, from a seq."""

    def __init__(self, frames: list[list[Any]]) -> None:
        self.frames = frames

    def fetch(self, start_seq: int, until: int | None = None) -> list[tuple[int, bytes]]:
        return [(s, base64.b64decode(p)) for s, p in self.frames if s >= start_seq and (until is None or s <= until)]


def expected(case: dict[str, Any], hasher: Any, holder_of: Any) -> set[tuple[bytes, str]]:
    """(kvpolicy key, directory holder) of every block the engine holds, the key built as a request builds its own:
    ``hasher.hash_blocks(prompt, extra_keys=extra_keys_for(...))``."""
    from kvpolicy.integrations.vllm_events import MEDIA, extra_keys_for

    B = hasher.block_size_tokens
    out = set()
    for h in case["held"]:
        n = len(h["tokens"]) // B
        ex = extra_keys_for(n, lora_name=h["lora_name"], cache_salt=h["cache_salt"], mm_items=[tuple(x) for x in h["mm_items"]],
                            block_size_tokens=B)
        out.add((hasher.hash_blocks(h["tokens"], extra_keys=ex)[-1], f"{holder_of(h['stream'])}/{MEDIA[h['medium']]}/g{h['group']}"))
    return out


def directory_pairs(d: Any, tenant: str = "acme") -> set[tuple[bytes, str]]:
    keys = d.keys(tenant)
    return {(k, e.holder) for k, es in zip(keys, d.lookup(tenant, keys)) for e in es}


def plan_of(case: dict[str, Any]) -> tuple[dict[str, list[list[Any]]], dict[str, str]]:
    """Which subscriber (one engine endpoint: its holder) hears which frames, in what order, and the holder of each
    stream. A case's ``plan`` says it; ``order`` is one endpoint over several engine lifetimes; without either each
    stream is its own endpoint (a DP rank each)."""
    if "plan" in case:
        plan = case["plan"]
    elif "order" in case:
        plan = {"pod": case["order"]}
    else:
        plan = {f"pod-{name}": [[name, seq] for seq, _ in frames] for name, frames in case["frames"].items()}
    return plan, {stream: holder for holder, steps in plan.items() for stream, _ in steps if stream != "check"}


def run_case(case: dict[str, Any], hasher: Any, *, verify: str | None = None, seed: str | None = None) -> tuple[Any, dict[str, Any], Any]:
    """Feed a case's frames to kvpolicy's ``ZmqEventSubscriber.handle``, one subscriber per endpoint of the case's
    :func:`plan_of`, its replay socket the running engine's (what that engine has published so far), into an in-memory
    directory. Returns (directory, ingestors by holder, holder of a stream)."""
    from kvpolicy.directory import InMemoryDirectory
    from kvpolicy.integrations.vllm_events import KVEventIngestor
    from kvpolicy.integrations.vllm_zmq import ZmqEventSubscriber

    d = InMemoryDirectory()
    plan, holder_of = plan_of(case)
    frames = {(name, s): p for name, fr in case["frames"].items() for s, p in fr}
    ings = {}
    for holder, steps in plan.items():
        ing = ings[holder] = KVEventIngestor(d, "acme", hasher, holder=holder, bytes_per_token=64, verify_algo=verify, none_hash_seed=seed)
        replay = Replay([])
        sub = ZmqEventSubscriber(ing, "inproc://kvpolicy-engine-events", replay=replay)  # nothing publishes there: handle() is fed
        try:
            for name, seq in steps:
                if name == "check":  # the periodic check against the replay socket (check_every_s later)
                    sub.check_continuity()
                    continue
                replay.frames = [f for f in case["replay"][name] if f[0] <= seq]
                sub.handle([b"", seq.to_bytes(8, "big"), base64.b64decode(frames[(name, seq)])])
        finally:
            sub.close()
    return d, ings, holder_of.__getitem__


def score(cases: dict[str, Any], block_size: int = 16) -> list[dict[str, Any]]:
    """Every case through kvpolicy (vLLM's verified against its own hashing, with the engine's seed): per case, the
    blocks the engine holds, and how many of them are missing from the directory and how many it claims that the
    engine does not hold."""
    from kvpolicy.keys import BlockHasher, Namespace

    hasher = BlockHasher(Namespace(model_id="m", model_revision="r", tokenizer_version="t", kv_dtype="bf16",
                                   block_size_tokens=block_size), "fast")
    rows = []
    log = logging.getLogger("kvpolicy.events")
    level = log.level
    log.setLevel(logging.ERROR)  # each restart is a warning: the table says how many
    for name, case in sorted(cases.items()):
        verify = "sha256" if case["engine"] == "vllm" else None
        d, ings, holder_of = run_case(case, hasher, verify=verify, seed=case.get("python_hash_seed"))
        want, got = expected(case, hasher, holder_of), directory_pairs(d)
        rows.append({"case": name, "held": len(want), "missing": len(want - got), "stale": len(got - want),
                     "verified": sum(i.counts["verified_blocks"] for i in ings.values()),
                     "restarts": sum(i.counts["restarts"] for i in ings.values())})
    log.setLevel(level)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm")
    ap.add_argument("--sglang")
    ap.add_argument("--build-dir", default=os.path.join(tempfile.gettempdir(), "kvpolicy-sglang-hash"))
    ap.add_argument("--out", required=True)
    ap.add_argument("--part", choices=["vllm-int", "vllm-bytes", "vllm-seeded", "sglang"], default=None,
                    help="(internal) one part in this process; without it, every part in its own process")
    a = ap.parse_args(argv)
    if a.part is not None:
        cases = {"vllm-int": lambda: vllm_cases(a.vllm, int_hashes=True), "vllm-bytes": lambda: vllm_cases(a.vllm, int_hashes=False),
                 "vllm-seeded": lambda: vllm_seeded_case(a.vllm, "42"), "sglang": lambda: sglang_cases(a.sglang, a.build_dir)}[a.part]()
        with open(a.out, "w") as f:
            json.dump(cases, f)
        return 0
    parts = (["vllm-int", "vllm-bytes", "vllm-seeded"] if a.vllm else []) + (["sglang"] if a.sglang else [])
    if not parts:
        ap.error("give --vllm and/or --sglang")
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for p in parts:
            path = os.path.join(tmp, p + ".json")
            cmd = [sys.executable, os.path.abspath(__file__), "--part", p, "--out", path, "--build-dir", a.build_dir]
            cmd += ["--vllm", a.vllm] if a.vllm else []
            cmd += ["--sglang", a.sglang] if a.sglang else []
            env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
            subprocess.run(cmd, check=True, env=env)
            with open(path) as f:
                out.update(json.load(f))
    with open(a.out, "w") as f:
        json.dump(out, f)
    print(f"engine_events: {len(out)} cases -> {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
