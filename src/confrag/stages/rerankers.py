"""Fine-tuned cross-encoders, cached by what trained them (rows, model, batches, epochs, seed).

A reranker fine-tuned on the same rows with the same settings is read from
`<cache>/rerankers/<key>/` (a plain `save_pretrained` folder beside `confrag_training.json`) instead of
being trained again, so a sweep over τ or K trains only what its values reach.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
from lightning import Trainer
from lightning.pytorch.loggers import Logger

from confrag.artifacts import atomic_write_text, fingerprint
from confrag.reranker.data import PreferenceDataModule
from confrag.reranker.module import RerankerModule

log = logging.getLogger(__name__)


@dataclass
class RerankerRecipe:
    """How a reranker fine-tuning is built; the task fills it from the config (`reranker_recipe`)."""

    make_model: Callable[..., RerankerModule]  # keyword overrides of the `model` node (backbone, lora, ...)
    make_datamodule: Callable[..., PreferenceDataModule]  # keyword arguments train, tokenizer, kind
    make_trainer: Callable[..., Trainer]  # keyword arguments logger, default_root_dir; fresh callbacks each call
    identity: dict[str, Any]  # model, batch and trainer settings, seed: with the rows, the cache key
    cache_dir: Path
    output_dir: Path  # each training writes its checkpoints under <output_dir>/<name>
    eval_batch_size: int = 32
    fast_dev_run: bool = False  # a smoke run: nothing read from or written to the cache
    device: str | None = None  # where the rerankers score ("cuda" with the GPU trainer)


def reranker_cache_dir(recipe: RerankerRecipe, train_rows: list[dict]) -> Path:
    """Where a reranker fine-tuned on exactly these rows with these settings is kept."""
    return recipe.cache_dir / "rerankers" / fingerprint({"rows": fingerprint(train_rows), **recipe.identity})


def load_reranker(recipe: RerankerRecipe, directory: Path) -> RerankerModule:
    """A RerankerModule over an exported fine-tuned cross-encoder (its head included, no LoRA)."""
    return recipe.make_model(backbone=str(directory), fresh_head=False, lora=None)


def ensure_reranker(recipe: RerankerRecipe, train_rows: list[dict], name: str, loggers: list[Logger],
                    run_config: dict | None = None) -> tuple[RerankerModule, dict[str, Any]]:
    """A cross-encoder fine-tuned with group InfoNCE on `train_rows`: loaded from the cache when the same
    rows and settings trained one before, else trained now and exported there."""
    directory = reranker_cache_dir(recipe, train_rows)
    if (directory / "confrag_training.json").is_file() and not recipe.fast_dev_run:
        log.info("Reranker %s: cached at %s", name, directory)
        info = json.loads((directory / "confrag_training.json").read_text())
        return load_reranker(recipe, directory), info
    model = recipe.make_model()
    model.run_config = run_config
    datamodule = recipe.make_datamodule(train=train_rows, tokenizer=model.hparams.backbone, kind=model.hparams.kind)
    datamodule.setup("fit")
    trainer = recipe.make_trainer(logger=loggers or False, default_root_dir=str(recipe.output_dir / name))
    trainer.fit(model, datamodule=datamodule)
    info = {"name": name, "train_rows": len(train_rows), "steps": int(trainer.global_step),
            "train_loss": float(trainer.callback_metrics.get("train/loss", float("nan"))),
            "truncation": datamodule.truncation.get("train", {})}
    if not recipe.fast_dev_run:
        model.export(directory)
        atomic_write_text(directory / "confrag_training.json", json.dumps(info, indent=2))
    return model, info


def place_on_device(recipe: RerankerRecipe, modules: Iterable[RerankerModule]) -> None:
    """Score where the run trains: Lightning hands a module back on the CPU after `fit`, and a cached or
    untuned reranker is built there, so with the GPU trainer Table 1 and every later stage would otherwise
    score each candidate of each question on the CPU."""
    if recipe.device == "cuda" and torch.cuda.is_available():
        for module in modules:
            module.to("cuda")
