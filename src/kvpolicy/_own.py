"""Loading a policy of the user's own from a spec: ``package.module:Name`` or ``path/to/file.py:Name``.

Used where kvpolicy accepts a policy by name — ``evict-bench --policies`` (an ``EvictionPolicy``),
``make_filter`` specs (a publish filter: ``publish-bench``, the engine adapters' ``publish`` setting) — so a
user's class runs beside kvpolicy's own. Every failure is a :class:`~kvpolicy.errors.ConfigError` naming the
field and the spec, never a traceback through kvpolicy.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from pathlib import Path
from typing import Any

from .errors import ConfigError


def is_own(spec: Any) -> bool:
    """A spec names a class of the user's (``module:Name`` / ``file.py:Name``), not one of kvpolicy's names."""
    return isinstance(spec, str) and ":" in spec


def load_own(spec: str, field: str, usage: str) -> Any:
    """The class or factory ``spec`` names: ``package.module:Name`` (imported) or ``path/to/file.py:Name`` (loaded from
    the file). ``usage`` says, in an error, how the object is called."""
    source, _, attr = spec.rpartition(":")
    if not source or not attr.isidentifier():
        raise ConfigError(field, f"{spec!r}: a policy of your own is MODULE:NAME or PATH.py:NAME, NAME {usage}")
    try:
        if source.endswith(".py"):
            path = Path(source)
            if not path.is_file():
                raise ConfigError(field, f"{spec!r}: no file {source}")
            mspec = importlib.util.spec_from_file_location(f"kvpolicy_own_{path.stem}", path)
            module = importlib.util.module_from_spec(mspec)  # type: ignore[arg-type]
            mspec.loader.exec_module(module)  # type: ignore[union-attr]
        else:
            module = importlib.import_module(source)
    except ConfigError:
        raise
    except ImportError as e:
        hint = (f"; give the file instead ({source.replace('.', '/')}.py:{attr}) or put its directory on PYTHONPATH"
                if isinstance(e, ModuleNotFoundError) and e.name == source.split(".")[0] else "")
        raise ConfigError(field, f"{spec!r}: cannot import {source} ({e}){hint}") from None
    except Exception as e:  # the user's module raised while loading: say so, without a traceback through kvpolicy
        raise ConfigError(field, f"{spec!r}: loading {source} raised {type(e).__name__}: {e}") from None
    factory = getattr(module, attr, None)
    if factory is None or not callable(factory):
        raise ConfigError(field, f"{spec!r}: {source} has no class or factory {attr!r}")
    return factory


def call_own(spec: str, field: str, factory: Any, *args: Any, **kw: Any) -> Any:
    """``factory(*args, **kw)``, passing only the keywords its signature takes (all of them to a ``**kwargs``);
    a ``TypeError`` from the call is an error naming ``field`` and the spec."""
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):  # no signature to read (a builtin): offer everything
        params = None
    if params is not None and not any(p.kind is p.VAR_KEYWORD for p in params):
        names = {p.name for p in params}
        kw = {k: v for k, v in kw.items() if k in names}
    try:
        return factory(*args, **kw)
    except TypeError as e:
        shown = ", ".join([*("…" for _ in args), *(f"{k}=…" for k in kw)])
        raise ConfigError(field, f"{spec!r}: calling it as {spec.rpartition(':')[2]}({shown}) raised TypeError: {e}") from None
