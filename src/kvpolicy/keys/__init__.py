"""Cache namespaces and chained block keys."""

from .hasher import SCHEMES, BlockHasher, BlockKeys, KeyChain, as_token_array, extra_digest
from .namespace import DATA_CLASSES, KV_DTYPE_BYTES, SCHEMA_VERSION, Namespace
from .vllm import VLLM_ALGOS, vllm_block_hashes, vllm_group_block_hashes, vllm_int_hash, vllm_none_hash

__all__ = [
    "DATA_CLASSES",
    "KV_DTYPE_BYTES",
    "SCHEMA_VERSION",
    "SCHEMES",
    "VLLM_ALGOS",
    "BlockHasher",
    "BlockKeys",
    "KeyChain",
    "Namespace",
    "as_token_array",
    "extra_digest",
    "vllm_block_hashes",
    "vllm_group_block_hashes",
    "vllm_int_hash",
    "vllm_none_hash",
]
