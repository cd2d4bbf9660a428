"""Question samples and splits: seeded, by question, and disjoint where results depend on it.

Every stage that learns (probe, preference rows, rerankers, gates) and every stage that reports
(Tables 1-3, the gates' table) takes its questions from here, so that "no evaluation question was
seen in training" is checked in one place (`check_disjoint`), not only trusted.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from confrag.data.nq import QARow
from confrag.data.qa_metrics import normalize_question
from confrag.infra import checks

# What `preferences.cross_fit` allows, as its errors say it.
CROSS_FIT = "0 (off) or an integer >= 2 folds"

log = logging.getLogger(__name__)


def drop_duplicate_questions(rows: Sequence[QARow]) -> list[QARow]:
    """The rows without repeats of an earlier row's question (compared by normalized text: case,
    punctuation, articles, whitespace), with a warning counting and naming them: a repeated question could
    otherwise land in a training split and an evaluation split at once."""
    seen: dict[str, str] = {}
    kept, dropped = [], []
    for row in rows:
        key = question_key(row)
        if key in seen:
            dropped.append((row.qid, seen[key]))
        else:
            seen[key] = row.qid
            kept.append(row)
    if dropped:
        examples = ", ".join(f"{qid!r} repeats {first!r}" for qid, first in dropped[:3])
        log.warning(
            "%d duplicate question(s) dropped (same normalized text as an earlier row), e.g. %s", len(dropped), examples
        )
    return kept


def select_questions(rows: Sequence[QARow], num_questions: int | None, seed: int) -> list[QARow]:
    """A seeded sample of `num_questions` rows, kept in file order (all rows when None), after dropping
    repeated questions (`drop_duplicate_questions`). Asking for more rows than there are gives all of them,
    with a warning naming both numbers."""
    rows = drop_duplicate_questions(rows)
    if num_questions is None or num_questions >= len(rows):
        if num_questions is not None and num_questions > len(rows):
            log.warning(
                "num_questions=%d asks for more questions than the data holds: using all %d", num_questions, len(rows)
            )
        return list(rows)
    if num_questions < 2:
        raise ValueError(f"num_questions must be >= 2 (got {num_questions})")
    chosen = np.sort(np.random.default_rng(seed).choice(len(rows), num_questions, replace=False))
    return [rows[i] for i in chosen]


def split_dev_test(rows: Sequence[QARow], dev_fraction: float, seed: int) -> dict[str, list[QARow]]:
    """Seeded split by question into dev and test, each part kept in file order."""
    n_dev = int(round(len(rows) * dev_fraction))
    if not 0 < n_dev < len(rows):
        raise ValueError(
            f"eval.dev_fraction={dev_fraction} of {len(rows)} evaluation questions leaves an empty dev or "
            "test split; raise eval.num_questions"
        )
    dev = set(np.random.default_rng(seed).permutation(len(rows))[:n_dev].tolist())
    return {"dev": [r for i, r in enumerate(rows) if i in dev], "test": [r for i, r in enumerate(rows) if i not in dev]}


def held_out(rows: Sequence[QARow], used: Iterable[QARow], what: str, where: str) -> list[QARow]:
    """The rows whose qid none of `used` has (file order); an error when fewer than two are left."""
    # By qid and by question text: a repeat of a used question under another qid is not held out.
    taken = {row.qid for row in used}
    used_questions = {question_key(row) for row in used}
    pool = [row for row in rows if row.qid not in taken and question_key(row) not in used_questions]
    if len(pool) < 2:
        raise ValueError(
            f"{where}: {len(taken)} of its {len(rows)} questions are used before {what}, leaving "
            f"{len(pool)}; lower probe.data.num_questions"
        )
    return pool


def question_key(row: QARow) -> str:
    """A question as compared across files: its normalized text, hyphens read as spaces (qids are line positions,
    not identities)."""
    return normalize_question(row.question)


def check_disjoint(
    evaluation: Sequence[QARow], training: Mapping[str, Sequence[QARow]], what: str = "the evaluation questions"
) -> None:
    """Raise when a question of `evaluation` is in one of the named `training` sets (compared by normalized
    text, so that two files numbering their questions differently are still compared correctly)."""
    held_out_keys = {question_key(r): r for r in evaluation}
    for name, rows in training.items():
        shared = sorted({held_out_keys[k].qid for k in map(question_key, rows) if k in held_out_keys})
        if shared:
            raise ValueError(
                f"{len(shared)} of {what} are also in {name}, e.g. {shared[:3]}: training and "
                "evaluation questions must be disjoint"
            )


@dataclass(frozen=True)
class QuestionPlan:
    """Which questions of one NQ file each stage uses; disjoint, asserted on construction."""

    probe: list[QARow]  # NQ_Confidence and the probe
    preference: list[QARow]  # NQ_Rerank and the aligned rerankers
    base: list[QARow]  # the base reranker's relevance training
    held_out: list[QARow]  # what is left: the evaluation questions are sampled from these
    # Cross-fitting (`preferences.cross_fit` folds): `preference` is every question the probe and the base do not
    # use, split into these folds; fold f's rerankers train on the other folds' rows and answer fold f's
    # questions, so every one of them is an evaluation question of rerankers that never saw it. Empty: off.
    folds: tuple[tuple[QARow, ...], ...] = ()

    def __post_init__(self) -> None:
        if self.folds:
            self._check_folds()
            return
        check_disjoint(
            self.held_out,
            {
                "the probe's questions": self.probe,
                "the preference questions": self.preference,
                "the base reranker's questions": self.base,
            },
            "the held-out questions",
        )
        check_disjoint(
            self.preference,
            {"the probe's questions": self.probe, "the base reranker's questions": self.base},
            "the preference questions",
        )
        check_disjoint(self.base, {"the probe's questions": self.probe}, "the base reranker's questions")

    def _check_folds(self) -> None:
        if self.held_out:
            raise ValueError("a cross-fitted question plan holds out nothing beside its folds")
        if sorted(r.qid for fold in self.folds for r in fold) != sorted(r.qid for r in self.preference):
            raise ValueError("the cross-fitting folds must partition the preference questions")
        for f, fold in enumerate(self.folds):
            check_disjoint(
                fold,
                {
                    "the probe's questions": self.probe,
                    "the base reranker's questions": self.base,
                    f"the training folds of fold {f}": self.training_questions(f),
                },
                f"the questions of fold {f}",
            )
        check_disjoint(self.base, {"the probe's questions": self.probe}, "the base reranker's questions")

    def training_questions(self, fold: int) -> list[QARow]:
        """The preference questions fold `fold`'s rerankers train on: every other fold's."""
        return [r for f, rows in enumerate(self.folds) if f != fold for r in rows]

    def fold_of(self, row: QARow) -> int | None:
        """The fold whose rerankers answer `row` (by normalized question text), None outside every fold."""
        return self._fold_by_key.get(question_key(row))

    def fold_of_question(self, question: str) -> int | None:
        """`fold_of` for a question's text (what a reranker's `score` receives)."""
        return self._fold_by_key.get(normalize_question(question))

    @functools.cached_property
    def _fold_by_key(self) -> dict[str, int]:
        return {question_key(r): f for f, rows in enumerate(self.folds) for r in rows}

    @property
    def evaluation_pool(self) -> list[QARow]:
        """The questions the evaluation samples: the held-out ones, or with cross-fitting every fold's."""
        return list(self.preference) if self.folds else list(self.held_out)


def cross_fit_plan(plan: QuestionPlan, folds: int, seed: int) -> QuestionPlan:
    """`plan` cross-fitted: the preference and held-out questions together (file order kept within each fold),
    split at random into `folds` folds of nearly equal size. The probe's and the base reranker's questions stay
    as `plan_questions` drew them, so the base reranker is the one the plain runs train."""
    checks.integer(folds, "folds", 2, describe=CROSS_FIT)
    order = {r.qid: i for i, r in enumerate([*plan.preference, *plan.held_out])}
    pool = sorted([*plan.preference, *plan.held_out], key=lambda r: order[r.qid])
    if len(pool) < 2 * folds:
        raise ValueError(
            f"preferences.cross_fit={folds} folds need at least {2 * folds} questions; {len(pool)} are left"
        )
    assignment = np.random.default_rng(seed).permutation(len(pool)) % folds
    split = tuple(tuple(r for r, a in zip(pool, assignment) if a == f) for f in range(folds))
    return QuestionPlan(plan.probe, pool, plan.base, [], split)


def plan_questions(
    rows: Sequence[QARow],
    probe: Sequence[QARow],
    preference_questions: int | None,
    base_questions: int | None,
    seed: int,
    where: str,
    base_rows: Sequence[QARow] | None = None,
) -> QuestionPlan:
    """The probe's questions as given; then, each a seeded sample of what is left in this order: the
    preference questions, the base reranker's (0 when it is not trained; from `base_rows`, another file,
    when given); the rest is held out. The order makes the preference rows and the base independent of how
    many evaluation questions a run asks for. Overlaps, possible with another file, are refused."""
    pool = held_out(rows, probe, "the preference data", where)
    preference = select_questions(pool, preference_questions, seed)
    pool = held_out(pool, preference, "the base reranker and the evaluation", where)
    if base_questions == 0:
        base = []
    elif base_rows is not None:
        base = select_questions(list(base_rows), base_questions, seed)
    else:
        base = select_questions(pool, base_questions, seed)
    # From the same file the base is part of the pool and leaves it; from another file nothing leaves, and
    # an overlap with the questions left for evaluation is refused below (QuestionPlan).
    taken = {r.qid for r in base} if base_rows is None else set()
    rest = [r for r in pool if r.qid not in taken]
    if len(rest) < 2:
        raise ValueError(
            f"{where}: the probe ({len(probe)}), preference ({len(preference)}) and base reranker "
            f"({len(base)}) questions leave {len(rest)} of {len(rows)} for evaluation; lower "
            "probe.data.num_questions, preferences.num_questions or base_reranker.num_questions"
        )
    return QuestionPlan(list(probe), preference, base, rest)
