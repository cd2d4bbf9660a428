"""End-to-end RAG: cached greedy answers, the retrieve → rerank → top-K → answer pipeline, Table 2 statistics."""

from confrag.rag.answers import AnswerStore, ScoredAnswer, prompt_hash, score_answer
from confrag.rag.pipeline import (
    QuestionOutcome,
    RagAnswer,
    RagRun,
    Reranker,
    check_ks,
    load_outcomes_jsonl,
    rank_contexts,
    run_rag,
    save_outcomes_jsonl,
)
from confrag.rag.stats import Accuracy, McNemar, accuracy_ci, mcnemar_exact, table2_markdown, table2_rows

__all__ = [
    "Accuracy",
    "AnswerStore",
    "McNemar",
    "QuestionOutcome",
    "RagAnswer",
    "RagRun",
    "Reranker",
    "ScoredAnswer",
    "accuracy_ci",
    "check_ks",
    "load_outcomes_jsonl",
    "mcnemar_exact",
    "prompt_hash",
    "rank_contexts",
    "run_rag",
    "save_outcomes_jsonl",
    "score_answer",
    "table2_markdown",
    "table2_rows",
]
