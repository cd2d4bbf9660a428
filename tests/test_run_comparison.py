"""`confrag-compare-runs`: one Table 2 over cbdr runs of the same question plan, shipped with the package (a console
command of the wheel, not only a script of the checkout)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from confrag.data.qa_metrics import has_answer
from confrag.rag.answers import ScoredAnswer
from confrag.rag.pipeline import QuestionOutcome, RagAnswer, save_outcomes_jsonl
from confrag.reports.run_comparison import main

from helpers.runs import ROOT

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

QIDS = [f"q{i:02d}" for i in range(12)]


def outcome(qid: str, right: bool) -> QuestionOutcome:
    answer = "paris" if right else "lyon"
    scored = dict(has_answer=has_answer(answer, ["Paris"]), em=right, f1=float(right), has_answer_dpr=right)
    closed = ScoredAnswer(answer="rome", has_answer=False, em=False, f1=0.0, has_answer_dpr=False)
    return QuestionOutcome(qid, f"question {qid}?", ("Paris",), closed, {1: RagAnswer(answer=answer, **scored)})


def cbdr_run(folder: Path, systems: dict[str, list[bool]]) -> Path:
    """A run folder as the cbdr task leaves it: metrics.json (its test questions), the resolved config, outcomes."""
    folder.mkdir(parents=True)
    (folder / "metrics.json").write_text(json.dumps({"eval": {"test": QIDS[:10]}}))
    config = "seed: 7\neval:\n  expected_discordance: 0.2\nretrieval:\n  corpus_path: corpus.jsonl\n"
    (folder / "config_resolved.yaml").write_text(config)
    for system, right in systems.items():
        path = folder / "outcomes" / "nq" / f"{system}.jsonl"
        save_outcomes_jsonl([outcome(q, r) for q, r in zip(QIDS, right)], path)
    return folder


def test_compare_runs_prints_one_table_over_two_runs_paired_with_the_base(tmp_path, capsys):
    base = [True] * 6 + [False] * 6
    a = cbdr_run(tmp_path / "a", {"base": base, "confidence_ft.sign": [True] * 3 + [False] * 9})
    b = cbdr_run(tmp_path / "b", {"base": base, "confidence_ft.rank": [True] * 9 + [False] * 3})
    main([f"qarag={a}", f"cand={b}"])
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "nq, Top-1 has_answer, n = 10 test questions; Holm over 2 rows"
    names = [line.split(" | ")[0].removeprefix("| ") for line in out[3:]]
    assert names == ["base", "confidence_ft.sign", "cand:confidence_ft.rank"]  # the shared base shown once
    assert "60.0" in out[3] and "30.0" in out[4] and "90.0" in out[5]


def test_compare_runs_refuses_a_run_that_answers_the_shared_base_differently(tmp_path):
    a = cbdr_run(tmp_path / "a", {"base": [True] * 12})
    b = cbdr_run(tmp_path / "b", {"base": [False] * 12})
    with pytest.raises(SystemExit, match="base: cand answers differently"):
        main([f"qarag={a}", f"cand={b}"])


def test_compare_runs_is_a_console_command_of_the_package():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["confrag-compare-runs"] == "confrag.reports.run_comparison:main"
    assert scripts["confrag-sweep-summary"] == "confrag.infra.sweep_summary:main"
    # The checkout's script is the same command, not a second copy of it.
    assert "from confrag.reports.run_comparison import main" in (ROOT / "experiments" / "compare_runs.py").read_text()


def test_gold_sources_read_the_question_file_of_a_run(tmp_path):
    from confrag.reports.run_comparison import gold_sources

    questions = tmp_path / "q.jsonl"
    rows = [{"question": f"q{i}?", "answers": ["a"], "ctxs": [{"title": "T", "text": f"text {i}"}]} for i in range(2)]
    questions.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = tmp_path / "run"
    run.mkdir()
    (run / "config_resolved.yaml").write_text(f"retrieval:\n  questions_path: {questions}\n  words_per_passage: 100\n")
    assert gold_sources(run) == {"nq-00000": "nq-00000", "nq-00001": "nq-00001"}
