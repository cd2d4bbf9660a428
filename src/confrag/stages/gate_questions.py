"""The gate comparison's questions and contexts: the training and test questions, the clean contexts
(retrieved, reranked once) and the conflicting ones.

Conflicting contexts (`data/conflicts.py` builds the passages, BRIDGE's FI construction): the gold
paragraph with every occurrence of its answer replaced by a same-kind answer of another evaluation
question. The contexts are that paragraph first, then the clean ranking's best K − 1 passages that were
not split from the gold paragraph (every piece of the original gold paragraph is replaced by its one
rewritten version, retrieved or not). Test questions whose gold paragraph does not contain an answer, or
have no usable substitute, are left out of *both* conditions, so clean and conflicting are the same
questions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from confrag.data.conflicts import ConflictExample, build_conflicts
from confrag.data.gold_needs import refuse_without_gold
from confrag.data.nq import QARow, load_questions_jsonl
from confrag.data.splits import split_dev_test
from confrag.gates.base import Gate
from confrag.gates.signal_maker import check_signals_before_loading
from confrag.rag import rank_contexts
from confrag.retrieval import Candidates
from confrag.retrieval.candidates import make_candidates
from confrag.stages.rerank import Scorer

CLEAN, CONFLICTING = "clean", "conflicting"
CONDITIONS = (CLEAN, CONFLICTING)


@dataclass
class QuestionSets:
    train: list[QARow]
    test: list[QARow]  # test questions with a conflicting version
    conflicts: dict[str, ConflictExample]  # test qid -> its conflicting gold paragraph
    report: dict[str, Any]


# Why the gates task refuses a question set without gold paragraphs, whatever its settings (the task's check).
WITHOUT_GOLD = (
    'the gates task edits into its conflicting contexts, so it needs a question set in the confrag format with "ctxs" '
    "(the cbdr task runs without them)"
)


def require_gold_paragraphs(rows: Sequence[QARow], where: str) -> None:
    """The conflicting contexts are edited copies of the questions' gold paragraphs: a question set without any
    (FlashRAG's format has none) cannot be compared on them, however many questions it has."""
    refuse_without_gold(where, rows, [WITHOUT_GOLD])


def check_before_any_stage(gates: dict[str, Gate], llm_cfg: Any, probe_data: Any) -> None:
    """What the gates task can refuse before the probe, NQ_Rerank and the rerankers run: a gate reading a signal
    the LLM cannot give (from its tokenizer), and a question file without gold paragraphs (`probe_data`: the
    probe's unbuilt data module, whose file every question of the run comes from)."""
    check_signals_before_loading(gates, llm_cfg)
    rows = load_questions_jsonl(probe_data.questions_path, questions_format=probe_data.questions_format)
    require_gold_paragraphs(rows, str(probe_data.questions_path))


def question_sets(rows: Sequence[QARow], dev_fraction: float, seed: int) -> QuestionSets:
    """The cbdr task's evaluation questions: its dev split trains the gates, its test split (where a
    conflicting version exists) evaluates them."""
    require_gold_paragraphs(rows, "the evaluation question set")
    parts = split_dev_test(rows, dev_fraction, seed)
    # Substitutes are drawn from every evaluation question (a larger pool of same-kind answers).
    conflict_set = build_conflicts(rows, seed)
    conflicts = {e.qid: e for e in conflict_set.examples}
    test = [r for r in parts["test"] if r.qid in conflicts]
    if not test:
        raise ValueError(
            f"none of the {len(parts['test'])} test questions has a conflicting version (skipped: "
            f"{dict(conflict_set.skipped)}); raise eval.num_questions"
        )
    kinds = sorted({e.kind for e in conflicts.values()})
    report = {
        "evaluation_questions": len(rows),
        "train": len(parts["dev"]),
        "test_all": len(parts["test"]),
        "test": len(test),
        "conflicts_skipped": dict(conflict_set.skipped),
        "kinds": {k: sum(conflicts[r.qid].kind == k for r in test) for k in kinds},
    }
    return QuestionSets(parts["dev"], test, {r.qid: conflicts[r.qid] for r in test}, report)


def reranked(candidates: Sequence[Candidates], scorer: Scorer) -> list[Candidates]:
    """Each question's candidates in the reranker's order (ranked once; `run_rag` then keeps the order)."""
    out = []
    for c in candidates:
        order = rank_contexts(c.question, c.passages, scorer, where=f"question {c.qid!r}: ")
        out.append(
            make_candidates(
                c.qid,
                c.question,
                c.answers,
                [c.passages[i] for i in order],
                [c.scores[i] for i in order],
                c.gold_source,
            )
        )
    return out


def conflicting_candidates(ranked: Candidates, example: ConflictExample, k: int) -> Candidates:
    """The conflicting paragraph first, then the best K − 1 passages not split from the gold paragraph."""
    rest = [(p, s) for p, s, gold in zip(ranked.passages, ranked.scores, ranked.from_gold) if not gold][: k - 1]
    # The conflicting paragraph was placed, not retrieved: it has no retrieval score.
    return make_candidates(
        ranked.qid,
        ranked.question,
        ranked.answers,
        [example.passage, *(p for p, _ in rest)],
        [math.nan, *(s for _, s in rest)],
        ranked.gold_source,
    )
