"""Task `probe`: NQ_Confidence (cached) → MLP probe training → test metrics, exported probe, layer scan."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate
from lightning import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import Logger, WandbLogger
from omegaconf import DictConfig, OmegaConf

from confrag.artifacts import atomic_write_text, fingerprint
from confrag.probe.datamodule import NQConfidenceDataModule
from confrag.probe.layer_scan import layer_scan
from confrag.probe.module import ProbeModule, SavedProbe, load_probe, save_probe

log = logging.getLogger(__name__)


def instantiate_list(section: DictConfig | None) -> list[Any]:
    """Instantiate every `_target_` node of a config group such as `callbacks` or `logger`."""
    if not section:
        return []
    return [instantiate(node) for node in section.values() if isinstance(node, DictConfig) and "_target_" in node]


def task_loggers(cfg: DictConfig) -> tuple[dict[str, Any], list[Logger]]:
    """The resolved config and the run's loggers, each already holding that config as hyperparameters."""
    run_config = OmegaConf.to_container(cfg, resolve=True)
    loggers: list[Logger] = instantiate_list(cfg.get("logger"))
    for logger in loggers:
        logger.log_hyperparams(run_config)
    return run_config, loggers


def run(cfg: DictConfig) -> dict[str, float]:
    from confrag.train import output_dir

    out = output_dir(cfg)
    run_config = OmegaConf.to_container(cfg, resolve=True)
    loggers: list[Logger] = instantiate_list(cfg.get("logger"))
    model, datamodule, metrics, best = fit_probe(cfg.data, cfg.model, cfg.trainer, instantiate_list(cfg.get("callbacks")),
                                                 loggers, run_config)
    summary = datamodule.data.summary()
    extra = {"metrics": metrics, "best_checkpoint": best, "nq_confidence": summary}
    save_probe(model, out / "probe", datamodule.activations(), extra)
    save_probe(model, probe_cache_dir(cfg.paths.cache_dir, datamodule, cfg.model, cfg.trainer, cfg.seed),
               datamodule.activations(), extra)
    scan = layer_scan(datamodule.data, seed=cfg.seed) if cfg.get("layer_scan") else []
    _report(cfg, out, datamodule, metrics, summary, scan, loggers)
    return metrics


def prepared_datamodule(data_cfg) -> NQConfidenceDataModule:
    datamodule: NQConfidenceDataModule = instantiate(data_cfg, _convert_="all")
    datamodule.prepare_data()
    datamodule.setup("fit")
    return datamodule


def fit_probe(data_cfg, model_cfg, trainer_cfg, callbacks: list[Callback], loggers: list[Logger],
              run_config: dict | None = None, datamodule: NQConfidenceDataModule | None = None):
    """NQ_Confidence (cached) → probe training with best-dev checkpoint → test metrics."""
    datamodule = datamodule or prepared_datamodule(data_cfg)
    summary = datamodule.data.summary()
    log.info("NQ_Confidence summary: %s", summary)
    model: ProbeModule = instantiate(model_cfg, input_dim=datamodule.input_dim, layer=datamodule.layer, _convert_="all")
    model.set_standardization(*datamodule.feature_stats())
    model.run_config = run_config
    trainer: Trainer = instantiate(trainer_cfg, callbacks=callbacks, logger=loggers or False)
    for logger in loggers:
        logger.log_hyperparams({**(run_config or {}), "nq_confidence": summary})
    trainer.fit(model, datamodule=datamodule)
    best = trainer.checkpoint_callback.best_model_path if trainer.checkpoint_callback else ""
    if best:
        model.load_state_dict(torch.load(best, map_location="cpu", weights_only=False)["state_dict"])
    test_metrics = trainer.test(model, datamodule=datamodule, verbose=False)[0]
    metrics = {k: float(v) for k, v in {**trainer.callback_metrics, **test_metrics}.items()}
    return model, datamodule, metrics, best


def probe_cache_dir(cache_dir: str, datamodule: NQConfidenceDataModule, model_cfg, trainer_cfg, seed: int) -> Path:
    """Where a probe trained with exactly these activations and settings is kept for later stages."""
    key = fingerprint({
        "activations": datamodule.activations()["key"],
        "split": [datamodule.split_sizes, datamodule.balance],
        "model": OmegaConf.to_container(model_cfg, resolve=True),
        "max_epochs": trainer_cfg.get("max_epochs"),
        "seed": seed,
    })
    return Path(cache_dir) / "probes" / key


def ensure_probe(probe_cfg: DictConfig, cache_dir: str, seed: int, workdir: Path) -> tuple[SavedProbe, NQConfidenceDataModule]:
    """The probe a later stage needs: read from the cache when trained before, else trained now."""
    datamodule = prepared_datamodule(probe_cfg.data)
    directory = probe_cache_dir(cache_dir, datamodule, probe_cfg.model, probe_cfg.trainer, seed)
    if not (directory / "probe.json").is_file():
        log.info("No cached probe at %s: training it", directory)
        checkpoint = ModelCheckpoint(dirpath=workdir / "probe_checkpoints", monitor="val/auroc", mode="max")
        trainer_cfg = OmegaConf.merge(probe_cfg.trainer, {"enable_progress_bar": False, "default_root_dir": str(workdir)})
        model, datamodule, metrics, best = fit_probe(probe_cfg.data, probe_cfg.model, trainer_cfg, [checkpoint], [],
                                                     datamodule=datamodule)
        save_probe(model, directory, datamodule.activations(),
                   {"metrics": metrics, "best_checkpoint": best, "nq_confidence": datamodule.data.summary()})
    return load_probe(directory), datamodule


def _report(cfg, out: Path, datamodule, metrics, summary, scan, loggers) -> None:
    result = {"layer": datamodule.layer, "train_states": datamodule.train_states, "metrics": metrics,
              "nq_confidence": summary, "layer_scan": scan}
    atomic_write_text(out / "metrics.json", json.dumps(result, indent=2))
    lines = [f"Probe on layer {datamodule.layer} ({datamodule.train_states} states) — {cfg.llm.name}",
             f"  questions {summary['questions']}, closed-book has_answer {summary['qa/has_answer']:.3f}",
             "  balanced examples: " + ", ".join(f"{s} {summary[f'{s}/examples']}" for s in ("train", "dev", "test")),
             "  test: " + ", ".join(f"{k.split('/')[1]} {metrics[k]:.3f}" for k in ("test/acc", "test/auroc", "test/ece")
                                     if k in metrics)]
    if scan:
        lines.append("  per-layer 5-fold logistic AUROC (all questions of " + "+".join(datamodule.data.stores) + "):")
        lines += [f"    layer {r['layer']:>3}: {r['auroc_mean']:.3f} ± {r['auroc_std']:.3f}" for r in scan]
    if scan:
        plot_layer_scan(scan, datamodule.num_layers // 2, out / "layer_scan.png", f"{cfg.llm.name}: probe AUROC by layer")
    text = "\n".join(lines)
    atomic_write_text(out / "summary.txt", text + "\n")
    print(text, flush=True)
    for logger in loggers:
        if isinstance(logger, WandbLogger) and scan:
            logger.log_table("layer_scan", columns=list(scan[0]), data=[list(r.values()) for r in scan])
            logger.log_image("layer_scan_plot", [str(out / "layer_scan.png")])


def plot_layer_scan(scan: list[dict], mid_layer: int, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = [r["layer"] for r in scan]
    mean = [r["auroc_mean"] for r in scan]
    std = [r["auroc_std"] for r in scan]
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    ax.errorbar(layers, mean, yerr=std, marker="o", capsize=3)
    ax.axhline(0.5, color="grey", linestyle=":", label="chance")
    ax.axvline(mid_layer, color="tab:red", linestyle="--", label="Layer/2")
    ax.set_xlabel("layer (hidden_states index)")
    ax.set_ylabel("5-fold AUROC (logistic)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
