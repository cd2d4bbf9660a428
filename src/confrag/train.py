"""Entry point shared by `python train.py` and `confrag-train`: picks the task named in the config.

Each task module (`confrag.tasks.<name>`) has three steps: `check(cfg)`, every setting it and its stages read
checked before the run folder gets a file; `run(cfg, checked, ctx)`, the computation on what `check` returned
(so the settings are checked once per run), done by every rank of a launch; and `write(cfg, checked, ctx,
computed)`, the run folder, the exports and the loggers from what `run` computed, which returns the run's
metrics. The run context (`RunContext`: cache, seed, progress, run folder, rank) is built here once; its
`on_main` runs the run record and `write` on rank 0 only.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import lightning as L
import torch
from omegaconf import DictConfig, OmegaConf

from confrag.infra import distributed
from confrag.infra.paths import config_dir, register_resolvers, task_folder
from confrag.infra.run_info import save_failure, save_run_info
from confrag.instantiators import refuse_moved_arguments, run_context
from confrag.recipes import llm_node
from confrag.tasks import cbdr, gates, probe, rerank

log = logging.getLogger(__name__)

TASKS: dict[str, ModuleType] = {"probe": probe, "rerank": rerank, "cbdr": cbdr, "gates": gates}

# Both entry points (train.py, confrag-train) import this module before Hydra resolves the run folder: there the
# folder's task part must be one of these tasks (conf/hydra/default.yaml), checked before any folder is made.
OmegaConf.register_new_resolver("confrag_task", lambda name: task_folder(name, TASKS), replace=True)


def run_task(cfg: DictConfig) -> float | None:
    """Run the configured task; the W&B run is finished whatever happens, so multiruns log one run per job.
    Returns `optimized_metric` for sweepers (Optuna); a name the task does not log is an error."""
    if cfg.task_name not in TASKS:
        raise ValueError(f"task_name={cfg.task_name!r} is not one of {sorted(TASKS)}")
    task = TASKS[cfg.task_name]
    # A single-process job should not fight the LLM's intra-op threads with Lightning workers.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    ctx = run_context(cfg)
    L.seed_everything(ctx.seed, workers=True)
    try:
        with _sigterm_raises():
            check_launch(cfg, ctx.rank)
            if "llm" in cfg:  # every task loads it: its node is checked first, whatever the task reads next
                llm_node(cfg.llm)
            checked = task.check(cfg)  # a bad value fails before the run record is written; checked once per run
            # The ranks of a multi-process launch share one run folder: every rank computes, rank 0 writes it.
            ctx.on_main(save_run_info, cfg, ctx.output_dir)
            computed = task.run(cfg, checked, ctx)
            metrics = ctx.on_main(task.write, cfg, checked, ctx, computed)
    except BaseException as error:  # a refusal or an interrupt too: the folder says the run did not finish, and why
        record_failure(ctx.output_dir, error, ctx.rank.rank)
        raise
    finally:
        _finish_wandb()
    metric_name = cfg.get("optimized_metric")
    if not metric_name or metrics is None:  # ranks > 0 of a launch helped compute; rank 0 reports
        return None
    if metric_name not in metrics:
        raise ValueError(
            f"optimized_metric={metric_name!r} is not a metric of task {cfg.task_name!r}; it logs {sorted(metrics)}"
        )
    return float(metrics[metric_name])


def record_failure(output_dir: Path, error: BaseException, rank: int) -> None:
    """`failure.json` for whatever stopped the run once its folder exists (Hydra makes it, with train.log, before
    the task starts): a refusal of `check` (the evaluation file's overlap, the FAISS index's size) as much as an
    exception, an interrupt or SIGTERM of the computation, so that a folder without `metrics.json` or
    `failure.json` was killed outright. A folder that does not exist yet (a run started from Python) gets none, and a
    marker that cannot be written (a full disk) is a warning, never the error the run reports."""
    if not output_dir.is_dir():
        return
    try:
        save_failure(output_dir, error, rank)
    except OSError as err:
        log.warning("Could not write the failure marker into %s: %s", output_dir, err)


def check_launch(cfg: DictConfig, launch: distributed.RankInfo) -> None:
    """Under a multi-process launch (torchrun, srun): the probe task trains across the ranks, so its trainer
    must be a DDP one over exactly these processes; the later tasks train their probe and rerankers on
    one rank under a lock, so theirs must be one-device trainers. Each rank computes on its own GPU."""
    if launch.world_size <= 1:
        return
    if cfg.task_name == "probe":
        trainer = cfg.trainer
        distributed.check_ddp_trainer(
            trainer.get("devices"), trainer.get("num_nodes", 1), trainer.get("strategy"), "trainer", launch
        )
    else:
        for key, trainer in (("trainer", cfg.trainer), ("probe.trainer", cfg.probe.trainer)):
            distributed.check_one_device_trainer(
                trainer.get("devices"), trainer.get("num_nodes", 1), trainer.get("strategy"), key, launch
            )
    if torch.cuda.is_available():
        # "cuda" without an index (a reranker placed for scoring) then means this rank's GPU, not GPU 0.
        torch.cuda.set_device(distributed.rank_device(launch))


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    """SIGTERM (what SLURM, torchrun's agent and `kill` send) raises SystemExit instead of ending the process
    silently, so the failure marker is written; a handler someone else installed is left alone."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield
        return

    def stop(signum: int, frame: object) -> None:
        raise SystemExit(f"terminated by signal {signal.Signals(signum).name}")

    signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _finish_wandb() -> None:
    try:
        import wandb
    except ImportError:
        return
    if wandb.run is not None:
        wandb.finish()


def check_command_line() -> None:
    """A command line (or environment) setting a key that moved ends the process with the key's new name, before
    Hydra reads it (`instantiators.refuse_moved_arguments`)."""
    try:
        refuse_moved_arguments(sys.argv[1:], os.environ)
    except ValueError as err:
        sys.exit(f"error: {err}")


def main() -> None:
    import hydra

    register_resolvers()
    check_command_line()

    @hydra.main(version_base="1.3", config_path=str(config_dir()), config_name="train")
    def _main(cfg: DictConfig) -> float | None:
        return run_task(cfg)

    _main()
