"""What every run records beside its results: argv, git commit and diff, the resolved config."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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


def save_run_info(cfg: DictConfig, output_dir: Path | str) -> dict[str, object]:
    """Writes run_info.json, config_resolved.yaml and (when the tree is dirty) git.diff into output_dir."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    info = {"argv": sys.argv, "python": sys.version.split()[0], **git_state()}
    atomic_write_text(output_dir / "run_info.json", json.dumps(info, indent=2))
    atomic_write_text(output_dir / "config_resolved.yaml", OmegaConf.to_yaml(cfg, resolve=True))
    if info["dirty"]:
        atomic_write_text(output_dir / "git.diff", _git("diff", "HEAD") or "")
    return info
