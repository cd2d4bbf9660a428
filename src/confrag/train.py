"""Entry point shared by `python train.py` and `confrag-train`: picks the task named in the config."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Callable

import lightning as L
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from confrag.paths import project_root
from confrag.run_info import save_run_info

log = logging.getLogger(__name__)

if not OmegaConf.has_resolver("confrag_root"):
    OmegaConf.register_new_resolver("confrag_root", lambda: str(project_root()))


def _tasks() -> dict[str, Callable[[DictConfig], dict]]:
    from confrag.tasks import cbdr, gates, probe, rerank

    return {"probe": probe.run, "rerank": rerank.run, "cbdr": cbdr.run, "gates": gates.run}


def output_dir(cfg: DictConfig) -> Path:
    if HydraConfig.initialized():
        return Path(HydraConfig.get().runtime.output_dir)
    return Path(cfg.paths.output_dir)


def _setting_checks(task_name: str) -> list[Callable[[DictConfig], object]]:
    """The checks a task runs on its settings, in stage order (a later task includes the earlier stages)."""
    from confrag.tasks import cbdr, gates, rerank

    order = {"rerank": [rerank.check_settings], "cbdr": [rerank.check_settings, cbdr.check_settings]}
    order["gates"] = [*order["cbdr"], gates.check_settings]
    return order.get(task_name, [])


def run_task(cfg: DictConfig) -> float | None:
    """Run the configured task; the W&B run is finished whatever happens, so multiruns log one run per job."""
    tasks = _tasks()
    if cfg.task_name not in tasks:
        raise ValueError(f"task_name={cfg.task_name!r} is not one of {sorted(tasks)}")
    # A single-process job should not fight the LLM's intra-op threads with Lightning workers.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    L.seed_everything(cfg.seed, workers=True)
    for check in _setting_checks(cfg.task_name):  # a bad value fails before the run folder gets any file
        check(cfg)
    out = output_dir(cfg)
    save_run_info(cfg, out)
    try:
        metrics = tasks[cfg.task_name](cfg)
    finally:
        _finish_wandb()
    metric_name = cfg.get("optimized_metric")
    if metric_name and metric_name in metrics:
        return float(metrics[metric_name])
    return None


def _finish_wandb() -> None:
    try:
        import wandb
    except ImportError:
        return
    if wandb.run is not None:
        wandb.finish()


def main() -> None:
    import hydra

    config_dir = str(project_root() / "conf")

    @hydra.main(version_base="1.3", config_path=config_dir, config_name="train")
    def _main(cfg: DictConfig) -> float | None:
        return run_task(cfg)

    _main()
