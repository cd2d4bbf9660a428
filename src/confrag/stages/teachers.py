"""The teacher scores an aligned reranker distils from (`preferences.teacher`, with `model.distill_weight` > 0).

Rows come from NQ_Rerank with `pos_scores` / `neg_scores` holding Inc, the probe's confidence shift (FlagEmbedding's
teacher-score format). A teacher here rewrites them before training:

- `inc`: as NQ_Rerank wrote them (the probe as teacher);
- `base`: the base reranker's own logits for each (query, passage): the distillation term then pulls the aligned
  reranker towards the base's ranking while InfoNCE moves the preferred contexts up, so the alignment cannot
  forget what the base ranks well unless the labels pay for it (what FlagEmbedding's distillation does with a
  stronger teacher, here with the starting point as the teacher).

A new teacher is one entry of `TEACHERS`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np


class Scores(Protocol):
    def score(self, queries: list[str], passages: list[str], batch_size: int = 32) -> np.ndarray: ...


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


TEACHERS: dict[str, Callable[[list[dict], Scores, int], list[dict]]] = {"inc": inc_teacher, "base": base_teacher}
