"""The question budget and the evaluation file's overlap, refused in the task's `check` (before any stage, before
the LLM loads), naming the counts, the settings to lower, and the evaluation file's line and question."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from confrag.data import default_questions_path, load_questions_jsonl
from confrag.data.splits import select_questions
from confrag.tasks import cbdr, gates, rerank
from confrag.train import run_task

from helpers.questions import write_questions
from helpers.runs import compose_cfg


def tiny(tmp_path, questions_path, *overrides):
    return compose_cfg(["+experiment=cbdr_tiny_llama", f"paths.questions_path={questions_path}", *overrides], tmp_path)


@pytest.mark.parametrize("task", [cbdr, rerank])
def test_a_file_too_small_for_the_settings_is_refused_with_its_budget(tmp_path, nothing_runs, task):
    """50 questions failed after the LLM had loaded with "2 of its 2 questions are used before the base reranker and
    the evaluation, leaving 0": now the task's check gives every count and what to lower."""
    path = write_questions(tmp_path / "questions50.jsonl", load_questions_jsonl(default_questions_path(), limit=50))
    cfg = tiny(tmp_path, path, *([] if task is cbdr else ["task_name=rerank"]))
    with pytest.raises(ValueError) as info:
        task.check(cfg)
    message = str(info.value)
    # Run as Hydra runs it (the folder made first): the refusal is recorded there, not only in train.log.
    Path(cfg.paths.output_dir).mkdir(parents=True)
    with pytest.raises(ValueError, match="Too few questions"):
        run_task(cfg)
    failure = json.loads((Path(cfg.paths.output_dir) / "failure.json").read_text())
    assert failure["message"] == message
    assert (
        f"Too few questions: {path} holds 50 distinct questions; the probe takes 48, NQ_Rerank 2, the base reranker 0, "
        "leaving 0" in message
    )
    assert (
        "lower probe.data.num_questions=48, preferences.num_questions=24 or base_reranker.num_questions=16 by 2 in "
        "all" in message
    )


def test_an_evaluation_split_left_empty_is_refused_up_front(tmp_path, nothing_runs):
    """Found by `split_dev_test` after the probe and the rerankers; now in `check`."""
    path = write_questions(tmp_path / "nq.jsonl", load_questions_jsonl(default_questions_path(), limit=120))
    for fraction in (0.1, 0.9):
        with pytest.raises(ValueError, match=rf"eval.dev_fraction={fraction} of the 4 evaluation questions .*empty"):
            cbdr.check(tiny(tmp_path, path, "eval.num_questions=4", f"eval.dev_fraction={fraction}"))


@pytest.mark.parametrize("task", [cbdr, gates])
def test_an_evaluation_file_sharing_a_training_question_is_refused_before_any_stage(tmp_path, nothing_runs, task):
    """Refused only after the probe, NQ_Rerank and every reranker (stages/evaluation.py), naming `nq-00009`: now in
    `check`, naming the file, the line and both questions."""
    rows = load_questions_jsonl(default_questions_path(), limit=200)
    questions_path = write_questions(tmp_path / "nq.jsonl", rows[:150])
    probe_question = select_questions(rows[:150], 48, 42)[5]
    fresh = [r for r in rows[150:153]]
    leaked = probe_question.__class__(**{**probe_question.__dict__, "question": probe_question.question.upper() + "?"})
    eval_path = write_questions(tmp_path / "mine.jsonl", [*fresh, leaked], blank_after=1)
    overrides = [f"eval.questions_path={eval_path}", "eval.num_questions=null", "eval.dev_fraction=0.5"]
    cfg = compose_cfg(
        [
            "+experiment=gates_tiny_llama" if task is gates else "+experiment=cbdr_tiny_llama",
            f"paths.questions_path={questions_path}",
            *overrides,
        ],
        tmp_path,
    )
    with pytest.raises(ValueError) as info:
        task.check(cfg)
    message = str(info.value)
    # Run as Hydra runs it (the folder made first): the refusal is recorded there, not only in train.log.
    Path(cfg.paths.output_dir).mkdir(parents=True)
    with pytest.raises(ValueError, match="training questions of"):
        run_task(cfg)
    failure = json.loads((Path(cfg.paths.output_dir) / "failure.json").read_text())
    assert failure["message"] == message
    assert (
        f"eval.questions_path={eval_path}: 1 of its 4 questions are training questions of {questions_path}" in message
    )
    # Line 5: a blank line after the second record; the probe's question named by its qid in the NQ file.
    assert re.search(
        rf"line 5 {re.escape(repr(leaked.question))} is the probe's question {probe_question.qid} "
        rf"\({re.escape(repr(probe_question.question))}\)",
        message,
    ), message
    # The same file without that question passes the check.
    clean = write_questions(tmp_path / "clean.jsonl", fresh)
    cfg.eval.questions_path = clean
    task.check(cfg)


def test_the_reports_name_the_question_set_by_its_dataset_or_file(tmp_path):
    """The report called every question set "NQ" (FlashRAG's PopQA included, and an eval.questions_path file)."""
    from types import SimpleNamespace

    from confrag.instantiators import question_set_label
    from confrag.reports.cbdr_setup import evaluation_pool_line
    from confrag.stages.evaluation import NQ, RagEvaluation

    assert question_set_label(compose_cfg(["+experiment=cbdr_tiny_llama"], tmp_path)) == "NQ"
    assert question_set_label(compose_cfg(["+experiment=cbdr_tiny_llama", "dataset=popqa"], tmp_path)) == "PopQA"
    mine = write_questions(tmp_path / "mine.jsonl", load_questions_jsonl(default_questions_path(), limit=2))
    assert question_set_label(
        compose_cfg(["+experiment=cbdr_tiny_llama", f"eval.questions_path={mine}"], tmp_path)
    ) == ("mine.jsonl")
    # The fixture's HotpotQA set beside a HotpotQA dataset: two names, not one key for both.
    both = compose_cfg(["+experiment=cbdr_tiny_llama", "dataset=hotpotqa"], tmp_path)
    assert question_set_label(both) == "HotpotQA (dataset)"

    outcome = SimpleNamespace(qid="q1")
    run = SimpleNamespace(outcomes=[outcome])
    test = {"dev": [], "test": [SimpleNamespace(qid="q1")]}
    evaluation = RagEvaluation(test, [], {"PopQA": {"bm25": run}}, {}, {}, main="PopQA")
    assert evaluation.tables() == {"PopQA": {"bm25": [outcome]}}
    assert RagEvaluation(test, [], {NQ: {"bm25": run}}, {}, {}).tables() == {NQ: {"bm25": [outcome]}}
    stage = SimpleNamespace(questions=SimpleNamespace(folds=()))
    assert evaluation_pool_line(stage, "mine.jsonl").startswith(
        "from the evaluation file mine.jsonl (eval.questions_path)"
    )
