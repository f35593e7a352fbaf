"""Reading the engines' own code out of their wheels, without installing them: a module made from one file of a wheel,
stand-ins for the heavy modules that file imports, and SGLang's ``RadixCache`` with what it needs.

Shared by ``tools/check_engine_bases.py`` (the adapters on the engines' own bases) and ``tools/engine_events.py`` (KV
events made by the engines' own code), and by ``benchmarks/bench_sglang_strategy.py``: neither tool imports the other.
"""

from __future__ import annotations

import sys
import types
import zipfile

SGLANG_EVICT = "sglang/srt/mem_cache/evict_policy.py"


def _module(name: str, **attrs: object) -> types.ModuleType:
    m = types.ModuleType(name)
    m.__dict__.update(attrs)
    sys.modules[name] = m
    return m


def _source(wheel: str, path: str) -> str:
    with zipfile.ZipFile(wheel) as z:
        return z.read(path).decode()


def _load(wheel: str, path: str, name: str) -> types.ModuleType:
    source = _source(wheel, path)
    mod = _module(name)
    exec(compile(source, f"{wheel}!{path}", "exec"), mod.__dict__)
    return mod


def _numpy_torch() -> types.ModuleType:
    """``torch`` as far as SGLang's radix tree uses it — ``tensor``, ``cat``, ``empty``, slicing, ``len``, ``.clone()`` —
    over numpy (the tree only moves token indices around)."""
    import numpy as np

    class Tensor(np.ndarray):
        def clone(self) -> Tensor:
            return self.copy()

    def tensor(data: object, dtype: object = None, device: object = None) -> Tensor:
        return np.asarray(data, dtype=np.int64).view(Tensor)

    def cat(xs: list, dim: int = 0) -> Tensor:
        return (np.concatenate([np.asarray(x) for x in xs]) if len(xs) else np.empty(0, np.int64)).view(Tensor)

    def empty(shape: object, dtype: object = None, device: object = None) -> Tensor:
        return np.empty(shape, dtype=np.int64).view(Tensor)

    return _module("torch", Tensor=Tensor, tensor=tensor, cat=cat, empty=empty, int64=np.int64, int32=np.int32,
                   device=lambda d="cpu": str(d), iinfo=np.iinfo)


def load_sglang_radix(wheel: str) -> tuple[types.ModuleType, types.ModuleType, types.ModuleType]:
    """SGLang's own ``RadixCache`` (``radix_cache.py``) and its parameter classes (``base_prefix_cache.py``) read out of
    the wheel, with what they import that a replay does not use stubbed: the GPU kernels, KV events' wire types,
    metrics, the memory pools; torch by :func:`_numpy_torch`. The tree code itself — match, split, insert, lock, evict —
    is SGLang's, as are ``mem_cache/utils.py`` (its strategy registry), ``evict_policy.py``, ``events.py`` and
    ``cache_init_params.py``. Returns the radix, parameter and eviction-strategy modules."""
    _numpy_torch()
    for n in ("sglang", "sglang.srt", "sglang.srt.mem_cache"):
        if n not in sys.modules:
            _module(n)
    if "sglang.srt.environ" not in sys.modules:
        class _Envs:
            def __getattr__(self, name: str) -> object:
                return types.SimpleNamespace(get=lambda: None, value=None)

        _module("sglang.srt.environ", envs=_Envs())
    evict = sys.modules.get("sglang.srt.mem_cache.evict_policy") or _load(wheel, SGLANG_EVICT, "sglang.srt.mem_cache.evict_policy")
    for n in ("sglang.kernels", "sglang.kernels.ops", "sglang.kernels.ops.kvcache", "sglang.srt.mem_cache.cpp_utils",
              "sglang.srt.mem_cache.unified_cache", "sglang.srt.observability", "sglang.srt.disaggregation", "sglang.srt.utils"):
        if n not in sys.modules:
            _module(n)
    _module("sglang.kernels.ops.kvcache.mla_buffer", **dict.fromkeys((
        "get_mla_kv_buffer_kernel", "get_mla_kv_buffer_triton", "set_mla_kv_buffer_dcp_sharded_triton", "set_mla_kv_buffer_fp8_quant_kernel",
        "set_mla_kv_buffer_kernel", "set_mla_kv_buffer_triton", "set_mla_kv_buffer_triton_fp8_quant", "set_mla_kv_scale_buffer_kernel",
        "set_mla_kv_scale_buffer_triton")))
    _module("sglang.srt.mem_cache.cpp_utils.native_hash", get_native_hash=None)
    _module("sglang.srt.disaggregation.kv_events", **dict.fromkeys(("AllBlocksCleared", "BlockRemoved", "BlockStored", "StorageMedium"), object),
            kv_event_namespace_seed=None, namespaced_block_hash=None)
    _load(wheel, "sglang/srt/mem_cache/utils.py", "sglang.srt.mem_cache.utils")
    _load(wheel, "sglang/srt/mem_cache/events.py", "sglang.srt.mem_cache.events")
    _module("sglang.srt.mem_cache.allocator", BaseTokenToKVPoolAllocator=object)
    _module("sglang.srt.mem_cache.memory_pool", ReqToTokenPool=object)
    _module("sglang.srt.mem_cache.unified_cache.component_type", ComponentType=object)
    _module("sglang.srt.observability.metrics_collector", STAT_LOGGER_ROLE_RADIX_CACHE=None, RadixCacheMetricsCollector=object,
            radix_cache_metric_labels=None, resolve_collector_class=None)
    _module("sglang.srt.runtime_context", get_observability=None, get_parallel=None)
    params = _load(wheel, "sglang/srt/mem_cache/base_prefix_cache.py", "sglang.srt.mem_cache.base_prefix_cache")
    _load(wheel, "sglang/srt/mem_cache/cache_init_params.py", "sglang.srt.mem_cache.cache_init_params")
    common = sys.modules.get("sglang.srt.utils.common") or _module("sglang.srt.utils.common")
    common.ceil_align = lambda x, a: -(-x // a) * a
    radix = _load(wheel, "sglang/srt/mem_cache/radix_cache.py", "sglang.srt.mem_cache.radix_cache")
    return radix, params, evict
