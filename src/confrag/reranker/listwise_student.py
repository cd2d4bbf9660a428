"""Students of a listwise teacher: the base reranker aligned to a target over each question's candidates.

The studies' base is a sentence-transformers bi-encoder (all-MiniLM-L6-v2) scoring a candidate by SCALE · cos(q, p);
in the rerank task it is the run's base reranker (`ListwiseData.scores`). Each student starts equal to it (a test
checks) and learns, over a question's list (`ListwiseData.top_k` restricts it to the base's top k),

    KL(softmax(target) ‖ softmax(f / τ)) + λ · KL(softmax(base / τ) ‖ softmax(f / τ)),

the teacher's distribution with an anchor keeping the student near the base (λ = 0: REPLUG LSR as published). τ
matters: softmax(base) at τ = 1 puts most of its mass on the base's top-1, so a flatter target asks mostly for
flatter scores and the anchor pins the top-1; τ matched to the teacher's spread asks for the order; `tau="learned"`
learns it (REPLUG tunes its γ) on a log scale at a rate of its own. One registered class per kind (`STUDENTS`):

- `query_tower`: REPLUG LSR's setting. The query encoder is fine-tuned; the passages' embeddings stay the base's
  (REPLUG keeps the document encoder fixed to spare re-indexing): a step encodes only the batch's questions.
- `residual_head`: the base frozen whole; f = base + w · SCALE · head(q ⊙ p) (zero at the start; w set at scoring).
- `residual_cross_encoder`: the base frozen; an encoder reads question and passage as one sequence into a
  zero-initialised head g (lr `head_lr`): f = base + w · SCALE · g.
- `cross_encoder`: the base reranker fine-tuned whole (the paper's kind; the studies' MiniLM bi-encoder, both towers).

The first two read the base's vectors (a bi-encoder base). `export` / `read` save and load any. Training: Lightning,
fixed optimizer steps, AdamW with linear warmup/decay (`module.build_optimizer`)."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import lightning as L
import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from confrag.infra import checks
from confrag.infra.atomic import swapped_in
from confrag.infra.digests import write_folder_digest
from confrag.reranker.bi_encoder import SCALE
from confrag.reranker.listwise_data import ListTarget, ListwiseData, list_batch
from confrag.reranker.listwise_trainer import train_student
from confrag.reranker.loss import listwise_kl
from confrag.reranker.module import build_optimizer
from confrag.reranker.pair_scorer import PairScorer
from confrag.retrieval.dense import MeanPoolEncoder
from confrag.retrieval.mean_pooling import mean_pool

# Lightning's precisions a student may train in: bf16 autocast is 2-3x faster on an AMX CPU; fp32 exact everywhere.
PRECISIONS = ("32-true", "bf16-mixed")
LEARNED = "learned"  # `tau`: the student's temperature learned rather than set
TAU_LR = 0.01  # the learned temperature's rate (on log τ, constant), whatever the weights' lr
CARD, WEIGHTS = "student.json", "student.safetensors"  # an exported student's settings and weights


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
    tau: float | str  # the student's temperature: f / τ; "learned": learned from 1
    anchor: float  # λ, the weight of KL(base ‖ student)
    seed: int
    # Whether the encoder's word embeddings train (11.7 M of MiniLM's 22.7 M weights: the part that lets a student
    # learn its training questions' words by heart rather than anything that carries to new questions).
    train_embeddings: bool
    # How many of the encoder's top layers train (None: all); the layers and embeddings below stay the base's, so a
    # cross-encoder still reads question and passage together in every layer, with no backward pass through them.
    train_layers: int | None
    precision: str
    # A fresh head's lr (None: lr): while it is zero the encoder gets no gradient, and at lr 1e-5-3e-5 Adam's ~lr a
    # step left the residual cross-encoder's correction < 0.1 logit after 150 steps (docs/results.md, fair study).
    head_lr: float | None = None
    # Whether the encoder trains with dropout (train mode, as sentence-transformers, FlagEmbedding and the pairwise rows
    # fine-tune); False: eval mode, as every fair-study student trained (a pretrained encoder arrives in eval mode).
    dropout: bool = False

    def identity(self) -> dict:
        """The settings as a cache key reads them: head_lr when set, dropout when on (older students are found)."""
        optional = {"head_lr": None, "dropout": False}
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in optional or v != optional[k]}

    def __post_init__(self) -> None:
        if self.student not in STUDENTS:
            raise ValueError(f"listwise student must be one of {sorted(STUDENTS)}; got {self.student!r}")
        checks.number(self.lr, "lr", 0, None, low_open=True)
        checks.positive_int(self.steps, "steps")
        checks.positive_int(self.batch_size, "batch_size")
        checks.number(self.warmup_ratio, "warmup_ratio", 0, 1, high_open=True)
        checks.number(self.weight_decay, "weight_decay", 0, None)
        if self.tau != LEARNED:
            checks.number(self.tau, "tau", 0, None, low_open=True, hint=f"(or {LEARNED!r})")
        checks.number(self.anchor, "anchor", 0, None)
        checks.flag(self.train_embeddings, "train_embeddings")
        checks.flag(self.dropout, "dropout")
        if self.train_layers is not None:
            checks.positive_int(self.train_layers, "train_layers")
            if self.train_embeddings:
                raise ValueError("train_embeddings=True with train_layers set: the embeddings lie below every layer, "
                                 "so they train only with train_layers=None (all layers)")  # fmt: skip
        checks.choice(self.precision, "precision", PRECISIONS)
        if self.head_lr is not None:
            checks.number(self.head_lr, "head_lr", 0, None, low_open=True, hint="(or None: lr)")
            if not STUDENTS[self.student].fresh_head:
                fresh = ", ".join(sorted(k for k, kind in STUDENTS.items() if kind.fresh_head))
                raise ValueError(f"head_lr is for a student with a fresh head ({fresh}), not {self.student!r}: None")


class ListwiseStudent(L.LightningModule, ABC):
    """f(q, candidates) for a batch of questions, trained on the anchored listwise KL. A kind implements `scores`."""

    weight_at_scoring: float = 1.0
    reads_vectors: ClassVar[bool] = False  # whether it reads the base's query and passage vectors (a bi-encoder's)
    exports_reranker: ClassVar[bool] = False  # whether its saved folder is the reranker's own (`CrossEncoder` loads)
    fresh_head: ClassVar[bool] = False  # whether it trains a zero-initialised `head` over a pretrained encoder
    residual: ClassVar[bool] = False  # f = base + w · correction: trains at w = 1, scores at `weight_at_scoring`

    def __init__(self, settings: ListwiseSettings) -> None:
        super().__init__()
        self.settings = settings
        self.log_tau = nn.Parameter(torch.zeros(())) if settings.tau == LEARNED else None

    @classmethod
    def build(cls, settings: ListwiseSettings, base: StudentBase) -> ListwiseStudent:  # a fresh one, equal to the base
        return cls(settings, MeanPoolEncoder(base.encoder_dir, device="cpu"))

    @abstractmethod
    def scores(self, batch: dict) -> torch.Tensor:
        """(B, N) scores of the batch's questions' candidates."""

    @property
    def temperature(self) -> float:  # τ as set, or as learned so far
        return float(self.log_tau.exp()) if self.log_tau is not None else float(self.settings.tau)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        s = self.settings
        f = self.scores(batch)
        if self.log_tau is None:
            loss = listwise_kl(f, batch["target"], batch["mask"], s.tau)
            if s.anchor > 0:
                loss = loss + s.anchor * listwise_kl(f, batch["base"] / s.tau, batch["mask"], s.tau)
        else:  # the same loss, τ a parameter: the target and the anchor get no gradient (listwise_kl detaches them)
            tau = self.log_tau.exp()
            loss = listwise_kl(f / tau, batch["target"], batch["mask"])
            if s.anchor > 0:
                loss = loss + s.anchor * listwise_kl(f / tau, batch["base"] / tau, batch["mask"])
        if not torch.isfinite(loss):
            raise FloatingPointError(f"listwise {s.student}: loss {loss.item()} at step {self.global_step}")
        self.log("train/loss", loss, batch_size=f.shape[0])
        return loss

    def configure_optimizers(self):
        s = self.settings
        if self.log_tau is not None:
            self.log_tau.requires_grad_(False)
        head = [p.requires_grad_(False) for p in self.head.parameters()] if s.head_lr is not None else []
        optimizer, scheduler = build_optimizer(self, s.lr, s.weight_decay, s.warmup_ratio, s.steps)
        lambdas = list(scheduler.lr_lambdas)
        for p in head:  # its own rate on the weights' schedule (the bias undecayed, as in build_optimizer)
            p.requires_grad_(True)
            optimizer.add_param_group({"params": [p], "lr": s.head_lr, "weight_decay": s.weight_decay * (p.dim() >= 2)})
            lambdas.append(lambdas[0])
        if self.log_tau is not None:  # a constant schedule for τ's
            self.log_tau.requires_grad_(True)
            optimizer.add_param_group({"params": [self.log_tau], "lr": TAU_LR, "weight_decay": 0.0})
            lambdas.append(lambda step: 1.0)
        if len(lambdas) > len(scheduler.lr_lambdas):
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambdas)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def autocast(self) -> contextlib.AbstractContextManager:
        """Scoring in the precision the student trained in."""
        if self.settings.precision == "bf16-mixed":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    @torch.no_grad()
    def score(self, data: ListwiseData, batch_size: int = 64) -> np.ndarray:
        """(Q, N) scores, -inf on padding, in eval mode."""
        was_training = self.training
        self.eval()
        out = []
        for start in range(0, len(data.questions), batch_size):
            rows = list(range(start, min(start + batch_size, len(data.questions))))
            batch = {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in list_batch(data, rows, None).items()}
            with self.autocast():
                out.append(self.scores(batch).float().cpu().numpy())
        self.train(was_training)
        scores = np.concatenate(out, axis=0) if out else np.zeros(data.mask.shape, dtype=np.float32)
        return np.where(data.mask, scores, -np.inf).astype(np.float32)

    def save(self, folder: Path) -> None:
        """Into `folder` (being built): the weights as `_write` puts them (`student.safetensors` unless the kind has
        its own format) and `student.json` (settings, w at scoring, τ)."""
        self._write(folder)
        card = {"settings": dataclasses.asdict(self.settings), "temperature": self.temperature}
        (folder / CARD).write_text(json.dumps({**card, "weight_at_scoring": self.weight_at_scoring}, indent=2))

    def export(self, directory: str | Path) -> Path:
        """`save` into a folder built beside `directory` with a digest, then swapped in (`load_student` in
        `confrag.reranker.aligned` reads it)."""
        directory = Path(directory)
        directory.parent.mkdir(parents=True, exist_ok=True)
        with swapped_in(directory) as tmp:
            self.save(tmp)
            write_folder_digest(tmp)
        return directory

    @classmethod
    def read(cls, folder: Path, base: StudentBase) -> ListwiseStudent:
        """A saved student of this kind (`save`), in eval mode; `base` as it was built from."""
        card = json.loads((Path(folder) / CARD).read_text())
        student = cls._read(Path(folder), ListwiseSettings(**card["settings"]), base)
        student.weight_at_scoring = float(card["weight_at_scoring"])
        return student.eval()

    def _write(self, folder: Path) -> None:
        save_file({k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()}, str(folder / WEIGHTS))

    @classmethod
    def _read(cls, folder: Path, settings: ListwiseSettings, base: StudentBase) -> ListwiseStudent:
        student = cls.build(settings, base)
        student.load_state_dict(load_file(str(folder / WEIGHTS)))
        return student


def _frozen_word_embeddings(encoder: nn.Module, settings: ListwiseSettings) -> nn.Module:
    """A copy of the base's encoder: word embeddings frozen unless `train_embeddings`, all below `train_layers` too."""
    return _frozen(copy.deepcopy(encoder).float(), settings)


def _frozen(encoder: nn.Module, settings: ListwiseSettings) -> nn.Module:
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

    reads_vectors = True

    def scores(self, batch: dict) -> torch.Tensor:
        tokens = self.tokenizer(
            batch["questions"], padding=True, truncation=True, max_length=self.max_length, return_tensors="pt"
        ).to(self.device)
        hidden = self.encoder(input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"]).last_hidden_state
        q = nn.functional.normalize(mean_pool(hidden, tokens["attention_mask"]).float(), dim=-1)
        return SCALE * torch.einsum("bd,bnd->bn", q, batch["passages"])


class ResidualHeadStudent(ListwiseStudent):
    """The base frozen; f = base + w · SCALE · (a · (q ⊙ p) + b), the head zero at the start. At SCALE, a = 1 on
    every dimension adds the base once more, so a step of the optimiser moves the score on the base's own scale."""

    reads_vectors = residual = True

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
    """The base frozen; f = base + w · SCALE · g(q, p), g a copy of a bi-encoder base's encoder (of the embedded
    all-MiniLM-L6-v2 when the base is a cross-encoder) reading "question [SEP] passage" as one sequence, mean-pooled,
    into a zero-initialised linear head. Only the candidates in the mask are read (the base's top k after
    `ListwiseData.top_k`), so a step costs k pairs a question."""

    fresh_head = residual = True

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
        ).to(self.device)
        hidden = self.encoder(**tokens).last_hidden_state
        g = self.head(mean_pool(hidden, tokens["attention_mask"])).squeeze(-1).float()
        correction = torch.zeros_like(base).index_put((rows, cols), g)
        w = self.weight_at_scoring if not self.training else 1.0
        return base + w * SCALE * correction


class CrossEncoderStudent(ListwiseStudent):
    """The base reranker fine-tuned whole (a copy: f = base at the start); its export is the reranker's own folder."""

    exports_reranker = True

    def __init__(self, settings: ListwiseSettings, reranker: PairScorer) -> None:
        super().__init__(settings)
        self.reranker = reranker
        self.model = reranker.model  # the weights, registered here so that they train and move with the student
        _frozen(getattr(self.model, getattr(self.model, "base_model_prefix", ""), self.model), settings)  # its encoder

    @classmethod
    def build(cls, settings: ListwiseSettings, base: StudentBase) -> ListwiseStudent:
        reranker = base.reranker or PairScorer.embedded()
        return cls(settings, dataclasses.replace(reranker, model=copy.deepcopy(reranker.model).float()))

    def scores(self, batch: dict) -> torch.Tensor:
        if batch["passage_texts"] is None:
            raise ValueError("cross_encoder: the listwise data has no passage_texts (it reads the passages)")
        mask = batch["mask"]
        rows, cols = mask.nonzero(as_tuple=True)
        out = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
        if len(rows) == 0:
            return out
        pairs = list(zip(rows.tolist(), cols.tolist()))
        queries, passages = [batch["questions"][r] for r, _ in pairs], [batch["passage_texts"][r][c] for r, c in pairs]
        return out.index_put((rows, cols), self.reranker.logits(queries, passages))

    def _write(self, folder: Path) -> None:
        self.reranker.export(folder)

    @classmethod
    def _read(cls, folder: Path, settings: ListwiseSettings, base: StudentBase) -> ListwiseStudent:
        return cls(settings, PairScorer.load(folder))  # τ is a training setting: scoring reads none


# kind -> class; each is built from the base (`StudentBase`) and starts equal to it.
STUDENTS: dict[str, type[ListwiseStudent]] = {
    "query_tower": QueryTowerStudent,
    "residual_head": ResidualHeadStudent,
    "residual_cross_encoder": ResidualCrossEncoderStudent,
    "cross_encoder": CrossEncoderStudent,
}


@dataclass(frozen=True)
class StudentBase:
    """What a student starts from: the bi-encoder folder the query tower and residual students copy, and the reranker
    `cross_encoder` fine-tunes (None: the embedded MiniLM bi-encoder, the studies' base)."""

    encoder_dir: Path | None = None
    reranker: PairScorer | None = None


def build_student(settings: ListwiseSettings, base: StudentBase | None = None) -> ListwiseStudent:
    """A fresh student equal to the base (by default the embedded MiniLM bi-encoder)."""
    return STUDENTS[settings.student].build(settings, base or StudentBase())


def fit_listwise(
    settings: ListwiseSettings,
    data: ListwiseData,
    targets: list[np.ndarray | ListTarget | None],
    base: StudentBase | None = None,
    accelerator: str = "cpu",
) -> ListwiseStudent:
    """A student trained on the questions that have a target, for `settings.steps` steps on `accelerator` (seeded:
    the same settings and data give the same student; `confrag.reranker.listwise_trainer`)."""
    return train_student(lambda: build_student(settings, base), settings, data, targets, accelerator)
