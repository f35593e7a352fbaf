"""vLLM-compatible key projection (vLLM 0.33 prefix-caching block hashes).

Reproduces ``hash_block_tokens`` chaining exactly: the root is
``NONE_HASH = hash_fn("vllm-none-hash")``; block i hashes
``(parent_hash, tuple(block_token_ids), extra_keys)`` where ``extra_keys`` is
``None`` or a tuple of ``("lora", lora_name, lora_path)`` (every block, when an
adapter is set) followed by ``("cache_salt", salt)`` (block 0 only).
``sha256`` hashes the pickle (highest protocol) of that tuple; ``sha256_cbor``
hashes its canonical CBOR. Checked against vectors produced by vLLM itself.
"""

from __future__ import annotations

import hashlib
import pickle
from typing import Any, Literal

from ..errors import ConfigError
from . import cbor
from .hasher import as_token_array

VllmAlgo = Literal["sha256", "sha256_cbor"]
VLLM_ALGOS = ("sha256", "sha256_cbor")
NONE_HASH_SEED = "vllm-none-hash"


def _sha256_pickle(obj: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _sha256_cbor(obj: Any) -> bytes:
    return hashlib.sha256(cbor.dumps(obj)).digest()


def vllm_none_hash(algo: VllmAlgo = "sha256", seed: str = NONE_HASH_SEED) -> bytes:
    """vLLM's chain root for a cryptographic algorithm."""
    if algo not in VLLM_ALGOS:
        raise ConfigError("algo", f"must be one of {VLLM_ALGOS}, got {algo!r}")
    return _sha256_pickle(seed) if algo == "sha256" else _sha256_cbor(seed)


def _extra_keys(i: int, cache_salt: str | None, lora_name: str | None, lora_path: str | None) -> tuple | None:
    keys: list[tuple] = []
    if lora_name is not None:
        keys.append(("lora", lora_name, lora_path))
    if cache_salt is not None and i == 0:
        keys.append(("cache_salt", cache_salt))
    return tuple(keys) if keys else None


def vllm_block_hashes(
    tokens: Any,
    block_size: int,
    algo: VllmAlgo = "sha256",
    cache_salt: str | None = None,
    lora_name: str | None = None,
    lora_path: str | None = None,
    *,
    parent: bytes | None = None,
    first_block_index: int = 0,
) -> list[bytes]:
    """Block hashes exactly as vLLM 0.33 computes them (full blocks only).

    ``parent``/``first_block_index`` continue an existing chain (the salt goes
    only on absolute block 0).
    """
    if algo not in VLLM_ALGOS:
        raise ConfigError("algo", f"must be one of {VLLM_ALGOS}, got {algo!r}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ConfigError("block_size", f"must be a positive int, got {block_size!r}")
    if lora_path is not None and lora_name is None:
        raise ConfigError("lora_path", "given without lora_name")
    toks = as_token_array(tokens)
    n_blocks = toks.size // block_size
    h = parent if parent is not None else vllm_none_hash(algo)
    out: list[bytes] = []
    if algo == "sha256":
        tl = toks[: n_blocks * block_size].tolist()
        for b in range(n_blocks):
            ek = _extra_keys(first_block_index + b, cache_salt, lora_name, lora_path)
            h = hashlib.sha256(
                pickle.dumps((h, tuple(tl[b * block_size : (b + 1) * block_size]), ek), protocol=pickle.HIGHEST_PROTOCOL)
            ).digest()
            out.append(h)
        return out
    # sha256_cbor: encode every token once, then splice each block's slice.
    buf, offsets = cbor.encode_uint_array(toks[: n_blocks * block_size])
    arr_head = cbor.dumps(tuple(range(block_size)))[: len(cbor._head(4, block_size))]
    no_extra = cbor.dumps(None)
    for b in range(n_blocks):
        ek = _extra_keys(first_block_index + b, cache_salt, lora_name, lora_path)
        body = buf[offsets[b * block_size] : offsets[(b + 1) * block_size]]
        msg = b"\x83" + cbor._head(2, len(h)) + h + arr_head + body + (no_extra if ek is None else cbor.dumps(ek))
        h = hashlib.sha256(msg).digest()
        out.append(h)
    return out
