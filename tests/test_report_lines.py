"""The base reranker and the candidates are stated by one function each, in the rerank task's summary and in the
cbdr report alike (`confrag.reports.rerank`)."""

from __future__ import annotations

from confrag.reports import cbdr as cbdr_report
from confrag.reports.rerank import base_line, base_summary, nq_rerank_summary, retrieval_line

BASE = {
    "trained": True,
    "rows": 16,
    "questions": 17,
    "steps": 8,
    "train_seconds": 13.4,
    "dropped": {"no_gold_paragraph": 1, "no_hard_negative": 0},
    "cached": True,
}
RETRIEVAL = {"gold_retrieved": 0.875, "answer_in_candidates": 0.9, "duplicate_passages_removed": 3}


def test_one_wording_per_fact_in_both_reports():
    assert base_line(BASE) == "trained on 16 relevance rows of 17 questions no other stage uses, 8 steps, 13 s"
    assert base_line({"trained": False}) == "the backbone as it is"
    assert base_line({"trained": False, "kind": "bi-encoder, cosine"}) == "the backbone as it is (bi-encoder, cosine)"
    assert retrieval_line(RETRIEVAL) == (
        "the question's gold paragraph is among them for 88 % of questions, a gold answer string for 90 %"
    )
    # The rerank task's summary.txt: the same sentences, with what only that run says beside them.
    assert base_summary(BASE) == (
        f"  base reranker: {base_line(BASE)} (questions dropped: {BASE['dropped']}, read from the cache)"
    )
    report = {
        "questions": 20,
        "rows": {"train": 10, "test": 4},
        "dropped": 6,
        "retrieval": RETRIEVAL,
        "by_reference": {},
    }
    assert f"  candidates: {retrieval_line(RETRIEVAL)}, 3 duplicate passages removed" in nq_rerank_summary(report)
    # The cbdr report reads the same functions (its text is unchanged by sharing them).
    assert cbdr_report.base_line is base_line and cbdr_report.retrieval_line is retrieval_line


def test_the_chain_says_which_rules_labels_got_no_reranker():
    """Every rule's labels are measured, only the compared rules are trained: the chain must not invite a
    `cbdr.reranker=confidence_ft.<rule>` for a rule that has no reranker in this run."""
    from types import SimpleNamespace

    from confrag.reports.cbdr_chain import chain_markdown

    gold = {"gold": {"gold_in_pos_rate": 0.8, "gold_in_neg_rate": 0.01}, "kept": 9}
    report = {"by_selection": {"sign": gold, "rank": gold}, "rules": {"sign": {}}}
    stage = SimpleNamespace(preferences=SimpleNamespace(report=report))
    text = chain_markdown(stage, [], {}, [1])
    assert "| labels: rule sign | " in text
    assert "| labels: rule rank (no reranker: not in preferences.compare) | " in text
