"""End-to-end RAG evaluation: candidates → reranker → top-K contexts → RAG answer → correctness.

For each question: its retrieved candidates (`Candidates`, best first) are reordered by a reranker
(`score(query, passages) -> scores`, higher is better; ties keep the retriever's order; None keeps
the retriever's order), the top K of them go into the RAG prompt for every K asked for, and the
greedy answers (plus the closed-book answer with the QA prompt) come from an `AnswerStore`, so they
are generated once per prompt across runs. The result is one `QuestionOutcome` per question.

K larger than the candidates a question has is capped to what it has: the RAG prompt holds all its
candidates, the record lists the context ids actually used, and `RagRun.capped[K]` counts the
questions concerned (also logged). A question with no candidate at all is an error naming its qid.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from confrag.data.jsonl import DataFormatError, read_jsonl
from confrag.data.nq import QARow
from confrag.infra import checks
from confrag.infra.atomic import atomic_write_text
from confrag.rag.answers import AnswerStore, ScoredAnswer, score_answer
from confrag.retrieval.candidates import Candidates, match_candidates
from confrag.retrieval.corpus import document_text

log = logging.getLogger(__name__)

Reranker = Callable[[str, list[str]], np.ndarray]
DEFAULT_KS = (1, 3)


@dataclass(frozen=True)
class RagAnswer(ScoredAnswer):
    contexts: tuple[str, ...] = ()  # ids of the contexts in the prompt, in prompt order


@dataclass
class QuestionOutcome:
    """Everything the tables and the β sweep need about one question; JSON-serialisable via to_dict()."""

    qid: str
    question: str
    answers: tuple[str, ...]
    closed_book: ScoredAnswer
    rag: dict[int, RagAnswer]
    confidence: float | None = None  # Conf(H(Q)) of the probe, when known

    def to_dict(self) -> dict[str, Any]:
        return {
            "qid": self.qid,
            "question": self.question,
            "answers": list(self.answers),
            "confidence": self.confidence,
            "closed_book": self.closed_book.to_dict(),
            "rag": {str(k): {**v.to_dict(), "contexts": list(v.contexts)} for k, v in sorted(self.rag.items())},
        }

    @classmethod
    def from_dict(cls, record: Mapping[str, Any]) -> QuestionOutcome:
        rag = {int(k): RagAnswer(**{**v, "contexts": tuple(v["contexts"])}) for k, v in record["rag"].items()}
        confidence = record.get("confidence")
        return cls(
            qid=str(record["qid"]),
            question=record["question"],
            answers=tuple(record["answers"]),
            closed_book=ScoredAnswer(**record["closed_book"]),
            rag=rag,
            confidence=None if confidence is None else float(confidence),
        )


@dataclass
class RagRun:
    outcomes: list[QuestionOutcome]
    ks: tuple[int, ...]
    capped: dict[int, int] = field(default_factory=dict)  # K -> questions with fewer than K candidates


def check_ks(ks: Sequence[int], key: str = "ks") -> tuple[int, ...]:
    if isinstance(ks, int):
        ks = (ks,)
    bad = [k for k in ks if not checks.is_integer(k, numpy=True) or k < 1]
    if not ks or bad:
        raise ValueError(f"{key} must be a non-empty list of integers >= 1 (e.g. [1, 3]); got {list(ks)!r}")
    return tuple(sorted({int(k) for k in ks}))


def rank_contexts(question: str, passages: Sequence[Any], reranker: Reranker | None, where: str = "") -> list[int]:
    """Indices of `passages` best first: by reranker score (stable, so ties keep the given order), or
    the given order without a reranker."""
    if reranker is None:
        return list(range(len(passages)))
    scores = np.asarray(reranker(question, [document_text(p) for p in passages]), dtype=np.float64).reshape(-1)
    if scores.shape != (len(passages),) or not np.isfinite(scores).all():
        raise ValueError(
            f"{where}the reranker must return one finite score per passage ({len(passages)}); got shape {scores.shape}"
        )
    return [int(i) for i in np.argsort(-scores, kind="stable")]


def _candidates_by_qid(rows: Sequence[QARow], candidates: Sequence[Candidates]) -> list[Candidates]:
    by_qid = {c.qid: c for c in candidates}
    for row in rows:
        if row.qid not in by_qid:
            raise ValueError(f"question {row.qid!r} has no candidates entry; retrieve for every question first")
    matched = match_candidates(rows, candidates, source="the candidates")  # same qid, same question
    for row, found in zip(rows, matched):
        if not found.passages:
            raise ValueError(
                f"question {row.qid!r} has no retrieved context (empty candidates); RAG needs at least one"
            )
    return matched


def run_rag(
    rows: Sequence[QARow],
    candidates: Sequence[Candidates],
    store: AnswerStore,
    ks: Sequence[int] = DEFAULT_KS,
    reranker: Reranker | None = None,
    confidences: Mapping[str, float] | None = None,
) -> RagRun:
    """Closed-book and top-K RAG answers with their correctness for every row (matched to its candidates
    by qid). `confidences` (qid -> Conf(H(Q))) is copied into the outcomes for the β sweep."""
    ks = check_ks(ks)
    matched = _candidates_by_qid(rows, candidates)
    chosen: list[dict[int, list[Any]]] = []
    capped = {k: 0 for k in ks}
    for row, cands in zip(rows, matched):
        order = rank_contexts(row.question, cands.passages, reranker, where=f"question {row.qid!r}: ")
        chosen.append({k: [cands.passages[i] for i in order[:k]] for k in ks})
        for k in ks:
            capped[k] += len(cands.passages) < k
    for k, count in capped.items():
        if count:
            log.warning(
                "top-%d: %d of %d questions have fewer than %d candidates; their prompts hold all they have",
                k,
                count,
                len(rows),
                k,
            )
    items = [(row.question, ()) for row in rows]
    items += [(row.question, picks[k]) for row, picks in zip(rows, chosen) for k in ks]
    answers = store.answer(items)
    closed, rag_answers = answers[: len(rows)], answers[len(rows) :]
    outcomes = []
    for index, (row, picks) in enumerate(zip(rows, chosen)):
        rag = {}
        for j, k in enumerate(ks):
            scored = score_answer(rag_answers[index * len(ks) + j], row.answers)
            rag[k] = RagAnswer(**scored.to_dict(), contexts=tuple(_context_id(p) for p in picks[k]))
        if confidences is not None and row.qid not in confidences:
            raise ValueError(f"question {row.qid!r} has no confidence; give one for every question or none")
        confidence = None if confidences is None else float(confidences[row.qid])
        outcomes.append(
            QuestionOutcome(
                row.qid, row.question, row.answers, score_answer(closed[index], row.answers), rag, confidence
            )
        )
    return RagRun(outcomes=outcomes, ks=ks, capped=capped)


def _context_id(passage: Any) -> str:
    return str(getattr(passage, "pid", None) or passage.title)


# ---------------------------------------------------------------- files


def save_outcomes_jsonl(outcomes: Sequence[QuestionOutcome], path: str | os.PathLike[str]) -> Path:
    """One JSON line per question, written atomically."""
    path = Path(path)
    if not path.name.lower().endswith(".jsonl"):
        raise ValueError(f"{path}: outcome files must end in .jsonl")
    atomic_write_text(path, "".join(json.dumps(o.to_dict(), ensure_ascii=False) + "\n" for o in outcomes))
    return path


def load_outcomes_jsonl(path: str | os.PathLike[str]) -> list[QuestionOutcome]:
    path = Path(path)
    if not path.is_file():
        raise DataFormatError(f"outcomes file {path} not found")
    out = []
    for lineno, record in read_jsonl(path, "an outcome record (QuestionOutcome.to_dict)"):
        try:
            out.append(QuestionOutcome.from_dict(record))
        except (KeyError, TypeError, ValueError) as exc:
            raise DataFormatError(f"{path}, line {lineno}: not an outcome record ({exc})") from exc
    return out
