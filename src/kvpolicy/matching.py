"""Block-aligned prefix matching over a local cache and remote tiers.

Only full blocks count, and only as a leading run: the local cache is asked
first, then each remote tier continues where the run stopped; nothing after a
gap counts. The request's last token is always recomputed (the engine needs its
logits), so at most ``floor((T - 1) / B)`` blocks can be hits — a prompt that is
an exact multiple of B never counts its final block.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Literal

import attrs

from .errors import ConfigError
from .keys.hasher import KEY_BYTES, BlockKeys
from .protocols import BlockIndex

StopReason = Literal["all_matchable_found", "miss", "no_matchable_block"]


def _key(k: object) -> bytes:
    if not isinstance(k, (bytes, bytearray)) or len(k) != KEY_BYTES:
        raise ConfigError("keys", f"block keys are {KEY_BYTES}-byte strings, got {k!r:.40}")
    return bytes(k)


class InMemoryBlockIndex:
    """A set of block keys with prefix semantics (the reference :class:`BlockIndex`)."""

    def __init__(self, keys: Iterable[bytes] = (), name: str = "memory") -> None:
        self.name = name
        self._keys: set[bytes] = set()
        self.add(keys)

    def add(self, keys: Iterable[bytes]) -> None:
        for k in keys:
            self._keys.add(_key(k))

    def discard(self, keys: Iterable[bytes]) -> None:
        for k in keys:  # checked as add() checks: bytes(n) of an int key would be n zero bytes
            self._keys.discard(_key(k))

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def match_prefix(self, keys: Sequence[bytes]) -> int:
        n = 0
        for k in keys:
            if k not in self._keys:
                break
            n += 1
        return n


@attrs.frozen
class PrefixMatch:
    """Where the leading blocks of one request can come from, and why the run stopped."""

    num_prompt_tokens: int
    block_size_tokens: int
    matchable_blocks: int
    local_blocks: int
    remote_blocks: tuple[int, ...]
    tier_names: tuple[str, ...]
    stop_reason: StopReason

    @property
    def remote_total_blocks(self) -> int:
        return sum(self.remote_blocks)

    @property
    def matched_blocks(self) -> int:
        return self.local_blocks + self.remote_total_blocks

    @property
    def local_tokens(self) -> int:
        return self.local_blocks * self.block_size_tokens

    @property
    def remote_tokens(self) -> int:
        return self.remote_total_blocks * self.block_size_tokens

    @property
    def useful_tokens(self) -> int:
        """Tokens whose KV can be reused: whole blocks of the leading run."""
        return self.matched_blocks * self.block_size_tokens

    @property
    def recompute_tokens(self) -> int:
        """Tokens the replica prefills itself (tail, partial block, last token)."""
        return self.num_prompt_tokens - self.useful_tokens

    @property
    def partial_tail_tokens(self) -> int:
        """Tokens in the trailing partial block: never a hit, always recomputed."""
        return self.num_prompt_tokens % self.block_size_tokens

    def remote_block_range(self, tier: int) -> tuple[int, int]:
        """Half-open block range ``[start, end)`` served by remote tier ``tier``."""
        start = self.local_blocks + sum(self.remote_blocks[:tier])
        return start, start + self.remote_blocks[tier]


def match(
    keys: BlockKeys | Sequence[bytes],
    num_tokens: int,
    local: BlockIndex | None,
    *remote_tiers: BlockIndex,
    block_size_tokens: int | None = None,
    tier_names: Sequence[str] | None = None,
) -> PrefixMatch:
    """Match a request's key chain: local first, then each remote tier in order."""
    if isinstance(keys, BlockKeys):
        if block_size_tokens is not None and block_size_tokens != keys.block_size_tokens:
            raise ConfigError("block_size_tokens", f"{block_size_tokens} disagrees with the keys' block size {keys.block_size_tokens}")
        bs = keys.block_size_tokens
    else:
        if isinstance(keys, (bytes, bytearray, str)) or not hasattr(keys, "__len__") or not hasattr(keys, "__getitem__"):  # one key is not a chain
            raise ConfigError("keys", f"must be BlockKeys or a sequence of block keys, got {type(keys).__name__}")
        if block_size_tokens is None:
            raise ConfigError("block_size_tokens", "required when keys are a plain sequence")
        bs = block_size_tokens
    if isinstance(bs, bool) or not isinstance(bs, int) or bs <= 0:
        raise ConfigError("block_size_tokens", f"must be a positive int, got {bs!r}")
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
        raise ConfigError("num_tokens", f"must be a non-negative int, got {num_tokens!r}")
    if len(keys) > num_tokens // bs:
        raise ConfigError("keys", f"{len(keys)} keys for {num_tokens} tokens: at most {num_tokens // bs} full blocks exist")
    if local is not None and not callable(getattr(local, "match_prefix", None)):
        raise ConfigError("local", f"must be a BlockIndex (an object with match_prefix(keys) -> int) or None, got {type(local).__name__}")
    for i, tier in enumerate(remote_tiers):
        if not callable(getattr(tier, "match_prefix", None)):
            raise ConfigError(f"remote tier {i}", f"must be a BlockIndex (an object with match_prefix(keys) -> int), got {type(tier).__name__}")
    if tier_names is None:
        tier_names = tuple(getattr(t, "name", f"remote{i}") for i, t in enumerate(remote_tiers))
    elif len(tier_names) != len(remote_tiers):
        raise ConfigError("tier_names", f"{len(tier_names)} names for {len(remote_tiers)} remote tiers")
    matchable = max(num_tokens - 1, 0) // bs
    limit = min(len(keys), matchable)
    if limit == 0:
        return PrefixMatch(num_tokens, bs, matchable, 0, tuple(0 for _ in remote_tiers), tuple(tier_names), "no_matchable_block")
    candidate = keys[:limit]
    run = _ask(local, candidate, "local") if local is not None else 0
    local_blocks = run
    remote: list[int] = []
    for name, tier in zip(tier_names, remote_tiers):
        got = _ask(tier, candidate[run:], name) if run < limit else 0
        remote.append(got)
        run += got
    reason: StopReason = "all_matchable_found" if run == limit else "miss"
    return PrefixMatch(num_tokens, bs, matchable, local_blocks, tuple(remote), tuple(tier_names), reason)


def _ask(index: BlockIndex, keys: Sequence[bytes], name: str) -> int:
    got = index.match_prefix(keys)
    if isinstance(got, bool) or not isinstance(got, int) or not 0 <= got <= len(keys):
        raise ConfigError(f"tier {name!r}", f"match_prefix returned {got!r} for {len(keys)} keys; it must be an int in [0, {len(keys)}]")
    return got
