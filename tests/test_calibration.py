"""The probe's reliability diagram: confidence bins against accuracy with their counts, whose ECE is the ECE the
probe logs, drawn and recorded by the probe task's report."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torchmetrics.classification import BinaryCalibrationError

from confrag.probe.calibration import expected_calibration_error, reliability_bins, split_confidences
from confrag.rag.stats import wilson
from confrag.reports.reliability import calibration_lines, calibration_record, plot_reliability, reliability_figure


def test_the_bins_give_the_ece_the_probe_logs():
    rng = np.random.default_rng(0)
    confidence = rng.uniform(0.0, 0.999, 500)
    correct = (rng.uniform(size=500) < confidence**2).astype(int)  # over-confident: accuracy below confidence
    bins = reliability_bins(confidence, correct)
    logged = BinaryCalibrationError(n_bins=10)(torch.tensor(confidence), torch.tensor(correct))
    assert expected_calibration_error(bins) == pytest.approx(float(logged), abs=1e-6)
    assert sum(b.count for b in bins) == 500 and [b.low for b in bins][:3] == pytest.approx([0.0, 0.1, 0.2])
    filled = [b for b in bins if b.count]
    assert all(b.low <= b.confidence < b.high for b in filled)
    assert sum(b.accuracy < b.confidence for b in filled) >= 8  # the diagram shows the over-confidence


def test_empty_bins_and_no_examples_are_marked_not_invented():
    bins = reliability_bins(np.array([0.05, 0.95, 1.0]), np.array([0, 1, 1]))
    assert [b.count for b in bins] == [1, 0, 0, 0, 0, 0, 0, 0, 0, 2]  # a confidence of 1 in the last bin
    assert bins[1].confidence is None and bins[1].accuracy is None
    assert expected_calibration_error(reliability_bins(np.zeros(0), np.zeros(0))) is None
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        reliability_bins(np.array([1.5]), np.array([1]))


def test_the_report_draws_and_records_the_diagram(tmp_path):
    bins = reliability_bins(np.array([0.1, 0.15, 0.8, 0.9]), np.array([0, 1, 1, 1]))
    png = plot_reliability(bins, tmp_path / "reliability.png", "tiny: probe reliability")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    record = calibration_record(bins, "test")
    assert record["examples"] == 4 and record["n_bins"] == 10 and record["bins"][1]["count"] == 2
    assert record["ece"] == pytest.approx(expected_calibration_error(bins))
    lines = calibration_lines(bins, "test", "reliability.png")
    assert lines[0].startswith("  calibration (test, 10 bins): ECE ") and "n = 2" in lines[1]


def test_every_bin_of_the_diagram_carries_its_wilson_interval():
    """A bin of two examples drew a bar as sure as one of two hundred: each bar has its 95 % Wilson whisker, in the
    drawing, in summary.txt and in metrics.json."""
    bins = reliability_bins(np.array([0.1, 0.15, 0.8, 0.9, 0.95, 0.97]), np.array([0, 1, 1, 1, 0, 1]))
    (axis, _) = reliability_figure(bins, "tiny").axes
    (whiskers,) = [c for c in axis.containers if type(c).__name__ == "ErrorbarContainer"]
    (segments,) = whiskers.lines[2]
    drawn = [(float(seg[0][1]), float(seg[1][1])) for seg in segments.get_segments()]
    filled = [b for b in bins if b.count]
    expected = [wilson(b.accuracy * b.count, b.count) for b in filled]
    assert len(drawn) == 3  # bins [0.1, 0.2), [0.8, 0.9), [0.9, 1]
    assert [x for pair in drawn for x in pair] == pytest.approx([x for pair in expected for x in pair])
    assert all(high - low > 0.3 for low, high in drawn)  # two or three examples a bin: wide, and shown so
    record = calibration_record(bins, "test")
    assert [b["accuracy_ci"] for b in record["bins"] if b["count"]] == [pytest.approx(list(e)) for e in expected]
    assert record["bins"][0]["accuracy_ci"] is None  # an empty bin has none
    low, high = expected[0]
    assert f"accuracy 0.500 [{low:.3f}, {high:.3f}], n = 2" in calibration_lines(bins, "test", "r.png")[1]


def test_split_confidences_reads_every_batch_in_eval_mode_and_restores_the_mode():
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Dropout(0.9))
    model.train()
    batches = [(torch.ones(4, 3), torch.tensor([0, 1, 1, 0])), (torch.zeros(2, 3), torch.tensor([1, 1]))]
    probs, labels = split_confidences(model, batches)
    assert probs.shape == (6,) and labels.tolist() == [0, 1, 1, 0, 1, 1]
    assert np.allclose(probs[:4], probs[0])  # no dropout: eval mode
    assert model.training
