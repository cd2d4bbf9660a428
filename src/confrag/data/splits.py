"""Question samples and splits: seeded, by question, and disjoint where results depend on it.

Every stage that learns (probe, preference rows, rerankers, gates) and every stage that reports
(Tables 1-3, the gates' table) takes its questions from here, so that "no evaluation question was
seen in training" is checked in one place (`check_disjoint`), not only trusted.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

import numpy as np

from confrag.data.nq import QARow


def select_questions(rows: Sequence[QARow], num_questions: int | None, seed: int) -> list[QARow]:
    """A seeded sample of `num_questions` rows, kept in file order (all rows when None)."""
    if num_questions is None or num_questions >= len(rows):
        return list(rows)
    if num_questions < 2:
        raise ValueError(f"data.num_questions must be >= 2 (got {num_questions})")
    chosen = np.sort(np.random.default_rng(seed).choice(len(rows), num_questions, replace=False))
    return [rows[i] for i in chosen]


def split_dev_test(rows: Sequence[QARow], dev_fraction: float, seed: int) -> dict[str, list[QARow]]:
    """Seeded split by question into dev and test, each part kept in file order."""
    n_dev = int(round(len(rows) * dev_fraction))
    if not 0 < n_dev < len(rows):
        raise ValueError(f"eval.dev_fraction={dev_fraction} of {len(rows)} evaluation questions leaves an empty dev or "
                         "test split; raise eval.num_questions")
    dev = set(np.random.default_rng(seed).permutation(len(rows))[:n_dev].tolist())
    return {"dev": [r for i, r in enumerate(rows) if i in dev], "test": [r for i, r in enumerate(rows) if i not in dev]}


def held_out(rows: Sequence[QARow], used: Iterable[QARow], what: str, where: str) -> list[QARow]:
    """The rows whose qid none of `used` has (file order); an error when fewer than two are left."""
    taken = {row.qid for row in used}
    pool = [row for row in rows if row.qid not in taken]
    if len(pool) < 2:
        raise ValueError(f"{where}: {len(taken)} of its {len(rows)} questions are used before {what}, leaving "
                         f"{len(pool)}; lower probe.data.num_questions")
    return pool


def check_disjoint(evaluation: Iterable[str], training: Mapping[str, Iterable[str]],
                   what: str = "the evaluation questions") -> None:
    """Raise when a question id of `evaluation` is in one of the named `training` sets."""
    held_out_ids = set(evaluation)
    for name, ids in training.items():
        shared = held_out_ids & set(ids)
        if shared:
            raise AssertionError(f"{len(shared)} of {what} are in {name}, e.g. {sorted(shared)[:3]}: training and "
                                 "evaluation questions must be disjoint")
