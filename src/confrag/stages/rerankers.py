"""Fine-tuned cross-encoders, cached by what trained them (rows, model, batches, epochs, seed).

A reranker fine-tuned on the same rows with the same settings is read from
`<cache>/rerankers/<key>/` (a plain `save_pretrained` folder beside `confrag_training.json`) instead of
being trained again, so a sweep over τ or K trains only what its values reach.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning import Trainer
from lightning.pytorch.loggers import Logger

from confrag.infra.atomic import atomic_write_text
from confrag.infra.digests import fingerprint, folder_problem, write_folder_digest
from confrag.infra.fit_progress import FitProgress
from confrag.infra.locks import once
from confrag.infra.run_context import RunContext
from confrag.reranker.budget import PairBudget
from confrag.reranker.data import PreferenceDataModule
from confrag.reranker.module import RerankerModule
from confrag.reranker.selection import DevTop1, DevTop1Selection

log = logging.getLogger(__name__)


@dataclass
class RerankerRecipe:
    """How a reranker fine-tuning is built; the task fills it from the config (`reranker_recipe`)."""

    make_model: Callable[..., RerankerModule]  # keyword overrides of the `model` node (backbone, lora, ...)
    make_datamodule: Callable[..., PreferenceDataModule]  # keyword arguments train, tokenizer, kind
    # keyword arguments logger, default_root_dir, extra_callbacks (beside the config's); fresh callbacks each call
    make_trainer: Callable[..., Trainer]
    identity: dict[str, Any]  # model, batch and trainer settings, seed: with the rows, the cache key
    eval_batch_size: int = 32
    fast_dev_run: bool = False  # a smoke run: nothing read from or written to the cache
    device: str | None = None  # where the rerankers score ("cuda" with the GPU trainer)

    def with_model_settings(self, **settings: Any) -> RerankerRecipe:
        """This recipe with `settings` fixed in its `model` node, in the models it makes and in its cache identity:
        for a reranker that some settings do not concern (the base ignores the alignment's LoRA and distillation,
        so changing those must neither change nor retrain it)."""
        make_model = self.make_model
        identity = {**self.identity, "model": {**self.identity.get("model", {}), **settings}}
        return dataclasses.replace(self, make_model=lambda **kw: make_model(**{**settings, **kw}), identity=identity)


def reranker_cache_dir(
    recipe: RerankerRecipe,
    cache_dir: Path,
    train_rows: list[dict],
    start_from: Path | None = None,
    trainer_settings: dict[str, Any] | None = None,
    model_overrides: dict[str, Any] | None = None,
) -> Path:
    """Where (under `cache_dir`) a reranker fine-tuned on exactly these rows with these settings (from
    `start_from`, an exported reranker, instead of the `model` backbone; with `trainer_settings` over the
    trainer's and `model_overrides` over the `model` node's) is kept."""
    key = {"rows": fingerprint(train_rows), **recipe.identity}
    if start_from is not None:  # a cached reranker's folder name is its own key
        key["start_from"] = Path(start_from).name
    if trainer_settings:
        key["trainer_settings"] = trainer_settings
    # Only the overrides that change a setting: `lora=None` over a `model.lora: null` trains the same model.
    model = recipe.identity.get("model", {})
    changed = {k: v for k, v in (model_overrides or {}).items() if k not in model or model[k] != v}
    if changed:
        key["model_overrides"] = changed
    return Path(cache_dir) / "rerankers" / fingerprint(key)


def reranker_budget(recipe: RerankerRecipe) -> PairBudget:
    """The reranker's tokenizer and length budget as its data module cuts pairs (the `model` node's backbone and kind,
    the `data` node's query_max_len and passage_max_len), from the tokenizer alone: no weights load."""
    model = recipe.identity.get("model", {})
    kind = {"kind": model["kind"]} if "kind" in model else {}  # else the data module's own
    datamodule = recipe.make_datamodule(tokenizer=model.get("backbone"), **kind)
    return PairBudget(datamodule.tokenizer, datamodule.kind, datamodule.query_max_len, datamodule.passage_max_len)


def load_reranker(recipe: RerankerRecipe, directory: Path) -> RerankerModule:
    """A RerankerModule over an exported fine-tuned cross-encoder (its head included, no LoRA)."""
    return recipe.make_model(backbone=str(directory), fresh_head=False, lora=None)


# wide: the keyword options (start_from, trainer_settings, dev, model overrides) are optional and
# independent: each of the five callers names the one or two it changes, as Lightning's Trainer takes its
# options; an object would be built at every call for one field. Inside, they travel as `RerankerTraining`.
def ensure_reranker(
    recipe: RerankerRecipe,
    ctx: RunContext,
    train_rows: list[dict],
    name: str,
    loggers: list[Logger],
    run_config: dict | None = None,
    *,
    start_from: Path | None = None,
    trainer_settings: dict[str, Any] | None = None,
    dev: DevTop1 | None = None,
    **model_overrides: Any,
) -> tuple[RerankerModule, dict[str, Any]]:
    """A cross-encoder fine-tuned with group InfoNCE on `train_rows` (from the `model` backbone, or from the
    exported reranker `start_from`): loaded from the cache when the same rows and settings trained one
    before, else trained now and exported there. The global RNG is seeded right before training, so a
    reranker depends on its key only, not on what else this process trained before it (a resumed run
    trains what is missing exactly as an uninterrupted one). With `dev`, the weights kept are those of the
    best dev Top-1 over training, the base's included (`confrag.reranker.selection`). Kept under the run's
    cache; a training writes its checkpoints under `<run folder>/<name>`."""
    key_settings = {**(trainer_settings or {}), **({"select_on_dev_top1": dev.key()} if dev is not None else {})}
    directory = reranker_cache_dir(recipe, ctx.cache_dir, train_rows, start_from, key_settings or None, model_overrides)
    marker = directory / "confrag_training.json"
    training = RerankerTraining(
        train_rows, name, loggers, run_config, start_from, trainer_settings, model_overrides, dev
    )

    def train() -> tuple[RerankerModule, dict[str, Any]]:
        return _train(recipe, ctx.output_dir, training, directory)

    if recipe.fast_dev_run:
        return train()

    def cached() -> tuple[RerankerModule, dict[str, Any]] | None:
        if not marker.is_file() or folder_problem(directory):
            return None
        log.info("Reranker %s: cached at %s", name, directory)
        return load_reranker(recipe, directory), json.loads(marker.read_text())

    def train_again() -> tuple[RerankerModule, dict[str, Any]]:
        if directory.exists():
            problem = folder_problem(directory) if marker.is_file() else "is not trained yet"
            log.warning("Cached reranker %s: %s; training it again.", directory, problem)
            marker.unlink(missing_ok=True)
        return train()

    # A whole cached reranker is read without a lock (a complete cache may be read-only); a missing one is trained
    # by one process while another one asking at the same time waits, then reads it.
    return once(directory.parent / f".{directory.name}.lock", f"the reranker {name}", cached, train_again)


@dataclass(frozen=True)
class RerankerTraining:
    """One reranker's training beside its recipe: its rows and name, what it logs to, and what it starts from
    and changes (the rows, start, trainer settings, overrides and dev selection are in its cache key)."""

    rows: list[dict]
    name: str
    loggers: list[Logger]
    run_config: dict | None
    start_from: Path | None
    trainer_settings: dict[str, Any] | None
    model_overrides: dict[str, Any]
    dev: DevTop1 | None


def _train(
    recipe: RerankerRecipe, output_dir: Path, training: RerankerTraining, directory: Path
) -> tuple[RerankerModule, dict[str, Any]]:
    train_rows, name, start_from, dev = training.rows, training.name, training.start_from, training.dev
    trainer_settings, model_overrides = training.trainer_settings, training.model_overrides
    start = time.perf_counter()
    L.seed_everything(int(recipe.identity.get("seed", 0)), workers=True, verbose=False)
    if start_from is not None:
        model_overrides = {"backbone": str(start_from), "fresh_head": False, **model_overrides}
    model = recipe.make_model(**model_overrides)
    model.run_config = training.run_config
    datamodule = recipe.make_datamodule(train=train_rows, tokenizer=model.hparams.backbone, kind=model.hparams.kind)
    datamodule.setup("fit")
    selection = DevTop1Selection(dev, batch_size=recipe.eval_batch_size) if dev is not None else None
    trainer = recipe.make_trainer(
        logger=training.loggers or False,
        default_root_dir=str(output_dir / name),
        extra_callbacks=[*([selection] if selection else []), FitProgress(f"reranker {name}")],  # train.log progress
        **(trainer_settings or {}),
    )
    trainer.fit(model, datamodule=datamodule)
    info = {
        "name": name,
        "train_rows": len(train_rows),
        "steps": int(trainer.global_step),
        "train_loss": float(trainer.callback_metrics.get("train/loss", float("nan"))),
        "truncation": datamodule.truncation.get("train", {}),
        "train_seconds": time.perf_counter() - start,
        "start_from": None if start_from is None else Path(start_from).name,
        "trainer_settings": trainer_settings or {},
        **(selection.chosen if selection else {}),
    }
    info["score_spread"] = check_not_collapsed(model, train_rows, name)
    if not recipe.fast_dev_run:
        model.export(directory)
        atomic_write_text(directory / "confrag_training.json", json.dumps(info, indent=2))
        write_folder_digest(directory)  # again, now with the marker: what a later run reads back
        remove_checkpoints(trainer)
    return model, info


# A reranker whose scores spread less than this (logits, median over groups) across a group's candidates no
# longer ranks: every later number made with it would be noise.
COLLAPSE_SPREAD = 1e-4
# The collapse check scores at most this many candidates of a group (evenly spaced over its positives, then its
# negatives): one row of 10,000 negatives had it score every one, minutes of CPU after training, in silence.
COLLAPSE_PASSAGES = 64


def check_not_collapsed(
    model: RerankerModule, rows: list[dict], name: str, groups: int = 32, passages: int = COLLAPSE_PASSAGES
) -> float:
    """The median spread (max - min) of the reranker's scores across at most `passages` candidates of each of its
    first `groups` training groups (at most groups x passages pairs scored, whatever the rows hold); a reranker
    under COLLAPSE_SPREAD is refused, naming the settings that usually cause it."""
    sample = [r for r in rows if len(r.get("pos", [])) + len(r.get("neg", [])) >= 2][:groups]
    if not sample:
        return float("nan")
    spreads = []
    for row in sample:
        candidates = [*row["pos"], *row["neg"]]
        if len(candidates) > passages:
            candidates = [
                candidates[i] for i in np.unique(np.linspace(0, len(candidates) - 1, passages).round().astype(int))
            ]
        scores = model.score([row["query"]] * len(candidates), candidates)
        spreads.append(float(np.max(scores) - np.min(scores)))
    spread = float(np.median(spreads))
    if not spread >= COLLAPSE_SPREAD:  # also catches NaN scores
        raise ValueError(
            f"reranker {name}: its scores no longer vary across candidates (median spread {spread:.2e} over "
            f"{len(sample)} training groups): training collapsed it. Lower model.lr, use model.tau closer to 1, "
            "or train fewer steps; nothing was exported"
        )
    return spread


def remove_checkpoints(trainer: Trainer) -> None:
    """Once a reranker is exported to the cache, the Lightning checkpoints its training wrote to the run folder
    are copies of it (hundreds of MB each for a cross-encoder): remove them."""
    for callback in trainer.checkpoint_callbacks:
        paths = {callback.last_model_path, callback.best_model_path, *getattr(callback, "best_k_models", {})}
        for path in filter(None, paths):
            Path(path).unlink(missing_ok=True)


def place_on_device(recipe: RerankerRecipe, modules: Iterable[RerankerModule]) -> None:
    """Score where the run trains: Lightning hands a module back on the CPU after `fit`, and a cached or
    untuned reranker is built there, so with the GPU trainer Table 1 and every later stage would otherwise
    score each candidate of each question on the CPU."""
    if recipe.device == "cuda" and torch.cuda.is_available():
        for module in modules:
            module.to("cuda")
