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

import numpy as np

from ..errors import ConfigError
from . import _sha256, cbor
from .hasher import as_token_array

VllmAlgo = Literal["sha256", "sha256_cbor"]
VLLM_ALGOS = ("sha256", "sha256_cbor")
NONE_HASH_SEED = "vllm-none-hash"


_PICKLE_FRAME_MAX = 60_000  # a pickle larger than one 64 KiB frame is laid out differently
_TUPLE_CLOSE = {1: b"\x85", 2: b"\x86", 3: b"\x87"}


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
    if n_blocks == 0:
        return []
    scheme = 0 if algo == "sha256" else 1
    buf, offsets = _sha256.encode_uints(toks[: n_blocks * block_size], scheme)
    if algo == "sha256":
        a, framed = b"\x80\x05\x95", True
        c = b"\x94" + (b"(" if block_size > 3 else b"")
        d = (_TUPLE_CLOSE[block_size] if block_size <= 3 else b"t") + b"\x94N\x87\x94."
        slow = _sha256_pickle
    else:
        a, framed, c, d = b"\x83", False, cbor._head(4, block_size), b"\xf6"
        slow = _sha256_cbor
    # A pickle larger than one 64 KiB frame is laid out differently: such block
    # sizes (over ~8.5K tokens) take the slow path, as do blocks with extra keys.
    kernel_ok = algo == "sha256_cbor" or block_size * 7 + 128 <= _PICKLE_FRAME_MAX
    out: list[bytes] = []
    b = 0
    while b < n_blocks:
        ek = _extra_keys(first_block_index + b, cache_salt, lora_name, lora_path)
        if ek is not None or not kernel_ok or len(h) >= 256:
            block = tuple(toks[b * block_size : (b + 1) * block_size].tolist())
            h = slow((h, block, ek))
            out.append(h)
            b += 1
            continue
        # Extras sit on absolute block 0 (salt) or on every block (LoRA), so a
        # block without them starts a run that lasts to the end: one kernel call.
        end = n_blocks
        bp = (b"C" + bytes((len(h),))) if algo == "sha256" else cbor._head(2, len(h))
        res = np.empty((end - b, 32), dtype=np.uint8)
        _sha256.sha256_spliced_chain(
            _u8(h), _u8(a), framed, _u8(bp), _u8(c), _u8(d), buf, offsets[b * block_size :], block_size, end - b, res
        )
        raw = res.tobytes()
        out.extend(raw[i : i + 32] for i in range(0, len(raw), 32))
        h = out[-1]
        b = end
    return out


def _u8(x: bytes) -> np.ndarray:
    return np.frombuffer(x, dtype=np.uint8)
