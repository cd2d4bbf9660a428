"""Where confrag keeps derived files (converted models, activation and generation caches)."""

from __future__ import annotations

import os
from pathlib import Path


def project_root() -> Path:
    """The directory holding pyproject.toml, found by walking up from this file (else the cwd)."""
    for parent in Path(__file__).resolve().parents:
        if (parent / "pyproject.toml").is_file():
            return parent
    return Path.cwd()


def default_cache_dir() -> Path:
    """`$CONFRAG_CACHE` if set, else `<project root>/.cache` (ignored by git)."""
    env = os.environ.get("CONFRAG_CACHE")
    return Path(env) if env else project_root() / ".cache"
