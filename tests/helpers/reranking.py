"""What the reranker tests share: a quiet CPU trainer for a few steps, and the group InfoNCE loss a module gives
a set of rows (to check that training lowered it)."""

from __future__ import annotations

import torch
from lightning import Trainer

from confrag.reranker.data import GroupDataset
from confrag.reranker.loss import group_infonce


def fast_trainer(max_steps: int, callbacks=None) -> Trainer:
    return Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=callbacks,
    )


def mean_group_loss(module, rows: list[dict], group_size: int = 3) -> float:
    """The module's group InfoNCE over the rows' seeded groups (dropout off)."""
    dataset = GroupDataset(rows, group_size, seed=0)
    items = [dataset[i] for i in range(len(dataset))]
    scores = module.score(
        [it["query"] for it in items for _ in it["passages"]], [p for it in items for p in it["passages"]]
    )
    return float(group_infonce(torch.from_numpy(scores).view(len(items), group_size), module.settings.tau))
