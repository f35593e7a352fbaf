"""kvpolicy — prefix KV-cache policy for LLM serving.

A shared KV cache saves GPU time only when a remote block is ready for attention
before the replica could have recomputed it. This package turns that rule into
code: namespaced chained block keys, block-aligned prefix matching, KV geometry
and measured profiles (``kvpolicy.keys``, ``matching``, ``geometry``,
``profile``); admission, eviction, publishing, warmup and the ledger
(``admission``, ``eviction``, ``publish``, ``warmup``, ``ledger``); trace
analytics and diagnosis (``traces``, ``analysis``, ``diagnose``); the shared
directory and engine adapters (``directory``, ``integrations``); a reference
engine (``reference``); the cluster simulator (``sim``); and property-based
contracts (``testing``).
"""

from . import errors
from .clock import ManualClock, MonotonicClock
from .geometry import KVGeometry, useful_tokens
from .keys import BlockHasher, BlockKeys, KeyChain, Namespace, vllm_block_hashes
from .matching import InMemoryBlockIndex, PrefixMatch, match
from .profile import MeasuredProfile, PrefillModel, fit_prefill, read_profile
from .protocols import BlockIndex, Clock

__version__ = "0.1.0"

__all__ = [
    "BlockHasher",
    "BlockIndex",
    "BlockKeys",
    "Clock",
    "InMemoryBlockIndex",
    "KVGeometry",
    "KeyChain",
    "ManualClock",
    "MeasuredProfile",
    "MonotonicClock",
    "Namespace",
    "PrefillModel",
    "PrefixMatch",
    "errors",
    "fit_prefill",
    "match",
    "read_profile",
    "useful_tokens",
    "vllm_block_hashes",
]
