"""SGLang: a kvpolicy eviction policy as an ``EvictionStrategy``.

SGLang's radix cache asks ``strategy.get_priority(node)`` and evicts the lowest
(``python/sglang/srt/mem_cache/evict_policy.py``). :class:`PriorityStrategy`
answers with a kvpolicy :class:`~kvpolicy.eviction.base.PriorityPolicy`'s
``priority`` over a view of the ``TreeNode`` — the fields SGLang keeps
(``last_access_time``, ``hit_count``, ``creation_time`` if present, ``parent``,
``key``/``value`` lengths) mapped onto kvpolicy's ``Node`` vocabulary
(``t_access``, ``hits``, ``t_insert``, ``depth``, ``size``). Nothing from SGLang
is imported; subclassing SGLang's abstract base is left to the caller (or use
:func:`make_sglang_strategy`, which does it lazily when SGLang is installed).
"""

from __future__ import annotations

from typing import Any

from ..eviction.base import PriorityPolicy
from ..errors import ConfigError


class _NodeView:
    __slots__ = ("key", "size", "depth", "t_access", "t_insert", "hits", "data", "seq")

    def __init__(self, node: Any) -> None:
        self.key = id(node)
        value = getattr(node, "value", None)
        key = getattr(node, "key", None)
        self.size = len(value) if value is not None and hasattr(value, "__len__") else (len(key) if key is not None and hasattr(key, "__len__") else 1)
        d, p = 0, getattr(node, "parent", None)
        while p is not None and d < 1_000_000:
            d += 1
            p = getattr(p, "parent", None)
        self.depth = max(d - 1, 0)  # the radix root is not a block
        self.t_access = float(getattr(node, "last_access_time", 0.0))
        self.t_insert = float(getattr(node, "creation_time", self.t_access))
        self.hits = int(getattr(node, "hit_count", 0))
        self.data = None
        self.seq = 0


class PriorityStrategy:
    """``get_priority(node)`` from a kvpolicy priority policy (lowest is evicted first)."""

    def __init__(self, policy: PriorityPolicy) -> None:
        if not isinstance(policy, PriorityPolicy):
            raise ConfigError("policy", "must be a kvpolicy PriorityPolicy (LRU, LFU, GDSF, reuse-distance, ...)")
        self.policy = policy

    def get_priority(self, node: Any, now_time: float | None = None) -> tuple:
        view = _NodeView(node)
        if hasattr(self.policy, "_admit"):
            self.policy._admit(view)  # type: ignore[arg-type]  # policy-specific per-node state (e.g. reuse-distance)
        return self.policy.priority(view)  # type: ignore[arg-type]


def make_sglang_strategy(policy: PriorityPolicy) -> Any:
    """A real ``sglang...EvictionStrategy`` subclass instance (needs SGLang installed)."""
    try:
        from sglang.srt.mem_cache.evict_policy import EvictionStrategy  # type: ignore[import-not-found]
    except ImportError:
        raise ConfigError("sglang", "SGLang is not installed; use PriorityStrategy directly") from None

    class KVPolicyStrategy(PriorityStrategy, EvictionStrategy):  # type: ignore[misc, valid-type]
        pass

    return KVPolicyStrategy(policy)
