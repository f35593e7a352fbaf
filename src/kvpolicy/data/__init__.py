"""Built-in data: model configs bundled with the package."""

from __future__ import annotations

from importlib import resources
from pathlib import Path


def bundled_configs() -> dict[str, Path]:
    """Name → path of every bundled model config (``llama-3-8b``, ...)."""
    root = resources.files(__package__) / "configs"
    return {Path(str(p)).stem: Path(str(p)) for p in root.iterdir() if str(p).endswith(".json")}


def resolve_config(name_or_path: str) -> Path:
    """A bundled config by name, else the path as given."""
    return bundled_configs().get(name_or_path, Path(name_or_path))
