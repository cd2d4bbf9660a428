"""What NQ_Rerank's controls need from the candidates (`confrag.stages.label_checks`): refused before the LLM loads
when the candidates cannot give it, and named with the counts where a rule or the relevance control is left with no
row (it read "data.train: no preference rows")."""

from __future__ import annotations

import logging

import pytest

from confrag.retrieval.candidates import make_candidates
from confrag.retrieval.corpus import CorpusPassage
from confrag.stages.label_checks import (
    CandidateCounts,
    check_label_sources,
    empty_split_message,
    relevance_control_rows,
)
from confrag.stages.nq_rerank import PreferenceSettings

from helpers.settings import shipped_settings


def question(i: int, gold: bool, answer: bool, gold_known: bool = True):
    """Question i with 4 candidates: the first from its own paragraph when `gold`, the second holding its answer
    when `answer`; its gold paragraph known (`q<i>`) unless `gold_known` is false (a corpus of your own)."""
    texts = ["zorblat quenches the flimmer", "vastrel grooves hum at dusk", "plinth of gromwell", "the yarrow kettle"]
    if answer:
        texts[1] = f"the answer is answer{i} indeed"
    passages = [
        CorpusPassage(f"d{i}.{j}#0", "t", text, f"q{i}" if gold and j == 0 else f"d{i}.{j}")
        for j, text in enumerate(texts)
    ]
    return make_candidates(
        f"q{i}", f"question {i}", [f"answer{i}"], passages, [4.0, 3.0, 2.0, 1.0], f"q{i}" if gold_known else None
    )


def settings(**values) -> PreferenceSettings:
    return shipped_settings(PreferenceSettings, "preferences", **{"top_k": 2, "test_fraction": 0.25, **values})


def test_a_corpus_without_the_questions_paragraphs_or_answers_is_refused_naming_both_controls():
    unrelated = [question(i, gold=False, answer=False, gold_known=False) for i in range(8)]
    with pytest.raises(ValueError) as err:
        check_label_sources(settings(confidence="relevance", relevance_baseline=True), unrelated, seed=0)
    message = str(err.value)
    assert message.startswith(
        "preferences.confidence=relevance needs each question's own paragraph among its candidates (Conf 1 on it, "
        "0 elsewhere): 8 of the 8 NQ_Rerank questions have none (their gold paragraph is not known: a corpus of "
        "your own names no question's paragraph)"
    )
    assert "or set preferences.confidence=probe" in message
    assert (
        "preferences.relevance_baseline=true (the control fine-tuned on relevance labels: a candidate holding a gold "
        "answer is positive) has no row: of the 8 NQ_Rerank questions, 8 have no candidate holding a gold answer and "
        "0 only such candidates (a row needs one of each)" in message
    )
    assert "set preferences.relevance_baseline=false" in message
    # The paper's settings (the probe's confidence, no control) have nothing to check here.
    check_label_sources(settings(confidence="probe", relevance_baseline=False), unrelated, seed=0)
    # A corpus holding the questions' own paragraphs and answers passes both.
    check_label_sources(
        settings(confidence="relevance", relevance_baseline=True), [question(i, True, True) for i in range(8)], 0
    )


def test_the_relevance_confidence_refuses_an_empty_split_and_warns_of_questions_without_their_paragraph(caplog):
    one = [question(0, gold=True, answer=True)] + [question(i, gold=False, answer=True) for i in range(1, 8)]
    with pytest.raises(ValueError) as err:  # sign keeps the one question with its paragraph: train or test is empty
        check_label_sources(settings(confidence="relevance", relevance_baseline=False), one, seed=0)
    assert "7 of the 8 NQ_Rerank questions have none, and rule sign keeps " in str(err.value)
    assert "(dropped: {'no_positive': 7, 'no_negative': 0, 'neither': 0})" in str(err.value)
    most = [question(i, gold=i > 0, answer=True) for i in range(8)]
    with caplog.at_level(logging.WARNING, logger="confrag.stages.label_checks"):
        check_label_sources(settings(confidence="relevance", relevance_baseline=False), most, seed=0)
    assert "1 of the 8 NQ_Rerank questions have none: rule sign drops them" in caplog.text


def test_the_relevance_control_with_no_row_names_itself_and_the_counts():
    candidates = [question(0, True, answer=True), *(question(i, True, answer=False) for i in range(1, 5))]
    assert len(relevance_control_rows(candidates, {"q0", "q1"}, 2, "sign")) == 1
    with pytest.raises(ValueError) as err:
        relevance_control_rows(candidates, {"q1", "q2", "q3"}, 2, "rank", "_fold1")
    assert str(err.value) == (
        "preferences.relevance_baseline=true (the control fine-tuned on relevance labels: a candidate holding a gold "
        "answer is positive) has no training row of fold 1: it trains on the 3 training questions that rule rank kept "
        "rows for; of these, 3 have no candidate holding a gold answer and 0 only such candidates (a row needs one of "
        "each). Set preferences.relevance_baseline=false, or use a corpus that holds the questions' answers"
    )
    assert CandidateCounts.of(candidates).without_answer == 4


def test_an_empty_nq_rerank_split_names_the_rule_the_confidence_source_and_the_counts():
    message = empty_split_message(settings(), 24, {"train": 0, "test": 0}, {"no_positive": 0, "no_negative": 24})
    assert message.startswith(
        "NQ_Rerank has 0 train and 0 test rows: label rule preferences.selection=sign on Conf from "
        "preferences.confidence=probe kept 0 of its 24 questions (dropped: {'no_positive': 0, 'no_negative': 24})"
    )


def test_a_selection_rule_without_training_rows_is_named_not_left_to_fail_later():
    """The fold's selection rule kept no row: its reranker was skipped like a compared rule's, and the run failed later
    looking it up."""
    from types import SimpleNamespace

    from confrag.stages.rerank import aligned_rerankers

    recipe = SimpleNamespace(preferences=settings(), reranker=SimpleNamespace(eval_batch_size=2))
    stage = SimpleNamespace(splits_by_rule={"sign": {"train": [{"qid": "q9"}], "test": []}}, candidates=[])
    with pytest.raises(ValueError) as err:
        aligned_rerankers(recipe, None, stage, {"q1", "q2"}, None, "_fold1", [], None)
    assert str(err.value).startswith(
        "label rule preferences.selection=sign on Conf from preferences.confidence=probe kept no row among the 2 "
        "training questions of fold 1: "
    )
