"""Task `probe`: NQ_Confidence (cached) → MLP probe training → test metrics, exported probe, layer scan."""

from __future__ import annotations

from omegaconf import DictConfig

from confrag.instantiators import instantiate_list, output_dir, plain
from confrag.probe.layer_scan import layer_scan
from confrag.recipes import probe_recipe
from confrag.reports.probe import write_probe_report
from confrag.stages.probe import fit_probe, probe_cache_dir, save_trained_probe


def check(cfg: DictConfig) -> None:
    """The probe's settings are checked by its DataModule and module as they are built."""


def run(cfg: DictConfig) -> dict[str, float]:
    out = output_dir(cfg)
    recipe = probe_recipe(cfg, cfg.seed)
    loggers = instantiate_list(cfg.get("logger"))
    model, datamodule, metrics, best = fit_probe(recipe, instantiate_list(cfg.get("callbacks")), loggers, plain(cfg))
    save_trained_probe(model, datamodule, metrics, best, out / "probe",
                       probe_cache_dir(cfg.paths.cache_dir, datamodule, recipe))
    scan = layer_scan(datamodule.data, seed=cfg.seed) if cfg.get("layer_scan") else []
    summary = write_probe_report(out, cfg.llm.name, datamodule, metrics, datamodule.data.summary(), scan, loggers)
    print(summary, flush=True)
    return metrics
