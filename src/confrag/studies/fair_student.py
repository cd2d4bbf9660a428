"""The fair-student study: students of ℓ that can move, chosen on dev, cross-fitted, with controls that move.

The design (docs/results.md, "A fair student of ℓ", fixed before any student was trained) in code: every student
reorders the base's top `TOP_K` candidates, trained on KL(softmax(ℓ/τ_T) ‖ softmax(f/τ)) + λ·KL(softmax(base/τ) ‖
softmax(f/τ)) over them, the student's τ on the dev grid (so the loss asks for the teacher's order rather than
for flatter scores, and the anchor no longer pins the top-1), word embeddings frozen. Rows:

- `residual_ce` (primary): f = base + w·SCALE·g(q, p), g a MiniLM cross-encoder with a zero-initialised head;
- `tower`: REPLUG LSR's query tower at a matched temperature;
- `residual_head`: the frozen base with a zero-initialised head on q ⊙ p, its lr on dev.

Dev (never trained on) chooses each row's settings on its Top-1 has_answer with fold 0's students; a tie keeps
the earlier setting of the grid (the smaller change). The controls train fold 0's students at settings that move
the top-1 and measure them where they trained and held out.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import cached_property

import numpy as np

from confrag.reranker import listwise_fit
from confrag.reranker.listwise_data import ListwiseData
from confrag.reranker.listwise_fit import StudyParts
from confrag.reranker.listwise_student import ListwiseSettings
from confrag.reranker.listwise_teachers import TeacherInputs
from confrag.studies.likelihood_study import Folds, Outcomes, Study, top1
from confrag.studies.trained_students import StudentStore, Trained

log = logging.getLogger(__name__)

TOP_K = 5
SEEDS = 3
# The training every student gets; the rows differ in student kind and in what dev chooses.
TRAINING = ListwiseSettings(
    student="query_tower", lr=1e-5, steps=150, batch_size=16, warmup_ratio=0.1, weight_decay=0.01, tau=1.0,
    anchor=1.0, seed=0, train_embeddings=False, train_layers=None, precision="32-true",
)  # fmt: skip
# The cross-encoder's own training (compute on a CPU, fixed before its run): its top 2 of 6 layers and head train
# (it reads question and passage together in every layer; the frozen ones need no backward pass), in bf16 autocast.
CROSS_ENCODER = {"train_layers": 2, "precision": "bf16-mixed"}
# Dev grids, the smaller change first in each (lower lr, larger λ, smaller w): a tie keeps the earlier setting.
TOWER_GRID = {"lr": (1e-5, 3e-5), "anchor": (1.0, 0.1), "tau": (1.0, 4.0, 8.0), "teacher_tau": (2.0, 0.5)}
# The residual cross-encoder's grid as amended before any test row was read: at lr 1e-5 and 3e-5 for every weight its
# zero-initialised head stayed near zero (a correction under 0.1 logit, no dev top-1 moved at any of the 12 points of
# the first grid), so its head trains at a rate of its own and the encoder at the larger of the two (docs/results.md).
CE_LR = 3e-5
CE_GRID = {"head_lr": (1e-3, 1e-2), "anchor": (1.0, 0.1)}
HEAD_GRID = {"lr": (1e-3, 1e-2, 1e-1)}
WEIGHTS = (0.5, 1.0, 2.0)  # w of a residual student at scoring
# The controls: fold 0's students at λ = 0 and learning rates that move the top-1, on ℓ with every training
# question and with `SMALL_TRAIN` of them (the learning curve), and on perfect relevance.
CONTROL_LRS = (3e-5, 1e-4)
SMALL_TRAIN = 400
FUSION_WEIGHT = 0.25  # z(base) + w·z(ℓ): the weight the teacher study's dev chose


@dataclass(frozen=True)
class Choice:
    """One row's dev-chosen settings: the student's training and w at scoring (1 for the tower)."""

    settings: ListwiseSettings
    teacher_tau: float
    weight: float
    dev_has_answer: float


@dataclass
class FairInputs:
    """Everything the rows read: the study, its ℓ, the base's vectors cut to the top k, folds and answers, and where
    the trained students are kept (the study resumes from them)."""

    study: Study
    ell: list[np.ndarray]
    data: ListwiseData  # already cut to the base's top TOP_K
    folds: Folds
    outcomes: Outcomes
    store: StudentStore
    training: ListwiseSettings = TRAINING
    cross_encoder: dict = field(default_factory=lambda: dict(CROSS_ENCODER))
    dev_log: list[dict] = field(default_factory=list)

    @cached_property
    def parts(self) -> StudyParts:
        sets = self.study.candidate_sets
        return StudyParts(sets, self.ell, self.data, [TeacherInputs(c, e) for c, e in zip(sets, self.ell)])


def train(inputs: FairInputs, settings: ListwiseSettings, teacher: str, teacher_tau: float, rows: list[int]) -> Trained:
    """A student of `teacher` trained on `rows` (positions in the study), or read back from the store."""

    def fit():
        return listwise_fit.train(settings, teacher, teacher_tau, inputs.parts, rows)[0]

    return inputs.store.get(settings, teacher, teacher_tau, rows, fit)


def has_answer(inputs: FairInputs, at: list[int], scores: np.ndarray) -> float:
    """Top-1 has_answer of `scores` (aligned with `at`) through the answer cache."""
    picks = [int(np.argmax(s)) for s in scores]
    return float(np.mean([o.has_answer for o in inputs.outcomes(at, picks)]))


def _dev(inputs: FairInputs, row: str, settings: ListwiseSettings, teacher_tau: float, weights=(1.0,)) -> list:
    """One grid point on dev: the fold-0 student, scored at each w; (dev has_answer, w) per w, logged."""
    dev_at = inputs.study.dev_at
    student = train(inputs, settings, "likelihood", teacher_tau, inputs.folds.training(0))
    out, base = [], top1(inputs.data.base_scores, dev_at)
    for w in weights:
        scores = student.at(dev_at, w)
        right = has_answer(inputs, dev_at, scores)
        # the share of dev top-1s it moves from the base's (no answer read): a point that moves none is no test
        moved = float(np.mean([int(np.argmax(s)) != b for s, b in zip(scores, base)]))
        entry = {"row": row, "lr": settings.lr, "head_lr": settings.head_lr, "anchor": settings.anchor,
                 "tau": settings.tau, "teacher_tau": teacher_tau, "w": w, "dev_has_answer": right,
                 "dev_moved": moved}  # fmt: skip
        inputs.dev_log.append(entry)
        log.info("dev %s: %s", row, entry)
        out.append((right, w))
    return out


def choose(inputs: FairInputs, row: str, points, weights=(1.0,)) -> Choice:
    """The grid point (settings, τ_T) with the best dev has_answer; a tie keeps the earlier one."""
    best = None
    for settings, teacher_tau in points:
        for right, w in _dev(inputs, row, settings, teacher_tau, weights):
            if best is None or right > best.dev_has_answer:
                best = Choice(settings, teacher_tau, w, right)
    return best


def choose_all(inputs: FairInputs) -> dict[str, Choice]:
    """Dev's choice for each row: the tower's τ, τ_T, λ, lr first; the cross-encoder and the head at its τ, τ_T."""
    t = inputs.training
    tower_points = [
        (replace(t, lr=lr, anchor=anchor, tau=tau), tau_t)
        for lr, anchor, tau, tau_t in itertools.product(*TOWER_GRID.values())
    ]
    tower = choose(inputs, "tower", tower_points)
    matched = tower.settings
    ce = inputs.cross_encoder
    ce_points = [
        (
            replace(matched, student="residual_cross_encoder", lr=CE_LR, head_lr=head_lr, anchor=anchor, **ce),
            tower.teacher_tau,
        )
        for head_lr, anchor in itertools.product(*CE_GRID.values())
    ]
    head_points = [
        (replace(matched, student="residual_head", lr=lr, weight_decay=0.0), tower.teacher_tau)
        for (lr,) in itertools.product(*HEAD_GRID.values())
    ]
    return {
        "residual_ce": choose(inputs, "residual_ce", ce_points, WEIGHTS),
        "tower": tower,
        "residual_head": choose(inputs, "residual_head", head_points, WEIGHTS),
    }


def agreement(inputs: FairInputs, teacher: str, at: list[int], scores: np.ndarray) -> float:
    """For ℓ: the share of `at` whose top-1 is ℓ's top-1 over every candidate (the design's measure); for
    relevance: the own paragraph first, of the questions whose own paragraph was retrieved."""
    return listwise_fit.agreement(listwise_fit.measure_of(teacher), inputs.parts, at, scores)


@dataclass(frozen=True)
class CrossFitted:
    """Each row's scores over the test questions, per seed, and its fit per fold (seed 0)."""

    scores: dict[str, list[np.ndarray]]  # row -> per seed, (questions, candidates), -inf where not scored
    fits: list[dict]  # per row and fold: agreement with ℓ's top-1 where it trained and held out, the base's beside
    students: dict[str, Trained]  # each row's fold-0, seed-0 student (`.load()`: for questions outside the study)


def cross_fit(inputs: FairInputs, chosen: dict[str, Choice], seeds: int = SEEDS, progress: Callable = log.info):
    data, folds = inputs.data, inputs.folds
    n_seeds = {"residual_ce": seeds, "tower": seeds, "residual_head": 1}
    scores = {row: [np.full(data.mask.shape, -np.inf, dtype=np.float32) for _ in range(n)] for row, n in
              n_seeds.items()}  # fmt: skip
    fits, students, start = [], {}, time.time()
    for k, fold in enumerate(folds.folds):
        rows = folds.training(k)
        for row, choice in chosen.items():
            for seed in range(n_seeds[row]):
                student = train(inputs, replace(choice.settings, seed=seed), "likelihood", choice.teacher_tau, rows)
                scores[row][seed][fold] = student.at(fold, choice.weight)
                if seed:
                    continue
                if k == 0:
                    students[row] = student
                fits.append({
                    "row": row, "fold": k,
                    "trained": agreement(inputs, "likelihood", rows, student.at(rows, choice.weight)),
                    "trained_base": agreement(inputs, "likelihood", rows, data.base_scores[rows]),
                    "held_out": agreement(inputs, "likelihood", fold, scores[row][0][fold]),
                    "held_out_base": agreement(inputs, "likelihood", fold, data.base_scores[fold]),
                })  # fmt: skip
        progress(f"fold {k + 1} of {len(folds.folds)} trained ({time.time() - start:.0f} s)")
    return CrossFitted(scores, fits, students)


@dataclass(frozen=True)
class Control:
    """One control: fold 0's student of `row` at λ = 0 and `lr` on `teacher`, with every training question or
    `at_most` of them; `tau` / `teacher_tau` the row's dev choice unless set (amendment 2's fit checks set them)."""

    row: str
    teacher: str
    lr: float
    at_most: int | None = None
    tau: float | None = None
    teacher_tau: float | str | None = None  # MATCHED: `matched_teacher_tau` at the control's τ
    label: str = ""  # how the docs name it (amendment 2's fit checks)

    @property
    def name(self) -> str:
        cap = f", at most {self.at_most} questions" if self.at_most else ""
        return f"{self.label + ': ' if self.label else ''}{self.row} on {self.teacher}, lr {self.lr:g}{cap}"


MATCHED = "matched"
# The design's controls: both students, on ℓ with every training question and SMALL_TRAIN of them, and on relevance.
CONTROLS = tuple(
    Control(row, teacher, lr, at_most)
    for row, (teacher, at_most), lr in itertools.product(
        ("residual_ce", "tower"), [("likelihood", None), ("likelihood", SMALL_TRAIN), ("relevance", None)], CONTROL_LRS
    )
)
# Amendment 2 (docs/results.md): can the residual cross-encoder fit a top-1 at all? Relevance at τ 1, the one-hot
# target's own spread, and ℓ sharpened to the same spread (τ_T matched to the base's top-1 mass at τ 1).
FIT_CHECKS = (
    Control("residual_ce", "relevance", 3e-5, tau=1.0, label="amendment 2 (a)"),
    Control("residual_ce", "likelihood", 3e-5, tau=1.0, teacher_tau=MATCHED, label="amendment 2 (b)"),
)


def top1_mass(logits: np.ndarray) -> float:
    """softmax(logits)'s largest probability."""
    z = np.exp(logits - np.max(logits))
    return float(z.max() / z.sum())


def matched_teacher_tau(inputs: FairInputs, rows: list[int], tau: float) -> float:
    """τ_T at which softmax(ℓ / τ_T)'s median top-1 mass over each question's scored candidates (the base's top k)
    equals softmax(base / τ)'s: the teacher as peaked as the student starts (bisection on log τ_T; 3 digits)."""
    data = inputs.data

    def median_mass(values, scale: float) -> float:
        return float(np.median([top1_mass(v[data.mask[i][: len(v)]] / scale) for i, v in zip(rows, values)]))

    goal = median_mass([data.base_scores[i] for i in rows], tau)
    ell = [inputs.ell[i] for i in rows]
    low, high = np.log(1e-3), np.log(1e3)  # the mass falls as τ_T rises
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if median_mass(ell, float(np.exp(mid))) > goal else (low, mid)
    return float(f"{np.exp((low + high) / 2):.3g}")


def controls(
    inputs: FairInputs, chosen: dict[str, Choice], specs=CONTROLS, progress: Callable = log.info
) -> list[dict]:
    """Each control of `specs` (fold 0's student at λ = 0): where it trained and held out, beside the base, in its
    teacher's measure and in its own training loss (KL at its τ over the base's top k), with the share of its training
    questions whose top-1 moved from the base's (a control that moves nothing is no test)."""
    data, folds = inputs.data, inputs.folds
    held = folds.folds[0]
    out = []
    for spec in specs:
        choice = chosen[spec.row]
        rows = folds.training(0, spec.at_most)
        tau = choice.settings.tau if spec.tau is None else spec.tau
        if spec.teacher_tau == MATCHED:
            tau_t = matched_teacher_tau(inputs, rows, tau)
        else:
            tau_t = choice.teacher_tau if spec.teacher_tau is None else spec.teacher_tau
        settings = replace(choice.settings, lr=spec.lr, anchor=0.0, seed=0, tau=tau)
        student = train(inputs, settings, spec.teacher, tau_t, rows)
        fitted, held_scores = student.at(rows, choice.weight), student.at(held, choice.weight)
        scored = data.mask[rows]  # the candidates it scores (-inf elsewhere, for the base as for it)

        def loss(at: list[int], scores: np.ndarray, teacher=spec.teacher, tau_t=tau_t, tau=tau) -> float:
            return listwise_fit.listwise_loss(teacher, tau_t, tau, inputs.parts, at, scores)

        out.append({
            "row": spec.row, "teacher": spec.teacher, "lr": spec.lr, "tau": tau, "teacher_tau": tau_t,
            "training_questions": len(rows), "name": spec.name,
            "trained": agreement(inputs, spec.teacher, rows, fitted),
            "trained_base": agreement(inputs, spec.teacher, rows, data.base_scores[rows]),
            "held_out": agreement(inputs, spec.teacher, held, held_scores),
            "held_out_base": agreement(inputs, spec.teacher, held, data.base_scores[held]),
            "loss_trained": loss(rows, fitted), "loss_trained_base": loss(rows, data.base_scores[rows]),
            "loss_held_out": loss(held, held_scores), "loss_held_out_base": loss(held, data.base_scores[held]),
            "moved_where_trained": float(np.mean(
                [a != b for a, b in zip(top1(fitted, range(len(rows))), top1(data.base_scores[rows], range(len(rows))))]
            )),
            "mean_correction": float(np.mean(np.abs(fitted[scored] - data.base_scores[rows][scored]))),
        })  # fmt: skip
        progress(f"control {out[-1]}")
    return out
