"""Choosing and diagnosing listwise students on a study's questions: the dev choice over a grid, and whether a
student learned its teacher (where it trained) and whether that carries (held out), up to its capacity.

- `choose_on_dev(points, score)`: the grid point with the best dev score, a tie keeping the earlier point (a grid
  is ordered smallest change first, so a tie goes to the setting nearer the base);
- `agreement(measure, ...)`: a student's fit to its teacher on some questions, measured as the teacher sees it:
  `likelihood` the share whose top-1 is ℓ's top-1, `relevance` the own paragraph first (of the questions whose own
  paragraph was retrieved), `utility` the top-1 answered right under (from the answer labels);
- `fit_lines`: each row's cross-fitted students on the questions they trained on against held out, beside the
  base on the same questions (the learning-curve row, fewer training questions at the same steps, is one of them);
- `capacity_curve`: one fold's students pushed harder and harder toward their teacher (λ = 0, rising lr and
  steps), each measured where it trained and held out: a student that cannot fit even where it trained lacks
  capacity; one that fits there and not held out lacks questions, or the target does not generalise.

`experiments/likelihood_training.py` is their command line on the likelihood study (`confrag.studies`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import numpy as np
import torch

from confrag.reranker.listwise_data import ListwiseData, padded_in_list, padded_targets, with_target
from confrag.reranker.listwise_student import ListwiseSettings, ListwiseStudent, fit_listwise
from confrag.reranker.listwise_teachers import TeacherInputs, teacher_targets
from confrag.reranker.loss import listwise_kl
from confrag.retrieval.candidates import Candidates

P = TypeVar("P")
# The capacity curve's (lr, steps), mildest first.
CAPACITY = ((3e-6, 150), (3e-5, 150), (1e-4, 600))
# What each row's fit is measured as, by the row's name (a row named otherwise is a student of ℓ).
MEASURES = {"relevance": "relevance", "utility": "utility"}
MEASURE_WORDS = {"likelihood": "= ℓ's top-1", "relevance": "own ¶ first", "utility": "top-1 answered right"}


@dataclass(frozen=True)
class StudyParts:
    """What every training and fit of one study reads, by position in the study: the questions' candidates, ℓ over
    them, the listwise data (the base's vectors and scores), each question's teacher inputs, and the answer labels
    of the `utility` measure (None when the study has none)."""

    sets: Sequence[Candidates]
    ell: Sequence[np.ndarray]
    data: ListwiseData
    inputs: Sequence[TeacherInputs]
    utility: Sequence[np.ndarray] | None = None


def measure_of(row: str) -> str:
    """The measure a row's fit is read in: its teacher's (`lsr`, `lsr_small` and the others: ℓ's top-1)."""
    return MEASURES.get(row, "likelihood")


def train(
    settings: ListwiseSettings, teacher: str, tau_t: float, parts: StudyParts, rows: list[int]
) -> tuple[ListwiseStudent, int]:
    """A student of `teacher` trained on the study's questions `rows`, and how many of them had no target."""
    targets, missing = teacher_targets(teacher, [parts.inputs[i] for i in rows], tau_t)
    return fit_listwise(settings, parts.data.subset(rows), targets), missing


def listwise_loss(
    teacher: str, tau_t: float, tau: float, parts: StudyParts, rows: list[int], scores: np.ndarray
) -> float:
    """The loss a student of `teacher` trains on without its anchor, KL(softmax(target / τ_T) ‖ softmax(f / τ)), of
    `scores` (aligned with `rows`) over the data's mask, averaged over the questions that have a target there."""
    targets, _ = teacher_targets(teacher, [parts.inputs[i] for i in rows], tau_t)
    mask = parts.data.mask[rows]
    table, _ = padded_targets(targets, mask.shape[1])
    in_list = padded_in_list(targets, mask.shape[1])
    kept = with_target(table, mask, in_list)
    if not kept:
        raise ValueError(f"listwise_loss: no question of {len(rows)} has a {teacher} target inside the mask")
    keep = mask[kept] & in_list[kept]
    f = torch.from_numpy(np.where(keep, scores[kept], 0.0).astype(np.float32))
    target = torch.from_numpy(np.where(keep, table[kept], -np.inf).astype(np.float32))
    return float(listwise_kl(f, target, torch.from_numpy(keep), tau))


def choose_on_dev(points: Iterable[P], score: Callable[[P], float]) -> tuple[P, float]:
    """The point with the best `score` (dev Top-1), a tie keeping the earlier one."""
    best, best_score = None, -1.0
    for point in points:
        value = score(point)
        if value > best_score:
            best, best_score = point, value
    if best is None:
        raise ValueError("choose_on_dev: an empty grid")
    return best, best_score


def agreement(measure: str, parts: StudyParts, rows: Sequence[int], scores: np.ndarray) -> float:
    """The fit of `scores` (aligned with `rows`, positions in the study) to the teacher of `measure`."""
    sets, ell, utility = parts.sets, parts.ell, parts.utility
    if measure == "utility":
        return float(np.mean([utility[i][int(np.argmax(scores[r]))] == 1 for r, i in enumerate(rows)]))
    if measure != "relevance":
        return float(np.mean([np.argmax(scores[r]) == np.argmax(ell[i]) for r, i in enumerate(rows)]))
    return float(
        np.mean([sets[i].from_gold[int(np.argmax(scores[r]))] for r, i in enumerate(rows) if sets[i].gold_retrieved])
    )


def capacity_curve(
    parts: StudyParts,
    tower: ListwiseSettings,
    tau_t: float,
    train_rows: list[int],
    held_rows: list[int],
    teachers: Sequence[tuple[str, str]],
) -> list[dict[str, Any]]:
    """Each (teacher, row) of `teachers` at λ = 0 and each (lr, steps) of `CAPACITY`: its agreement on its own
    training questions and held out, beside the base's on the same questions."""
    data, out = parts.data, []
    for teacher, name in teachers:
        measure = measure_of(name)

        def fit(rows: list[int], scores: np.ndarray, m: str = measure) -> float:
            return agreement(m, parts, rows, scores)

        base_in = fit(train_rows, data.base_scores[train_rows])
        base_out = fit(held_rows, data.base_scores[held_rows])
        for lr, steps in CAPACITY:
            student, _ = train(replace(tower, lr=lr, steps=steps, anchor=0.0), teacher, tau_t, parts, train_rows)
            out.append({
                "student": f"{name} capacity lr={lr:g} steps={steps}",
                "measure": MEASURE_WORDS[measure],
                "training_questions": fit(train_rows, student.score(data.subset(train_rows))),
                "training_questions_base": base_in,
                "held_out": fit(held_rows, student.score(data.subset(held_rows))),
                "held_out_base": base_out,
            })  # fmt: skip
    return out


def fit_lines(
    parts: StudyParts,
    fitted: dict[str, list[tuple[list[int], np.ndarray]]],
    scores: dict[str, list[np.ndarray]],
    folds: Sequence[Sequence[int]],
) -> list[dict[str, Any]]:
    """In-sample against held-out: each row's fold students (`fitted[row]`: (training rows, their scores) per fold)
    and its seed-0 cross-fitted scores (`scores[row][0]`), each beside the base on the same questions."""
    data, out = parts.data, []
    for name, per_fold in fitted.items():
        measure = measure_of(name)

        def fit(rows: Sequence[int], s: np.ndarray, m: str = measure) -> float:
            return agreement(m, parts, rows, s)

        trained = [fit(rows, s) for rows, s in per_fold]
        trained_base = [fit(rows, data.base_scores[rows]) for rows, _ in per_fold]
        held_rows = [i for fold in folds for i in fold]
        out.append({"student": f"{name}@0 fit", "measure": MEASURE_WORDS[measure],
                    "training_questions": float(np.mean(trained)),
                    "training_questions_base": float(np.mean(trained_base)),
                    "held_out": fit(held_rows, scores[name][0][held_rows]),
                    "held_out_base": fit(held_rows, data.base_scores[held_rows])})  # fmt: skip
    return out
