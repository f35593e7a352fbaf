"""Chained 128-bit block keys.

``key[i] = H(key[i-1] ‖ tokens of block i ‖ extra[i])`` with ``key[-1]`` derived
from the namespace digest. Only full blocks get keys: the tokens of a trailing
partial block are never hashed (they can never be a hit).

Two families:

* ``keyed`` (default): BLAKE2b-128 keyed with a per-deployment secret. BLAKE2b
  is collision-resistant, and the key makes block keys unpredictable outside
  the deployment, so a leaked directory cannot be probed with guessed prompts.
  Use it for any pool shared by more than one tenant.
* ``fast``: a non-cryptographic two-lane 128-bit hash, ~10× cheaper than keyed.
  Anyone who can choose prompts can in principle craft collisions, so use it only
  for trusted single-tenant deployments and for trace replay.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal

import numpy as np

from ..errors import ConfigError
from . import _kernels, cbor
from .namespace import Namespace

Scheme = Literal["keyed", "fast"]
SCHEMES: tuple[str, ...] = ("keyed", "fast")
ROOT_PERSON = b"kvpolicy.root.v1"
EXTRA_PERSON = b"kvpolicy.xtr.v1"
KEY_BYTES = 16
_U32_MAX = (1 << 32) - 1


def as_token_array(tokens: Any, field: str = "tokens") -> np.ndarray:
    """Validate token ids and return them as a contiguous ``uint32`` array."""
    if isinstance(tokens, np.ndarray) and tokens.dtype == np.uint32 and tokens.ndim == 1:
        return np.ascontiguousarray(tokens)
    try:
        arr = np.asarray(tokens)
    except (ValueError, TypeError) as exc:
        raise ConfigError(field, f"must be a 1-D sequence of integer token ids ({exc})") from None
    if arr.ndim != 1:
        if arr.size == 0:
            return np.empty(0, dtype=np.uint32)
        raise ConfigError(field, f"must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        return np.empty(0, dtype=np.uint32)
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        # the caller's own elements where it gave a sequence: numpy made [1, 2, 4.0] all floats, and the message
        # named position 0 ("1.0") instead of the 4.0 at position 2
        given = arr.tolist() if isinstance(tokens, np.ndarray) else list(tokens)
        bad = next((i for i, t in enumerate(given) if isinstance(t, bool) or not isinstance(t, (int, np.integer))), 0)
        raise ConfigError(field, f"token ids must be integers; position {bad} is {given[bad]!r}")
    lo, hi = arr.min(), arr.max()
    if lo < 0 or hi > _U32_MAX:
        pos = int(np.argmax((arr < 0) | (arr > _U32_MAX)))
        raise ConfigError(field, f"token ids must be in [0, 2**32); position {pos} is {int(arr[pos])}")
    return np.ascontiguousarray(arr, dtype=np.uint32)


class BlockKeys(Sequence[bytes]):
    """An immutable run of block keys: ``array`` is ``(n, 2) uint64``.

    Index it for ``bytes`` (single lookups), slice it for another ``BlockKeys``,
    use :meth:`as_int64` for engines whose events carry 64-bit ids.
    """

    __slots__ = ("_array", "block_size_tokens")

    def __init__(self, array: np.ndarray, block_size_tokens: int) -> None:
        arr = np.ascontiguousarray(array, dtype=np.uint64).reshape(-1, 2)
        arr.setflags(write=False)
        self._array = arr
        self.block_size_tokens = block_size_tokens

    @property
    def array(self) -> np.ndarray:
        return self._array

    def __len__(self) -> int:
        return self._array.shape[0]

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return BlockKeys(self._array[i], self.block_size_tokens)
        return self._array[i].tobytes()

    def __iter__(self) -> Iterator[bytes]:
        raw = self._array.tobytes()
        for k in range(0, len(raw), KEY_BYTES):
            yield raw[k : k + KEY_BYTES]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, BlockKeys):
            return NotImplemented
        return self.block_size_tokens == other.block_size_tokens and np.array_equal(self._array, other._array)

    def __hash__(self) -> int:
        return hash((self.block_size_tokens, self._array.tobytes()))

    def __repr__(self) -> str:
        head = ", ".join(k.hex()[:12] for k in list(self)[:3])
        more = ", ..." if len(self) > 3 else ""
        return f"BlockKeys(n={len(self)}, block_size_tokens={self.block_size_tokens}, [{head}{more}])"

    def hex(self) -> list[str]:
        return [k.hex() for k in self]

    def as_int64(self) -> np.ndarray:
        """64-bit projection: the first 8 key bytes as a little-endian signed int."""
        return self._array[:, 0].view(np.int64).copy()

    def last(self) -> bytes | None:
        return self[len(self) - 1] if len(self) else None

    @staticmethod
    def concat(parts: Sequence[BlockKeys], block_size_tokens: int) -> BlockKeys:
        arrays = [p.array for p in parts if len(p)]
        if not arrays:
            return BlockKeys(np.empty((0, 2), np.uint64), block_size_tokens)
        return BlockKeys(np.concatenate(arrays), block_size_tokens)


def extra_digest(extra: Any) -> bytes:
    """16-byte digest of a per-block extra key (canonical CBOR, BLAKE2b)."""
    return hashlib.blake2b(cbor.dumps(extra), digest_size=16, person=EXTRA_PERSON).digest()


class BlockHasher:
    """Builds chained keys for one namespace.

    >>> ns = Namespace(model_id="m", model_revision="r1", tokenizer_version="t1",
    ...                kv_dtype="bf16", block_size_tokens=4)
    >>> h = BlockHasher(ns, scheme="fast")
    >>> len(h.hash_blocks(list(range(10))))   # two full blocks; 2 tail tokens get no key
    2
    """

    def __init__(self, namespace: Namespace, scheme: Scheme = "keyed", secret: bytes | None = None) -> None:
        if not isinstance(namespace, Namespace):
            raise ConfigError("namespace", f"must be a kvpolicy Namespace, got {type(namespace).__name__}")
        if scheme not in SCHEMES:
            raise ConfigError("scheme", f"must be one of {SCHEMES}, got {scheme!r}")
        if scheme == "keyed":
            if not isinstance(secret, (bytes, bytearray)) or not 16 <= len(secret) <= 64:
                raise ConfigError(
                    "secret",
                    "the keyed scheme needs a per-deployment secret of 16..64 bytes "
                    "(use scheme='fast' only for a trusted single-tenant deployment)",
                )
        elif secret is not None and (not isinstance(secret, (bytes, bytearray)) or not 1 <= len(secret) <= 64):
            raise ConfigError("secret", "must be None or 1..64 bytes")
        self.namespace = namespace
        self.scheme: Scheme = scheme
        self.block_size_tokens = namespace.block_size_tokens
        digest = namespace.digest
        if secret is not None:
            digest = hashlib.blake2b(digest, key=bytes(secret), digest_size=16, person=ROOT_PERSON).digest()
        self.root: bytes = digest
        self._root_words = np.frombuffer(digest, dtype="<u8").copy()
        if scheme == "keyed":
            assert secret is not None
            key_words = np.frombuffer(bytes(secret).ljust(128, b"\0"), dtype="<u8").copy()
            person_words = np.frombuffer(_kernels.BLOCK_PERSON.ljust(16, b"\0"), dtype="<u8").copy()
            self._h_keyed = _kernels.blake2b_keyed_init(key_words, len(secret), person_words)
        self._secret = bytes(secret) if secret is not None else None

    def __repr__(self) -> str:
        return f"BlockHasher(scheme={self.scheme!r}, block_size_tokens={self.block_size_tokens}, namespace={self.namespace.model_id!r}/{self.namespace.tenant!r})"

    def hash_blocks(
        self,
        tokens: Any,
        *,
        parent: bytes | None = None,
        extra_keys: Mapping[int, Any] | Sequence[Any] | None = None,
    ) -> BlockKeys:
        """Keys of every full block of ``tokens``, chained from ``parent``.

        ``parent`` is the last key of an existing chain (default: the namespace
        root); ``extra_keys`` maps a block index (relative to ``tokens``) to any
        CBOR-encodable value — multimodal item hashes, for example.
        """
        toks = as_token_array(tokens)
        bs = self.block_size_tokens
        n_blocks = toks.size // bs
        out = np.empty((n_blocks, 2), dtype=np.uint64)
        if n_blocks == 0:
            return BlockKeys(out, bs)
        if parent is None:
            root = self._root_words
        else:
            if not isinstance(parent, (bytes, bytearray)) or len(parent) != KEY_BYTES:
                raise ConfigError("parent", f"must be a {KEY_BYTES}-byte key, got {parent!r:.40}")
            root = np.frombuffer(bytes(parent), dtype="<u8").copy()
        extras, has_extra = self._extras(extra_keys, n_blocks)
        if self.scheme == "keyed":
            _kernels.blake2b_chain_kernel(toks, bs, n_blocks, self._h_keyed, root, extras, has_extra, out)
        else:
            _kernels.fast_chain_kernel(toks, bs, n_blocks, root, extras, has_extra, out)
        return BlockKeys(out, bs)

    def hash_block_reference(self, parent: bytes, block_tokens: Any, extra: Any = None) -> bytes:
        """One block through the pure-Python reference (for tests and audits)."""
        ed = extra_digest(extra) if extra is not None else None
        toks = as_token_array(block_tokens)
        if toks.size != self.block_size_tokens:
            raise ConfigError("block_tokens", f"must hold exactly {self.block_size_tokens} tokens, got {toks.size}")
        if self.scheme == "keyed":
            assert self._secret is not None
            return _kernels.blake2b_block_reference(parent, toks, ed, self._secret)
        return _kernels.fast_block_reference(parent, toks, ed)

    def chain(self) -> KeyChain:
        """An empty incremental chain (decode steps, next turns)."""
        return KeyChain(self)

    @staticmethod
    def _extras(extra_keys: Mapping[int, Any] | Sequence[Any] | None, n_blocks: int) -> tuple[np.ndarray, np.ndarray]:
        extras = np.zeros((n_blocks, 2), dtype=np.uint64)
        has = np.zeros(n_blocks, dtype=np.bool_)
        if extra_keys is None:
            return extras, has
        items = extra_keys.items() if isinstance(extra_keys, Mapping) else enumerate(extra_keys)
        for i, value in items:
            if isinstance(i, bool) or not isinstance(i, int) or i < 0:
                raise ConfigError("extra_keys", f"block index must be a non-negative int, got {i!r}")
            if value is None or i >= n_blocks:
                continue  # an extra for a block that is not full yet has no key to change
            extras[i] = np.frombuffer(extra_digest(value), dtype="<u8")
            has[i] = True
        return extras, has


class KeyChain:
    """Incremental hashing: append tokens, get the keys of newly completed blocks.

    Bit-identical to hashing the whole sequence from scratch; extending costs
    O(appended tokens + one block), never O(prompt).
    """

    def __init__(self, hasher: BlockHasher) -> None:
        self.hasher = hasher
        self._parts: list[BlockKeys] = []
        self._n_blocks = 0
        self._pending = np.empty(0, dtype=np.uint32)
        self._last: bytes | None = None

    @property
    def num_tokens(self) -> int:
        return self._n_blocks * self.hasher.block_size_tokens + self._pending.size

    @property
    def num_blocks(self) -> int:
        return self._n_blocks

    @property
    def keys(self) -> BlockKeys:
        if len(self._parts) > 1:
            self._parts = [BlockKeys.concat(self._parts, self.hasher.block_size_tokens)]
        return self._parts[0] if self._parts else BlockKeys(np.empty((0, 2), np.uint64), self.hasher.block_size_tokens)

    @property
    def last_key(self) -> bytes | None:
        return self._last

    def extend(self, tokens: Any, extra_keys: Mapping[int, Any] | None = None) -> BlockKeys:
        """Append tokens; return the keys of the blocks they complete.

        ``extra_keys`` is indexed by *absolute* block index in the chain.
        """
        new = as_token_array(tokens)
        toks = np.concatenate([self._pending, new]) if self._pending.size else new
        bs = self.hasher.block_size_tokens
        n_full = toks.size // bs
        rel_extra = None
        if extra_keys:
            rel_extra = {i - self._n_blocks: v for i, v in extra_keys.items() if isinstance(i, int) and i >= self._n_blocks}
            bad = [i for i in extra_keys if not isinstance(i, int) or isinstance(i, bool) or i < self._n_blocks]
            if bad:
                raise ConfigError("extra_keys", f"block {bad[0]!r} is already hashed or not a block index")
        keys = self.hasher.hash_blocks(toks[: n_full * bs], parent=self._last, extra_keys=rel_extra)
        self._pending = toks[n_full * bs :].copy()
        if len(keys):
            self._parts.append(keys)
            self._n_blocks += len(keys)
            self._last = keys.last()
        return keys
