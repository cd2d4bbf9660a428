"""The LLM-aligned reranker: a cross-encoder fine-tuned with group InfoNCE on preference rows.

Any `AutoModelForSequenceClassification` with one logit works as the backbone: the paper's
bge-reranker-v2-m3 (head included), or an encoder without a head such as the embedded
all-MiniLM-L6-v2, which gets a freshly initialised, seeded head; `model.kind=qwen3_yes_no` takes a
Qwen3-Reranker causal LM instead, scored as logit(yes) − logit(no) (see `qwen3`). The paper's settings (lr 6e-5,
weight decay 0.01, query_max_len 128, passage_max_len 512) are conf/model/reranker_minilm.yaml's; AdamW with a
linear schedule.

`export()` writes a plain transformers folder (LoRA adapters merged) that loads unchanged in
transformers, sentence-transformers' `CrossEncoder` and FlagEmbedding's `FlagReranker`.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning import LightningModule
from torch import nn

from confrag.infra.atomic import swapped_in
from confrag.infra.digests import write_folder_digest
from confrag.infra.finite import require_finite
from confrag.infra.locks import exclusive
from confrag.reranker.backbone import minilm_dir, resolve_backbone
from confrag.reranker.kinds import head_module_names, load_cross_encoder, reranker_kind
from confrag.reranker.loss import distillation_kl, group_infonce
from confrag.reranker.metrics import RankingMetrics
from confrag.reranker.settings import RerankerSettings

__all__ = ["RerankerModule", "minilm_dir", "load_cross_encoder", "build_optimizer", "head_module_names"]


def _check(condition: bool, key: str, allowed: str, value: Any) -> None:
    if not condition:
        raise ValueError(f"{key} must be {allowed} (got {value!r})")


def apply_lora(model: nn.Module, lora: dict[str, Any]) -> nn.Module:
    """Wrap with peft LoRA: adapters plus a trainable copy of the head; everything else frozen."""
    from peft import LoraConfig, get_peft_model

    kwargs = dict(lora)
    kwargs.setdefault("task_type", "SEQ_CLS")
    kwargs.setdefault("modules_to_save", head_module_names(model))
    try:
        config = LoraConfig(**kwargs)
    except (TypeError, ValueError) as err:
        raise ValueError(
            f"model.lora: {err}. Keys are peft.LoraConfig fields (r, lora_alpha, lora_dropout, target_modules, ...)"
        ) from err
    return get_peft_model(model, config)


def build_optimizer(
    model: nn.Module, lr: float, weight_decay: float, warmup_ratio: float, total_steps: int
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over the trainable parameters (no decay on biases and norm weights, as the HF Trainer that
    FlagEmbedding uses does) and a linear warmup / linear decay schedule over `total_steps`."""
    from transformers import get_linear_schedule_with_warmup

    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=lr)
    total_steps = max(int(total_steps), 1)
    scheduler = get_linear_schedule_with_warmup(optimizer, int(warmup_ratio * total_steps), total_steps)
    return optimizer, scheduler


class RerankerModule(LightningModule):
    def __init__(self, settings: RerankerSettings, ks: Sequence[int] = (1, 3, 5)) -> None:
        """A reranker of `settings` (the `model` node builds them: conf/model/reranker_minilm.yaml; outside a run
        `confrag.instantiators.shipped("model/reranker_minilm.yaml", seed=..., ...)`), its ranking metrics at `ks`.
        The settings were checked when built; here the backbone loads."""
        super().__init__()
        self.settings = settings
        self.kind = reranker_kind(settings.kind)
        self.encode = self.kind.encode
        ks = [int(k) for k in ks]  # plain ints, so the saved hparams stay JSON lists
        # The settings, key by key, as the loggers and checkpoints record a module's hyperparameters.
        self.save_hyperparameters({**dataclasses.asdict(settings), "ks": ks})
        path = resolve_backbone(settings.backbone)
        self.tokenizer = self.kind.load_tokenizer(path, settings.trust_remote_code)
        remote = settings.trust_remote_code
        self.model = self.kind.load(path, self.tokenizer, settings.fresh_head, settings.seed, remote)
        if settings.lora is not None:
            self.model = apply_lora(self.model, self.kind.lora_settings(settings.lora))
        self.model.train()  # from_pretrained returns eval mode; a LightningModule starts in training mode
        self.val_metrics = RankingMetrics(ks, prefix="val/")
        self.test_metrics = RankingMetrics(ks, prefix="test/")

    # --- scoring -----------------------------------------------------------------------------
    def forward(self, features: dict[str, torch.Tensor]) -> torch.Tensor:
        """One score (the raw logit) per (query, passage) pair."""
        return self.model(**features).logits.view(-1)

    def scorer_for(self, query: str) -> RerankerModule:
        """The reranker that scores `query`: this one (a cross-fitted reranker answers with its fold's)."""
        return self

    @torch.no_grad()
    def score(self, queries: Sequence[str], passages: Sequence[str], batch_size: int = 32) -> np.ndarray:
        """Raw logits for (queries[i], passages[i]), tokenized as in training; dropout off."""
        _check(batch_size >= 1, "batch_size", ">= 1", batch_size)
        was_training = self.training
        self.eval()
        out = []
        try:
            for start in range(0, len(queries), batch_size):
                encoded = self.encode(
                    self.tokenizer,
                    queries[start : start + batch_size],
                    passages[start : start + batch_size],
                    self.settings.query_max_len,
                    self.settings.passage_max_len,
                )
                out.append(self({k: v.to(self.device) for k, v in encoded.features.items()}).float().cpu())
        finally:
            self.train(was_training)
        scores = torch.cat(out).numpy() if out else np.zeros(0, dtype=np.float32)
        require_finite(scores, stage="reranker scoring", artifact=f"the scores of {self.settings.backbone}")
        return scores

    # --- training ----------------------------------------------------------------------------
    def setup(self, stage: str) -> None:
        # Pairs tokenized for the other kind still run through the backbone and score as noise: refuse them.
        encode = getattr(getattr(self.trainer, "datamodule", None), "encode", self.encode)
        if encode is not self.encode:
            raise ValueError(
                f"the datamodule tokenizes pairs for another model.kind than {self.settings.kind!r}: "
                f"build PreferenceDataModule with kind=model.kind"
            )

    def on_train_start(self) -> None:
        # from_pretrained returns the backbone in eval mode and Lightning keeps modules in the mode it
        # finds them: without this, fine-tuning would run without dropout.
        self.model.train()

    def on_train_epoch_start(self) -> None:
        # Lightning tells samplers the epoch, not datasets: a fresh positive per epoch needs this call.
        dataset = getattr(self.trainer.train_dataloader, "dataset", None)
        if hasattr(dataset, "set_epoch"):
            dataset.set_epoch(self.current_epoch)

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        scores = self(batch["features"]).view(-1, batch["group_size"])
        loss = group_infonce(scores, self.settings.tau)
        if self.settings.distill_weight > 0:
            teacher = batch.get("teacher_scores")
            if teacher is None:
                raise ValueError(
                    "model.distill_weight > 0 needs teacher scores: every training row must have "
                    "pos_scores and neg_scores"
                )
            kl = distillation_kl(scores, teacher, self.settings.tau, self.settings.distill_tau)
            loss = loss + self.settings.distill_weight * kl
        require_finite(
            loss, stage="reranker training", artifact=f"the loss of batch {batch_idx} (epoch {self.current_epoch})"
        )
        # Not on the progress bar: that would read the value back (a device sync) at every step.
        self.log("train/loss", loss, on_step=True, on_epoch=False, batch_size=scores.shape[0])
        return loss

    def _eval_step(self, batch: dict[str, Any], metrics: RankingMetrics) -> None:
        scores = self(batch["features"]).float()
        metrics.update(list(torch.split(scores, batch["group_sizes"])), batch["labels"])

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self._eval_step(batch, self.val_metrics)

    def on_validation_epoch_end(self) -> None:
        self.log_dict(self.val_metrics.compute(), prog_bar=True)
        self.val_metrics.reset()

    def test_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self._eval_step(batch, self.test_metrics)

    def on_test_epoch_end(self) -> None:
        self.log_dict(self.test_metrics.compute())
        self.test_metrics.reset()

    def configure_optimizers(self):
        optimizer, scheduler = build_optimizer(
            self.model,
            self.settings.lr,
            self.settings.weight_decay,
            self.settings.warmup_ratio,
            self.trainer.estimated_stepping_batches,
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # The resolved run config travels inside each checkpoint (set by the task that trains the reranker).
        checkpoint["confrag_config"] = getattr(self, "run_config", None)

    # --- export ------------------------------------------------------------------------------
    def plain_model(self) -> nn.Module:
        """The transformers model to save: a merged copy when LoRA is on (training can go on)."""
        if self.settings.lora is None:
            return self.model
        return copy.deepcopy(self.model).merge_and_unload()

    def export(self, directory: str | Path) -> Path:
        """Write model + tokenizer with `save_pretrained`, atomically (built beside, then renamed). Two
        processes exporting to one directory take turns (a lock), so neither rename meets the other's."""
        directory = Path(directory)
        directory.parent.mkdir(parents=True, exist_ok=True)
        model = self.plain_model()
        self.kind.prepare_export(model)  # a cross-encoder's config tells sentence-transformers to score raw logits
        with exclusive(directory.parent / f".{directory.name}.lock", f"the export to {directory}"):
            with swapped_in(directory) as tmp:
                model.save_pretrained(str(tmp))
                self.tokenizer.save_pretrained(str(tmp))
                write_folder_digest(tmp)  # checked where the export is read (`resolve_backbone`)
        return directory


def fold_export(directory: str | Path, fold: int) -> Path:
    """Where a cross-fitted export (`FoldedReranker.export`) puts fold `fold`'s model."""
    return Path(directory) / f"fold{fold}"


def exported_folds(directory: str | Path) -> list[Path]:
    """The fold models of a cross-fitted export in `directory`, in fold order (none for a single model)."""
    folds: list[Path] = []
    while (fold_export(directory, len(folds)) / "config.json").is_file():
        folds.append(fold_export(directory, len(folds)))
    return folds
