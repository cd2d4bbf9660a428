"""Students of a listwise teacher: the base bi-encoder aligned to a target over each question's candidates.

The base is a sentence-transformers bi-encoder (all-MiniLM-L6-v2) scoring a candidate by SCALE · cos(q, p). Each
student starts equal to it (a test checks) and learns, over a question's whole list,

    KL(softmax(target) ‖ softmax(f / τ)) + λ · KL(softmax(base / τ) ‖ softmax(f / τ)),

the teacher's distribution with an anchor keeping the student near the base (λ = 0: REPLUG LSR as published).
One registered class per kind:

- `query_tower`: REPLUG LSR's setting. The query encoder is fine-tuned; the passages' embeddings stay the frozen
  base's (REPLUG keeps the document encoder fixed to spare re-indexing), so one training step encodes only the
  batch's questions and a corpus index built with the base still serves the student.
- `residual_head`: the base frozen whole; a linear head on q ⊙ p (a diagonal bilinear correction, zero at the
  start) is added: f = base + w · SCALE · head, trained at w = 1, w chosen on dev at scoring time.

Training runs in Lightning for a fixed number of optimizer steps (matched across the rows a study compares), with
AdamW and a linear warmup/decay (`confrag.reranker.module.build_optimizer`, the reranker's own).
"""

from __future__ import annotations

import copy
import gc
from abc import ABC, abstractmethod
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import lightning as L
import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader

from confrag.infra import checks
from confrag.infra.finite import require_finite
from confrag.infra.fit_progress import FitProgress
from confrag.reranker.bi_encoder import SCALE
from confrag.reranker.loss import listwise_kl
from confrag.reranker.module import build_optimizer
from confrag.retrieval.dense import MeanPoolEncoder
from confrag.retrieval.mean_pooling import mean_pool


@dataclass(frozen=True)
class ListTarget:
    """A target that also leaves candidates out of the list the student is scored over (`in_list` False): a
    candidate the teacher can call neither positive nor negative (for `utility`: an answer-bearing candidate the LLM
    failed under, one never answered), which a -inf logit would instead push down as a negative. A plain array of
    logits is a target with every candidate in the list."""

    logits: np.ndarray
    in_list: np.ndarray

    def __post_init__(self) -> None:
        if np.shape(self.logits) != np.shape(self.in_list):
            raise ValueError(f"ListTarget: logits {np.shape(self.logits)} and in_list {np.shape(self.in_list)} differ")
        if not np.any(np.isfinite(self.logits) & self.in_list):
            raise ValueError("ListTarget: no candidate in the list has a finite logit (nothing to learn)")


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


@dataclass(frozen=True)
class ListwiseData:
    """Questions with their candidates' frozen base embeddings, padded to the longest list.

    `query_vectors` (Q, d) and `passage_vectors` (Q, N, d) are the base's unit vectors; `mask` (Q, N) is False on
    padding. The base's score is SCALE · q · p."""

    questions: list[str]
    query_vectors: np.ndarray
    passage_vectors: np.ndarray
    mask: np.ndarray

    def __post_init__(self) -> None:
        q, n = self.mask.shape
        if len(self.questions) != q or self.query_vectors.shape[0] != q or self.passage_vectors.shape[:2] != (q, n):
            raise ValueError(
                f"listwise data: {len(self.questions)} questions, query vectors {self.query_vectors.shape}, passage "
                f"vectors {self.passage_vectors.shape} and mask {self.mask.shape} disagree"
            )
        require_finite(self.passage_vectors, stage="listwise data", artifact="passage vectors")
        require_finite(self.query_vectors, stage="listwise data", artifact="query vectors")

    @classmethod
    def from_lists(cls, questions: list[str], query_vectors: np.ndarray, passages: list[np.ndarray]) -> ListwiseData:
        """From each question's (candidates, d) passage vectors, of any lengths."""
        width = max((len(p) for p in passages), default=0)
        dim = query_vectors.shape[1]
        padded = np.zeros((len(passages), width, dim), dtype=np.float32)
        mask = np.zeros((len(passages), width), dtype=bool)
        for i, p in enumerate(passages):
            padded[i, : len(p)] = p
            mask[i, : len(p)] = True
        return cls(list(questions), np.asarray(query_vectors, dtype=np.float32), padded, mask)

    @cached_property
    def base_scores(self) -> np.ndarray:
        """SCALE · cos(q, p), -inf on padding."""
        scores = SCALE * np.einsum("qd,qnd->qn", self.query_vectors, self.passage_vectors)
        return np.where(self.mask, scores, -np.inf).astype(np.float32)

    def subset(self, rows: list[int]) -> ListwiseData:
        return ListwiseData(
            [self.questions[i] for i in rows], self.query_vectors[rows], self.passage_vectors[rows], self.mask[rows]
        )


class ListwiseStudent(L.LightningModule, ABC):
    """f(q, candidates) for a batch of questions, trained on the anchored listwise KL. A kind implements `scores`."""

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

    @torch.no_grad()
    def score(self, data: ListwiseData, batch_size: int = 64) -> np.ndarray:
        """(Q, N) scores, -inf on padding, in eval mode."""
        was_training = self.training
        self.eval()
        out = []
        for start in range(0, len(data.questions), batch_size):
            rows = list(range(start, min(start + batch_size, len(data.questions))))
            out.append(self.scores(_batch(data, rows, None)).float().numpy())
        self.train(was_training)
        scores = np.concatenate(out, axis=0) if out else np.zeros(data.mask.shape, dtype=np.float32)
        return np.where(data.mask, scores, -np.inf).astype(np.float32)


class QueryTowerStudent(ListwiseStudent):
    """REPLUG LSR: the query encoder (a copy of the base's) trained; passage vectors frozen."""

    def __init__(self, settings: ListwiseSettings, encoder: nn.Module, tokenizer, max_length: int) -> None:
        super().__init__(settings)
        self.encoder = copy.deepcopy(encoder).float()
        self.tokenizer = tokenizer
        self.max_length = int(max_length)

    def scores(self, batch: dict) -> torch.Tensor:
        tokens = self.tokenizer(
            batch["questions"], padding=True, truncation=True, max_length=self.max_length, return_tensors="pt"
        )
        hidden = self.encoder(input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"]).last_hidden_state
        q = nn.functional.normalize(mean_pool(hidden, tokens["attention_mask"]), dim=-1)
        return SCALE * torch.einsum("bd,bnd->bn", q, batch["passages"])


class ResidualHeadStudent(ListwiseStudent):
    """The base frozen; f = base + w · SCALE · (a · (q ⊙ p) + b), the head zero at the start. At SCALE, a = 1 on
    every dimension adds the base once more, so a step of the optimiser moves the score on the base's own scale."""

    def __init__(self, settings: ListwiseSettings, dim: int) -> None:
        super().__init__(settings)
        self.head = nn.Linear(dim, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)
        self.weight_at_scoring = 1.0

    def scores(self, batch: dict) -> torch.Tensor:
        product = batch["query_vectors"][:, None, :] * batch["passages"]
        w = self.weight_at_scoring if not self.training else 1.0
        return batch["base"].masked_fill(~batch["mask"], 0.0) + w * SCALE * self.head(product).squeeze(-1)


STUDENTS = {"query_tower": QueryTowerStudent, "residual_head": ResidualHeadStudent}


def _batch(data: ListwiseData, rows: list[int], targets: np.ndarray | None, in_list: np.ndarray | None = None) -> dict:
    base = data.base_scores[rows]
    # Training scores a question over the candidates its target keeps in the list; scoring, over all of them.
    mask = torch.from_numpy(data.mask[rows] & (in_list[rows] if in_list is not None else True))
    batch = {
        "questions": [data.questions[i] for i in rows],
        "query_vectors": torch.from_numpy(data.query_vectors[rows]),
        "passages": torch.from_numpy(data.passage_vectors[rows]),
        "mask": mask,
        "base": torch.from_numpy(np.where(data.mask[rows], base, 0.0).astype(np.float32)),
    }
    if targets is not None:
        batch["target"] = torch.from_numpy(np.where(data.mask[rows], targets[rows], -np.inf).astype(np.float32))
    return batch


def padded_targets(targets: list[np.ndarray | ListTarget | None], width: int) -> tuple[np.ndarray, list[int]]:
    """(Q, width) target logits (-inf on padding, on a question without target and on a candidate its target
    leaves out of the list) and the questions that have one."""
    out = np.full((len(targets), width), -np.inf, dtype=np.float32)
    kept = []
    for i, t in enumerate(targets):
        if isinstance(t, ListTarget):
            out[i, : len(t.logits)] = np.where(t.in_list, t.logits, -np.inf)
            kept.append(i)
        elif t is not None:
            out[i, : len(t)] = t
            kept.append(i)
    return out, kept


def padded_in_list(targets: list[np.ndarray | ListTarget | None], width: int) -> np.ndarray:
    """(Q, width): False where a target leaves a candidate out of the list (padding is data.mask's to drop)."""
    out = np.ones((len(targets), width), dtype=bool)
    for i, t in enumerate(targets):
        if isinstance(t, ListTarget):
            out[i, : len(t.in_list)] = t.in_list
    return out


def build_student(settings: ListwiseSettings, base_dir: str | Path | None = None) -> ListwiseStudent:
    """A fresh student equal to the base; `base_dir` is the bi-encoder's folder (query_tower only)."""
    encoder = MeanPoolEncoder(base_dir, device="cpu")
    if settings.student == "residual_head":
        return ResidualHeadStudent(settings, encoder.model.config.hidden_size)
    return QueryTowerStudent(settings, encoder.model, encoder.tokenizer, encoder.max_length)


def fit_listwise(
    settings: ListwiseSettings, data: ListwiseData, targets: list[np.ndarray | ListTarget | None], base_dir=None
) -> ListwiseStudent:
    """A student trained on the questions that have a target, for `settings.steps` steps (seeded: the same
    settings and data give the same student)."""
    if len(targets) != len(data.questions):
        raise ValueError(f"{len(targets)} targets for {len(data.questions)} questions")
    table, kept = padded_targets(targets, data.mask.shape[1])
    in_list = padded_in_list(targets, data.mask.shape[1])
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
        collate_fn=lambda rows: _batch(data, list(rows), table, in_list),
    )
    trainer = L.Trainer(
        max_steps=settings.steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
        callbacks=[FitProgress(f"listwise {settings.student}")],  # its steps, rate and time left in the log
    )
    trainer.fit(student, loader)
    # Drop the trainer (and through it the optimizer's state, twice the model's size): a study trains dozens of
    # students, and the module <-> trainer cycle would otherwise keep each one's state until a full collection.
    student.trainer = None
    del trainer
    gc.collect()
    return student.eval()
