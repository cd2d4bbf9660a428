"""What every run records beside its results: argv, git commit and diff, the resolved config, and the numeric
environment its bytes depend on (package versions, the CPU kernels torch dispatches to, the GPUs)."""

from __future__ import annotations

import json
import subprocess
import sys
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
        "cuda": torch.version.cuda if gpus else None,
        "gpus": gpus,
    }


def save_run_info(cfg: DictConfig, output_dir: Path | str) -> dict[str, object]:
    """Writes run_info.json, config_resolved.yaml and (when the tree is dirty) git.diff into output_dir."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    info = {"argv": sys.argv, "python": sys.version.split()[0], **git_state(), "environment": environment()}
    atomic_write_text(output_dir / "run_info.json", json.dumps(info, indent=2))
    atomic_write_text(output_dir / "config_resolved.yaml", OmegaConf.to_yaml(cfg, resolve=True))
    if info["dirty"]:
        atomic_write_text(output_dir / "git.diff", _git("diff", "HEAD") or "")
    return info
