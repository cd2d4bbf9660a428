"""The probe stage: NQ_Confidence (cached) → probe training with the best-dev checkpoint → test metrics.

The checkpoint is chosen by `ProbeRecipe.monitor`: by default the dev questions' candidate ranking
(`val/gold_mrr`, `confrag.probe.ranking`), the probe's use downstream, not AUROC on a mix of prompt kinds.
A best checkpoint at the last epoch means the probe was still improving: the run warns and records it.

A later stage asks for the probe with `ensure_probe`: read from the cache when the same activations and
settings trained one before, else trained now and kept there.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import Logger

from confrag.infra.digests import fingerprint, folder_problem
from confrag.infra.fit_progress import FitProgress
from confrag.infra.locks import once
from confrag.infra.run_context import RunContext
from confrag.probe.datamodule import NQConfidenceDataModule
from confrag.probe.module import ProbeModule, SavedProbe, load_probe, metric_value, save_probe
from confrag.probe.ranking import SELECTION_METRIC, RankingSet

# What a probe trained for a later task is selected on when its node names nothing else (`probe.monitor`).
DEFAULT_MONITOR = f"val/{SELECTION_METRIC}"
RANKING_METRICS = ("gold_first", "gold_mrr", "gold_mean_rank", "chance_gold_first", "questions")

log = logging.getLogger(__name__)


@dataclass
class ProbeRecipe:
    """How the parts of a probe run are built; the task fills it from the config (`probe_recipe`)."""

    make_datamodule: Callable[[], NQConfidenceDataModule]  # the probe's layer given (`layer`)
    make_model: Callable[..., ProbeModule]  # keyword argument input_dim; the probe's layer given (`layer`)
    make_trainer: Callable[..., Trainer]  # keyword arguments callbacks, logger and any Trainer setting
    identity: dict[str, Any]  # the model settings and epochs: with the activations and the seed, the cache key
    layer: int  # the LLM layer the probe reads, resolved once from `model.layer` (`recipes.probe_recipe`)
    monitor: str = DEFAULT_MONITOR  # the dev metric the checkpoint is chosen by (higher is better)


class CandidateRanking(Callback):
    """Scores the dev questions' candidates at the end of every validation and logs where their own
    paragraph lands (`val/gold_mrr`, `val/gold_first`): the metric the checkpoint is chosen by."""

    def __init__(self, ranking: RankingSet) -> None:
        self.ranking = ranking

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        found = self.ranking.metrics(pl_module.confidence(self.ranking.states))
        for name in ("gold_mrr", "gold_first"):
            if found[name] is not None:
                pl_module.log(f"val/{name}", float(found[name]), prog_bar=name == "gold_mrr")


def ranking_callbacks(datamodule: NQConfidenceDataModule, monitor: str) -> list[Callback]:
    """The dev ranking callback when the data has a dev ranking set; a monitor on a ranking metric without
    one is refused, naming both settings."""
    dev = getattr(datamodule, "ranking", {}).get("dev")
    if dev is None:
        if monitor.startswith("val/gold_"):
            raise ValueError(
                f"the probe's checkpoint monitors {monitor!r}, a candidate-ranking metric, but data.ranking.top_n "
                "is null: set data.ranking.top_n (e.g. 20) or monitor val/auroc"
            )
        return []
    if not dev.metrics(np.zeros(len(dev.states)))["questions"]:
        raise ValueError(
            "no dev question has its own paragraph among its candidates, so the probe cannot be selected on "
            f"{monitor!r}: raise data.num_questions or data.ranking.top_n, or monitor val/auroc"
        )
    return [CandidateRanking(dev)]


def ranking_results(model: ProbeModule, datamodule: NQConfidenceDataModule) -> dict[str, float]:
    """The probe as a reranker of its dev and test questions' candidates (`val/gold_first`, `test/gold_mrr`,
    ...; `heldout/...` for the `data.ranking.test_questions` alone, the same questions whatever the probe's
    splits; none without ranking sets), for the weights given: the chosen checkpoint's, not the last epoch's."""
    found = {}
    for split, prefix in (("dev", "val"), ("test", "test"), ("heldout", "heldout")):
        ranking = getattr(datamodule, "ranking", {}).get(split)
        if ranking is not None:
            values = ranking.metrics(model.confidence(ranking.states))
            found.update({f"{prefix}/{k}": float(values[k]) for k in RANKING_METRICS if values.get(k) is not None})
    return found


def prepared_datamodule(recipe: ProbeRecipe) -> NQConfidenceDataModule:
    datamodule = recipe.make_datamodule()
    datamodule.prepare_data()
    datamodule.setup("fit")
    return datamodule


def fit_probe(
    recipe: ProbeRecipe,
    callbacks: list[Callback],
    loggers: list[Logger],
    run_config: dict | None = None,
    datamodule: NQConfidenceDataModule | None = None,
    **trainer_settings: Any,
):
    """NQ_Confidence (cached) → probe training with best-dev checkpoint → test metrics."""
    datamodule = datamodule or prepared_datamodule(recipe)
    summary = datamodule.data.summary()
    log.info("NQ_Confidence summary: %s", summary)
    check_classes(summary, datamodule.config_node, datamodule.splits.allow_one_class)
    model = recipe.make_model(input_dim=datamodule.input_dim)
    model.set_standardization(*datamodule.feature_stats())
    model.set_class_weights([e.label for e in datamodule.data.examples["train"]])
    model.run_config = run_config
    # Progress in train.log (Lightning's bar writes nothing there), beside the caller's and the ranking callbacks.
    callbacks = [*callbacks, *ranking_callbacks(datamodule, recipe.monitor), FitProgress("probe")]
    trainer = recipe.make_trainer(callbacks=callbacks, logger=loggers or False, **trainer_settings)
    for logger in loggers:
        logger.log_hyperparams({**(run_config or {}), "nq_confidence": summary})
    trainer.fit(model, datamodule=datamodule)
    # `test` replaces the trainer's callback metrics: keep fit's (train/, val/) first. The monitored
    # metric is reported at the checkpoint the test uses (best dev), which is what a sweeper should see.
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    checkpoint = trainer.checkpoint_callback
    best = checkpoint.best_model_path if checkpoint else ""
    if best:
        saved = read_checkpoint(best)
        model.load_state_dict(saved["state_dict"])
        score = checkpoint.best_model_score
        if checkpoint.monitor and score is not None and math.isfinite(float(score)):  # -inf: never defined
            metrics[checkpoint.monitor] = float(score)
        metrics.update(best_epoch_metrics(saved.get("epoch"), trainer))
    test_metrics = trainer.test(model, datamodule=datamodule, verbose=False)[0]
    metrics.update({k: float(v) for k, v in {**trainer.callback_metrics, **test_metrics}.items()})
    metrics.update(ranking_results(model, datamodule))
    return model, datamodule, metrics, best


def check_classes(summary: dict[str, Any], node: str, allow_one_class: bool) -> None:
    """A train or dev split without one of the two classes (no answer right, or none wrong) trains a probe that
    says one thing and a checkpoint chosen on nothing: refused before training, naming the split and its counts,
    unless `<node>.splits.allow_one_class` (then a warning)."""
    problems = []
    for split in ("train", "dev"):
        examples, positives = int(summary[f"{split}/examples"]), int(summary[f"{split}/positives"])
        if positives == 0 or positives == examples:
            missing = "positive (a right answer)" if positives == 0 else "negative (a wrong answer)"
            problems.append(f"the {split} split has {examples} examples and no {missing}")
    if not problems:
        return
    text = "; ".join(problems)
    if allow_one_class:
        log.warning(
            "The probe trains on one class (%s.splits.allow_one_class=true): %s; its scores mean nothing", node, text
        )
        return
    raise ValueError(
        f"{text}: a probe needs both classes in train and dev. Raise {node}.num_questions, use another LLM or "
        f"{node}.train_states, or set {node}.splits.allow_one_class=true to train it anyway (a smoke test)"
    )


def read_checkpoint(path: str) -> dict[str, Any]:
    """A Lightning checkpoint of the probe, read with `weights_only=True`: tensors, numbers, strings and plain
    containers only, so a checkpoint file someone replaced cannot run code when it is read."""
    return torch.load(path, map_location="cpu", weights_only=True)


def best_epoch_metrics(epoch: int | None, trainer: Trainer) -> dict[str, float]:
    """The epoch of the best checkpoint beside the last epoch; a warning when they are the same: a probe
    still improving at its last epoch is under-trained, not a result (raise trainer.max_epochs or model.lr)."""
    last = trainer.current_epoch - 1  # current_epoch counts the finished epochs once fit ends
    if epoch is None:
        return {}
    if epoch >= last and last > 0:
        log.warning(
            "The probe's best dev checkpoint is its last epoch (%d): it was still improving when training stopped. "
            "Raise trainer.max_epochs (or model.lr) until the best epoch comes before the last.",
            epoch,
        )
    return {"best_epoch": float(epoch), "last_epoch": float(last)}


def probe_cache_dir(ctx: RunContext, datamodule: NQConfidenceDataModule, recipe: ProbeRecipe) -> Path:
    """Where a probe trained with exactly these activations and settings (and the run's seed) is kept for
    later stages: under the run's cache."""
    splits, ranking = datamodule.splits, datamodule.ranking_options
    key = fingerprint(
        {
            "activations": datamodule.activations()["key"],
            # Named as before the data node's options were grouped, so that a probe trained then is found again.
            "split": [splits.sizes, splits.balance],
            **({"question_splits": splits.proportions} if splits.proportions else {}),
            **({"ranking_top_n": ranking.top_n} if ranking.top_n else {}),
            "monitor": recipe.monitor,
            **recipe.identity,
            "seed": ctx.seed,
        }
    )
    return ctx.cache_dir / "probes" / key


def save_trained_probe(
    model: ProbeModule, datamodule: NQConfidenceDataModule, metrics: dict, best: str, *directories: Path
) -> None:
    """The probe with its metrics (undefined ones as null) and data summary, in each of `directories`."""
    extra = {
        "metrics": {k: metric_value(v) for k, v in metrics.items()},
        "best_checkpoint": best,
        "nq_confidence": datamodule.data.summary(),
    }
    for directory in directories:
        save_probe(model, directory, datamodule.activations(), extra)


def cache_trained_probe(
    model: ProbeModule, datamodule: NQConfidenceDataModule, metrics: dict, best: str, directory: Path, run_copy: Path
) -> None:
    """Keep the trained probe in the cache folder `directory` for the stages that read it. A whole probe
    already there (a previous run of the same recipe, same key) is kept, not rewritten: the stages may
    already have used it, and a complete cache may be read-only. A cache that cannot be written costs only
    the cached copy; the run's own copy (`run_copy`) is written first."""
    if not folder_problem(directory):
        log.info("The cache already holds this probe (%s): kept; this run's copy is in %s", directory, run_copy)
        return
    try:
        save_trained_probe(model, datamodule, metrics, best, directory)
    except OSError as err:
        log.warning("The probe could not be kept in the cache (%s); the run's copy is in %s", err, run_copy)


def ensure_probe(recipe: ProbeRecipe, ctx: RunContext) -> tuple[SavedProbe, NQConfidenceDataModule]:
    """The probe a later stage needs: read from the cache when trained before, else trained now (its
    checkpoints under `<run folder>/probe_stage`)."""
    datamodule = prepared_datamodule(recipe)
    directory = probe_cache_dir(ctx, datamodule, recipe)
    workdir = ctx.output_dir / "probe_stage"

    def whole() -> Path | None:
        return None if folder_problem(directory) else directory

    def train() -> Path:
        problem = folder_problem(directory)
        if (directory / "probe.json").is_file():  # a damaged one (or saved before digests)
            log.warning("Cached probe %s: %s; training it again.", directory, problem)
        log.info("No whole cached probe at %s: training it", directory)
        checkpoint = ModelCheckpoint(dirpath=workdir / "probe_checkpoints", monitor=recipe.monitor, mode="max")
        model, fitted, metrics, best = fit_probe(
            recipe, [checkpoint], [], datamodule=datamodule, enable_progress_bar=False, default_root_dir=str(workdir)
        )
        save_trained_probe(model, fitted, metrics, best, directory)
        return directory

    # A whole cached probe is read without a lock; a missing one is trained by one process while another waits.
    once(directory.parent / f".{directory.name}.lock", f"the probe {directory.name}", whole, train)
    return load_probe(directory), datamodule
