"""The fixed-steps Lightning fit every listwise student trains with (`confrag.reranker.listwise_student.fit_listwise`):
the questions that have a target, shuffled by the student's seed, `steps` optimizer steps of `batch_size`
questions, on the CPU or a GPU, Lightning's per-fit notices kept below WARNING, the trainer dropped afterwards."""

from __future__ import annotations

import gc
import logging
import warnings
from collections.abc import Callable
from typing import Any

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader

from confrag.infra.fit_progress import FitProgress
from confrag.reranker.listwise_data import (
    ListTarget,
    ListwiseData,
    list_batch,
    padded_in_list,
    padded_targets,
    with_target,
)


def train_student(
    build: Callable[[], L.LightningModule],
    settings: Any,
    data: ListwiseData,
    targets: list[np.ndarray | ListTarget | None],
    accelerator: str = "cpu",
) -> L.LightningModule:
    """The student `build()` makes (called once the global RNG is seeded from `settings.seed`), trained on the
    questions of `data` that have a target in `targets`, in eval mode."""
    if len(targets) != len(data.questions):
        raise ValueError(f"{len(targets)} targets for {len(data.questions)} questions")
    table, _ = padded_targets(targets, data.mask.shape[1])
    in_list = padded_in_list(targets, data.mask.shape[1])
    kept = with_target(table, data.mask, in_list)
    if not kept:
        raise ValueError(f"listwise {settings.student}: no question has a target (nothing to train on)")
    L.seed_everything(settings.seed, workers=True, verbose=False)
    student = build()
    if settings.dropout:
        student.train()  # every module, the pretrained encoder's dropout included (it arrives in eval mode)
    generator = torch.Generator().manual_seed(settings.seed)
    loader = DataLoader(
        kept,
        batch_size=min(settings.batch_size, len(kept)),
        shuffle=True,
        generator=generator,
        drop_last=len(kept) >= settings.batch_size,
        collate_fn=lambda rows: list_batch(data, list(rows), table, in_list),
    )
    # A study trains dozens of students: Lightning's per-fit notices (devices, tips, "max_steps reached") would bury
    # the study's own log, so they are kept below WARNING while a student fits.
    quiet = logging.getLogger("lightning.pytorch")
    level = quiet.level
    quiet.setLevel(logging.WARNING)
    trainer = L.Trainer(
        max_steps=settings.steps,
        accelerator=accelerator,
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        # On a GPU some kernels have no deterministic form: warned there rather than refused.
        deterministic=True if accelerator == "cpu" else "warn",
        precision=settings.precision,
        callbacks=[FitProgress(f"listwise {settings.student}")],  # its steps, rate and time left in the log
    )
    try:
        with warnings.catch_warnings():
            if not settings.dropout:  # eval mode is the setting's meaning (ListwiseSettings.dropout), not a slip
                warnings.filterwarnings("ignore", message=r"Found \d+ module\(s\) in eval mode", category=Warning)
            trainer.fit(student, loader)
    finally:
        quiet.setLevel(level)
    # Drop the trainer (and through it the optimizer's state, twice the model's size): a study trains dozens of
    # students, and the module <-> trainer cycle would otherwise keep each one's state until a full collection.
    student.trainer = None
    del trainer
    gc.collect()
    return student.eval()
