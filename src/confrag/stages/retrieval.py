"""Retrieval for every stage: the corpus, its BM25 (and dense) index, and each question's candidates.

The corpus is every gold paragraph of the NQ file split into passages (or `retrieval.corpus_path`, a
JSONL of documents); candidates are the retriever's top N with repeated texts removed, or a prebuilt
list read from `retrieval.candidates_path`. An evaluation file of its own (`eval.questions_path`, read here as
`retrieval.eval_questions_path`) adds its questions' gold paragraphs to the NQ paragraphs, as the NQ file's
held-out questions have theirs there; its qids carry the prefix `EVAL_IDS`, so that "own paragraph" is never
looked up under another file's question.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from confrag.data.nq import QUESTION_FORMAT_CHOICES, QARow, load_questions_jsonl
from confrag.infra import checks
from confrag.infra.checks import collect
from confrag.infra.digests import fingerprint
from confrag.reranker.budget import PairBudget
from confrag.retrieval import (
    BM25Retriever,
    Candidates,
    Corpus,
    DenseRetriever,
    corpus_from_gold_paragraphs,
    document_text,
    load_candidates_jsonl,
    load_corpus_jsonl,
    match_candidates,
    retrieve_candidates,
    validate_candidates_jsonl,
    validate_corpus_jsonl,
)
from confrag.retrieval.candidates import make_candidates, without_duplicates
from confrag.retrieval.corpus import CORPUS_FORMAT_CHOICES, check_words_per_passage
from confrag.retrieval.dense import model_fingerprint
from confrag.retrieval.faiss_index import DENSE_INDEX_KINDS
from confrag.retrieval.lengths import TokenBudget, budget_line, counted_once, fit_passages
from confrag.retrieval.prebuilt_index import (
    PrebuiltDenseRetriever,
    check_prebuilt_index,
    encoder_dimension,
    load_encoder,
    read_index_header,
)
from confrag.retrieval.ranked_ids import (
    CANDIDATES_FORMATS,
    detect_candidates_format,
    ranked_candidates,
    read_ranked_lists,
)

log = logging.getLogger(__name__)

RETRIEVERS = ("bm25", "dense")
EVAL_IDS = "eval:"  # the qid prefix of the evaluation file's questions (`evaluation_file_rows`)


def evaluation_file_rows(path: str | Path) -> list[QARow]:
    """The questions of the evaluation file (`eval.questions_path`), each qid prefixed with `EVAL_IDS`: a file without
    ids numbers its rows as the NQ file does (`nq-00000`), and these must name other questions."""
    return load_questions_jsonl(path, id_prefix=EVAL_IDS)


@dataclass(frozen=True)
class RetrievalSettings:
    """The `retrieval` config node. Defaults: conf/retrieval/nq.yaml."""

    questions_path: str
    retriever: str  # bm25 | dense (MiniLM bi-encoder, exact search)
    top_n: int
    words_per_passage: int | None  # null: the corpus's own passages, one per document (its id the passage's)
    candidates_path: str | None
    corpus_path: str | None
    questions_format: str  # confrag | flashrag | auto (confrag.data.nq.QUESTION_FORMATS)
    corpus_format: str  # confrag | flashrag | auto (confrag.retrieval.corpus.CORPUS_FORMATS)
    bi_encoder: bool  # build the dense index too (Table 1's bi-encoder row)
    dense_index: str  # auto | exact | flat | ivf (confrag.retrieval.faiss_index.choose_index_kind)
    dense_index_path: str | None  # where the FAISS index is kept; a prebuilt one must match corpus and encoder
    candidates_format: str  # auto | confrag | flashrag | ranked_ids (confrag.retrieval.ranked_ids)
    max_passage_tokens: int | None  # a passage's LLM tokens at most; null: what one passage may hold in a prompt
    cut_passages: bool  # a passage past that: refused (false) or cut to it
    dense_encoder: str | None  # the sentence-transformers folder of a prebuilt FAISS index file (dense_index_path)
    eval_questions_path: str | None  # `eval.questions_path`: its gold paragraphs join the NQ paragraphs' corpus

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
        collect(problems, checks.choice, self.retriever, "retriever", RETRIEVERS)
        collect(problems, checks.integer, self.top_n, "top_n", 2, hint="(candidates per question)")
        collect(problems, checks.choice, self.questions_format, "questions_format", QUESTION_FORMAT_CHOICES)
        collect(problems, checks.choice, self.corpus_format, "corpus_format", CORPUS_FORMAT_CHOICES)
        collect(problems, checks.choice, self.dense_index, "dense_index", DENSE_INDEX_KINDS)
        collect(problems, check_words_per_passage, self.words_per_passage)
        collect(problems, checks.choice, self.candidates_format, "candidates_format", CANDIDATES_FORMATS)
        collect(problems, checks.positive_int, self.max_passage_tokens, "max_passage_tokens", allow_none=True)
        collect(problems, checks.flag, self.cut_passages, "cut_passages")
        if self.dense_encoder and not self.dense_index_path:
            problems.append(
                "dense_encoder names the encoder of a prebuilt FAISS index: set dense_index_path to that index file too"
            )
        checks.refuse(problems)

    @property
    def candidates_kind(self) -> str | None:
        """The candidates file's format (`auto` read from the file), or None without one."""
        if not self.candidates_path:
            return None
        if self.candidates_format == "auto":
            return detect_candidates_format(self.candidates_path)
        return self.candidates_format

    def check_files(self) -> None:
        """Parse a user corpus, a candidates file and a prebuilt FAISS index whole (naming file, line and format
        on a bad one; the index's size against the corpus's, its dimension against its encoder's) before
        anything expensive runs; nothing is built or kept."""
        documents = validate_corpus_jsonl(self.corpus_path, self.corpus_format) if self.corpus_path else None
        if self.candidates_kind == "confrag":
            validate_candidates_jsonl(self.candidates_path)
        elif self.candidates_kind:
            read_ranked_lists(self.candidates_path, self.candidates_kind)
        if self.dense_encoder:
            if self.words_per_passage is not None:
                raise ValueError(
                    "dense_encoder (a prebuilt FAISS index: vector i is document i of the corpus) needs "
                    "the corpus's documents as given: set words_per_passage=null "
                    f"(got {self.words_per_passage})"
                )
            index = read_index_header(self.dense_index_path)
            dimension = encoder_dimension(load_encoder(self.dense_encoder))
            if documents is not None:
                check_prebuilt_index(index, self.dense_index_path, documents, dimension)


@dataclass
class Retrieval:
    corpus: Corpus
    bm25: BM25Retriever
    dense: DenseRetriever | PrebuiltDenseRetriever | None
    settings: RetrievalSettings
    # What one passage may hold in the LLM's prompts, when checked (`confrag.retrieval.lengths`), and the counts.
    llm_budget: TokenBudget | None = None
    lengths: dict[str, Any] | None = None
    # The evaluation file's paragraphs in the corpus: its questions, those with a paragraph, the documents they
    # added (a paragraph the NQ file already has is kept once); empty without `retrieval.eval_questions_path`.
    joined: dict[str, int] = field(default_factory=dict)
    # The corpus passages past the dense encoder's max_seq_length (`encoder_corpus_count`), when it is built.
    encoder_lengths: dict[str, int] | None = None
    # The reranker's tokenizer and budget: every candidate list's pairs are counted against it (`question_candidates`).
    reranker_budget: PairBudget | None = None

    @property
    def retriever(self) -> BM25Retriever | DenseRetriever | PrebuiltDenseRetriever:
        """The retriever the candidates come from."""
        return self.dense if self.settings.retriever == "dense" else self.bm25


def load_corpus(settings: RetrievalSettings, rows: Sequence[QARow] | None = None) -> Corpus:
    """The corpus: the paragraphs of `rows`, else `retrieval.corpus_path` (used as given), else every gold paragraph
    of the NQ file and of the evaluation file (`retrieval.eval_questions_path`), split into
    `retrieval.words_per_passage`-word passages (null: as given)."""
    words = settings.words_per_passage
    if rows is not None:
        return corpus_from_gold_paragraphs(rows, words_per_passage=words)
    if settings.corpus_path:
        if settings.eval_questions_path:
            log.info("The evaluation file's paragraphs stay out of the corpus retrieval.corpus_path (used as given)")
        return load_corpus_jsonl(settings.corpus_path, words_per_passage=words, corpus_format=settings.corpus_format)
    rows_of_file = load_questions_jsonl(settings.questions_path, questions_format=settings.questions_format)
    extra = evaluation_file_rows(settings.eval_questions_path) if settings.eval_questions_path else []
    return corpus_from_gold_paragraphs([*rows_of_file, *extra], words_per_passage=words)


def joined_counts(settings: RetrievalSettings, corpus: Corpus, rows: Sequence[QARow] | None) -> dict[str, int]:
    """The evaluation file's paragraphs in the NQ paragraphs' corpus: its questions, those with a paragraph, the
    documents they added (empty when no evaluation file joined)."""
    if rows is not None or settings.corpus_path or not settings.eval_questions_path:
        return {}
    extra = evaluation_file_rows(settings.eval_questions_path)
    if not extra:
        return {}
    joined = {
        "questions": len(extra),
        "with_paragraph": sum(1 for r in extra if r.contexts),
        "documents_added": len({p.source_id for p in corpus.passages if p.source_id.startswith(EVAL_IDS)}),
    }
    log.info("The evaluation file's paragraphs joined the corpus: %s", joined)
    return joined


def build_retrieval(
    settings: RetrievalSettings,
    cache_dir: str | Path,
    rows: Sequence[QARow] | None = None,
    corpus: Corpus | None = None,
    llm_budget: TokenBudget | None = None,
) -> Retrieval:
    """The corpus (given, already checked, or `load_corpus`), its BM25 index, and (when asked for, or for
    Table 1's bi-encoder row) the dense index: the MiniLM one built here, or a prebuilt FAISS index with its
    encoder (`retrieval.dense_encoder`); all cached under `cache_dir`. It takes the cache alone, not the run's
    context: it is also built outside a run (docs/usage.md, experiments/)."""
    corpus = corpus if corpus is not None else load_corpus(settings, rows)
    joined = joined_counts(settings, corpus, rows)
    bm25 = BM25Retriever(corpus, cache_dir=cache_dir)
    dense: DenseRetriever | PrebuiltDenseRetriever | None = None
    if settings.retriever == "dense" or settings.bi_encoder:
        if settings.dense_encoder:
            dense = PrebuiltDenseRetriever(corpus, settings.dense_index_path, settings.dense_encoder)
        else:
            dense = DenseRetriever(
                corpus, cache_dir=cache_dir, index=settings.dense_index, index_path=settings.dense_index_path
            )
    log.info("Corpus: %d passages from %d documents", len(corpus), len({p.source_id for p in corpus.passages}))
    retrieval = Retrieval(corpus, bm25, dense, settings, llm_budget, joined=joined)
    retrieval.encoder_lengths = encoder_corpus_count(retrieval, cache_dir)
    return retrieval


def encoder_budget(retrieval: Retrieval) -> TokenBudget | None:
    """What one passage may hold in the dense encoder's input (its tokenizer cuts the rest)."""
    dense = retrieval.dense
    if dense is None:
        return None
    if isinstance(dense, DenseRetriever):
        tokenizer, limit = dense.encoder.tokenizer, dense.encoder.max_length
    else:
        tokenizer, limit = dense.tokenizer, dense.max_length
    # The encoder's input holds the special tokens too ([CLS] ... [SEP]).
    return TokenBudget("the dense encoder", tokenizer, limit - 2, "the encoder's max_seq_length")


def encoder_corpus_count(retrieval: Retrieval, cache_dir: str | Path | None) -> dict[str, int] | None:
    """How many corpus passages are longer than the dense encoder's max_seq_length (its tokenizer cuts them before
    they are embedded; a question whose answer sits past the cut is not found by it), logged; None without a dense
    index. Counted once per corpus, encoder and limit (kept under `cache_dir/retrieval/lengths/`)."""
    budget = encoder_budget(retrieval)
    if budget is None:
        return None
    dense = retrieval.dense
    if isinstance(dense, DenseRetriever):
        encoder = dense.encoder.key
    else:  # a prebuilt index's encoder: its name, and its files where it is a folder
        named = retrieval.settings.dense_encoder
        encoder = fingerprint({"name": str(named), "files": model_fingerprint(named)})
    key = fingerprint({"corpus": retrieval.corpus.fingerprint, "encoder": encoder, "limit": budget.limit})
    directory = Path(cache_dir) / "retrieval" / "lengths" / key if cache_dir is not None else None
    counted = counted_once(budget, [document_text(p) for p in retrieval.corpus.passages], directory)
    log.info(budget_line("dense encoder", counted))
    return counted


def reranker_count(budget: PairBudget, candidates: Sequence[Candidates]) -> dict[str, Any]:
    """How many (question, candidate) pairs the reranker's tokenization cuts (`PairBudget.count`), logged."""
    pairs = [(c.question, document_text(p)) for c in candidates for p in c.passages]
    counted = budget.count([q for q, _ in pairs], [p for _, p in pairs])
    log.info("%d questions' candidates: %s", len(candidates), budget_line("reranker", counted))
    return counted


def question_candidates(
    retrieval: Retrieval,
    rows: Sequence[QARow],
    candidates_path: str | None = None,
    top_n: int | None = None,
    log_cut: bool = True,
) -> tuple[list[Candidates], dict[str, Any]]:
    """Top-N candidates per question (N = `retrieval.top_n` unless `top_n` says otherwise): retrieved, or
    read from `candidates_path` (a prebuilt list, cut to its first N as a retriever's would be: a TREC run or
    FlashRAG file may hold deeper lists; the cut is counted in the stats, `file_depth`, and logged unless
    `log_cut` is false: a check that reads a set a stage reads again right after)."""
    source = f"retrieval.candidates_path={candidates_path}"
    depth = int(top_n or retrieval.settings.top_n)
    if candidates_path and retrieval.settings.candidates_kind not in (None, "confrag"):  # ranked ids of the corpus
        lists = read_ranked_lists(candidates_path, retrieval.settings.candidates_format)
        found = ranked_candidates(rows, lists, retrieval.corpus, source)
    elif candidates_path:  # joined by qid, then checked by question text
        found = match_candidates(rows, load_candidates_jsonl(candidates_path), source=source)
        if retrieval.llm_budget is not None:  # their texts are the file's, not the checked corpus's
            found = [fitted_candidates(c, retrieval.llm_budget, source, retrieval.settings.cut_passages) for c in found]
    else:
        found = retrieve_candidates(rows, retrieval.corpus, retrieval.retriever, top_n=depth)
    depth_stats = None
    if candidates_path:
        found, depth_stats = cut_to_depth(found, depth, source, say=log_cut)
    cleaned, removed = zip(*(without_duplicates(c) for c in found)) if found else ((), ())
    empty = [c.qid for c in cleaned if not c.passages]
    if empty:
        raise ValueError(f"questions without any retrieved context: {empty[:5]}")
    stats = {
        "questions": len(cleaned),
        "duplicate_passages_removed": int(sum(removed)),
        "gold_retrieved": float(np.mean([c.gold_retrieved for c in cleaned])),
        # The share whose gold document is known at all: a corpus or candidates file of your own names none.
        "gold_known": float(np.mean([c.gold_source is not None for c in cleaned])),
        "answer_in_candidates": float(np.mean([any(c.has_answer) for c in cleaned])),
    }
    if depth_stats is not None:
        stats["file_depth"] = depth_stats
    lengths = dict(retrieval.lengths or {})
    if retrieval.encoder_lengths is not None:  # what the corpus loses to the encoder's cut
        lengths["dense_encoder"] = dict(retrieval.encoder_lengths)
    if retrieval.reranker_budget is not None:  # what these candidates lose to the reranker's cut
        lengths["reranker"] = reranker_count(retrieval.reranker_budget, cleaned)
    if lengths:
        stats["passage_lengths"] = lengths
    return list(cleaned), stats


def cut_to_depth(
    found: Sequence[Candidates], depth: int, source: str, say: bool = True
) -> tuple[list[Candidates], dict[str, int]]:
    """A candidates file's lists cut to their first `depth` passages (`retrieval.top_n`), as a retriever returns
    them; how many were cut, and the depth the file gave, returned (and logged with `say`)."""
    longest = max((len(c.passages) for c in found), default=0)
    cut = [c for c in found if len(c.passages) > depth]
    if cut and say:
        log.info(
            "%s: %d of %d questions' lists cut to their first %d candidates (retrieval.top_n; the file gives up to %d)",
            source,
            len(cut),
            len(found),
            depth,
            longest,
        )
    shortened = [
        dataclasses.replace(c, passages=c.passages[:depth], scores=c.scores[:depth], has_answer=c.has_answer[:depth])
        for c in found
    ]
    return shortened, {"top_n": depth, "lists_cut": len(cut), "file_longest": longest}


def fitted_candidates(candidates: Candidates, budget: TokenBudget, source: str, cut: bool) -> Candidates:
    """A candidates file's passages of one question checked against the LLM's budget (cut with `cut`)."""
    passages, _ = fit_passages(
        candidates.passages,
        budget,
        cut,
        lambda indices: [f"{source}, question {candidates.qid!r}, contexts[{i}]" for i in indices],
        "retrieval.cut_passages",
    )
    if passages == candidates.passages:
        return candidates
    return make_candidates(
        candidates.qid,
        candidates.question,
        candidates.answers,
        passages,
        candidates.scores,
        candidates.gold_source,
    )


def retrieve_fn(retrieval: Retrieval):
    """question -> the retriever's top-N passages (repeated texts removed), as the batch stages get them."""

    def retrieve(question: str) -> list:
        texts: dict[str, Any] = {}
        for index, _ in retrieval.retriever.search([question], int(retrieval.settings.top_n))[0]:
            passage = retrieval.corpus.passages[index]
            texts.setdefault(document_text(passage), passage)
        return list(texts.values())

    return retrieve
