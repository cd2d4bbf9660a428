"""Confidence-based dynamic retrieval (CBDR): the gate, batch confidences, and the β sweep."""

from confrag.cbdr.confidence import question_confidences
from confrag.cbdr.gate import (
    ConfidenceGate,
    GateAnswer,
    check_beta,
    check_probe,
    evaluate_gate,
    layer_module,
    should_retrieve,
)
from confrag.cbdr.sweep import (
    BetaChoice,
    FlipReport,
    SweepData,
    SweepResult,
    check_betas,
    choose_beta,
    default_beta_grid,
    flip_analysis,
    flips_markdown,
    plot_beta_curve,
    report_beta,
    sweep,
    table3_markdown,
)

__all__ = [
    "BetaChoice",
    "ConfidenceGate",
    "FlipReport",
    "GateAnswer",
    "SweepData",
    "SweepResult",
    "check_beta",
    "check_betas",
    "check_probe",
    "choose_beta",
    "default_beta_grid",
    "evaluate_gate",
    "flip_analysis",
    "flips_markdown",
    "layer_module",
    "plot_beta_curve",
    "question_confidences",
    "report_beta",
    "should_retrieve",
    "sweep",
    "table3_markdown",
]
