"""The probe's calibration: its confidence P(correct) in equal-width bins against how often the LLM was correct
there (a reliability diagram), with each bin's count, and the expected calibration error those bins give.

The bins are those of the ECE the probe logs (`ProbeModule`: torchmetrics' `BinaryCalibrationError(n_bins=10)`,
which bins P(correct) and compares it with the label), so the diagram shows where `test/ece` comes from: ECE is
the count-weighted mean of |accuracy - confidence| over the bins. A confidence of exactly 1 falls in the last
bin here (torchmetrics gives it a bin of its own), the one case where the two ECEs can differ.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

N_BINS = 10  # as the probe's logged ECE


@dataclass(frozen=True)
class CalibrationBin:
    low: float
    high: float
    count: int
    confidence: float | None  # mean P(correct) of the bin's examples (None: empty bin)
    accuracy: float | None  # fraction of them the LLM answered correctly

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def reliability_bins(confidence: np.ndarray, correct: np.ndarray, n_bins: int = N_BINS) -> list[CalibrationBin]:
    """`n_bins` equal-width bins of [0, 1] over `confidence` (P(correct) per example) with `correct` (0/1)."""
    confidence = np.asarray(confidence, dtype=np.float64).ravel()
    correct = np.asarray(correct, dtype=np.float64).ravel()
    if confidence.shape != correct.shape:
        raise ValueError(f"{len(confidence)} confidences for {len(correct)} labels")
    if len(confidence) and not ((confidence >= 0) & (confidence <= 1)).all():
        raise ValueError("confidences must lie in [0, 1]")
    edges = np.linspace(0.0, 1.0, n_bins + 1)
    index = np.clip(np.searchsorted(edges, confidence, side="right") - 1, 0, n_bins - 1)
    bins = []
    for b in range(n_bins):
        members = index == b
        count = int(members.sum())
        bins.append(
            CalibrationBin(
                low=float(edges[b]),
                high=float(edges[b + 1]),
                count=count,
                confidence=float(confidence[members].mean()) if count else None,
                accuracy=float(correct[members].mean()) if count else None,
            )
        )
    return bins


def expected_calibration_error(bins: list[CalibrationBin]) -> float | None:
    """Σ count/n × |accuracy − confidence| over the bins; None without examples."""
    total = sum(b.count for b in bins)
    if not total:
        return None
    return sum(b.count / total * abs(b.accuracy - b.confidence) for b in bins if b.count)


@torch.no_grad()
def split_confidences(model: torch.nn.Module, loader) -> tuple[np.ndarray, np.ndarray]:
    """The probe's P(correct) and the labels of every example a loader of (hidden, label) batches gives."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    probs, labels = [], []
    try:
        for hidden, label in loader:
            probs.append(torch.softmax(model(hidden.to(device)), dim=-1)[:, 1].float().cpu().numpy())
            labels.append(label.cpu().numpy())
    finally:
        model.train(was_training)
    if not probs:
        return np.zeros(0), np.zeros(0)
    return np.concatenate(probs), np.concatenate(labels)
