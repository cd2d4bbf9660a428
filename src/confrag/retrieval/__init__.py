"""Retrieval for the preference stage: corpora split into passages, BM25 and dense retrievers, and the
top-N candidate contexts of each question (with whether they hold the gold document or an answer)."""

from confrag.retrieval.bm25 import BM25Retriever
from confrag.retrieval.candidates import (
    Candidates,
    CandidatesMismatchError,
    Retriever,
    load_candidates_jsonl,
    match_candidates,
    retrieve_candidates,
    save_candidates_jsonl,
    validate_candidates_jsonl,
)
from confrag.retrieval.corpus import (
    Corpus,
    CorpusPassage,
    corpus_from_gold_paragraphs,
    document_text,
    load_corpus_jsonl,
    split_passages,
    validate_corpus_jsonl,
)
from confrag.retrieval.dense import DenseRetriever, MeanPoolEncoder, default_model_dir, model_fingerprint

__all__ = [
    "BM25Retriever",
    "Candidates",
    "CandidatesMismatchError",
    "Corpus",
    "CorpusPassage",
    "DenseRetriever",
    "MeanPoolEncoder",
    "Retriever",
    "corpus_from_gold_paragraphs",
    "default_model_dir",
    "document_text",
    "load_candidates_jsonl",
    "load_corpus_jsonl",
    "match_candidates",
    "model_fingerprint",
    "retrieve_candidates",
    "save_candidates_jsonl",
    "split_passages",
    "validate_candidates_jsonl",
    "validate_corpus_jsonl",
]
