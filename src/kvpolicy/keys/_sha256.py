"""SHA-256 chains of spliced messages, in Numba, for the vLLM projection.

vLLM hashes, per block, the serialisation (pickle or canonical CBOR) of
``(parent, tuple(block_tokens), None)``. Both serialisations are a fixed layout
around the parent digest and the block's token encodings::

    A ‖ [le64(len(msg) − len(A) − 8) if framed] ‖ Bp ‖ parent ‖ C ‖ tokens_b ‖ D

so each token's encoding is computed once for the whole prompt and every block's
message is assembled and hashed inside one kernel. The reference is
:func:`hashlib.sha256` over ``pickle.dumps`` / canonical CBOR; the test suite
checks the two agree byte for byte.
"""

from __future__ import annotations

import numba as nb
import numpy as np

_K = np.array(
    [
        0x428A2F98, 0x71374491, 0xB5C0FBCF, 0xE9B5DBA5, 0x3956C25B, 0x59F111F1, 0x923F82A4, 0xAB1C5ED5,
        0xD807AA98, 0x12835B01, 0x243185BE, 0x550C7DC3, 0x72BE5D74, 0x80DEB1FE, 0x9BDC06A7, 0xC19BF174,
        0xE49B69C1, 0xEFBE4786, 0x0FC19DC6, 0x240CA1CC, 0x2DE92C6F, 0x4A7484AA, 0x5CB0A9DC, 0x76F988DA,
        0x983E5152, 0xA831C66D, 0xB00327C8, 0xBF597FC7, 0xC6E00BF3, 0xD5A79147, 0x06CA6351, 0x14292967,
        0x27B70A85, 0x2E1B2138, 0x4D2C6DFC, 0x53380D13, 0x650A7354, 0x766A0ABB, 0x81C2C92E, 0x92722C85,
        0xA2BFE8A1, 0xA81A664B, 0xC24B8B70, 0xC76C51A3, 0xD192E819, 0xD6990624, 0xF40E3585, 0x106AA070,
        0x19A4C116, 0x1E376C08, 0x2748774C, 0x34B0BCB5, 0x391C0CB3, 0x4ED8AA4A, 0x5B9CCA4F, 0x682E6FF3,
        0x748F82EE, 0x78A5636F, 0x84C87814, 0x8CC70208, 0x90BEFFFA, 0xA4506CEB, 0xBEF9A3F7, 0xC67178F2,
    ],
    dtype=np.uint32,
)
_H0 = np.array([0x6A09E667, 0xBB67AE85, 0x3C6EF372, 0xA54FF53A, 0x510E527F, 0x9B05688C, 0x1F83D9AB, 0x5BE0CD19], dtype=np.uint32)


_M32 = np.uint64(0xFFFFFFFF)
_K64 = _K.astype(np.uint64)
_H064 = _H0.astype(np.uint64)


# Numba widens uint32 arithmetic to 64 bits, so 32-bit words live in uint64
# values and every sum / rotation is masked back to 32 bits explicitly.
@nb.njit(inline="always")
def _rotr32(x, n):
    return ((x >> np.uint64(n)) | (x << np.uint64(32 - n))) & _M32


@nb.njit(cache=True)
def _sha256_into(msg, n, out, out_row, w):
    """SHA-256 of ``msg[:n]`` (``msg`` has room for padding) into ``out[out_row]``."""
    # padding: 0x80, zeros, 64-bit big-endian bit length
    total = ((n + 9 + 63) // 64) * 64
    msg[n] = 0x80
    for i in range(n + 1, total - 8):
        msg[i] = 0
    bits = n * 8
    for i in range(8):
        msg[total - 1 - i] = (bits >> (8 * i)) & 0xFF
    h0, h1, h2, h3 = _H064[0], _H064[1], _H064[2], _H064[3]
    h4, h5, h6, h7 = _H064[4], _H064[5], _H064[6], _H064[7]
    for c in range(0, total, 64):
        for t in range(16):
            j = c + 4 * t
            w[t] = (np.uint64(msg[j]) << np.uint64(24)) | (np.uint64(msg[j + 1]) << np.uint64(16)) | (np.uint64(msg[j + 2]) << np.uint64(8)) | np.uint64(msg[j + 3])
        for t in range(16, 64):
            x = w[t - 15]
            y = w[t - 2]
            s0 = _rotr32(x, 7) ^ _rotr32(x, 18) ^ (x >> np.uint64(3))
            s1 = _rotr32(y, 17) ^ _rotr32(y, 19) ^ (y >> np.uint64(10))
            w[t] = (w[t - 16] + s0 + w[t - 7] + s1) & _M32
        a, b, cc, d, e, f, g, h = h0, h1, h2, h3, h4, h5, h6, h7
        for t in range(64):
            S1 = _rotr32(e, 6) ^ _rotr32(e, 11) ^ _rotr32(e, 25)
            ch = (e & f) ^ ((~e) & _M32 & g)
            t1 = (h + S1 + ch + _K64[t] + w[t]) & _M32
            S0 = _rotr32(a, 2) ^ _rotr32(a, 13) ^ _rotr32(a, 22)
            maj = (a & b) ^ (a & cc) ^ (b & cc)
            h = g
            g = f
            f = e
            e = (d + t1) & _M32
            d = cc
            cc = b
            b = a
            a = (t1 + S0 + maj) & _M32
        h0 = (h0 + a) & _M32
        h1 = (h1 + b) & _M32
        h2 = (h2 + cc) & _M32
        h3 = (h3 + d) & _M32
        h4 = (h4 + e) & _M32
        h5 = (h5 + f) & _M32
        h6 = (h6 + g) & _M32
        h7 = (h7 + h) & _M32
    hs = (h0, h1, h2, h3, h4, h5, h6, h7)
    for i in range(8):
        v = hs[i]
        out[out_row, 4 * i] = (v >> np.uint64(24)) & np.uint64(0xFF)
        out[out_row, 4 * i + 1] = (v >> np.uint64(16)) & np.uint64(0xFF)
        out[out_row, 4 * i + 2] = (v >> np.uint64(8)) & np.uint64(0xFF)
        out[out_row, 4 * i + 3] = v & np.uint64(0xFF)


@nb.njit(cache=True)
def sha256_spliced_chain(parent, a, framed, bp, c, d, buf, offsets, block_size, n_blocks, out):
    """Chain ``n_blocks`` SHA-256 hashes of spliced messages (see module doc)."""
    max_body = 0
    for b in range(n_blocks):
        body = offsets[(b + 1) * block_size] - offsets[b * block_size]
        if body > max_body:
            max_body = body
    cap = a.size + 8 + bp.size + 32 + c.size + max_body + d.size + 72
    msg = np.empty(cap, dtype=np.uint8)
    w = np.empty(64, dtype=np.uint64)
    par = parent.copy()
    for b in range(n_blocks):
        s = offsets[b * block_size]
        e = offsets[(b + 1) * block_size]
        n = a.size + (8 if framed else 0) + bp.size + par.size + c.size + (e - s) + d.size
        p = 0
        for i in range(a.size):
            msg[p] = a[i]
            p += 1
        if framed:
            frame_len = n - a.size - 8
            for i in range(8):
                msg[p] = (frame_len >> (8 * i)) & 0xFF
                p += 1
        for i in range(bp.size):
            msg[p] = bp[i]
            p += 1
        for i in range(par.size):
            msg[p] = par[i]
            p += 1
        for i in range(c.size):
            msg[p] = c[i]
            p += 1
        for i in range(s, e):
            msg[p] = buf[i]
            p += 1
        for i in range(d.size):
            msg[p] = d[i]
            p += 1
        _sha256_into(msg, n, out, b, w)
        if par.size != 32:
            par = np.empty(32, dtype=np.uint8)
        for i in range(32):
            par[i] = out[b, i]


@nb.njit(cache=True)
def encode_uints(values, scheme):
    """Per-token encodings for ``scheme`` 0 = pickle opcodes, 1 = canonical CBOR.

    Returns ``(buf, offsets)``: token i is ``buf[offsets[i]:offsets[i + 1]]``.
    """
    n = values.size
    offsets = np.empty(n + 1, dtype=np.int64)
    offsets[0] = 0
    for i in range(n):
        v = np.uint64(values[i])
        if scheme == 0:
            size = 2 if v < 0x100 else (3 if v < 0x10000 else (5 if v < 0x80000000 else 7))
        else:
            size = 1 if v < 24 else (2 if v < 0x100 else (3 if v < 0x10000 else 5))
        offsets[i + 1] = offsets[i] + size
    buf = np.empty(offsets[n], dtype=np.uint8)
    for i in range(n):
        v = np.uint64(values[i])
        p = offsets[i]
        if scheme == 0:  # pickle: K u8 | M u16le | J i32le | LONG1 5 bytes le
            if v < 0x100:
                buf[p] = 0x4B
                buf[p + 1] = v
            elif v < 0x10000:
                buf[p] = 0x4D
                buf[p + 1] = v & 0xFF
                buf[p + 2] = v >> 8
            elif v < 0x80000000:
                buf[p] = 0x4A
                for k in range(4):
                    buf[p + 1 + k] = (v >> (8 * k)) & 0xFF
            else:
                buf[p] = 0x8A
                buf[p + 1] = 5
                for k in range(4):
                    buf[p + 2 + k] = (v >> (8 * k)) & 0xFF
                buf[p + 6] = 0
        else:  # CBOR major type 0, big-endian
            if v < 24:
                buf[p] = v
            elif v < 0x100:
                buf[p] = 24
                buf[p + 1] = v
            elif v < 0x10000:
                buf[p] = 25
                buf[p + 1] = v >> 8
                buf[p + 2] = v & 0xFF
            else:
                buf[p] = 26
                for k in range(4):
                    buf[p + 1 + k] = (v >> (8 * (3 - k))) & 0xFF
    return buf, offsets
