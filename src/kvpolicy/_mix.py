"""splitmix64: the one integer mixer kvpolicy's kernels share (sampling, routing, fingerprints); and a key as 64 bits."""

from __future__ import annotations

import hashlib
from collections.abc import Hashable

import numba as nb
import numpy as np

_M64 = (1 << 64) - 1


def splitmix64_next(state: int) -> tuple[int, int]:
    """One step of splitmix64 in Python ints: (new state, output). The kernels run the same arithmetic in uint64."""
    state = (state + 0x9E3779B97F4A7C15) & _M64
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return state, z ^ (z >> 31)


def fmix64(x: int) -> int:
    """MurmurHash3's 64-bit finaliser in Python ints."""
    x ^= x >> 33
    x = (x * 0xFF51AFD7ED558CCD) & _M64
    x ^= x >> 33
    x = (x * 0xC4CEB9FE1A85EC53) & _M64
    return x ^ (x >> 33)


def key_bits(key: Hashable) -> int:
    """A key as 64 bits: an int as itself (mod 2**64), bytes and str by BLAKE2b of all their bytes (stable across
    processes, unlike ``hash``, and keys that share a prefix stay apart), anything else by its repr."""
    if isinstance(key, int):
        return key & _M64
    if isinstance(key, str):
        key = key.encode()
    elif not isinstance(key, (bytes, bytearray, memoryview)):
        key = repr(key).encode()
    return int.from_bytes(hashlib.blake2b(bytes(key), digest_size=8).digest(), "little")


@nb.njit(cache=True, inline="always")
def splitmix64(x):
    z = np.uint64(x) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))
