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
    """The configs' own resolvers: `${confrag_root:}` (conf/paths/default.yaml), the project root wherever
    Python runs; `${confrag_run_stamp:...}` and `${confrag_rank_suffix:}` (conf/hydra/default.yaml)."""
    from omegaconf import OmegaConf

    from confrag.distributed import launch_stamp, rank_suffix

    if not OmegaConf.has_resolver("confrag_root"):
        OmegaConf.register_new_resolver("confrag_root", lambda: str(project_root()))
    # `${confrag_run_stamp:%Y-%m-%d_%H-%M-%S_%f}`: like Hydra's `now`, but one value for every rank of a
    # torchrun launch, so that they share one run folder (confrag.distributed.launch_stamp). Cached: the
    # folder is resolved several times and must not move.
    if not OmegaConf.has_resolver("confrag_run_stamp"):
        OmegaConf.register_new_resolver("confrag_run_stamp", launch_stamp, use_cache=True)
    # `${confrag_rank_suffix:}`: "" in rank 0, "_rank<r>" in the others (per-rank log and config files).
    if not OmegaConf.has_resolver("confrag_rank_suffix"):
        OmegaConf.register_new_resolver("confrag_rank_suffix", lambda: rank_suffix(), use_cache=True)


# Registered on import, so that anything composing the configs (train.py, tests, notebooks) has it.
register_resolvers()
