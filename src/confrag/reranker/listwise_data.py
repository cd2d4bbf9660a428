"""What a listwise student trains on: each question's candidates (the base's frozen vectors, their texts), the
target over them, and the batches the students read.

The base is a sentence-transformers bi-encoder (all-MiniLM-L6-v2) scoring a candidate by SCALE · cos(q, p). A
question's candidates are padded to the longest list; `mask` is False on padding. `top_k(k)` keeps only the
base's top k of each list in the mask, so a student trained and scored on it reorders those alone (the loss is
taken over them, the top-1 is chosen among them), as a reranker of the base's shortlist does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch

from confrag.infra import checks
from confrag.infra.finite import require_finite
from confrag.reranker.bi_encoder import SCALE


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
class ListwiseData:
    """Questions with their candidates' frozen base embeddings, padded to the longest list.

    `query_vectors` (Q, d) and `passage_vectors` (Q, N, d) are the base's unit vectors; `mask` (Q, N) is False on
    padding (and, after `top_k`, outside the base's top k). The base's score is SCALE · q · p, or `scores` (Q, N) where
    given: the scores of a base that is not a bi-encoder (a cross-encoder reranker: its vectors may then be of width
    0, and no student that reads them can train). `passage_texts` holds each question's candidates' texts (the
    students that read them, e.g. a cross-encoder, need them)."""

    questions: list[str]
    query_vectors: np.ndarray
    passage_vectors: np.ndarray
    mask: np.ndarray
    passage_texts: list[list[str]] | None = field(default=None, compare=False)
    scores: np.ndarray | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        q, n = self.mask.shape
        if self.scores is not None:
            if np.shape(self.scores) != (q, n):
                raise ValueError(f"listwise data: base scores {np.shape(self.scores)} for a mask of {(q, n)}")
            require_finite(np.where(self.mask, self.scores, 0.0), stage="listwise data", artifact="base scores")
        if len(self.questions) != q or self.query_vectors.shape[0] != q or self.passage_vectors.shape[:2] != (q, n):
            raise ValueError(
                f"listwise data: {len(self.questions)} questions, query vectors {self.query_vectors.shape}, passage "
                f"vectors {self.passage_vectors.shape} and mask {self.mask.shape} disagree"
            )
        if self.passage_texts is not None and (
            len(self.passage_texts) != q or any(len(t) > n for t in self.passage_texts)
        ):
            raise ValueError(f"listwise data: passage_texts must hold one list (≤ {n} texts) per question ({q})")
        require_finite(self.passage_vectors, stage="listwise data", artifact="passage vectors")
        require_finite(self.query_vectors, stage="listwise data", artifact="query vectors")

    @classmethod
    def from_lists(
        cls,
        questions: list[str],
        query_vectors: np.ndarray,
        passages: list[np.ndarray],
        passage_texts: list[list[str]] | None = None,
        base_scores: list[np.ndarray] | None = None,
    ) -> ListwiseData:
        """From each question's (candidates, d) passage vectors, of any lengths (and, optionally, their texts and
        the base's scores of its candidates, when the base is not the bi-encoder of these vectors)."""
        width = max((len(p) for p in passages), default=0)
        dim = query_vectors.shape[1]
        padded = np.zeros((len(passages), width, dim), dtype=np.float32)
        mask = np.zeros((len(passages), width), dtype=bool)
        for i, p in enumerate(passages):
            padded[i, : len(p)] = p
            mask[i, : len(p)] = True
        texts = None if passage_texts is None else [list(t) for t in passage_texts]
        scores = None
        if base_scores is not None:
            scores = np.zeros((len(passages), width), dtype=np.float32)
            for i, s in enumerate(base_scores):
                scores[i, : len(s)] = s
        return cls(list(questions), np.asarray(query_vectors, dtype=np.float32), padded, mask, texts, scores)

    @cached_property
    def base_scores(self) -> np.ndarray:
        """The base's scores (SCALE · cos(q, p), or the `scores` given), -inf outside the mask."""
        if self.scores is not None:
            return np.where(self.mask, self.scores, -np.inf).astype(np.float32)
        scores = SCALE * np.einsum("qd,qnd->qn", self.query_vectors, self.passage_vectors)
        return np.where(self.mask, scores, -np.inf).astype(np.float32)

    def subset(self, rows: list[int]) -> ListwiseData:
        texts = None if self.passage_texts is None else [self.passage_texts[i] for i in rows]
        return ListwiseData(
            [self.questions[i] for i in rows],
            self.query_vectors[rows],
            self.passage_vectors[rows],
            self.mask[rows],
            texts,
            None if self.scores is None else self.scores[rows],
        )

    def top_k(self, k: int | None) -> ListwiseData:
        """The same questions with each mask cut to the base's top `k` candidates (ties by position, as the
        stable sort puts them); None keeps every candidate."""
        if k is None:
            return self
        checks.positive_int(k, "top_k")
        order = np.argsort(-self.base_scores, axis=1, kind="stable")
        keep = np.zeros_like(self.mask)
        np.put_along_axis(keep, order[:, :k], True, axis=1)
        return ListwiseData(
            self.questions, self.query_vectors, self.passage_vectors, self.mask & keep, self.passage_texts, self.scores
        )


def list_batch(
    data: ListwiseData, rows: list[int], targets: np.ndarray | None, in_list: np.ndarray | None = None
) -> dict:
    """The tensors a student reads for `rows`: training scores a question over the candidates its target keeps in
    the list (`in_list`), scoring over every candidate of the mask."""
    base = data.base_scores[rows]
    mask = torch.from_numpy(data.mask[rows] & (in_list[rows] if in_list is not None else True))
    batch = {
        "questions": [data.questions[i] for i in rows],
        "query_vectors": torch.from_numpy(data.query_vectors[rows]),
        "passages": torch.from_numpy(data.passage_vectors[rows]),
        "passage_texts": None if data.passage_texts is None else [data.passage_texts[i] for i in rows],
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


def with_target(table: np.ndarray, mask: np.ndarray, in_list: np.ndarray) -> list[int]:
    """The rows whose target (`padded_targets`) keeps a finite logit inside `mask` and the list: the questions a
    student trains on (after `top_k`, a relevance target whose own paragraph lies below the base's top k has none)."""
    return [i for i in range(len(table)) if np.isfinite(table[i][mask[i] & in_list[i]]).any()]


def padded_in_list(targets: list[np.ndarray | ListTarget | None], width: int) -> np.ndarray:
    """(Q, width): False where a target leaves a candidate out of the list (padding is data.mask's to drop)."""
    out = np.ones((len(targets), width), dtype=bool)
    for i, t in enumerate(targets):
        if isinstance(t, ListTarget):
            out[i, : len(t.in_list)] = t.in_list
    return out
