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


def cbdr_run(folder: Path, systems: dict[str, list[bool]], dataset: str | None = None) -> Path:
    """A run folder as the cbdr task leaves it: metrics.json (its test questions; the folder of its question set
    from `dataset` on, none in a run written before), the resolved config, outcomes."""
    folder.mkdir(parents=True)
    record = {"test": QIDS[:10], **({"questions": dataset, "outcomes": dataset.lower()} if dataset else {})}
    (folder / "metrics.json").write_text(json.dumps({"eval": record}))
    config = "seed: 7\neval:\n  expected_discordance: 0.2\nretrieval:\n  corpus_path: corpus.jsonl\n"
    (folder / "config_resolved.yaml").write_text(config)
    for system, right in systems.items():
        path = folder / "outcomes" / (dataset or "NQ").lower() / f"{system}.jsonl"
        save_outcomes_jsonl([outcome(q, r) for q, r in zip(QIDS, right)], path)
    return folder


def table_rows(out: str) -> list[list[str]]:
    return [line.strip("| ").split(" | ") for line in out.splitlines() if line.startswith("| ") and "---" not in line][
        1:
    ]


def test_compare_runs_prints_one_table_over_two_runs_paired_with_the_base(tmp_path, capsys):
    base = [True] * 6 + [False] * 6
    a = cbdr_run(tmp_path / "a", {"base": base, "confidence_ft.sign": [True] * 3 + [False] * 9})
    b = cbdr_run(tmp_path / "b", {"base": base, "confidence_ft.rank": [True] * 9 + [False] * 3})
    main([f"qarag={a}", f"cand={b}"])
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "nq, Top-1 has_answer, n = 10 test questions; Holm over 2 rows"
    rows = table_rows(out)
    # Keyed by run and system; the base both runs share (the same answers) shown once, and said so.
    assert [r[0] for r in rows] == ["qarag:base", "qarag:confidence_ft.sign", "cand:confidence_ft.rank"]
    assert "60.0" in rows[0][1] and "30.0" in rows[1][1] and "90.0" in rows[2][1]
    assert "Shown once (the same answers to every question): cand:base = qarag:base" in out


def test_two_settings_of_one_rule_are_two_rows_paired_on_the_same_questions_and_holm_corrected(tmp_path, capsys):
    """Two cbdr runs differing only in model.tau: the same system id, other answers. Each is its own row (it was one
    row, or refused as answering differently), each paired with the base on the same questions, Holm across both."""
    base = [True] * 6 + [False] * 6
    tau05 = [True] * 10 + [False] * 2  # 4 questions only it gets right (of the 10 test questions: q00-q09)
    tau1 = [False] * 2 + [True] * 4 + [False] * 6  # 2 questions only the base gets right
    a = cbdr_run(tmp_path / "a", {"base": base, "confidence_ft.rank": tau05}, dataset="PopQA")
    b = cbdr_run(tmp_path / "b", {"base": base, "confidence_ft.rank": tau1}, dataset="PopQA")
    main([f"tau05={a}", f"tau1={b}"])
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "popqa, Top-1 has_answer, n = 10 test questions; Holm over 2 rows"  # its own set
    rows = {r[0]: r for r in table_rows(out)}
    assert list(rows) == ["tau05:base", "tau05:confidence_ft.rank", "tau1:confidence_ft.rank"]
    # Exact McNemar on the same 10 questions: 4 vs 0 discordant (p 0.125), 0 vs 2 (p 0.5); Holm over the two rows:
    # 2 x 0.125 = 0.25, then max(0.25, 1 x 0.5) = 0.5.
    assert "+40.0" in rows["tau05:confidence_ft.rank"][2] and " 0.250 " in rows["tau05:confidence_ft.rank"][2]
    assert "-20.0" in rows["tau1:confidence_ft.rank"][2] and " 0.500 " in rows["tau1:confidence_ft.rank"][2]
    # The base of another run is named by its label; a label given twice is refused (it keys the rows).
    main([f"tau05={a}", f"tau1={b}", "--base", "tau1:confidence_ft.rank"])
    assert "− tau1:confidence_ft.rank" in capsys.readouterr().out
    main([f"tau05={a}", f"tau1={b}", "--base", "tau1:base"])  # shared: the row it is shown as
    assert "− tau05:base" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="run labels must differ"):
        main([f"tau={a}", f"tau={b}"])
    # A run holding other test questions cannot be paired: refused.
    c = cbdr_run(tmp_path / "c", {"base": base[:8], "confidence_ft.rank": tau1[:8]}, dataset="PopQA")  # q00-q07
    with pytest.raises(SystemExit, match="holds 8 of the first run's 10 test questions"):
        main([f"tau05={a}", f"tau2={c}"])


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
