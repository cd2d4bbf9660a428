"""The probe's reliability diagram (reliability.png) and its record in metrics.json: confidence bins against the
LLM's accuracy, each bin's count and the 95 % Wilson interval of its accuracy beside it (a bin may hold two
examples), and the ECE those bins give (confrag.probe.calibration)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from confrag.infra.atomic import atomic_save_png
from confrag.probe.calibration import CalibrationBin, expected_calibration_error
from confrag.rag.stats import wilson


def accuracy_interval(b: CalibrationBin) -> tuple[float, float] | None:
    """The 95 % Wilson interval of a bin's accuracy (None for an empty bin)."""
    return wilson(b.accuracy * b.count, b.count) if b.count else None


def _listed(interval: tuple[float, float] | None) -> list[float] | None:
    return None if interval is None else list(interval)


def calibration_record(bins: list[CalibrationBin], split: str) -> dict[str, Any]:
    """metrics.json's `calibration`: the split, the bins (null confidence / accuracy: an empty bin), the ECE."""
    return {
        "split": split,
        "n_bins": len(bins),
        "examples": sum(b.count for b in bins),
        "ece": expected_calibration_error(bins),
        "bins": [{**b.to_dict(), "accuracy_ci": _listed(accuracy_interval(b))} for b in bins],
    }


def calibration_lines(bins: list[CalibrationBin], split: str, image: str) -> list[str]:
    """summary.txt's lines: the ECE and, per non-empty bin, its confidence, accuracy and count."""
    ece = expected_calibration_error(bins)
    if ece is None:
        return [f"  calibration ({split}): no examples"]
    lines = [f"  calibration ({split}, {len(bins)} bins): ECE {ece:.3f}; reliability diagram {image}"]
    for b in bins:
        if b.count:
            span = f"[{b.low:.1f}, {b.high:.1f}{']' if b.high == 1.0 else ')'}"  # the last bin holds a confidence of 1
            low, high = accuracy_interval(b)
            lines.append(
                f"    P(correct) {span}: mean {b.confidence:.3f}, accuracy {b.accuracy:.3f} [{low:.3f}, {high:.3f}], "
                f"n = {b.count}"
            )
    return lines


def reliability_figure(bins: list[CalibrationBin], title: str) -> Figure:
    """Accuracy per confidence bin with its 95 % Wilson interval as a whisker, against the diagonal of perfect
    calibration, each bar labelled with its count; the counts per bin below."""
    fig = Figure(figsize=(5.2, 5.6), layout="constrained")
    ax, counts = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    width = bins[0].high - bins[0].low
    filled = [b for b in bins if b.count]
    lows, accuracy = [b.low for b in filled], [b.accuracy for b in filled]
    ax.bar(lows, accuracy, width=width, align="edge", edgecolor="black", label="accuracy in the bin")
    intervals = [accuracy_interval(b) for b in filled]
    ax.errorbar(
        [b.low + width / 2 for b in filled],
        accuracy,
        yerr=[
            [a - low for a, (low, _) in zip(accuracy, intervals)],
            [high - a for a, (_, high) in zip(accuracy, intervals)],
        ],
        fmt="none",
        ecolor="black",
        elinewidth=1,
        capsize=3,
        label="95 % interval (Wilson)",
    )
    ax.plot([b.confidence for b in filled], [b.accuracy for b in filled], "o", color="tab:red", label="mean P(correct)")
    ax.plot([0, 1], [0, 1], linestyle="--", color="grey", label="perfect calibration")
    for b, (_, high) in zip(filled, intervals):
        ax.annotate(f"n={b.count}", (b.low + width / 2, high), ha="center", va="bottom", fontsize=7)
    ece = expected_calibration_error(bins)
    ax.set_ylabel("accuracy (LLM correct)")
    ax.set_ylim(0, 1.12)
    ax.set_title(title + ("" if ece is None else f" (ECE {ece:.3f})"))
    ax.legend(loc="upper left", fontsize=8)
    counts.bar([b.low for b in bins], [b.count for b in bins], width=width, align="edge", edgecolor="black")
    counts.set_xlabel("probe confidence P(correct)")
    counts.set_ylabel("examples")
    counts.set_xlim(0, 1)
    return fig


def plot_reliability(bins: list[CalibrationBin], path: Path, title: str) -> Path:
    """`reliability_figure` written to `path` as PNG."""
    atomic_save_png(reliability_figure(bins, title), path)
    return path
