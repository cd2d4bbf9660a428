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
    known = [SimpleNamespace(gold_source="d0")]  # a question whose own paragraph the corpus names
    stage = SimpleNamespace(preferences=SimpleNamespace(report=report, candidates=known))
    text = chain_markdown(stage, [], {}, [1])
    assert "| labels: rule sign | " in text
    assert "| labels: rule rank (no reranker: not in preferences.compare) | " in text


def test_the_chain_promises_the_probes_rows_only_when_the_run_measured_them():
    from confrag.reports.cbdr_chain import chain_intro

    without = chain_intro({})  # eval.diagnostics=false: no probe-as-reranker row, no oracle
    assert "eval.diagnostics=true; this run left them out" in without and "upper bound" not in without
    measured = chain_intro({"NQ": {"probe_auroc_on_candidates": 0.6}})
    assert "does the probe's confidence under a retrieved context predict" in measured
    assert "left them out" not in measured


def test_the_chain_gives_the_holm_p_and_says_at_which_k_the_own_paragraph_counts():
    from types import SimpleNamespace

    from confrag.rag import accuracy_ci, mcnemar_exact
    from confrag.reports.cbdr_chain import chain_markdown

    test = mcnemar_exact([1, 1, 1, 1, 1, 1, 0, 0], [0, 0, 0, 0, 0, 0, 0, 0])  # uncorrected p = 0.031
    row = {"id": "base", "dataset": "NQ", "top3": accuracy_ci([1, 0]), "gold_top3": 0.5}
    aligned = {**row, "id": "confidence_ft.sign", "top3_vs_base": test, "top3_p_holm": 0.0625}
    stage = SimpleNamespace(preferences=SimpleNamespace(report={}, candidates=[SimpleNamespace(gold_source="d0")]))
    text = chain_markdown(stage, [row, aligned], {}, [3])
    assert "own ¶ in Top-3 50.0 %, Top-3 " in text and "own ¶ first" not in text  # K = 3 is not "first"
    assert "(Holm p vs base 0.062)" in text and f"{test.pvalue:.3f}" not in text


def test_the_reading_guide_defines_the_own_paragraph_once_and_the_one_p_value():
    from confrag.reports.cbdr_setup import reading_guide

    guide = reading_guide(gold_known=True)
    assert guide.count("**Own ¶**") == 1 and "**own ¶ first**: K = 1" in guide
    assert "Table 1 and Table 2 measure different things on different questions" in guide
    assert "Holm-corrected" in guide and "only p-value" in guide
    assert "not known for this corpus" in reading_guide(gold_known=False)


def test_table1_says_what_its_labels_are_and_what_a_random_order_gets():
    """Why every row can show the same P@1: most candidates are positives, and with few questions P@1 moves in
    large steps."""
    from types import SimpleNamespace

    from confrag.reports.cbdr_setup import table1_labels_line

    rows = [{"pos": ["a", "b", "c"], "neg": ["d"]}, {"pos": ["a"], "neg": ["b"]}]
    stage = SimpleNamespace(
        preferences=SimpleNamespace(report={"selection": "sign"}, splits={"test": rows}),
        questions=SimpleNamespace(folds=[]),
        table1_rows=rows,
    )
    line = table1_labels_line(stage)
    assert "rule `sign` labels them (the paper's: the top-K candidates with Inc > 0 are pos" in line
    assert "2.0 positive and 1.0 negative a question" in line
    assert "On average 62.5 % of a question's candidates are positive" in line  # (3/4 + 1/2) / 2
    assert "P@1 moves in steps of 50.00 points" in line and "not with the own ¶ or the LLM's answers" in line


def test_an_unknown_gold_paragraph_is_said_unknown_not_zero():
    unknown = {**RETRIEVAL, "gold_retrieved": 0.0, "gold_known": 0.0}
    assert retrieval_line(unknown).startswith("the question's gold paragraph is unknown (no question's gold document")
    assert "0 %" not in retrieval_line(unknown).split(",")[0]
    partial = {**RETRIEVAL, "gold_retrieved": 0.4, "gold_known": 0.5}
    assert retrieval_line(partial).startswith(
        "the question's gold paragraph is among them for 80 % of the 50 % of questions whose gold document is known"
    )


def test_a_corpus_naming_no_questions_paragraph_reads_unknown_in_the_chain_and_table2_without_nan():
    """With a corpus of your own no question's own paragraph is known: the chain and Table 2 said 0.0 % and
    `mean rank nan`; they say unknown, and name the question set as the run does (no NQ for a PopQA run)."""
    from types import SimpleNamespace

    from confrag.rag import accuracy_ci, table2_markdown
    from confrag.reports.cbdr_chain import chain_markdown

    row = {"id": "base", "dataset": "PopQA", "top1": accuracy_ci([1, 0]), "gold_top1": None}
    gold = {"gold": {"gold_in_pos_rate": 0.0, "gold_in_neg_rate": 0.0}, "kept": 9}
    stage = SimpleNamespace(
        preferences=SimpleNamespace(
            report={"by_selection": {"rank": gold}}, candidates=[SimpleNamespace(gold_source=None)]
        )
    )
    diagnostics = {"PopQA": {"probe_auroc_on_candidates": None, "candidates": 6, "correct_share": 0.0}}
    diagnostics["PopQA"] |= {"chance_gold_first": None, "probe_gold_first": None, "probe_gold_mean_rank": None}
    diagnostics["PopQA"] |= {"questions_with_gold_known": 0, "questions_with_gold_retrieved": 0}
    diagnostics["PopQA"] |= {"questions_with_a_correct_candidate": 0.0}
    text = chain_markdown(stage, [row], diagnostics, [1], "PopQA")
    assert "| link | measured as | PopQA test |" in text and "nan" not in text
    assert "own ¶ ranked first by Conf(Q + C): unknown" in text and "| labels: rule rank | " in text
    assert "unknown, 9 |" in text and "own ¶ unknown, Top-1" in text
    table = table2_markdown([{**row, "llm": "m", "reranker": "base", "n": 2, "top1_p_holm": None}], "base", [1])
    assert table.splitlines()[2].endswith("| unknown |")


def test_candidates_from_a_file_are_described_as_the_files_lists_not_a_retrievers():
    """A TREC run's candidates were reported as "top-6 by bm25 over the candidates file"."""
    from types import SimpleNamespace

    from confrag.reports.cbdr import candidates_phrase

    from_file = SimpleNamespace(top_n=6, retriever="bm25", candidates_source="the candidates file run.trec")
    assert (
        candidates_phrase(from_file)
        == "the first 6 of each question's list in the candidates file run.trec (its own ranking)"
    )
    retrieved = SimpleNamespace(top_n=6, retriever="bm25", candidates_source="the corpus wiki.jsonl")
    assert candidates_phrase(retrieved) == "top-6 by bm25 over the corpus wiki.jsonl"
