"""Retrieval for every stage: the corpus, its BM25 (and dense) index, and each question's candidates.

The corpus is every gold paragraph of the NQ file split into passages (or `retrieval.corpus_path`, a
JSONL of documents); candidates are the retriever's top N with repeated texts removed, or a prebuilt
list read from `retrieval.candidates_path`. An evaluation file of its own (`eval.nq_path`, read here as
`retrieval.eval_questions_path`) adds its questions' gold paragraphs to the NQ paragraphs, as the NQ file's
held-out questions have theirs there; its qids carry the prefix `EVAL_IDS`, so that "own paragraph" is never
looked up under another file's question.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from confrag.data.nq import QUESTION_FORMAT_CHOICES, QARow, load_nq_jsonl
from confrag.infra import checks
from confrag.infra.checks import collect
from confrag.retrieval import (
    BM25Retriever,
    Candidates,
    Corpus,
    DenseRetriever,
    corpus_from_nq,
    document_text,
    load_candidates_jsonl,
    load_corpus_jsonl,
    match_candidates,
    retrieve_candidates,
    validate_candidates_jsonl,
    validate_corpus_jsonl,
)
from confrag.retrieval.candidates import without_duplicates
from confrag.retrieval.corpus import CORPUS_FORMAT_CHOICES
from confrag.retrieval.faiss_index import DENSE_INDEX_KINDS

log = logging.getLogger(__name__)

RETRIEVERS = ("bm25", "dense")
EVAL_IDS = "eval:"  # the qid prefix of the evaluation file's questions (`evaluation_file_rows`)


def evaluation_file_rows(path: str | Path) -> list[QARow]:
    """The questions of the evaluation file (`eval.nq_path`), each qid prefixed with `EVAL_IDS`: a file without
    ids numbers its rows as the NQ file does (`nq-00000`), and these must name other questions."""
    return load_nq_jsonl(path, id_prefix=EVAL_IDS)


@dataclass(frozen=True)
class RetrievalSettings:
    """The `retrieval` config node. Defaults: conf/retrieval/nq.yaml."""

    nq_path: str
    retriever: str  # bm25 | dense (MiniLM bi-encoder, exact search)
    top_n: int
    words_per_passage: int
    candidates_path: str | None
    corpus_path: str | None
    questions_format: str  # confrag | flashrag | auto (confrag.data.nq.QUESTION_FORMATS)
    corpus_format: str  # confrag | flashrag | auto (confrag.retrieval.corpus.CORPUS_FORMATS)
    bi_encoder: bool  # build the dense index too (Table 1's bi-encoder row)
    dense_index: str  # auto | exact | flat | ivf (confrag.retrieval.faiss_index.choose_index_kind)
    dense_index_path: str | None  # where the FAISS index is kept; a prebuilt one must match corpus and encoder
    eval_questions_path: str | None  # `eval.nq_path`: its gold paragraphs join the NQ paragraphs' corpus

    @property
    def source(self) -> str:
        """Where the candidates come from, as a report says it (the file names only: reports are shared)."""
        if self.candidates_path:
            return f"the candidates file {Path(self.candidates_path).name}"
        if self.corpus_path:
            return f"the corpus {Path(self.corpus_path).name}"
        return "the NQ paragraphs"

    def __post_init__(self) -> None:
        problems = []
        collect(problems, checks.choice, self.retriever, "retrieval.retriever", RETRIEVERS)
        collect(problems, checks.integer, self.top_n, "retrieval.top_n", 2, hint="(candidates per question)")
        collect(problems, checks.choice, self.questions_format, "retrieval.questions_format", QUESTION_FORMAT_CHOICES)
        collect(problems, checks.choice, self.corpus_format, "retrieval.corpus_format", CORPUS_FORMAT_CHOICES)
        collect(problems, checks.choice, self.dense_index, "retrieval.dense_index", DENSE_INDEX_KINDS)
        if problems:
            raise ValueError("; ".join(problems))

    def check_files(self) -> None:
        """Parse a user corpus and a candidates file whole (naming file, line and format on a bad one)
        before anything expensive runs; nothing is built or kept."""
        if self.corpus_path:
            validate_corpus_jsonl(self.corpus_path, self.corpus_format)
        if self.candidates_path:
            validate_candidates_jsonl(self.candidates_path)


@dataclass
class Retrieval:
    corpus: Corpus
    bm25: BM25Retriever
    dense: DenseRetriever | None
    settings: RetrievalSettings
    # The evaluation file's paragraphs in the corpus: its questions, those with a paragraph, the documents they
    # added (a paragraph the NQ file already has is kept once); empty without `retrieval.eval_questions_path`.
    joined: dict[str, int] = field(default_factory=dict)

    @property
    def retriever(self) -> BM25Retriever | DenseRetriever:
        """The retriever the candidates come from."""
        return self.dense if self.settings.retriever == "dense" else self.bm25


def build_retrieval(
    settings: RetrievalSettings, cache_dir: str | Path, rows: Sequence[QARow] | None = None
) -> Retrieval:
    """The corpus (the paragraphs of `rows`, else `retrieval.corpus_path`, else every gold paragraph of the
    NQ file), its BM25 index, and (when asked for, or for Table 1's bi-encoder row) the dense MiniLM index;
    all cached under `cache_dir`. It takes the cache alone, not the run's context: it is also built outside
    a run (docs/usage.md, experiments/)."""
    words = int(settings.words_per_passage)
    joined: dict[str, int] = {}
    if rows is not None:
        corpus = corpus_from_nq(rows, words_per_passage=words)
    elif settings.corpus_path:
        corpus = load_corpus_jsonl(settings.corpus_path, words_per_passage=words, corpus_format=settings.corpus_format)
        if settings.eval_questions_path:
            log.info("The evaluation file's paragraphs stay out of the corpus retrieval.corpus_path (used as given)")
    else:
        rows_of_file = load_nq_jsonl(settings.nq_path, questions_format=settings.questions_format)
        extra = evaluation_file_rows(settings.eval_questions_path) if settings.eval_questions_path else []
        corpus = corpus_from_nq([*rows_of_file, *extra], words_per_passage=words)
        if extra:
            joined = {
                "questions": len(extra),
                "with_paragraph": sum(1 for r in extra if r.contexts),
                "documents_added": len({p.source_id for p in corpus.passages if p.source_id.startswith(EVAL_IDS)}),
            }
            log.info("The evaluation file's paragraphs joined the corpus: %s", joined)
    bm25 = BM25Retriever(corpus, cache_dir=cache_dir)
    dense = (
        DenseRetriever(corpus, cache_dir=cache_dir, index=settings.dense_index, index_path=settings.dense_index_path)
        if (settings.retriever == "dense" or settings.bi_encoder)
        else None
    )
    log.info("Corpus: %d passages from %d documents", len(corpus), len({p.source_id for p in corpus.passages}))
    return Retrieval(corpus, bm25, dense, settings, joined)


def question_candidates(
    retrieval: Retrieval, rows: Sequence[QARow], candidates_path: str | None = None, top_n: int | None = None
) -> tuple[list[Candidates], dict[str, Any]]:
    """Top-N candidates per question (N = `retrieval.top_n` unless `top_n` says otherwise): retrieved, or
    read from `candidates_path` (a prebuilt list)."""
    if candidates_path:  # joined by qid, then checked by question text
        found = match_candidates(
            rows, load_candidates_jsonl(candidates_path), source=f"retrieval.candidates_path={candidates_path}"
        )
    else:
        found = retrieve_candidates(
            rows, retrieval.corpus, retrieval.retriever, top_n=int(top_n or retrieval.settings.top_n)
        )
    cleaned, removed = zip(*(without_duplicates(c) for c in found)) if found else ((), ())
    empty = [c.qid for c in cleaned if not c.passages]
    if empty:
        raise ValueError(f"questions without any retrieved context: {empty[:5]}")
    stats = {
        "questions": len(cleaned),
        "duplicate_passages_removed": int(sum(removed)),
        "gold_retrieved": float(np.mean([c.gold_retrieved for c in cleaned])),
        "answer_in_candidates": float(np.mean([any(c.has_answer) for c in cleaned])),
    }
    return list(cleaned), stats


def retrieve_fn(retrieval: Retrieval):
    """question -> the retriever's top-N passages (repeated texts removed), as the batch stages get them."""

    def retrieve(question: str) -> list:
        texts: dict[str, Any] = {}
        for index, _ in retrieval.retriever.search([question], int(retrieval.settings.top_n))[0]:
            passage = retrieval.corpus.passages[index]
            texts.setdefault(document_text(passage), passage)
        return list(texts.values())

    return retrieve
