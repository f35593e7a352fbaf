"""Canonical CBOR (RFC 8949 §4.2.1 core deterministic encoding) for the value
shapes vLLM hashes: ``None``, ``bool``, ``int`` (bignums as tags 2/3), ``str``,
``bytes`` and tuples/lists of them. Enough to reproduce ``cbor2.dumps(obj, canonical=True)``
for block-hash inputs without a runtime dependency; the test suite checks it
against ``cbor2`` on generated values.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

from ..errors import ConfigError


def _head(major: int, n: int) -> bytes:
    if n < 24:
        return bytes([(major << 5) | n])
    if n < 0x100:
        return bytes([(major << 5) | 24, n])
    if n < 0x10000:
        return bytes([(major << 5) | 25]) + struct.pack(">H", n)
    if n < 0x100000000:
        return bytes([(major << 5) | 26]) + struct.pack(">I", n)
    if n < 0x10000000000000000:
        return bytes([(major << 5) | 27]) + struct.pack(">Q", n)
    raise ConfigError("cbor", f"length {n} does not fit a CBOR head")


def dumps(obj: Any) -> bytes:
    """Encode ``obj`` canonically."""
    out: list[bytes] = []
    _encode(obj, out)
    return b"".join(out)


def _encode(obj: Any, out: list[bytes]) -> None:
    if obj is None:
        out.append(b"\xf6")
    elif obj is True:
        out.append(b"\xf5")
    elif obj is False:
        out.append(b"\xf4")
    elif isinstance(obj, int):
        n, major = (obj, 0) if obj >= 0 else (-1 - obj, 1)
        if n < 0x10000000000000000:
            out.append(_head(major, n))
        else:  # bignum: tag 2 (positive) / 3 (negative) around the big-endian magnitude
            mag = n.to_bytes((n.bit_length() + 7) // 8, "big")
            out.append(bytes([0xC2 if major == 0 else 0xC3]))
            out.append(_head(2, len(mag)))
            out.append(mag)
    elif isinstance(obj, bytes):
        out.append(_head(2, len(obj)))
        out.append(obj)
    elif isinstance(obj, str):
        b = obj.encode("utf-8")
        out.append(_head(3, len(b)))
        out.append(b)
    elif isinstance(obj, (tuple, list)):
        out.append(_head(4, len(obj)))
        for item in obj:
            _encode(item, out)
    else:
        raise ConfigError("cbor", f"cannot encode {type(obj).__name__}")


def encode_uint_array(values: np.ndarray) -> tuple[bytes, np.ndarray]:
    """Encode non-negative ints < 2**32 one after another, vectorised.

    Returns the concatenated encodings and ``offsets`` (len n + 1) so that item i
    is ``buf[offsets[i]:offsets[i + 1]]`` — lets a caller slice a block's token
    array encoding without a Python loop per token.
    """
    v = np.asarray(values, dtype=np.uint64)
    n = v.size
    size = np.where(v < 24, 1, np.where(v < 0x100, 2, np.where(v < 0x10000, 3, 5))).astype(np.int64)
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(size, out=offsets[1:])
    buf = np.zeros(int(offsets[-1]), dtype=np.uint8)
    start = offsets[:-1]
    small = size == 1
    buf[start[small]] = v[small].astype(np.uint8)
    for width, first_byte in ((2, 24), (3, 25), (5, 26)):
        sel = size == width
        if not sel.any():
            continue
        s = start[sel]
        vals = v[sel]
        buf[s] = first_byte
        nbytes = width - 1
        for k in range(nbytes):
            shift = np.uint64(8 * (nbytes - 1 - k))
            buf[s + 1 + k] = ((vals >> shift) & np.uint64(0xFF)).astype(np.uint8)
    return buf.tobytes(), offsets
