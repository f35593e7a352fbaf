"""The shared directory of published blocks: a protocol, an in-memory default, a Redis backend."""

from .base import Entry, Lease, PeerIndex, TenantIndex, TenantScopedDirectory
from .memory import InMemoryDirectory


def __getattr__(name: str):  # RedisDirectory imports redis-py lazily
    if name == "RedisDirectory":
        from .redis import RedisDirectory

        return RedisDirectory
    raise AttributeError(name)


__all__ = ["Entry", "InMemoryDirectory", "Lease", "PeerIndex", "RedisDirectory", "TenantIndex", "TenantScopedDirectory"]
