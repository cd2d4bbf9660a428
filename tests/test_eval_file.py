"""Evaluation questions from a file of their own (`eval.nq_path`): disjoint from every training pool."""

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
        match="eval.nq_path must be an existing file or null .a JSONL of NQ-format questions.; got '.*nope.jsonl'",
    ):
        shipped_settings(EvalSettings, "eval", nq_path=str(tmp_path / "nope.jsonl"))
