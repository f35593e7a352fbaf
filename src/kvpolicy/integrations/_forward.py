"""Wrappers that subclass an engine's base class must hand the engine's other calls to the object they wrap.

An adapter such as :class:`~kvpolicy.integrations.vllm_kv_connector.KVPolicyConnector` subclasses the engine's
abstract base (vLLM's ``KVConnectorBase_V1``, SGLang's ``HiCacheStorage``) and decides a few of its calls itself.
``__getattr__`` alone cannot forward the rest: it runs only for names the class lacks, and the base *defines*
them — as abstract methods (the class would not instantiate) or as defaults (``bind_connector_metadata`` would
keep the metadata on the wrapper, ``on_host_pools_registered`` would never reach the real store).
:func:`forward_to_inner` gives every public method and property of the base that the adapter does not define
itself a body that calls the wrapped object's, whatever the engine's version adds.
"""

from __future__ import annotations

import abc
from typing import Any


def _method(name: str, attr: str) -> Any:
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(getattr(self, attr), name)(*args, **kwargs)

    forward.__name__ = forward.__qualname__ = name
    forward.__doc__ = f"The wrapped object's ``{name}``."
    return forward


def _property(name: str, attr: str) -> property:
    return property(lambda self: getattr(getattr(self, attr), name), doc=f"The wrapped object's ``{name}``.")


def forward_to_inner(cls: type, base: type, attr: str = "inner") -> list[str]:
    """Install on ``cls`` a forwarder to ``self.<attr>`` for each public method and property ``base`` (or a class
    above it) defines and ``cls``'s own classes do not. Class and static methods are left alone: they are asked
    of the class, before any wrapped object exists. Returns the forwarded names."""
    if base is object:
        return []
    engine = [c for c in base.__mro__ if c is not object]
    own: set[str] = set()
    for c in cls.__mro__:
        if c not in engine and c is not object:
            own.update(vars(c))
    done: set[str] = set()
    forwarded = []
    for c in engine:
        for name, value in vars(c).items():
            if name.startswith("_") or name in own or name in done:
                continue
            done.add(name)
            if isinstance(value, (classmethod, staticmethod)):
                continue
            if isinstance(value, property):
                setattr(cls, name, _property(name, attr))
            elif callable(value):
                setattr(cls, name, _method(name, attr))
            else:
                continue
            forwarded.append(name)
    abc.update_abstractmethods(cls)
    return forwarded
