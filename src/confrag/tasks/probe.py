"""Task `probe`: NQ_Confidence (cached) → MLP probe training → test metrics, exported probe, layer scan."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
from lightning.pytorch.loggers import Logger
from omegaconf import DictConfig

from confrag.infra.run_context import RunContext
from confrag.instantiators import instantiate_list, plain, refuse_moved_keys
from confrag.probe.calibration import reliability_bins, split_confidences
from confrag.probe.datamodule import NQConfidenceDataModule
from confrag.probe.layer_scan import layer_scan, skip_reason
from confrag.probe.module import ProbeModule
from confrag.recipes import Exported, exported, probe_recipe
from confrag.reports.hub import push_folder
from confrag.reports.probe import write_probe_report
from confrag.reports.wandb_artifacts import log_exports
from confrag.stages.probe import ProbeRecipe, cache_trained_probe, fit_probe, probe_cache_dir, save_trained_probe

log = logging.getLogger(__name__)

Checked = Exported[ProbeRecipe]


@dataclass
class Trained:
    """What every rank of a DDP launch trained together; rank 0 writes it."""

    model: ProbeModule
    datamodule: NQConfidenceDataModule
    metrics: dict[str, Any]
    best: str  # the best dev checkpoint's path
    loggers: list[Logger]


def check(cfg: DictConfig) -> Checked:
    """The probe's data settings against the model's config (layer range), and `hub`, before anything runs (a key
    that moved, set by a config file, refused first naming its new place: `refuse_moved_keys`)."""
    refuse_moved_keys(cfg)
    checkpoint = (cfg.get("callbacks") or {}).get("model_checkpoint") or {}
    return exported(cfg, lambda: probe_recipe(cfg, monitor=checkpoint.get("monitor")), "probe_repo")


def run(cfg: DictConfig, checked: Checked, ctx: RunContext) -> Trained:
    """The probe trained on the settings `check(cfg)` returned (on every rank of a DDP launch)."""
    loggers = instantiate_list(cfg.get("logger"))
    model, datamodule, metrics, best = fit_probe(
        checked.recipe, instantiate_list(cfg.get("callbacks")), loggers, plain(cfg)
    )
    return Trained(model, datamodule, metrics, best, loggers)


def write(cfg: DictConfig, checked: Checked, ctx: RunContext, trained: Trained) -> dict[str, float]:
    """Rank 0: the layer scan, the run folder, the cache's copy of the probe, the exports; the metrics."""
    out, recipe, hub = ctx.output_dir, checked.recipe, checked.hub
    model, datamodule, metrics, best = trained.model, trained.datamodule, trained.metrics, trained.best
    loggers = trained.loggers
    scan = layer_scan(datamodule.data, seed=ctx.seed) if cfg.get("layer_scan") else []
    calibration = reliability_bins(*split_confidences(model, datamodule.test_dataloader()))  # the best checkpoint
    skipped = skip_reason(all_labels(datamodule)) if cfg.get("layer_scan") and not scan else None
    # The run folder first: a read-only or full cache must not cost the run its metrics.
    summary = write_probe_report(
        out,
        cfg.llm.name,
        datamodule,
        metrics,
        datamodule.data.summary(),
        scan,
        calibration,
        loggers,
        scan_skipped=skipped,
    )
    save_trained_probe(model, datamodule, metrics, best, out / "probe")
    cache_trained_probe(model, datamodule, metrics, best, probe_cache_dir(ctx, datamodule, recipe), out / "probe")
    log_exports(loggers, {"probe": out / "probe"}, str(cfg.llm.name), {"layer": datamodule.layer})
    if hub.push:  # the whole folder: its digest and run record travel with it
        url = push_folder(out / "probe", hub.probe_repo, "model", hub.private)
        print(f"Pushed {out / 'probe'} to model repo {hub.probe_repo}: {url}", flush=True)
    print(summary, flush=True)
    return metrics


def all_labels(datamodule: NQConfidenceDataModule) -> np.ndarray:
    """Every cached state's label, of every prompt kind: what the layer scan runs on."""
    return np.concatenate([datamodule.data.labels[k] for k in datamodule.data.stores])
