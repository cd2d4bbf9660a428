"""Metrics on fewer than 30 examples, or on one class, carry their interval or are marked in every printed line."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from confrag.probe.calibration import reliability_bins
from confrag.reports.probe import metrics_line, ranking_lines, write_probe_report
from confrag.reports.rerank import write_rerank_report
from confrag.reports.small_samples import auroc_interval, small_mark, wilson


def test_the_closed_form_intervals():
    low, high = wilson(1, 8)  # 1 of 8: Wilson's interval (0.022, 0.471)
    assert low == pytest.approx(0.0224, abs=1e-3) and high == pytest.approx(0.4709, abs=1e-3)
    assert wilson(8, 8)[1] == 1.0 and wilson(0, 8)[0] == 0.0
    # Hanley-McNeil: an AUROC of 1.0 from 1 positive and 7 negatives has no width (its formula's limit), 0.8 has.
    low, high = auroc_interval(0.8, 10, 10)
    assert 0.55 < low < 0.65 and 0.95 < high <= 1.0


def test_a_small_or_one_class_test_split_is_marked_with_its_intervals(tmp_path):
    """ "test auroc 1.000" was reported from 8 examples with 1 positive, without an interval."""
    metrics = {"test/acc": 0.75, "test/auroc": 0.9, "test/ece": 0.2}
    line = metrics_line(metrics, 8, 3)
    low, high = wilson(6, 8)
    assert line.startswith("  test (8 examples, 3 positive: below 30, 95 % intervals): ")
    assert f"acc 0.750 [{low:.3f}, {high:.3f}]" in line and "auroc 0.900 [" in line
    one_class = metrics_line({"test/acc": 0.75, "test/auroc": float("nan")}, 40, 0)
    low, high = wilson(30, 40)
    mark = "  test (40 examples, 0 positive: one class only, not a result)"
    assert one_class == f"{mark}: acc 0.750 [{low:.3f}, {high:.3f}], auroc undefined"
    assert metrics_line(metrics, 300, 100) == "  test: acc 0.750, auroc 0.900, ece 0.200"  # large: as before
    ranking = ranking_lines({"test/gold_first": 2 / 13, "test/gold_mrr": 0.3, "test/questions": 13})
    assert ranking[0].startswith("  probe as reranker, test: own paragraph first 15.4 [") and "(below 30)" in ranking[0]
    summary = {"questions": 10, "test/examples": 8, "test/positives": 3}
    summary.update({f"{s}/{k}": 4 for s in ("train", "dev") for k in ("examples", "positives")})
    splits = SimpleNamespace(balance=True)
    datamodule = SimpleNamespace(layer=1, train_states="qa", splits=splits, data=None, num_layers=2)
    write_probe_report(
        tmp_path, "tiny", datamodule, metrics, summary, [], reliability_bins(np.array([0.2, 0.9]), np.array([0, 1])), []
    )
    intervals = json.loads((tmp_path / "metrics.json").read_text())["test_intervals"]
    assert intervals["test/acc"] == pytest.approx(list(wilson(6, 8))) and len(intervals["test/auroc"]) == 2


def test_table_1_on_few_questions_is_marked(tmp_path):
    report = {"questions": 12, "rows": {"train": 9, "test": 3}, "dropped": 0, "reference": "qa", "top_k": 2}
    report["selection"] = "sign"  # as NQ_Rerank's report always says
    report.update(by_reference={}, retrieval={"gold_retrieved": 1.0, "answer_in_candidates": 1.0})
    report["retrieval"]["duplicate_passages_removed"] = 0
    rows = [{"system": "BM25", "P@1": 50.0}]
    text = write_rerank_report(tmp_path, "tiny", report, 3, rows, {}, {}, [])
    assert "3 questions (below 30 questions: no interval, not a result)" in text
    assert small_mark(30) == ""


def gate(name: str, n: int, retrieval_rate: float, auroc: float, helped: int, contexts: str = "clean"):
    from confrag.gates.evaluation import GateRow

    return GateRow(
        name,
        contexts,
        n,
        0.5,
        0.3,
        0.7,
        retrieval_rate,
        0.0,
        0.5,
        1.0,
        0.01,
        retrieval_rate,
        auroc,
        0.2,
        helped,
        1,
        0,
        1.0,
    )


def test_gate_rows_on_few_questions_carry_their_intervals_or_say_why_not():
    from confrag.reports.gates import gate_record, tables_text

    rows = [gate("always", 12, 1.0, float("nan"), 5), gate("cbdr", 12, 5 / 12, 0.7, 5)]
    rows += [
        gate("always", 12, 1.0, float("nan"), 0, "conflicting"),
        gate("cbdr", 12, 0.5, float("nan"), 0, "conflicting"),
    ]
    text = tables_text(rows, "has_answer")
    low, high = wilson(5, 12)
    a_low, a_high = auroc_interval(0.7, 5, 7)
    assert (
        f"Below 30 test questions (n = 12), 95 % intervals: retrieval rate (%) always 100.0 [75.8, 100.0], cbdr "
        f"41.7 [{100 * low:.1f}, {100 * high:.1f}]; AUROC (Hanley-McNeil): cbdr 0.700 [{a_low:.3f}, {a_high:.3f}]."
    ) in text
    assert "AUROC and PRR undefined: retrieval helped on 0 of 12 (one class only, not a result)." in text
    settings = SimpleNamespace(names=[], configs={})
    evaluation = SimpleNamespace(sets=SimpleNamespace(train=[], test=[], report={}), timings={})
    results = SimpleNamespace(rows=rows, fits={}, decisions={})
    table = gate_record(settings, evaluation, results, [], {}, 1.0)["table"]
    assert table[1]["retrieval_rate_ci"] == pytest.approx([low, high], abs=1e-6) and table[1][
        "auroc_ci"
    ] == pytest.approx([a_low, a_high])
    assert table[0]["auroc_ci"] is None and table[1]["sample"] == "12 test questions, below 30: 95 % intervals"
    large = [gate("cbdr", 300, 0.5, 0.7, 100)]
    assert (
        "Below 30" not in tables_text(large, "has_answer")
        and "sample"
        not in gate_record(settings, evaluation, SimpleNamespace(rows=large, fits={}, decisions={}), [], {}, 1.0)[
            "table"
        ][0]
    )


def test_table_3_and_the_beta_sweep_on_few_questions_carry_their_intervals():
    from confrag.reports.cbdr import sample_fields, share, table3_note, with_intervals

    rows = [{"reranker": "base", "id": "base", "beta": 0.0, "retrieval_rate": 1.0, "top1": 0.5, "top3": 0.25}]
    low, high = wilson(6, 12)
    assert table3_note(rows, 12, "has_answer", (1, 3))[-1] == (
        f"- base, β 0: Top-1 50.00 [{100 * low:.2f}, {100 * high:.2f}], Top-3 25.00 [{100 * wilson(3, 12)[0]:.2f}, "
        f"{100 * wilson(3, 12)[1]:.2f}], RR 100.00 [{100 * wilson(12, 12)[0]:.2f}, 100.00]"
    )
    assert table3_note(rows, 12, "f1", (1,)) == [
        "",
        "Table 3 is on 12 test questions (below 30 questions: no interval, not a result).",
    ]
    assert table3_note(rows, 40, "has_answer", (1,)) == [] and with_intervals(rows, 40, "em") == rows
    (row,) = with_intervals(rows, 12, "em")
    assert row["top1_ci"] == pytest.approx([low, high], abs=1e-6) and row["retrieval_rate_ci"] == pytest.approx(
        list(wilson(12, 12))
    )
    (row,) = with_intervals(rows, 12, "f1")  # F1's mean is no proportion: the retrieval rate's interval only
    assert "top1_ci" not in row and "retrieval_rate_ci" in row
    assert sample_fields(12, "f1")["sample"].startswith("12 test questions, below 30: intervals of the retrieval rate")
    assert sample_fields(30, "em") == {}
    assert share(0.5, 12, "has_answer") == f"50.00 % [{100 * low:.2f}, {100 * high:.2f}]"
    assert share(0.5, 300, "has_answer") == share(0.5, 12, "f1") == "50.00 %"  # as the report wrote it before
