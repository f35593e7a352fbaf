"""Writing reports the way a user can trust: strict JSON, replaced atomically, errors that name the file."""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

from .errors import ConfigError


def read_text(path: str | os.PathLike[str], field: str) -> str:
    """A UTF-8 text file's contents; every way it can fail is a ConfigError naming ``field`` and the path."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(field, f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except IsADirectoryError:
        raise ConfigError(field, f"{path}: is a directory, expected a file") from None
    except FileNotFoundError:
        raise ConfigError(field, f"{path}: no such file") from None
    except OSError as e:
        raise ConfigError(field, f"{path}: {e.strerror or e}") from None


def finite(obj: Any) -> Any:
    """``obj`` with every non-finite float (NaN, ±inf) as None: strict JSON parsers reject NaN."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    if hasattr(obj, "item") and hasattr(obj, "dtype") and getattr(obj, "shape", None) == ():  # a numpy scalar
        return finite(obj.item())
    return obj


def strict_json(obj: Any, **kw: Any) -> str:
    """JSON with null where a number is not finite (never ``NaN``)."""
    return json.dumps(finite(obj), allow_nan=False, default=str, **kw)


def write_text_atomic(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` to a temporary file beside ``path`` and rename it into place: a full disk or
    a crash leaves the previous file intact, never half a report. Errors name the file."""
    return write_bytes_atomic(path, text.encode("utf-8"), "the report")


def write_bytes_atomic(path: str | os.PathLike[str], data: bytes, what: str = "the file") -> Path:
    """``data`` to a temporary file beside ``path``, renamed into place: a symlink at ``path`` is replaced, never
    written through, and a failure leaves the previous file whole. Errors name the file."""
    p = Path(path)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    except OSError as e:
        raise ConfigError(str(p), f"cannot write here: {e.strerror or e}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except OSError as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise ConfigError(str(p), f"cannot write {what}: {e.strerror or e} (the previous file, if any, is intact)") from None
    return p


def json_loads(text: str | bytes) -> Any:
    """``json.loads``, with nesting deeper than Python can recurse (200,000 ``[`` in a trace row, a tokens file or a
    config) refused as malformed JSON — a ``json.JSONDecodeError`` the caller already names the file and line for —
    rather than a ``RecursionError`` traceback."""
    try:
        return json.loads(text)
    except RecursionError:
        doc = text if isinstance(text, str) else ""
        raise json.JSONDecodeError("nested too deeply", doc, 0) from None
