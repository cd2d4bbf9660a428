"""The probe stage: NQ_Confidence (cached) → probe training with the best-dev checkpoint → test metrics.

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

import torch
from lightning import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import Logger

from confrag.artifacts import exclusive, fingerprint, folder_problem
from confrag.probe.datamodule import NQConfidenceDataModule
from confrag.probe.module import ProbeModule, SavedProbe, load_probe, metric_value, save_probe

log = logging.getLogger(__name__)


@dataclass
class ProbeRecipe:
    """How the parts of a probe run are built; the task fills it from the config (`probe_recipe`)."""

    make_datamodule: Callable[[], NQConfidenceDataModule]
    make_model: Callable[..., ProbeModule]  # keyword arguments input_dim, layer
    make_trainer: Callable[..., Trainer]  # keyword arguments callbacks, logger and any Trainer setting
    identity: dict[str, Any]  # the model settings and epochs: with the activations, the probe's cache key
    seed: int


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
    model = recipe.make_model(input_dim=datamodule.input_dim, layer=datamodule.layer)
    model.set_standardization(*datamodule.feature_stats())
    model.run_config = run_config
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
        model.load_state_dict(torch.load(best, map_location="cpu", weights_only=False)["state_dict"])
        score = checkpoint.best_model_score
        if checkpoint.monitor and score is not None and math.isfinite(float(score)):  # -inf: never defined
            metrics[checkpoint.monitor] = float(score)
    test_metrics = trainer.test(model, datamodule=datamodule, verbose=False)[0]
    metrics.update({k: float(v) for k, v in {**trainer.callback_metrics, **test_metrics}.items()})
    return model, datamodule, metrics, best


def probe_cache_dir(cache_dir: str | Path, datamodule: NQConfidenceDataModule, recipe: ProbeRecipe) -> Path:
    """Where a probe trained with exactly these activations and settings is kept for later stages."""
    key = fingerprint(
        {
            "activations": datamodule.activations()["key"],
            "split": [datamodule.split_sizes, datamodule.balance],
            **recipe.identity,
            "seed": recipe.seed,
        }
    )
    return Path(cache_dir) / "probes" / key


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


def ensure_probe(
    recipe: ProbeRecipe, cache_dir: str | Path, workdir: Path
) -> tuple[SavedProbe, NQConfidenceDataModule]:
    """The probe a later stage needs: read from the cache when trained before, else trained now."""
    datamodule = prepared_datamodule(recipe)
    directory = probe_cache_dir(cache_dir, datamodule, recipe)
    if folder_problem(directory):
        # One process trains it; another one asking at the same time waits, then reads it.
        with exclusive(directory.parent / f".{directory.name}.lock", f"the probe {directory.name}"):
            problem = folder_problem(directory)
            if problem:
                if (directory / "probe.json").is_file():  # a damaged one (or saved before digests)
                    log.warning("Cached probe %s: %s; training it again.", directory, problem)
                log.info("No whole cached probe at %s: training it", directory)
                checkpoint = ModelCheckpoint(dirpath=workdir / "probe_checkpoints", monitor="val/auroc", mode="max")
                model, datamodule, metrics, best = fit_probe(
                    recipe,
                    [checkpoint],
                    [],
                    datamodule=datamodule,
                    enable_progress_bar=False,
                    default_root_dir=str(workdir),
                )
                save_trained_probe(model, datamodule, metrics, best, directory)
    return load_probe(directory), datamodule
