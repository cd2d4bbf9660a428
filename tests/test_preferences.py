"""The confidence-shift selection rule, drop counts, gold placement and the split by question."""

from __future__ import annotations

import json

import numpy as np
import pytest

from confrag.reranker.label_rules import RULES, select_by_sign, sparse_rule_message
from confrag.reranker.preferences import (
    ConfidenceShifts,
    build_rows,
    dataset_report,
    gold_placement,
    save_rows,
    split_by_question,
)
from confrag.retrieval.candidates import Candidates, make_candidates
from confrag.retrieval.corpus import CorpusPassage


def test_selection_takes_top_k_positive_and_most_negative():
    inc = np.array([0.10, -0.30, 0.50, 0.0, -0.05, 0.20, -0.40])
    pos, neg = select_by_sign(inc, top_k=2)
    assert pos == [2, 5] and neg == [6, 1]  # largest gains first; largest losses first; 0 is neither
    pos, neg = select_by_sign(inc, top_k=5)
    assert pos == [2, 5, 0] and neg == [6, 1, 4]
    with pytest.raises(ValueError, match="^top_k"):
        select_by_sign(inc, top_k=0)


def candidate_set(qid: str, n: int, gold_at: int | None) -> Candidates:
    passages = [CorpusPassage(f"{qid}-{j}#0", f"title {qid}-{j}", f"text {qid}-{j}", f"{qid}-{j}") for j in range(n)]
    gold = f"{qid}-{gold_at}" if gold_at is not None else None
    return make_candidates(qid, f"question {qid}?", ("answer",), passages, [1.0] * n, gold)


def shifts_for(sets, reference_qa, reference_empty, candidates):
    return ConfidenceShifts(
        {"qa": np.array(reference_qa), "rag_empty": np.array(reference_empty)}, [np.array(c) for c in candidates]
    )


def test_rows_follow_flagembedding_format_and_drops_are_counted():
    sets = [candidate_set("a", 3, 0), candidate_set("b", 3, None), candidate_set("c", 2, 1)]
    shifts = shifts_for(sets, [0.5, 0.5, 0.5], [0.6, 0.6, 0.6], [[0.9, 0.2, 0.6], [0.7, 0.8, 0.9], [0.1, 0.2]])
    rows, drops = build_rows(sets, shifts, "qa", top_k=5, selection="sign")
    assert [r["qid"] for r in rows] == ["a"]
    assert drops == {"no_positive": 1, "no_negative": 1, "neither": 0}
    row = rows[0]
    assert set(row) == {"qid", "query", "pos", "neg", "pos_scores", "neg_scores", "prompt"}
    assert row["pos"] == ["title a-0\ntext a-0", "title a-2\ntext a-2"]
    assert row["neg"] == ["title a-1\ntext a-1"]
    assert np.allclose(row["pos_scores"], [0.4, 0.1]) and np.allclose(row["neg_scores"], [-0.3])
    # the reference choice changes which side a context falls on
    rows_empty, _ = build_rows(sets, shifts, "rag_empty", top_k=5, selection="sign")
    assert rows_empty[0]["pos"] == ["title a-0\ntext a-0"]
    with pytest.raises(ValueError, match="^reference"):
        build_rows(sets, shifts, "nope", top_k=5, selection="sign")


def test_gold_placement_counts_questions_with_a_retrieved_gold_passage():
    sets = [candidate_set("a", 3, 0), candidate_set("b", 3, 2), candidate_set("c", 3, None)]
    shifts = shifts_for(sets, [0.5] * 3, [0.5] * 3, [[0.9, 0.1, 0.5], [0.9, 0.8, 0.1], [0.9, 0.1, 0.2]])
    placement = gold_placement(sets, shifts, "qa", top_k=5, selection="sign")
    assert placement["questions_with_gold"] == 2
    assert placement["gold_in_pos"] == 1 and placement["gold_in_neg"] == 1
    assert placement["gold_in_pos_rate"] == 0.5


def test_gold_placement_counts_only_the_questions_trained_on():
    """A question whose row is dropped (here: no context lowers Conf, so no negative) teaches nothing: before, its
    gold passage counted in the rates, so a rule that drops most questions looked noisier than its rows are."""
    sets = [candidate_set("a", 3, 0), candidate_set("b", 3, 2), candidate_set("d", 3, 1)]
    shifts = shifts_for(sets, [0.5] * 3, [0.5] * 3, [[0.9, 0.1, 0.5], [0.9, 0.8, 0.1], [0.9, 0.8, 0.7]])
    placement = gold_placement(sets, shifts, "qa", top_k=5, selection="sign")
    assert placement["questions_with_gold"] == 2 and placement["dropped_with_gold"] == 1
    assert placement["gold_in_pos"] == 1 and placement["gold_in_neg"] == 1 and placement["gold_in_neg_rate"] == 0.5


def test_report_covers_both_references_and_prints_examples():
    sets = [candidate_set(q, 3, 0) for q in "abcd"]
    shifts = shifts_for(sets, [0.5] * 4, [0.7] * 4, [[0.9, 0.1, 0.6]] * 4)
    rows, drops = build_rows(sets, shifts, "qa", 5, "sign")
    report = dataset_report(sets, shifts, 5, {"train": rows[:3], "test": rows[3:]}, "qa", drops, "sign")
    assert set(report["by_reference"]) == {"qa", "rag_empty"}
    assert report["by_reference"]["qa"]["gold"]["gold_in_pos_rate"] == 1.0
    assert report["by_reference"]["rag_empty"]["share_positive"] == pytest.approx(1 / 3)
    assert len(report["examples"]) == 3
    assert report["examples"][0]["confidence_before"] == 0.5 and report["examples"][0]["raises"]["confidence"] == 0.9
    json.dumps(report)  # the report is saved as JSON


def test_split_is_by_question_and_seeded(tmp_path):
    rows = [
        {
            "qid": f"q{i // 2}",
            "query": "x",
            "pos": ["p"],
            "neg": ["n"],
            "pos_scores": [0.1],
            "neg_scores": [-0.1],
            "prompt": "p",
        }
        for i in range(40)
    ]
    splits = split_by_question(rows, 0.25, seed=3)
    train_q, test_q = {r["qid"] for r in splits["train"]}, {r["qid"] for r in splits["test"]}
    assert not train_q & test_q and len(test_q) == 5
    assert splits == split_by_question(rows, 0.25, seed=3)
    with pytest.raises(ValueError, match="^test_fraction"):
        split_by_question(rows, 1.0, seed=3)
    save_rows(splits, tmp_path)
    lines = (tmp_path / "train.jsonl").read_text().splitlines()
    assert len(lines) == len(splits["train"]) and json.loads(lines[0])["pos"] == ["p"]
    from datasets import load_from_disk

    assert load_from_disk(str(tmp_path / "test_arrow")).num_rows == len(splits["test"])


def test_a_label_rule_is_one_table_entry(monkeypatch):
    from confrag.reranker.label_rules import LabelRule

    assert all(rule.id == key for key, rule in RULES.items()) and [r for r in RULES if RULES[r].needs_answers] == [
        "utility"
    ]
    # A toy rule: the first candidate positive, the last negative. Registered, build_rows uses it as it is.
    toy = LabelRule("ends", "first pos, last neg", lambda inc, conf, correct, k: ([0], [len(conf) - 1]))
    monkeypatch.setitem(RULES, "ends", toy)
    sets = [candidate_set("q1", 3, gold_at=0)]
    shifts = shifts_for(sets, [0.5], [0.5], [[0.1, 0.2, 0.3]])
    rows, drops = build_rows(sets, shifts, "qa", 2, "ends")
    assert [(r["pos"], r["neg"]) for r in rows] == [(["title q1-0\ntext q1-0"], ["title q1-2\ntext q1-2"])]
    with pytest.raises(ValueError, match=r"^selection='nope' is not one of"):
        build_rows(sets, shifts, "qa", 2, "nope")


def test_a_rule_that_drops_most_questions_is_reported_with_the_share_of_positive_shifts():
    """A reference scored below every candidate (as a post-retrieval probe scores the empty-context prompt) leaves
    `sign` no negative: the message says how many questions it keeps and why; `rank` keeps them all."""
    sets = [candidate_set(q, 3, 0) for q in "abcd"]
    shifts = shifts_for(
        sets, [0.5] * 4, [0.01] * 4, [[0.9, 0.2, 0.6], [0.3, 0.4, 0.5], [0.1, 0.2, 0.3], [0.2, 0.0, 0.4]]
    )
    _, drops = build_rows(sets, shifts, "rag_empty", top_k=1, selection="sign")
    assert drops == {"no_positive": 0, "no_negative": 3, "neither": 0}  # d's 0.0 is the one Inc < 0
    share = dataset_report(sets, shifts, 1, {}, "rag_empty", drops, "sign")["by_reference"]["rag_empty"][
        "share_positive"
    ]
    message = sparse_rule_message(RULES["sign"], drops, len(sets), share, "rag_empty")
    assert "keeps 1 of 4 questions" in message and "positive for 91.7 % of candidates" in message
    assert "preferences.selection=rank" in message
    _, rank_drops = build_rows(sets, shifts, "rag_empty", top_k=1, selection="rank")
    assert sparse_rule_message(RULES["rank"], rank_drops, len(sets)) is None
    half_kept = {"no_positive": 2, "no_negative": 0, "neither": 0}
    assert sparse_rule_message(RULES["sign"], half_kept, 4) is None


def test_the_perfect_relevance_control_labels_the_own_paragraph_positive_under_both_rules():
    """preferences.confidence=relevance: Conf 1 on the own paragraph's passages, 0 elsewhere, references 0.5. With
    one relevant passage, sign at K = 5 keeps one positive and five negatives; rank at K = 5 must take four
    irrelevant passages as positives too (what the rule does to a question with one relevant passage)."""
    from confrag.reranker.confidence_sources import SOURCES, relevance_shifts

    assert set(SOURCES) == {"probe", "relevance"}
    sets = [candidate_set("a", 12, 3), candidate_set("b", 12, None)]
    shifts = relevance_shifts(sets)
    rows, drops = build_rows(sets, shifts, "qa", top_k=5, selection="sign")
    assert [r["qid"] for r in rows] == ["a"] and drops["no_positive"] == 1  # b: its own paragraph not retrieved
    assert rows[0]["pos"] == ["title a-3\ntext a-3"] and len(rows[0]["neg"]) == 5
    assert rows[0]["pos_scores"] == [0.5] and set(rows[0]["neg_scores"]) == {-0.5}
    ranked, _ = build_rows(sets, shifts, "qa", top_k=5, selection="rank")
    assert len(ranked[0]["pos"]) == 5 and ranked[0]["pos"][0] == "title a-3\ntext a-3"
    one, _ = build_rows(sets, shifts, "rag_empty", top_k=1, selection="rank")
    assert one[0]["pos"] == ["title a-3\ntext a-3"]


def test_each_rule_and_teacher_is_described_in_its_registry_entry_only():
    """One catalogue per extension point: the config and the docs point at the registry instead of listing what
    each entry does (a list beside it goes stale when an entry is added)."""
    from confrag.stages.teachers import ROW_TEACHERS

    from helpers.runs import ROOT

    entries = [*RULES.values(), *ROW_TEACHERS.values()]
    assert all(key == entry.id and len(entry.description) > 20 for key, entry in {**RULES, **ROW_TEACHERS}.items())
    config = (ROOT / "conf" / "preferences" / "default.yaml").read_text()
    assert "label_rules.py" in config and "teachers.py" in config
    for path in [ROOT / "conf" / "preferences" / "default.yaml", *(ROOT / "docs").glob("*.md")]:
        text = " ".join(path.read_text().split())
        for entry in entries:
            assert entry.description[:40] not in text, f"{path.name} repeats the description of {entry.id}"
