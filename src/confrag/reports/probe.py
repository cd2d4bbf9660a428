"""The probe task's report: metrics.json, summary.txt, the reliability diagram, the per-layer scan plot, W&B."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning.pytorch.loggers import Logger

from confrag.infra.atomic import atomic_write_text
from confrag.probe.calibration import CalibrationBin
from confrag.probe.datamodule import NQConfidenceDataModule
from confrag.probe.module import metric_text, metric_value
from confrag.reports.reliability import calibration_lines, calibration_record, plot_reliability
from confrag.reports.small_samples import SMALL_N, auroc_interval, is_small, proportion_text, sample_mark, wilson
from confrag.reports.tables import log_rows, wandb_loggers


# wide: independent facts of one probe run (its folder, LLM, data module, metrics, NQ_Confidence summary,
# layer scan, calibration bins, loggers), each produced by a different step of the task; an object holding them
# would be built for this one call.
def write_probe_report(
    out: Path,
    llm_name: str,
    datamodule: NQConfidenceDataModule,
    metrics: dict[str, float],
    summary: dict[str, Any],
    scan: list[dict],
    calibration: list[CalibrationBin],
    loggers: Sequence[Logger],
    scan_skipped: str | None = None,
) -> str:
    """`calibration`: the test split's reliability bins (confrag.probe.calibration), drawn beside the ECE."""
    # An undefined metric (AUROC of a one-class split) is null in JSON and "undefined" when printed.
    result = {
        "layer": datamodule.layer,
        "train_states": datamodule.train_states,
        "metrics": {k: metric_value(v) for k, v in metrics.items()},
        "nq_confidence": summary,
        "layer_scan": scan,
        "calibration": calibration_record(calibration, "test"),
        "test_intervals": small_split_intervals(metrics, int(summary["test/examples"]), int(summary["test/positives"])),
        **({"layer_scan_skipped": scan_skipped} if scan_skipped else {}),
    }
    atomic_write_text(out / "metrics.json", json.dumps(result, indent=2))
    requested = summary.get("questions_requested")
    lines = [
        f"Probe on layer {datamodule.layer} ({datamodule.train_states} states) — {llm_name}",
        f"  questions {summary['questions']}"
        + (f" (of {requested} requested)" if requested else "")
        + (f", closed-book has_answer {summary['qa/has_answer']:.3f}" if "qa/has_answer" in summary else "")
        + (
            f", has_answer under a candidate {summary['candidates/has_answer']:.3f}"
            if "candidates/has_answer" in summary
            else ""
        ),
        (
            "  balanced examples: "
            if datamodule.splits.balance
            else "  examples (every state, loss weighted by model.class_weight): "
        )
        + ", ".join(
            f"{s} {summary[f'{s}/examples']} ({summary[f'{s}/positives']} positive)" for s in ("train", "dev", "test")
        ),
        metrics_line(metrics, int(summary["test/examples"]), int(summary["test/positives"])),
    ]
    lines += calibration_lines(calibration, "test", "reliability.png")
    lines += ranking_lines(metrics)
    plot_reliability(calibration, out / "reliability.png", f"{llm_name}: probe reliability, test split")
    if scan_skipped:
        lines.append(f"  per-layer scan skipped: {scan_skipped}")
    if scan:
        lines.append("  per-layer 5-fold logistic AUROC (all questions of " + "+".join(datamodule.data.stores) + "):")
        lines += [f"    layer {r['layer']:>3}: {r['auroc_mean']:.3f} ± {r['auroc_std']:.3f}" for r in scan]
        plot_layer_scan(scan, datamodule.num_layers // 2, out / "layer_scan.png", f"{llm_name}: probe AUROC by layer")
    text = "\n".join(lines)
    atomic_write_text(out / "summary.txt", text + "\n")
    for logger in wandb_loggers(loggers):
        log_rows(logger, "calibration", [b.to_dict() for b in calibration])
        logger.log_image("reliability_diagram", [str(out / "reliability.png")])
        if scan:
            log_rows(logger, "layer_scan", scan)
            logger.log_image("layer_scan_plot", [str(out / "layer_scan.png")])
    return text


def small_split_intervals(metrics: dict[str, float], n: int, positives: int) -> dict[str, list[float] | None]:
    """95 % intervals of the test accuracy (Wilson) and AUROC (Hanley-McNeil; None on one class) when the test split
    is small (`small_samples.is_small`); empty otherwise."""
    if not is_small(n, positives):
        return {}
    found: dict[str, list[float] | None] = {}
    acc, auroc = metric_value(metrics.get("test/acc")), metric_value(metrics.get("test/auroc"))
    if acc is not None:
        found["test/acc"] = list(wilson(acc * n, n))
    if "test/auroc" in metrics:
        two_classes = auroc is not None and 0 < positives < n
        found["test/auroc"] = list(auroc_interval(auroc, positives, n - positives)) if two_classes else None
    return found


def metrics_line(metrics: dict[str, float], n: int, positives: int) -> str:
    """The test metrics; on a small test split (or one class) marked with the counts, with their intervals."""
    names = [k for k in ("test/acc", "test/auroc", "test/ece") if k in metrics]
    if not is_small(n, positives):
        return "  test: " + ", ".join(f"{k.split('/')[1]} {metric_text(metrics[k])}" for k in names)
    intervals = small_split_intervals(metrics, n, positives)
    parts = []
    for k in names:
        bounds = intervals.get(k)
        extra = f" [{bounds[0]:.3f}, {bounds[1]:.3f}]" if bounds else ""
        parts.append(f"{k.split('/')[1]} {metric_text(metrics[k])}{extra}")
    return f"  test ({sample_mark(n, positives)}): " + ", ".join(parts)


def ranking_lines(metrics: dict[str, float]) -> list[str]:
    """The probe as a reranker of its dev and test questions' candidates, and where its best checkpoint was."""
    lines = []
    for stage, name in (("val", "dev"), ("test", "test"), ("heldout", "held-out questions")):
        first, mrr = metrics.get(f"{stage}/gold_first"), metrics.get(f"{stage}/gold_mrr")
        if first is None:
            continue
        n = metrics.get(f"{stage}/questions")
        chance = metrics.get(f"{stage}/chance_gold_first")
        first_text = proportion_text(first, int(n), 1, 100.0) if n else f"{100 * first:.1f}"
        lines.append(
            f"  probe as reranker, {name}: own paragraph first {first_text} %, MRR {mrr:.3f}"
            + (f" over {int(n)} questions" + (f" (below {SMALL_N})" if n < SMALL_N else "") if n else "")
            + (f" (chance {100 * chance:.1f} %)" if chance is not None else "")
        )
    if "best_epoch" in metrics:
        lines.append(f"  best dev checkpoint: epoch {int(metrics['best_epoch'])} of 0..{int(metrics['last_epoch'])}")
    return lines


def plot_layer_scan(scan: list[dict], mid_layer: int, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = [r["layer"] for r in scan]
    mean = [r["auroc_mean"] for r in scan]
    std = [r["auroc_std"] for r in scan]
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    ax.errorbar(layers, mean, yerr=std, marker="o", capsize=3)
    ax.axhline(0.5, color="grey", linestyle=":", label="chance")
    ax.axvline(mid_layer, color="tab:red", linestyle="--", label="Layer/2")
    ax.set_xlabel("layer (hidden_states index)")
    ax.set_ylabel("5-fold AUROC (logistic)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
