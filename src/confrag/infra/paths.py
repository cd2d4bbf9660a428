"""Where confrag finds its configs and keeps derived files (converted models, activation and generation caches).

confrag runs either from a source checkout (pyproject.toml, conf/ and src/confrag/ in one folder: the
project root) or from an installed package (a wheel), which carries the same configs as `confrag/conf`
(pyproject.toml maps the package `confrag.conf` to the top-level conf/ folder). Installed, the project
root is the current folder: logs and caches go there, and paths to data (`paths.questions_path`, `dataset.*`)
are set on the command line or through their environment variables (docs/usage.md#installing-confrag).
"""

from __future__ import annotations

import os
import re
from collections.abc import Collection
from pathlib import Path

# A run folder's name part taken from the config (`task_name`): one plain folder name, never a path.
_FOLDER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


def source_checkout() -> Path | None:
    """The source checkout this module runs from (the folder holding pyproject.toml, conf/train.yaml and
    src/confrag/), or None when it runs from an installed package. Only the checkout's own layout counts:
    a pyproject.toml of another project above a virtual environment is not confrag's root."""
    here = Path(__file__).resolve()  # <root>/src/confrag/infra/paths.py
    root = here.parents[3]
    if (
        (root / "pyproject.toml").is_file()
        and (root / "conf" / "train.yaml").is_file()
        and here.parents[2] == root / "src"
    ):
        return root
    return None


def project_root() -> Path:
    """The source checkout, else (an installed package) the current folder."""
    return source_checkout() or Path.cwd()


def config_dir() -> Path:
    """The Hydra configs: the checkout's conf/ folder, else the installed package's copy of it (confrag/conf)."""
    root = source_checkout()
    return root / "conf" if root is not None else Path(__file__).resolve().parents[1] / "conf"


def default_cache_dir() -> Path:
    """`$CONFRAG_CACHE` if set, else `<project root>/.cache` (ignored by git)."""
    env = os.environ.get("CONFRAG_CACHE")
    return Path(env) if env else project_root() / ".cache"


def task_folder(name: object, tasks: Collection[str] | None = None) -> str:
    """`task_name` as the run folder's part (`${confrag_task:${task_name}}` in conf/hydra/default.yaml): Hydra
    resolves it before it makes the folder, so a name that is not one plain folder name (`../../escape`), or not
    one of `tasks` where the entry point knows them, is refused before any folder exists."""
    text = str(name)
    if not _FOLDER_NAME.fullmatch(text) or ".." in text:
        raise ValueError(
            f"task_name={text!r} must be a plain folder name (letters, digits, '_', '-', '.'; no path)"
            + (f": one of {sorted(tasks)}" if tasks else "")
        )
    if tasks is not None and text not in tasks:
        raise ValueError(f"task_name={text!r} is not one of {sorted(tasks)}")
    return text


def register_resolvers() -> None:
    """The configs' own resolvers: `${confrag_root:}` (conf/paths/default.yaml), the project root wherever
    Python runs; `${confrag_run_stamp:...}` and `${confrag_rank_suffix:}` (conf/hydra/default.yaml)."""
    try:
        from omegaconf import OmegaConf
    except ModuleNotFoundError:
        # Without OmegaConf there is no config to resolve: the library (engine, generation, benchmarks/gpu_scale.py)
        # runs on PyTorch and transformers alone, as on a bare GPU image.
        return

    from confrag.infra.distributed import launch_stamp, rank_suffix

    if not OmegaConf.has_resolver("confrag_root"):
        OmegaConf.register_new_resolver("confrag_root", lambda: str(project_root()))
    # `${confrag_run_stamp:%Y-%m-%d_%H-%M-%S_%f}`: like Hydra's `now`, but one value for every rank of a
    # torchrun launch, so that they share one run folder (confrag.infra.distributed.launch_stamp). Cached: the
    # folder is resolved several times and must not move.
    if not OmegaConf.has_resolver("confrag_run_stamp"):
        OmegaConf.register_new_resolver("confrag_run_stamp", launch_stamp, use_cache=True)
    # `${confrag_rank_suffix:}`: "" in rank 0, "_rank<r>" in the others (per-rank log and config files).
    # `${confrag_task:${task_name}}`: the task's part of the run folder, checked (`task_folder`); the entry point
    # (confrag.train) replaces it with one that also knows the task names.
    if not OmegaConf.has_resolver("confrag_task"):
        OmegaConf.register_new_resolver("confrag_task", task_folder)
    if not OmegaConf.has_resolver("confrag_rank_suffix"):
        OmegaConf.register_new_resolver("confrag_rank_suffix", lambda: rank_suffix(), use_cache=True)


# Registered on import, so that anything composing the configs (train.py, tests, notebooks) has it.
register_resolvers()
