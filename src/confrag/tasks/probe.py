"""Task `probe`: NQ_Confidence (cached) → MLP probe training → test metrics, exported probe, layer scan."""

from __future__ import annotations

import logging

from omegaconf import DictConfig

from confrag.distributed import rank_info
from confrag.instantiators import instantiate_list, output_dir, plain
from confrag.probe.layer_scan import layer_scan
from confrag.recipes import probe_recipe
from confrag.reports.probe import write_probe_report
from confrag.stages.probe import ProbeRecipe, fit_probe, probe_cache_dir, save_trained_probe

log = logging.getLogger(__name__)


def check(cfg: DictConfig) -> ProbeRecipe:
    """The probe's data settings against the model's config (layer range), before anything runs."""
    checkpoint = (cfg.get("callbacks") or {}).get("model_checkpoint") or {}
    return probe_recipe(cfg, cfg.seed, monitor=checkpoint.get("monitor"))


def run(cfg: DictConfig) -> dict[str, float]:
    out, recipe = output_dir(cfg), check(cfg)
    loggers = instantiate_list(cfg.get("logger"))
    model, datamodule, metrics, best = fit_probe(recipe, instantiate_list(cfg.get("callbacks")), loggers, plain(cfg))
    if not rank_info().is_main:  # every rank of a DDP launch trained; rank 0 writes the run folder and the cache
        return metrics
    scan = layer_scan(datamodule.data, seed=cfg.seed) if cfg.get("layer_scan") else []
    # The run folder first: a read-only or full cache must not cost the run its metrics.
    summary = write_probe_report(out, cfg.llm.name, datamodule, metrics, datamodule.data.summary(), scan, loggers)
    save_trained_probe(model, datamodule, metrics, best, out / "probe")
    try:
        save_trained_probe(model, datamodule, metrics, best, probe_cache_dir(cfg.paths.cache_dir, datamodule, recipe))
    except OSError as err:
        log.warning("The probe could not be kept in the cache (%s); the run's copy is in %s", err, out / "probe")
    print(summary, flush=True)
    return metrics
