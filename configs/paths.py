"""Where a data file named in a config is: relative paths are looked up from the working directory,
then beside the shipped presets, so `configs/data/...` in a preset works from the repository root and
from an installed copy alike."""

from __future__ import annotations

from importlib import resources
from pathlib import Path


def data_path(path: str | Path) -> Path:
    """`path` itself when it exists or is absolute; else the same relative path under the installed
    package's root (`asyncrl/`, which holds `configs/`); else `path` unchanged (the caller's error names it)."""
    where = Path(path)
    if where.exists() or where.is_absolute():
        return where
    shipped = Path(str(resources.files("asyncrl.configs"))).parent / where
    return shipped if shipped.exists() else where
