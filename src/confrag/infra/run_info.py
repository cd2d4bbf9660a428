"""What every run records beside its results: argv, the confrag version, git commit and diff, the resolved config,
the numeric environment its bytes depend on (package versions, the CPU kernels torch dispatches to, the thread
counts, the GPUs), and, when it fails, the exception that stopped it (failure.json)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
from importlib import metadata
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from confrag.infra.atomic import atomic_write_text
from confrag.infra.paths import project_root


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=project_root(), capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def git_state() -> dict[str, object]:
    commit = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit.strip() if commit else None, "dirty": bool(status and status.strip())}


# The packages whose numerics or data handling a run's numbers depend on.
RECORDED_PACKAGES = (
    "torch",
    "transformers",
    "lightning",
    "numpy",
    "sentence-transformers",
    "peft",
    "bm25s",
    "faiss-cpu",
)


# The environment variables that set the CPU thread pools (torch's intra-op pool reads OMP_NUM_THREADS at start).
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "TOKENIZERS_PARALLELISM")


def confrag_version() -> str | None:
    """The installed confrag's version (the wheel's or the editable checkout's), None when not installed."""
    try:
        return metadata.version("confrag")
    except metadata.PackageNotFoundError:
        return None


def threads() -> dict[str, object]:
    """torch's intra-op and inter-op thread counts and the variables that set them: float sums split across
    threads in another order can round differently, so a number that moved with OMP_NUM_THREADS is traceable."""
    return {
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "cpu_count": os.cpu_count(),
        "env": {name: os.environ.get(name) for name in THREAD_VARIABLES},
    }


def environment() -> dict[str, object]:
    """The numeric environment of this process. The same cache keys computed on another machine can hold other
    bytes: torch picks its CPU kernels by instruction set, and a probe retrained on SmolLM2 states recomputed on
    another machine chose another epoch (docs/reliability.md), so a run says where its numbers came from."""
    versions = {}
    for name in RECORDED_PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    gpus = (
        [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    )
    return {
        "packages": versions,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch_threads": torch.get_num_threads(),
        "threads": threads(),
        "cuda": torch.version.cuda if gpus else None,
        "gpus": gpus,
    }


def save_run_info(cfg: DictConfig, output_dir: Path | str) -> dict[str, object]:
    """Writes run_info.json, config_resolved.yaml and (when the tree is dirty) git.diff into output_dir."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    info = {
        "argv": sys.argv,
        "confrag": confrag_version(),
        "python": sys.version.split()[0],
        **git_state(),
        "environment": environment(),
    }
    atomic_write_text(output_dir / "run_info.json", json.dumps(info, indent=2))
    atomic_write_text(output_dir / "config_resolved.yaml", OmegaConf.to_yaml(cfg, resolve=True))
    if info["dirty"]:
        atomic_write_text(output_dir / "git.diff", _git("diff", "HEAD") or "")
    return info


FAILURE_FILE = "failure.json"


def failure_file(rank: int) -> str:
    """failure.json of rank 0; failure_rank<r>.json of a higher rank (ranks share the run folder)."""
    return FAILURE_FILE if rank == 0 else f"failure_rank{rank}.json"


def save_failure(output_dir: Path | str, error: BaseException, rank: int = 0) -> Path:
    """The failure marker: the exception (type, message, traceback), when and in which process, written into the
    run folder so that a failed run is told from a finished one (metrics.json) and from a killed one (neither)."""
    path = Path(output_dir) / failure_file(rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "exception": f"{type(error).__module__}.{type(error).__qualname__}",
        "message": str(error),
        "traceback": "".join(traceback.format_exception(type(error), error, error.__traceback__)),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "pid": os.getpid(),
        "rank": rank,
    }
    atomic_write_text(path, json.dumps(record, indent=2))
    return path
