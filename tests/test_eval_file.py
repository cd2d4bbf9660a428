"""Evaluation questions from a file of their own (`eval.questions_path`): disjoint from every training pool."""

from __future__ import annotations

import gzip
import json
from types import SimpleNamespace

import pytest

from confrag.data.splits import QuestionPlan
from confrag.rag.settings import EvalSettings
from confrag.stages.evaluation import evaluation_rows

from helpers.settings import shipped_settings


def write_nq(path, rows):
    with gzip.open(path, "wt", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps({"question": row.question, "answers": list(row.answers)}) + "\n")
    return str(path)


def stage_of(nq_rows):
    probe, preference, base, rest = nq_rows[:10], nq_rows[10:20], nq_rows[20:30], nq_rows[30:]
    return SimpleNamespace(
        probe_data=SimpleNamespace(data=SimpleNamespace(rows=probe)),
        questions=QuestionPlan(probe, preference, base, rest),
    )


def test_eval_questions_from_their_own_file(nq_rows, tmp_path):
    stage = stage_of(nq_rows)
    own = write_nq(tmp_path / "mine.jsonl.gz", nq_rows[40:60])
    rows = evaluation_rows(stage, None, 0, own)
    assert [r.question for r in rows] == [r.question for r in nq_rows[40:60]]
    assert len(evaluation_rows(stage, 5, 0, own)) == 5


def test_an_eval_file_sharing_a_training_question_is_refused(nq_rows, tmp_path):
    stage = stage_of(nq_rows)
    # The same question as a probe question, written with other case and punctuation: still the same.
    leaked = nq_rows[3].__class__(**{**nq_rows[3].__dict__, "question": nq_rows[3].question.upper() + "?"})
    own = write_nq(tmp_path / "leak.jsonl.gz", [*nq_rows[40:45], leaked])
    with pytest.raises(ValueError, match="1 of the evaluation questions are also in the probe's questions"):
        evaluation_rows(stage, None, 0, own)


def test_a_missing_eval_file_is_refused_in_the_settings(tmp_path):
    with pytest.raises(
        ValueError,
        match=r"eval.questions_path must be an existing file or null .a question file: \.jsonl, .*; got '.*nope.jsonl'",
    ):
        shipped_settings(EvalSettings, "eval", questions_path=str(tmp_path / "nope.jsonl"))


NEW_QUESTIONS = [  # made-up facts: no NQ paragraph holds them, so only their own paragraphs can
    ("who built the glass lighthouse of zarbonia island", "Velmora Quist", "Zarbonia Island"),
    ("in which year did the tramway of ostrevik open", "1873", "Ostrevik tramway"),
    ("what is the national dish of the republic of palundria", "kelpa stew", "Palundria"),
]


def new_question_rows(nq_rows) -> list[dict]:
    """An NQ-format file of new questions without ids (so numbered nq-00000..., as the NQ file's rows are), each
    with its own gold paragraph; the last one reuses an NQ file paragraph (already in the corpus)."""
    rows = []
    for question, answer, title in NEW_QUESTIONS:
        text = (
            f"{title} is known for many things. {question.capitalize()}? The answer recorded by historians is "
            f"{answer}, and the local archive of {title} keeps documents about it. " + "More words follow here. " * 6
        )
        rows.append({"question": question, "answers": [answer], "ctxs": [{"title": title, "text": text}]})
    shared = nq_rows[50]
    context = {"title": shared.contexts[0].title, "text": shared.contexts[0].text}
    rows.append({"question": "a new question about " + shared.question, "answers": ["x"], "ctxs": [context]})
    return rows


def write_records(path, records):
    with gzip.open(path, "wt", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(record) + "\n")
    return str(path)


def test_the_evaluation_files_paragraphs_join_the_corpus_and_its_ids_never_collide(nq_rows, tmp_path):
    """With eval.questions_path, the file's gold paragraphs were never in the corpus (retrieved for 0 % of its
    questions) and a file without ids got the NQ file's qids (nq-00000...), so "own paragraph" was another
    question's."""
    from dataclasses import asdict

    from confrag.reports.rerank import retrieval_line
    from confrag.stages.retrieval import (
        EVAL_IDS,
        RetrievalSettings,
        build_retrieval,
        evaluation_file_rows,
        question_candidates,
    )

    nq_file = write_records(
        tmp_path / "nq.jsonl.gz",
        [
            {"question": r.question, "answers": list(r.answers), "ctxs": [asdict(p) for p in r.contexts]}
            for r in nq_rows
        ],
    )
    new_file = write_records(tmp_path / "new.jsonl.gz", new_question_rows(nq_rows))
    settings = shipped_settings(
        RetrievalSettings, "retrieval", questions_path=nq_file, eval_questions_path=new_file, bi_encoder=False, top_n=5
    )
    assert shipped_settings(RetrievalSettings, "retrieval").eval_questions_path is None  # no eval node: none
    retrieval = build_retrieval(settings, tmp_path / "cache")
    rows = evaluation_file_rows(new_file)
    assert [r.qid for r in rows] == [f"{EVAL_IDS}nq-{i:05d}" for i in range(4)]
    assert not {r.qid for r in rows} & {r.qid for r in nq_rows}
    assert retrieval.joined == {"questions": 4, "with_paragraph": 4, "documents_added": 3}
    candidates, stats = question_candidates(retrieval, rows)
    # Every new question's own paragraph is retrieved, and "own" is its own document, not an NQ question's.
    assert stats["gold_retrieved"] == 1.0
    for row, found in zip(rows, candidates):
        own = [p for p, gold in zip(found.passages, found.from_gold) if gold]
        assert own and all(
            (p.title, p.text.split()[:5]) == (row.contexts[0].title, row.contexts[0].text.split()[:5]) for p in own
        )
    assert [c.gold_source for c in candidates[:3]] == [r.qid for r in rows[:3]]
    assert candidates[3].gold_source == retrieval.corpus.gold_source_of[nq_rows[50].qid]  # the shared paragraph
    # Without the file, the same questions find no paragraph of theirs (the 0 %).
    plain = build_retrieval(
        shipped_settings(RetrievalSettings, "retrieval", questions_path=nq_file, bi_encoder=False, top_n=5),
        tmp_path / "cache",
    )
    assert question_candidates(plain, rows[:3])[1]["gold_retrieved"] == 0.0
    line = retrieval_line({**stats, "eval_file": retrieval.joined})
    assert (
        "the evaluation file's paragraphs joined the corpus: 4 of its 4 questions have one, 3 documents added" in line
    )


def test_the_overlap_check_reads_hyphens_as_spaces(nq_rows, tmp_path):
    """ "3-second" and "3 second" are one question: the answer normalization dropped the hyphen ("3second") and
    let a training question through as an evaluation question."""
    from confrag.data.splits import question_key
    from confrag.retrieval.candidates import same_question
    from confrag.stages.question_budget import check_evaluation_file

    trained = nq_rows[2].__class__(**{**nq_rows[2].__dict__, "question": "what is the 3 second rule in basketball"})
    plan = QuestionPlan([*nq_rows[:2], trained, *nq_rows[3:10]], nq_rows[10:20], nq_rows[20:30], nq_rows[30:])
    asked = nq_rows[2].__class__(**{**nq_rows[2].__dict__, "question": "What is the 3-second rule in basketball?"})
    own = write_nq(tmp_path / "hyphen.jsonl.gz", [*nq_rows[40:43], asked])
    with pytest.raises(ValueError, match=r"1 of its 4 questions are training questions .*line 4 'What is the 3-second"):
        check_evaluation_file(own, plan, nq_rows, "nq.jsonl")
    assert question_key(asked) == question_key(trained) == "what is 3 second rule in basketball"
    assert same_question("the 3–second rule", "the 3 second rule")  # an en dash too
    assert not same_question("the 3-second rule", "the 3 seconds rule")
