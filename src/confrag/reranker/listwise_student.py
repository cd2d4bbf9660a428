"""Students of a listwise teacher: the base bi-encoder aligned to a target over each question's candidates.

The base is a sentence-transformers bi-encoder (all-MiniLM-L6-v2) scoring a candidate by SCALE · cos(q, p). Each
student starts equal to it (a test checks) and learns, over a question's list (`ListwiseData.top_k` restricts it to
the base's top k),

    KL(softmax(target) ‖ softmax(f / τ)) + λ · KL(softmax(base / τ) ‖ softmax(f / τ)),

the teacher's distribution with an anchor keeping the student near the base (λ = 0: REPLUG LSR as published). The
student's temperature τ matters: softmax(base) at τ = 1 puts most of its mass on the base's top-1, so a target
flatter than that asks the student mostly to be flatter, and the anchor at τ = 1 pins the top-1; τ matched to the
teacher's spread asks for the order instead. One registered class per kind (`STUDENTS`):

- `query_tower`: REPLUG LSR's setting. The query encoder is fine-tuned; the passages' embeddings stay the frozen
  base's (REPLUG keeps the document encoder fixed to spare re-indexing), so one training step encodes only the
  batch's questions and a corpus index built with the base still serves the student.
- `residual_head`: the base frozen whole; a linear head on q ⊙ p (a diagonal bilinear correction, zero at the
  start) is added: f = base + w · SCALE · head, trained at w = 1, w chosen on dev at scoring time.
- `residual_cross_encoder`: the base frozen; a copy of its encoder reads question and passage together (one
  sequence, mean-pooled) into a zero-initialised linear head g: f = base + w · SCALE · g(q, p). It starts as the
  base and learns only the correction, and unlike the two above it can read the passage in the light of the
  question (an answer-typed span a frozen passage vector may not encode).

Training runs in Lightning for a fixed number of optimizer steps (matched across the rows a study compares), with
AdamW and a linear warmup/decay (`confrag.reranker.module.build_optimizer`, the reranker's own).
"""

from __future__ import annotations

import contextlib
import copy
import gc
import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader

from confrag.infra import checks
from confrag.infra.fit_progress import FitProgress
from confrag.reranker.bi_encoder import SCALE
from confrag.reranker.listwise_data import ListTarget, ListwiseData, list_batch, padded_in_list, padded_targets
from confrag.reranker.loss import listwise_kl
from confrag.reranker.module import build_optimizer
from confrag.retrieval.dense import MeanPoolEncoder
from confrag.retrieval.mean_pooling import mean_pool

# Lightning's precision names a student may train in: bf16 autocast runs the encoder 2-3x faster on a CPU with
# AMX (and on a GPU); fp32 is exact everywhere.
PRECISIONS = ("32-true", "bf16-mixed")


@dataclass(frozen=True)
class ListwiseSettings:
    """How a student trains. `steps` optimizer steps of `batch_size` questions, whatever the training set's size,
    so rows trained on different numbers of questions get the same updates."""

    student: str
    lr: float
    steps: int
    batch_size: int
    warmup_ratio: float
    weight_decay: float
    tau: float  # the student's temperature: f / τ
    anchor: float  # λ, the weight of KL(base ‖ student)
    seed: int
    # Whether the encoder's word embeddings train (11.7 M of MiniLM's 22.7 M weights: the part that lets a student
    # learn its training questions' words by heart rather than anything that carries to new questions).
    train_embeddings: bool
    # How many of the encoder's top transformer layers train (None: all). Below them, the layers and the embeddings
    # stay the base's: a cross-encoder then still reads question and passage together in every layer, and a step
    # costs no backward pass through the frozen ones (about half the seconds of a step on a CPU).
    train_layers: int | None
    precision: str

    def __post_init__(self) -> None:
        if self.student not in STUDENTS:
            raise ValueError(f"listwise student must be one of {sorted(STUDENTS)}; got {self.student!r}")
        checks.number(self.lr, "lr", 0, None, low_open=True)
        checks.positive_int(self.steps, "steps")
        checks.positive_int(self.batch_size, "batch_size")
        checks.number(self.warmup_ratio, "warmup_ratio", 0, 1, high_open=True)
        checks.number(self.weight_decay, "weight_decay", 0, None)
        checks.number(self.tau, "tau", 0, None, low_open=True)
        checks.number(self.anchor, "anchor", 0, None)
        checks.flag(self.train_embeddings, "train_embeddings")
        if self.train_layers is not None:
            checks.positive_int(self.train_layers, "train_layers")
            if self.train_embeddings:
                raise ValueError("train_embeddings=True with train_layers set: the embeddings lie below every layer, "
                                 "so they train only with train_layers=None (all layers)")  # fmt: skip
        checks.choice(self.precision, "precision", PRECISIONS)


class ListwiseStudent(L.LightningModule, ABC):
    """f(q, candidates) for a batch of questions, trained on the anchored listwise KL. A kind implements `scores`.
    A residual kind (f = base + w · correction) trains at w = 1 and scores at `weight_at_scoring` (chosen on dev);
    the others ignore it."""

    weight_at_scoring: float = 1.0

    def __init__(self, settings: ListwiseSettings) -> None:
        super().__init__()
        self.settings = settings

    @abstractmethod
    def scores(self, batch: dict) -> torch.Tensor:
        """(B, N) scores of the batch's questions' candidates."""

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        s = self.settings
        f = self.scores(batch)
        loss = listwise_kl(f, batch["target"], batch["mask"], s.tau)
        if s.anchor > 0:
            loss = loss + s.anchor * listwise_kl(f, batch["base"] / s.tau, batch["mask"], s.tau)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"listwise {s.student}: loss {loss.item()} at step {self.global_step}")
        self.log("train/loss", loss, batch_size=f.shape[0])
        return loss

    def configure_optimizers(self):
        s = self.settings
        optimizer, scheduler = build_optimizer(self, s.lr, s.weight_decay, s.warmup_ratio, s.steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def autocast(self) -> contextlib.AbstractContextManager:
        """Scoring in the precision the student trained in."""
        if self.settings.precision == "bf16-mixed":
            return torch.autocast("cpu", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    @torch.no_grad()
    def score(self, data: ListwiseData, batch_size: int = 64) -> np.ndarray:
        """(Q, N) scores, -inf on padding, in eval mode."""
        was_training = self.training
        self.eval()
        out = []
        for start in range(0, len(data.questions), batch_size):
            rows = list(range(start, min(start + batch_size, len(data.questions))))
            with self.autocast():
                out.append(self.scores(list_batch(data, rows, None)).float().numpy())
        self.train(was_training)
        scores = np.concatenate(out, axis=0) if out else np.zeros(data.mask.shape, dtype=np.float32)
        return np.where(data.mask, scores, -np.inf).astype(np.float32)


def _frozen_word_embeddings(encoder: nn.Module, settings: ListwiseSettings) -> nn.Module:
    """A copy of the base's encoder with what the settings keep frozen frozen: the word embeddings unless
    `train_embeddings`, and with `train_layers` every layer below the top ones and the embeddings."""
    encoder = copy.deepcopy(encoder).float()
    if not settings.train_embeddings:
        encoder.get_input_embeddings().weight.requires_grad_(False)
    if settings.train_layers is not None:
        layers = encoder.encoder.layer  # BERT-style encoders (MiniLM): embeddings, then encoder.layer[0..L)
        if settings.train_layers > len(layers):
            raise ValueError(f"train_layers={settings.train_layers}: the encoder has {len(layers)} layers")
        for module in [encoder.embeddings, *layers[: len(layers) - settings.train_layers]]:
            module.requires_grad_(False)
    return encoder


class QueryTowerStudent(ListwiseStudent):
    """REPLUG LSR: the query encoder (a copy of the base's) trained; passage vectors frozen."""

    def __init__(self, settings: ListwiseSettings, base: MeanPoolEncoder) -> None:
        super().__init__(settings)
        self.encoder = _frozen_word_embeddings(base.model, settings)
        self.tokenizer = base.tokenizer
        self.max_length = int(base.max_length)

    def scores(self, batch: dict) -> torch.Tensor:
        tokens = self.tokenizer(
            batch["questions"], padding=True, truncation=True, max_length=self.max_length, return_tensors="pt"
        )
        hidden = self.encoder(input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"]).last_hidden_state
        q = nn.functional.normalize(mean_pool(hidden, tokens["attention_mask"]).float(), dim=-1)
        return SCALE * torch.einsum("bd,bnd->bn", q, batch["passages"])


class ResidualHeadStudent(ListwiseStudent):
    """The base frozen; f = base + w · SCALE · (a · (q ⊙ p) + b), the head zero at the start. At SCALE, a = 1 on
    every dimension adds the base once more, so a step of the optimiser moves the score on the base's own scale."""

    def __init__(self, settings: ListwiseSettings, base: MeanPoolEncoder) -> None:
        super().__init__(settings)
        self.head = nn.Linear(base.model.config.hidden_size, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def scores(self, batch: dict) -> torch.Tensor:
        product = batch["query_vectors"][:, None, :] * batch["passages"]
        w = self.weight_at_scoring if not self.training else 1.0
        return batch["base"].masked_fill(~batch["mask"], 0.0) + w * SCALE * self.head(product).squeeze(-1).float()


class ResidualCrossEncoderStudent(ListwiseStudent):
    """The base frozen; f = base + w · SCALE · g(q, p), g a copy of the base's encoder reading "question [SEP]
    passage" as one sequence, mean-pooled, into a zero-initialised linear head. Only the candidates in the mask
    are read (the base's top k after `ListwiseData.top_k`), so a step costs k pairs a question."""

    def __init__(self, settings: ListwiseSettings, base: MeanPoolEncoder) -> None:
        super().__init__(settings)
        self.encoder = _frozen_word_embeddings(base.model, settings)
        self.tokenizer = base.tokenizer
        self.max_length = int(base.max_length)
        self.head = nn.Linear(base.model.config.hidden_size, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def scores(self, batch: dict) -> torch.Tensor:
        if batch["passage_texts"] is None:
            raise ValueError("residual_cross_encoder: the listwise data has no passage_texts (it reads the passages)")
        mask = batch["mask"]
        rows, cols = mask.nonzero(as_tuple=True)
        base = batch["base"].masked_fill(~mask, 0.0)
        if len(rows) == 0:
            return base
        tokens = self.tokenizer(
            [batch["questions"][r] for r in rows.tolist()],
            [batch["passage_texts"][r][c] for r, c in zip(rows.tolist(), cols.tolist())],
            padding=True,
            truncation="only_second",
            max_length=self.max_length,
            return_tensors="pt",
        )
        hidden = self.encoder(**tokens).last_hidden_state
        g = self.head(mean_pool(hidden, tokens["attention_mask"])).squeeze(-1).float()
        correction = torch.zeros_like(base).index_put((rows, cols), g)
        w = self.weight_at_scoring if not self.training else 1.0
        return base + w * SCALE * correction


# kind -> class; each is built from the base bi-encoder and starts equal to it.
STUDENTS: dict[str, type[ListwiseStudent]] = {
    "query_tower": QueryTowerStudent,
    "residual_head": ResidualHeadStudent,
    "residual_cross_encoder": ResidualCrossEncoderStudent,
}


def build_student(settings: ListwiseSettings, base_dir: str | Path | None = None) -> ListwiseStudent:
    """A fresh student equal to the base; `base_dir` is the bi-encoder's folder (None: the embedded MiniLM)."""
    return STUDENTS[settings.student](settings, MeanPoolEncoder(base_dir, device="cpu"))


def fit_listwise(
    settings: ListwiseSettings, data: ListwiseData, targets: list[np.ndarray | ListTarget | None], base_dir=None
) -> ListwiseStudent:
    """A student trained on the questions that have a target, for `settings.steps` steps (seeded: the same
    settings and data give the same student)."""
    if len(targets) != len(data.questions):
        raise ValueError(f"{len(targets)} targets for {len(data.questions)} questions")
    table, _ = padded_targets(targets, data.mask.shape[1])
    in_list = padded_in_list(targets, data.mask.shape[1])
    # A question trains where its target keeps a finite logit inside the data's mask (after `top_k`, a relevance
    # target whose own paragraph lies below the base's top k has none there).
    kept = [i for i in range(len(targets)) if np.isfinite(table[i][data.mask[i] & in_list[i]]).any()]
    if not kept:
        raise ValueError(f"listwise {settings.student}: no question has a target (nothing to train on)")
    L.seed_everything(settings.seed, workers=True, verbose=False)
    student = build_student(settings, base_dir)
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
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
        precision=settings.precision,
        callbacks=[FitProgress(f"listwise {settings.student}")],  # its steps, rate and time left in the log
    )
    try:
        trainer.fit(student, loader)
    finally:
        quiet.setLevel(level)
    # Drop the trainer (and through it the optimizer's state, twice the model's size): a study trains dozens of
    # students, and the module <-> trainer cycle would otherwise keep each one's state until a full collection.
    student.trainer = None
    del trainer
    gc.collect()
    return student.eval()
