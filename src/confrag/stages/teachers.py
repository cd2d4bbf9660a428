"""The teachers of the pairwise rows: the scores an aligned reranker distils from beside InfoNCE
(`preferences.teacher`, with `model.distill_weight` > 0).

Rows come from NQ_Rerank with `pos_scores` / `neg_scores` holding Inc, the probe's confidence shift (FlagEmbedding's
teacher-score format); a teacher rewrites them before training. `ROW_TEACHERS` is their catalogue: each teacher's
id, what it does (its `description`, the one place it is written: the docs and the config point here) and the
rewrite. A new teacher is one entry. (The listwise teachers, whose targets span a question's whole candidate list,
are another catalogue: `confrag.reranker.listwise_teachers`.)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np


class Scores(Protocol):
    def score(self, queries: list[str], passages: list[str], batch_size: int = 32) -> np.ndarray: ...


@dataclass(frozen=True)
class RowTeacher:
    """A teacher of the pairwise rows: `rewrite(rows, base, batch_size)` gives the rows with its scores."""

    id: str
    description: str
    rewrite: Callable[[list[dict], Scores, int], list[dict]]


def inc_teacher(rows: list[dict], base: Scores, batch_size: int) -> list[dict]:
    return rows


def base_teacher(rows: list[dict], base: Scores, batch_size: int) -> list[dict]:
    """The rows with `pos_scores` / `neg_scores` replaced by the base reranker's scores of the same passages."""
    queries = [r["query"] for r in rows for _ in (*r["pos"], *r["neg"])]
    passages = [p for r in rows for p in (*r["pos"], *r["neg"])]
    scores = np.asarray(base.score(queries, passages, batch_size=batch_size), dtype=np.float64)
    out, at = [], 0
    for row in rows:
        n_pos, n_neg = len(row["pos"]), len(row["neg"])
        out.append(
            {
                **row,
                "pos_scores": scores[at : at + n_pos].tolist(),
                "neg_scores": scores[at + n_pos : at + n_pos + n_neg].tolist(),
            }
        )
        at += n_pos + n_neg
    return out


# The pairwise rows' teachers by id (`preferences.teacher`); a new teacher is one entry.
ROW_TEACHERS: dict[str, RowTeacher] = {
    teacher.id: teacher
    for teacher in (
        RowTeacher(
            "inc", "the probe's Inc, as NQ_Rerank wrote the rows (the paper's rows: the probe as teacher)", inc_teacher
        ),
        RowTeacher(
            "base",
            "the base reranker's own scores of the same passages: the KL term pulls the aligned reranker towards the "
            "base's ranking while InfoNCE moves the preferred passages up, so it cannot forget what the base ranks "
            "well unless the labels pay for it (FlagEmbedding's distillation, with the starting point as teacher)",
            base_teacher,
        ),
    )
}
