"""The request a filter is asked about, the filter protocol, and the rules that need no model: ``never``, ``all``,
``threshold-k``, ``boundary``, and :class:`AllOf` (the minimum of several filters)."""

from __future__ import annotations

import math
import numbers
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import Any, Protocol, runtime_checkable

import attrs

from .._validate import check_positive_int
from ..errors import ConfigError


DATA_CLASSES = ("public", "shared", "internal", "private")


@attrs.frozen
class PublishRequest:
    request_id: Hashable
    num_tokens: int
    block_size_tokens: int
    #: seconds on any clock that only moves forward; None: not given — the filters that decay counts or close windows
    #: (reuse-aware, structure-aware, WriteBudget) refuse such a request, as a time of 0 for every request broke them
    time_s: float | None = None
    tenant: str = "default"
    data_class: str = "shared"
    boundary_tokens: int | None = None
    replica: str = "replica-0"
    reused_blocks: int = 0  # leading blocks this request itself found (local or remote)
    #: of those, the leading blocks found in the replica's own cache (no pool read); None: not said (the dueling
    #: selector's ghost pools then count a local hit as a pool hit)
    local_blocks: int | None = None
    #: recent utilisation (0..1) of the links a write would cross (the replica's egress, the pool's
    #: ingress), as the engine measures it; None: unknown (a write then costs its full link time)
    write_path_utilisation: float | None = None
    #: after the replica's own blocks (``local_blocks``), the leading ones another replica held in its local cache when
    #: the request arrived — blocks a pull from that peer serves whatever was published (the directory knows them from
    #: the engines' KV events). The dueling selector credits no rule with them and lets every ghost keep them as a pull
    #: would; 0 (default): no pulls, or none possible
    peer_blocks: int = 0
    #: recent busy share (0..1) of the replica's prefill slots, as the engine's scheduler measures it: a GPU second a
    #: hit saves is worth 1/(1 − ρ) seconds of latency (its own and the queue's behind it); None: unknown (1)
    prefill_utilisation: float | None = None

    def __attrs_post_init__(self) -> None:
        for name in ("write_path_utilisation", "prefill_utilisation"):
            u = getattr(self, name)
            if u is not None and (isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 <= u <= 1):
                raise ConfigError(name, f"must be in [0, 1] or None, got {u!r}")
        for name, least in (("num_tokens", 0), ("block_size_tokens", 1), ("reused_blocks", 0), ("peer_blocks", 0)):
            v = getattr(self, name)
            if type(v) is not int and (isinstance(v, bool) or not isinstance(v, numbers.Integral)) or v < least:  # numpy ints are ints
                raise ConfigError(name, f"must be an int >= {least}, got {v!r}")
        lb = self.local_blocks
        if lb is not None and (type(lb) is not int and (isinstance(lb, bool) or not isinstance(lb, numbers.Integral)) or not 0 <= lb <= self.reused_blocks):
            raise ConfigError("local_blocks", f"must be an int in [0, reused_blocks={self.reused_blocks}] or None, got {lb!r}")
        t = self.time_s
        if t is not None and (type(t) is not float and (isinstance(t, bool) or not isinstance(t, numbers.Real)) or not math.isfinite(t)):
            raise ConfigError("time_s", f"must be a finite number of seconds or None, got {t!r}")
        if self.data_class not in DATA_CLASSES:
            raise ConfigError("data_class", f"must be one of {DATA_CLASSES}, got {self.data_class!r}")
        b = self.boundary_tokens
        if b is not None and (isinstance(b, bool) or not isinstance(b, numbers.Integral)):
            raise ConfigError("boundary_tokens", f"must be an int or None, got {b!r}")
        if self.boundary_tokens is not None and not 0 <= self.boundary_tokens <= self.num_tokens:
            raise ConfigError("boundary_tokens", f"must be in [0, num_tokens={self.num_tokens}], got {self.boundary_tokens}")

    @property
    def full_blocks(self) -> int:
        return self.num_tokens // self.block_size_tokens


@runtime_checkable
class PublishFilter(Protocol):
    def observe(self, request: PublishRequest, keys: Sequence[Hashable]) -> None: ...

    def publishable(self, request: PublishRequest, keys: Sequence[Hashable]) -> int: ...


def _check(request: PublishRequest, keys: Sequence[Hashable], *, timed: str | None = None) -> None:
    if type(request) is not PublishRequest and not isinstance(request, PublishRequest):
        raise ConfigError("request", f"must be a PublishRequest, got {type(request).__name__}")
    if type(keys) is not list and (isinstance(keys, (str, bytes, bytearray)) or not hasattr(keys, "__len__") or not hasattr(keys, "__getitem__")):
        raise ConfigError("keys", f"must be a sequence of block keys, got {type(keys).__name__}")
    if len(keys) > request.full_blocks:
        raise ConfigError("keys", f"{len(keys)} keys for {request.num_tokens} tokens: only full blocks ({request.full_blocks}) may be published — never a partial one")
    if timed is not None and request.time_s is None:
        raise ConfigError("time_s", f"{timed} decays its counts and closes its windows on the request's time: give "
                                    "PublishRequest(time_s=...) in seconds from any clock that only moves forward")


def _timed(request: PublishRequest, keys: Sequence[Hashable], name: str) -> float:
    """:func:`_check` for a filter that keeps time: the request's time, which it must carry."""
    _check(request, keys, timed=name)
    assert request.time_s is not None  # _check refused a request without one
    return request.time_s


class _Dedup:
    """Counts each (request, block) pair once: an engine may observe a request
    several times, or block by block as it looks the prefix up. Remembers the
    keys of the newest ``size`` requests (memory bound)."""

    def __init__(self, size: int = 4096) -> None:
        # request -> the keys it showed: a tuple after its first look (a tenth of a set's memory, and most requests are
        # looked at once), a set from its second on
        self._seen: OrderedDict[Hashable, tuple | set] = OrderedDict()
        self._size = size

    def new_keys(self, request_id: Hashable, keys: Sequence[Hashable]) -> list[Hashable]:
        seen = self._seen
        done = seen.get(request_id)
        if done is None:  # a request's first look: every key is new
            # a chain's keys are distinct (nearly always): the keys as they are, else the first of each in order
            fresh = list(keys) if len(set(keys)) == len(keys) else list(dict.fromkeys(keys))
            seen[request_id] = tuple(fresh)
            if len(seen) > self._size:
                seen.popitem(last=False)
            return fresh
        seen.move_to_end(request_id)
        if isinstance(done, tuple):
            done = seen[request_id] = set(done)
        fresh = [k for k in dict.fromkeys(keys) if k not in done]
        done.update(fresh)
        return fresh

    def first(self, request_id: Hashable) -> bool:
        """True the first time ``request_id`` is seen (among the newest ``size``), and remembers it; False after."""
        if request_id in self._seen:
            self._seen.move_to_end(request_id)
            return False
        self.new_keys(request_id, ())
        return True


class NeverPublish:
    name = "never"

    def observe(self, request: PublishRequest, keys: Sequence[Hashable]) -> None:
        _check(request, keys)

    def publishable(self, request: PublishRequest, keys: Sequence[Hashable]) -> int:
        _check(request, keys)
        return 0


class PublishAll:
    name = "all"

    def observe(self, request: PublishRequest, keys: Sequence[Hashable]) -> None:
        _check(request, keys)

    def publishable(self, request: PublishRequest, keys: Sequence[Hashable]) -> int:
        _check(request, keys)
        return len(keys)


class ThresholdPublish:
    """A block after ``k`` distinct requests that contain it.

    Counts are kept for the ``capacity_keys`` most recently seen keys (default 500k, as ``structure-aware``): a key
    seen less recently than that starts again from 0, so an engine that runs for days holds bounded memory (an
    unbounded count grew by one entry for every block ever seen)."""

    def __init__(self, k: int = 2, *, capacity_keys: int = 500_000) -> None:
        if isinstance(k, bool) or not isinstance(k, int) or k <= 0:
            raise ConfigError("k", f"must be a positive int, got {k!r}")
        check_positive_int("capacity_keys", capacity_keys)
        self.k = k
        self.name = f"threshold-{k}"
        self._count: OrderedDict[Hashable, int] = OrderedDict()  # least recently seen first
        self._capacity = capacity_keys
        self._dedup = _Dedup()

    def observe(self, request: PublishRequest, keys: Sequence[Hashable]) -> None:
        _check(request, keys)
        count = self._count
        for key in self._dedup.new_keys(request.request_id, keys):
            c = count.get(key)
            if c is None:
                count[key] = 1
                if len(count) > self._capacity:
                    count.popitem(last=False)
            else:
                count[key] = c + 1
                count.move_to_end(key)  # now the most recently seen

    @property
    def held_keys(self) -> int:
        """Keys with a count held (at most ``capacity_keys``). Not ``__len__``: an empty filter must stay truthy."""
        return len(self._count)

    def count(self, key: Hashable) -> int:
        return self._count.get(key, 0)

    def publishable(self, request: PublishRequest, keys: Sequence[Hashable]) -> int:
        _check(request, keys)
        n = 0
        for key in keys:
            if self._count.get(key, 0) < self.k:
                break
            n += 1
        return n


class BoundaryPublish:
    """Nothing past the application's boundary, nothing private, ever."""

    name = "boundary"

    def observe(self, request: PublishRequest, keys: Sequence[Hashable]) -> None:
        _check(request, keys)

    def publishable(self, request: PublishRequest, keys: Sequence[Hashable]) -> int:
        _check(request, keys)
        if request.data_class == "private" or request.boundary_tokens is None:
            return 0
        return min(len(keys), request.boundary_tokens // request.block_size_tokens)


class AllOf:
    """Composition: a block is publishable only if every filter allows it."""

    def __init__(self, *filters: Any) -> None:
        if not filters:
            raise ConfigError("filters", "AllOf needs at least one filter")
        self.filters = filters
        self.name = " & ".join(getattr(f, "name", type(f).__name__) for f in filters)

    def observe(self, request: PublishRequest, keys: Sequence[Hashable]) -> None:
        for f in self.filters:
            f.observe(request, keys)

    def publishable(self, request: PublishRequest, keys: Sequence[Hashable]) -> int:
        return min(f.publishable(request, keys) for f in self.filters)
