"""Any online policy as a ``cachetools.Cache``.

``PolicyCache(maxsize, policy="sieve", getsizeof=len)`` is a ``cachetools.Cache``
subclass: ``maxsize``, ``currsize``, ``getsizeof(value)``, ``popitem()`` (evicts the
policy's victim), ``__missing__``; a value larger than ``maxsize`` raises
``ValueError`` — so ``@cachetools.cached(PolicyCache(...))``, ``cachetools.keys`` and
code typed against ``Cache`` work unchanged. Keys are flat (no prefix parents). The
policy, not ``Cache``'s own bookkeeping, holds the sizes and chooses victims.

A value of size 0 (``getsizeof=len`` of an empty string — ``Cache`` accepts it) takes
no capacity, so no policy ranks it: it stays until deleted, and ``popitem()`` takes
one (the oldest) only once no sized item is left.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator
from typing import Any

import cachetools
import numpy as np

from .._validate import check_non_negative_int
from ..errors import CapacityError
from .replay import make_policy


class PolicyCache(cachetools.Cache):
    def __init__(self, maxsize: int, policy: str = "lru", getsizeof: Callable[[Any], int] | None = None, **policy_kw: Any) -> None:
        check_non_negative_int("maxsize", maxsize)  # int() would cut 10.7 to 10, read "10", fail on inf
        super().__init__(maxsize, getsizeof)
        self._policy = make_policy(policy, maxsize, **policy_kw)
        self._data: dict[Hashable, Any] = {}
        self._weightless: dict[Hashable, None] = {}  # keys of size-0 values, oldest first: not in the policy

    def __copy__(self) -> PolicyCache:
        raise TypeError("PolicyCache cannot be copied: the copy would share its policy's state")

    @property
    def maxsize(self) -> int:
        return self._policy.capacity_bytes

    @property
    def currsize(self) -> int:
        return self._policy.used_bytes

    @property
    def policy(self) -> Any:
        return self._policy

    def __missing__(self, key: Hashable) -> Any:
        raise KeyError(key)

    def __getitem__(self, key: Hashable) -> Any:
        if key not in self._data:
            return self.__missing__(key)
        if key not in self._weightless:
            self._policy.on_access(key)
        return self._data[key]

    def __setitem__(self, key: Hashable, value: Any) -> None:
        size = self.getsizeof(value)
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)):  # the policies count whole bytes
            # a TypeError, not a ValueError: cachetools.cached swallows ValueError (a value too large is not stored),
            # so a getsizeof that returns 1.5 would silently never cache anything
            raise TypeError(f"getsizeof: must return an int (bytes, or units of maxsize), got {size!r} for key {key!r}")
        size = int(size)
        if size > self.maxsize:
            raise ValueError("value too large")
        if size < 0:
            raise ValueError("value size must be non-negative")
        if key in self._data:
            del self[key]
        if size == 0:
            self._weightless[key] = None
        else:
            for victim in self._policy.victims(size, incoming=key):
                del self._data[victim]
            self._policy.on_insert(key, size)
        self._data[key] = value

    def __delitem__(self, key: Hashable) -> None:
        if key not in self._data:
            raise KeyError(key)
        if key in self._weightless:
            del self._weightless[key]
        else:
            self._policy.on_remove(key)
        del self._data[key]

    def __contains__(self, key: object) -> bool:
        return key in self._data

    def __iter__(self) -> Iterator[Hashable]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def popitem(self) -> tuple[Hashable, Any]:
        """Evict and return the item the policy would evict next."""
        if not self._data:
            raise KeyError(f"{type(self).__name__} is empty")
        if not self._policy.nodes:  # only size-0 items are left: the oldest
            key = next(iter(self._weightless))
            del self._weightless[key]
            return key, self._data.pop(key)
        try:
            node = self._policy._choose()
        except CapacityError:
            raise KeyError("every item is pinned") from None
        key = node.key
        self._policy._remove(node)
        return key, self._data.pop(key)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._policy.name}, maxsize={self.maxsize}, currsize={self.currsize}, items={len(self)})"
