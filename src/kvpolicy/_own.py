"""Loading a policy of the user's own from a spec: ``package.module:Name`` or ``path/to/file.py:Name``.

Used where kvpolicy accepts a policy by name — ``evict-bench --policies`` (an ``EvictionPolicy``),
``make_filter`` specs (a publish filter: ``publish-bench``, the engine adapters' ``publish`` setting) — so a
user's class runs beside kvpolicy's own. Every failure is a :class:`~kvpolicy.errors.ConfigError` naming the
field and the spec, never a traceback through kvpolicy.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
from pathlib import Path
from typing import Any

from .errors import ConfigError


def is_own(spec: Any) -> bool:
    """A spec names a class of the user's (``module:Name`` / ``file.py:Name``), not one of kvpolicy's names."""
    return isinstance(spec, str) and ":" in spec


def load_own(spec: str, field: str, usage: str, *, want_callable: bool = True) -> Any:
    """The class or factory ``spec`` names: ``package.module:Name`` (imported) or ``path/to/file.py:Name`` (loaded from
    the file); with ``want_callable=False``, any object (a value such as a policy set). ``usage`` says, in an error,
    what the object must be."""
    source, _, attr = spec.rpartition(":")
    if not source or not attr.isidentifier():
        raise ConfigError(field, f"{spec!r}: a policy of your own is MODULE:NAME or PATH.py:NAME, NAME {usage}")
    try:
        if source.endswith(".py"):
            module = _load_file(spec, field, source)
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
    if factory is None or (want_callable and not callable(factory)):
        raise ConfigError(field, f"{spec!r}: {source} has no {'class or factory' if want_callable else 'name'} {attr!r}")
    return factory


def _load_file(spec: str, field: str, source: str) -> Any:
    """The module in ``source`` (a .py file), loaded once per process (per version of the file) under a name of its own, as an import would be:
    a file whose module-level code names itself (a PolicySet whose eviction is a class of the same file) gets the
    module being loaded, not an endless chain of fresh copies, and every replica's policy is the same class."""
    path = Path(source)
    if not path.is_file():
        raise ConfigError(field, f"{spec!r}: no file {source}")
    resolved = path.resolve()
    st = resolved.stat()  # an edited file is another module (a notebook that fixes its policy and runs again)
    ident = f"{resolved}|{st.st_mtime_ns}|{st.st_size}".encode()
    name = f"kvpolicy_own_{resolved.stem}_{hashlib.blake2b(ident, digest_size=6).hexdigest()}"
    module = sys.modules.get(name)
    if module is not None:
        return module
    mspec = importlib.util.spec_from_file_location(name, resolved)
    module = importlib.util.module_from_spec(mspec)  # type: ignore[arg-type]
    sys.modules[name] = module
    try:
        mspec.loader.exec_module(module)  # type: ignore[union-attr]
    except BaseException:
        del sys.modules[name]
        raise
    return module


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
