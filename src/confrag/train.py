"""Entry point shared by `python train.py` and `confrag-train`: picks the task named in the config.

Each task module (`confrag.tasks.<name>`) has `check(cfg)`, every setting it and its stages read checked
before the run folder gets a file, and `run(cfg)`, which returns the run's metrics.
"""

from __future__ import annotations

import os
from types import ModuleType

import lightning as L
from omegaconf import DictConfig

from confrag.instantiators import output_dir
from confrag.paths import project_root, register_resolvers
from confrag.run_info import save_run_info
from confrag.tasks import cbdr, gates, probe, rerank

TASKS: dict[str, ModuleType] = {"probe": probe, "rerank": rerank, "cbdr": cbdr, "gates": gates}


def run_task(cfg: DictConfig) -> float | None:
    """Run the configured task; the W&B run is finished whatever happens, so multiruns log one run per job.
    Returns `optimized_metric` for sweepers (Optuna); a name the task does not log is an error."""
    if cfg.task_name not in TASKS:
        raise ValueError(f"task_name={cfg.task_name!r} is not one of {sorted(TASKS)}")
    task = TASKS[cfg.task_name]
    # A single-process job should not fight the LLM's intra-op threads with Lightning workers.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    L.seed_everything(cfg.seed, workers=True)
    task.check(cfg)  # a bad value fails before the run folder gets any file
    save_run_info(cfg, output_dir(cfg))
    try:
        metrics = task.run(cfg)
    finally:
        _finish_wandb()
    metric_name = cfg.get("optimized_metric")
    if not metric_name:
        return None
    if metric_name not in metrics:
        raise ValueError(f"optimized_metric={metric_name!r} is not a metric of task {cfg.task_name!r}; it logs "
                         f"{sorted(metrics)}")
    return float(metrics[metric_name])


def _finish_wandb() -> None:
    try:
        import wandb
    except ImportError:
        return
    if wandb.run is not None:
        wandb.finish()


def main() -> None:
    import hydra

    register_resolvers()

    @hydra.main(version_base="1.3", config_path=str(project_root() / "conf"), config_name="train")
    def _main(cfg: DictConfig) -> float | None:
        return run_task(cfg)

    _main()
