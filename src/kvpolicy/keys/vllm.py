"""vLLM-compatible key projection (vLLM 0.33 prefix-caching block hashes).

Reproduces ``hash_block_tokens`` chaining exactly: the root is
``NONE_HASH = hash_fn("vllm-none-hash")``; block i hashes
``(parent_hash, tuple(block_token_ids), extra_keys)`` where ``extra_keys`` is
``None`` or a tuple of ``("lora", lora_name, lora_path)`` (every block, when an
adapter is set) followed by ``("cache_salt", salt)`` (block 0 only).
``sha256`` hashes the pickle (highest protocol) of that tuple; ``sha256_cbor``
hashes its canonical CBOR; ``xxhash`` / ``xxhash_cbor`` take XXH3-128 of the same
bytes (the ``xxhash`` package). Checked against vectors produced by vLLM itself.

Also as vLLM does: an empty ``cache_salt`` is no salt; the root seed is
``PYTHONHASHSEED`` when the engine sets it (``none_hash_seed``) — and for the
xxhash algorithms vLLM draws a *random* per-process seed otherwise, so their
projection needs the engine's seed; with ``lookahead_tokens`` L > 0 (EAGLE/MTP
drafters) block i's extra keys become ``(extra_keys, *the next L tokens)`` and
a block is hashed only once those tokens exist; a KV-cache group whose block
size is a multiple of the hash block size uses every m-th hash
(:func:`vllm_group_block_hashes`); events carry hashes as 64-bit ints by default
(:func:`vllm_int_hash`).
"""

from __future__ import annotations

import hashlib
import pickle
from typing import Any, Literal

import numpy as np

from ..errors import ConfigError
from . import _sha256, cbor
from .hasher import as_token_array

VllmAlgo = Literal["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"]
VLLM_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
NONE_HASH_SEED = "vllm-none-hash"
_M64 = (1 << 64) - 1


def _xxh3_128(data: bytes) -> bytes:
    try:
        import xxhash
    except ImportError:
        raise ConfigError("algo", "the xxhash algorithms need the xxhash package: pip install xxhash") from None
    return xxhash.xxh3_128_digest(data)


def _slow_fn(algo: str) -> Any:
    if algo == "sha256":
        return _sha256_pickle
    if algo == "sha256_cbor":
        return _sha256_cbor
    if algo == "xxhash":
        return lambda obj: _xxh3_128(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
    return lambda obj: _xxh3_128(cbor.dumps(obj))


def vllm_int_hash(block_hash: bytes) -> int:
    """The 64-bit int vLLM's KV events carry by default (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``): the low 64 bits."""
    return int.from_bytes(block_hash, "big") & _M64


def vllm_group_block_hashes(block_hashes: list[bytes], hash_block_size: int, target_block_size: int) -> list[bytes]:
    """A group's hashes when its block size is a multiple of the hash block size (vLLM's
    ``BlockHashListWithBlockSize``): each hash chains over its whole prefix, so the last one
    inside a larger block is that block's hash."""
    for name, v in (("hash_block_size", hash_block_size), ("target_block_size", target_block_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ConfigError(name, f"must be a positive int, got {v!r}")
    if target_block_size % hash_block_size:
        raise ConfigError("target_block_size", f"must be a multiple of the hash block size {hash_block_size}, got {target_block_size}")
    m = target_block_size // hash_block_size
    return [block_hashes[(i + 1) * m - 1] for i in range(len(block_hashes) // m)]


_PICKLE_FRAME_MAX = 60_000  # a pickle larger than one 64 KiB frame is laid out differently
_TUPLE_CLOSE = {1: b"\x85", 2: b"\x86", 3: b"\x87"}


def _sha256_pickle(obj: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _sha256_cbor(obj: Any) -> bytes:
    return hashlib.sha256(cbor.dumps(obj)).digest()


def vllm_none_hash(algo: VllmAlgo = "sha256", seed: str | None = NONE_HASH_SEED) -> bytes:
    """vLLM's chain root: ``hash_fn(seed)``, the seed being the engine's ``PYTHONHASHSEED`` when
    set, else ``"vllm-none-hash"`` for sha256 — and, for xxhash, a random per-process value that
    must be given."""
    if algo not in VLLM_ALGOS:
        raise ConfigError("algo", f"must be one of {VLLM_ALGOS}, got {algo!r}")
    if seed is None or (algo.startswith("xxhash") and seed == NONE_HASH_SEED):
        raise ConfigError("none_hash_seed", f"vLLM seeds {algo} with a random per-process value unless PYTHONHASHSEED is set: "
                          "pass the engine's PYTHONHASHSEED (and set it on the engine)")
    if not isinstance(seed, str):
        raise ConfigError("none_hash_seed", f"must be a string (PYTHONHASHSEED's value), got {seed!r}")
    return _slow_fn(algo)(seed)


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
    none_hash_seed: str | None = None,
    lookahead_tokens: int = 0,
) -> list[bytes]:
    """Block hashes exactly as vLLM 0.33 computes them (full blocks only).

    ``parent``/``first_block_index`` continue an existing chain (the salt goes
    only on absolute block 0). ``none_hash_seed``: the engine's ``PYTHONHASHSEED``
    (required for the xxhash algorithms). ``lookahead_tokens``: vLLM's
    ``num_hash_lookahead_tokens`` (speculative drafters).
    """
    if algo not in VLLM_ALGOS:
        raise ConfigError("algo", f"must be one of {VLLM_ALGOS}, got {algo!r}")
    if isinstance(lookahead_tokens, bool) or not isinstance(lookahead_tokens, int) or lookahead_tokens < 0:
        raise ConfigError("lookahead_tokens", f"must be a non-negative int, got {lookahead_tokens!r}")
    cache_salt = cache_salt or None  # vLLM drops an empty salt (``if request.cache_salt``)
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ConfigError("block_size", f"must be a positive int, got {block_size!r}")
    if lora_path is not None and lora_name is None:
        raise ConfigError("lora_path", "given without lora_name")
    toks = as_token_array(tokens)
    L = lookahead_tokens
    n_blocks = max(toks.size - L, 0) // block_size
    if parent is not None:
        h = parent
    else:
        h = vllm_none_hash(algo, none_hash_seed if none_hash_seed is not None else (None if algo.startswith("xxhash") else NONE_HASH_SEED))
    if n_blocks == 0:
        return []
    if L or algo.startswith("xxhash"):  # the documented rule, block by block
        slow = _slow_fn(algo)
        out: list[bytes] = []
        tl = toks.tolist()
        for b in range(n_blocks):
            ek = _extra_keys(first_block_index + b, cache_salt, lora_name, lora_path)
            end = (b + 1) * block_size
            if L:
                ek = (ek, tl[end]) if L == 1 else (ek, *tl[end:end + L])
            h = slow((h, tuple(tl[b * block_size:end]), ek))
            out.append(h)
        return out
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
    out = []
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
