"""Numba kernels for chained block hashing, beside their pure-Python references.

A block's message is a stream of little-endian 32-bit words::

    parent key (4 words) ‖ block tokens (B words) ‖ [extra digest (4 words)]

* ``keyed``: the message is hashed with BLAKE2b-128, keyed with the deployment
  secret and personalised with :data:`BLOCK_PERSON`. The reference is
  :func:`hashlib.blake2b`; :func:`blake2b_block_reference` is what the kernel must
  equal, byte for byte.
* ``fast``: a two-lane multiply/xor-shift hash (not cryptographic) for trusted,
  single-tenant deployments. Its reference is :func:`fast_block_reference`, a
  pure-Python transcription of the same arithmetic.

Both kernels chain: the key of block i is the parent of block i + 1.
"""

from __future__ import annotations

import hashlib

import numba as nb
import numpy as np

from .._mix import fmix64

BLOCK_PERSON = b"kvpolicy.blk.v1"
MASK64 = (1 << 64) - 1

_IV = np.array(
    [
        0x6A09E667F3BCC908, 0xBB67AE8584CAA73B, 0x3C6EF372FE94F82B, 0xA54FF53A5F1D36F1,
        0x510E527FADE682D1, 0x9B05688C2B3E6C1F, 0x1F83D9ABFB41BD6B, 0x5BE0CD19137E2179,
    ],
    dtype=np.uint64,
)
_SIGMA = np.array(
    [
        [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15],
        [14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3],
        [11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4],
        [7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8],
        [9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13],
        [2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9],
        [12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11],
        [13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10],
        [6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5],
        [10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0],
        [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15],
        [14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3],
    ],
    dtype=np.int64,
)


# --------------------------------------------------------------------------- BLAKE2b


@nb.njit(inline="always")
def _rotr(x, n):
    return (x >> np.uint64(n)) | (x << np.uint64(64 - n))


@nb.njit(inline="always")
def _g(a, b, c, d, x, y):
    a = a + b + x
    d = _rotr(d ^ a, 32)
    c = c + d
    b = _rotr(b ^ c, 24)
    a = a + b + y
    d = _rotr(d ^ a, 16)
    c = c + d
    b = _rotr(b ^ c, 63)
    return a, b, c, d


@nb.njit(cache=True)
def _compress(h, m, t, last, v):
    """BLAKE2b compression F (RFC 7693 §3.2) on state h with 16-word block m.

    The 16 working words live in scalar locals so they stay in registers; ``v``
    is kept in the signature for callers that reuse a scratch buffer.
    """
    v0, v1, v2, v3, v4, v5, v6, v7 = h[0], h[1], h[2], h[3], h[4], h[5], h[6], h[7]
    v8, v9, v10, v11 = _IV[0], _IV[1], _IV[2], _IV[3]
    v12 = _IV[4] ^ np.uint64(t)
    v13 = _IV[5]
    v14 = ~_IV[6] if last else _IV[6]
    v15 = _IV[7]
    for r in range(12):
        s = _SIGMA[r]
        v0, v4, v8, v12 = _g(v0, v4, v8, v12, m[s[0]], m[s[1]])
        v1, v5, v9, v13 = _g(v1, v5, v9, v13, m[s[2]], m[s[3]])
        v2, v6, v10, v14 = _g(v2, v6, v10, v14, m[s[4]], m[s[5]])
        v3, v7, v11, v15 = _g(v3, v7, v11, v15, m[s[6]], m[s[7]])
        v0, v5, v10, v15 = _g(v0, v5, v10, v15, m[s[8]], m[s[9]])
        v1, v6, v11, v12 = _g(v1, v6, v11, v12, m[s[10]], m[s[11]])
        v2, v7, v8, v13 = _g(v2, v7, v8, v13, m[s[12]], m[s[13]])
        v3, v4, v9, v14 = _g(v3, v4, v9, v14, m[s[14]], m[s[15]])
    h[0] ^= v0 ^ v8
    h[1] ^= v1 ^ v9
    h[2] ^= v2 ^ v10
    h[3] ^= v3 ^ v11
    h[4] ^= v4 ^ v12
    h[5] ^= v5 ^ v13
    h[6] ^= v6 ^ v14
    h[7] ^= v7 ^ v15


@nb.njit(cache=True)
def blake2b_keyed_init(key_words, key_len, person_words):
    """State after the parameter block and the key block (shared by every message)."""
    h = _IV.copy()
    h[0] ^= np.uint64(0x01010000) ^ (np.uint64(key_len) << np.uint64(8)) ^ np.uint64(16)
    h[6] ^= person_words[0]
    h[7] ^= person_words[1]
    v = np.empty(16, dtype=np.uint64)
    _compress(h, key_words, 128, False, v)
    return h


@nb.njit(cache=True)
def blake2b_chain_kernel(tokens, block_size, n_blocks, h_keyed, root, extras, has_extra, out):
    """Chained keyed BLAKE2b-128 over ``n_blocks`` full blocks of uint32 ``tokens``.

    ``h_keyed`` is :func:`blake2b_keyed_init`'s state; the byte counter starts at
    128 because the key block was already compressed.
    """
    max_words32 = 4 + block_size + 4
    n_chunks_max = (max_words32 * 4 + 127) // 128
    msg32 = np.zeros(n_chunks_max * 32, dtype=np.uint32)
    m = np.empty(16, dtype=np.uint64)
    h = np.empty(8, dtype=np.uint64)
    v = np.empty(16, dtype=np.uint64)
    p0 = root[0]
    p1 = root[1]
    for i in range(n_blocks):
        n32 = 4 + block_size
        msg32[0] = np.uint32(p0 & np.uint64(0xFFFFFFFF))
        msg32[1] = np.uint32(p0 >> np.uint64(32))
        msg32[2] = np.uint32(p1 & np.uint64(0xFFFFFFFF))
        msg32[3] = np.uint32(p1 >> np.uint64(32))
        base = i * block_size
        for k in range(block_size):
            msg32[4 + k] = tokens[base + k]
        if has_extra[i]:
            e0 = extras[i, 0]
            e1 = extras[i, 1]
            msg32[n32] = np.uint32(e0 & np.uint64(0xFFFFFFFF))
            msg32[n32 + 1] = np.uint32(e0 >> np.uint64(32))
            msg32[n32 + 2] = np.uint32(e1 & np.uint64(0xFFFFFFFF))
            msg32[n32 + 3] = np.uint32(e1 >> np.uint64(32))
            n32 += 4
        n_bytes = n32 * 4
        n_chunks = (n_bytes + 127) // 128
        for k in range(n32, n_chunks * 32):
            msg32[k] = 0
        for k in range(8):
            h[k] = h_keyed[k]
        for c in range(n_chunks):
            for w in range(16):
                lo = np.uint64(msg32[c * 32 + 2 * w])
                hi = np.uint64(msg32[c * 32 + 2 * w + 1])
                m[w] = lo | (hi << np.uint64(32))
            last = c == n_chunks - 1
            counted = 128 + (n_bytes if last else (c + 1) * 128)
            _compress(h, m, counted, last, v)
        p0 = h[0]
        p1 = h[1]
        out[i, 0] = p0
        out[i, 1] = p1


def blake2b_block_reference(parent: bytes, block_tokens, extra: bytes | None, secret: bytes) -> bytes:
    """Pure-Python reference: one keyed block hash through :mod:`hashlib`."""
    msg = parent + np.asarray(block_tokens, dtype="<u4").tobytes() + (extra or b"")
    return hashlib.blake2b(msg, key=secret, digest_size=16, person=BLOCK_PERSON).digest()


# --------------------------------------------------------------------------- fast

_F_K1 = 0x9E3779B97F4A7C15
_F_K2 = 0xC2B2AE3D27D4EB4F
_F_K3 = 0x165667B19E3779F9
_F_M1 = 0xFF51AFD7ED558CCD
_F_M2 = 0xC4CEB9FE1A85EC53


@nb.njit(inline="always")
def _fmix64(x):
    x ^= x >> np.uint64(33)
    x *= np.uint64(_F_M1)
    x ^= x >> np.uint64(33)
    x *= np.uint64(_F_M2)
    x ^= x >> np.uint64(33)
    return x


@nb.njit(inline="always")
def _rotl(x, n):
    return (x << np.uint64(n)) | (x >> np.uint64(64 - n))


@nb.njit(cache=True)
def fast_chain_kernel(tokens, block_size, n_blocks, root, extras, has_extra, out):
    """Chained two-lane 128-bit hash (non-cryptographic) over full blocks."""
    p0 = root[0]
    p1 = root[1]
    k1 = np.uint64(_F_K1)
    k2 = np.uint64(_F_K2)
    k3 = np.uint64(_F_K3)
    for i in range(n_blocks):
        a = p0 ^ k3
        b = p1 ^ k1
        base = i * block_size
        k = 0
        while k + 1 < block_size:
            w = np.uint64(tokens[base + k]) | (np.uint64(tokens[base + k + 1]) << np.uint64(32))
            a = _rotl((a ^ w) * k1, 31) * k2
            b = _rotl((b + w) * k2, 27) * k1 + k3
            k += 2
        if k < block_size:
            w = np.uint64(tokens[base + k])
            a = _rotl((a ^ w) * k1, 31) * k2
            b = _rotl((b + w) * k2, 27) * k1 + k3
        if has_extra[i]:
            a = _rotl((a ^ extras[i, 0]) * k1, 31) * k2
            b = _rotl((b + extras[i, 1]) * k2, 27) * k1 + k3
            b ^= np.uint64(0x5BD1E995)
        a ^= np.uint64(block_size)
        b ^= np.uint64(block_size) << np.uint64(32)
        a = _fmix64(a + b)
        b = _fmix64(b + a)
        p0 = a
        p1 = b
        out[i, 0] = a
        out[i, 1] = b


_py_fmix64 = fmix64  # the kernel's _fmix64 in Python ints


def _py_rotl(x: int, n: int) -> int:
    return ((x << n) | (x >> (64 - n))) & MASK64


def fast_block_reference(parent: bytes, block_tokens, extra: bytes | None) -> bytes:
    """Pure-Python reference of one ``fast`` block hash (what the kernel must equal)."""
    p0 = int.from_bytes(parent[:8], "little")
    p1 = int.from_bytes(parent[8:], "little")
    toks = [int(t) for t in block_tokens]
    bs = len(toks)
    a, b = p0 ^ _F_K3, p1 ^ _F_K1

    def step(a: int, b: int, w: int, w2: int) -> tuple[int, int]:
        a = (_py_rotl(((a ^ w) * _F_K1) & MASK64, 31) * _F_K2) & MASK64
        b = (_py_rotl(((b + w2) * _F_K2) & MASK64, 27) * _F_K1 + _F_K3) & MASK64
        return a, b

    k = 0
    while k + 1 < bs:
        w = toks[k] | (toks[k + 1] << 32)
        a, b = step(a, b, w, w)
        k += 2
    if k < bs:
        a, b = step(a, b, toks[k], toks[k])
    if extra is not None:
        a, b = step(a, b, int.from_bytes(extra[:8], "little"), int.from_bytes(extra[8:], "little"))
        b ^= 0x5BD1E995
    a ^= bs
    b ^= bs << 32
    a = _py_fmix64((a + b) & MASK64)
    b = _py_fmix64((b + a) & MASK64)
    return a.to_bytes(8, "little") + b.to_bytes(8, "little")
