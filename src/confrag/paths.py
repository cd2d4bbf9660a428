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


def register_resolvers() -> None:
    """`${confrag_root:}` in the configs (conf/paths/default.yaml): the project root, wherever Python runs."""
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("confrag_root"):
        OmegaConf.register_new_resolver("confrag_root", lambda: str(project_root()))


# Registered on import, so that anything composing the configs (train.py, tests, notebooks) has it.
register_resolvers()
