"""Task `probe`: NQ_Confidence (cached) → MLP probe training → test metrics, exported probe, layer scan."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from omegaconf import DictConfig

from confrag.infra.distributed import rank_info
from confrag.instantiators import instantiate_list, output_dir, plain, settings_from
from confrag.probe.layer_scan import layer_scan
from confrag.recipes import probe_recipe
from confrag.reports.hub import HubSettings, push_folder
from confrag.reports.probe import write_probe_report
from confrag.reports.wandb_artifacts import log_exports
from confrag.stages.probe import ProbeRecipe, cache_trained_probe, fit_probe, probe_cache_dir, save_trained_probe

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Checked:
    recipe: ProbeRecipe
    hub: HubSettings


def check(cfg: DictConfig) -> Checked:
    """The probe's data settings against the model's config (layer range), and `hub`, before anything runs."""
    hub = hub_settings(cfg)
    checkpoint = (cfg.get("callbacks") or {}).get("model_checkpoint") or {}
    return Checked(probe_recipe(cfg, cfg.seed, monitor=checkpoint.get("monitor")), hub)


def hub_settings(cfg: DictConfig) -> HubSettings:
    return settings_from(HubSettings, cfg.get("hub"), "hub").require("probe_repo")


def run(cfg: DictConfig, checked: Checked) -> dict[str, float]:
    """The task on the settings `check(cfg)` returned (checked once, before the run folder got a file)."""
    out, recipe, hub = output_dir(cfg), checked.recipe, checked.hub
    loggers = instantiate_list(cfg.get("logger"))
    model, datamodule, metrics, best = fit_probe(recipe, instantiate_list(cfg.get("callbacks")), loggers, plain(cfg))
    if not rank_info().is_main:  # every rank of a DDP launch trained; rank 0 writes the run folder and the cache
        return metrics
    scan = layer_scan(datamodule.data, seed=cfg.seed) if cfg.get("layer_scan") else []
    # The run folder first: a read-only or full cache must not cost the run its metrics.
    summary = write_probe_report(out, cfg.llm.name, datamodule, metrics, datamodule.data.summary(), scan, loggers)
    save_trained_probe(model, datamodule, metrics, best, out / "probe")
    cache_trained_probe(
        model, datamodule, metrics, best, probe_cache_dir(cfg.paths.cache_dir, datamodule, recipe), out / "probe"
    )
    log_exports(loggers, {"probe": out / "probe"}, str(cfg.llm.name), {"layer": datamodule.layer})
    if hub.push:  # the whole folder: its digest and run record travel with it
        url = push_folder(out / "probe", hub.probe_repo, "model", hub.private)
        print(f"Pushed {out / 'probe'} to model repo {hub.probe_repo}: {url}", flush=True)
    print(summary, flush=True)
    return metrics
