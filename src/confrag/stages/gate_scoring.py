"""The gate comparison's fitting, deciding and scoring: each gate fitted on the training split only,
deciding on the test split in both context conditions, scored against the cached answers (the table's
rows), and the threshold gates' curves (`confrag.gates.evaluation` holds the metrics and the wall-time
model). Outcomes: parametric → the closed-book answer, retrieve → the RAG answer (or the gate's own
contexts' answer, `Gate.retrieve_contexts`), refuse → a refusal."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from confrag.gates import Decision, Gate, GateTrainingData, retrieval_helped
from confrag.gates.evaluation import (
    CurvePoint,
    GateCosts,
    GateRow,
    RowReference,
    gate_row,
    quantile_grid,
    score_decisions,
    wall_time_per_question,
)
from confrag.gates.settings import GateSettings
from confrag.rag import QuestionOutcome, score_answer
from confrag.stages.gate_comparison import GateEvaluation
from confrag.stages.gate_questions import CONDITIONS


def correct_of(outcomes: Sequence[QuestionOutcome], metric: str, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(closed-book correct, top-K RAG correct) per question."""
    return (
        np.array([bool(getattr(o.closed_book, metric)) for o in outcomes]),
        np.array([bool(getattr(o.rag[k], metric)) for o in outcomes]),
    )


def training_data(gate: Gate, evaluation: GateEvaluation, settings: GateSettings) -> GateTrainingData | None:
    """The training split's data for a gate that learns (None for one that does not): its signals, its
    cached outcomes (clean contexts), gold answers, and what the gate computed for itself beforehand
    (`Gate.training_extras`, e.g. CtrlA's direction)."""
    if not gate.training_needs:
        return None
    rows, signals = evaluation.sets.train, evaluation.train_signals
    closed_book, rag = correct_of(evaluation.train_outcomes, settings.metric, settings.top_k)
    answer_embedding = (
        evaluation.maker.embed([r.answers[0] for r in rows]) if "answer_embedding" in gate.training_needs else None
    )
    key = gate.extras_key(evaluation.default_layer)
    return GateTrainingData(
        signals,
        closed_book_correct=closed_book,
        rag_correct=rag,
        answers=[tuple(r.answers) for r in rows],
        answer_embedding=answer_embedding,
        split="train",
        **({} if key is None else evaluation.extras[key]),
    )


def retrieval_correct(gate: Gate, evaluation: GateEvaluation, condition: str, settings: GateSettings) -> np.ndarray:
    """Per test question, whether the answer a RETRIEVE decision of this gate gives is correct: the top-K
    RAG answer, or the answer over the gate's own contexts where it has them (`Gate.retrieve_contexts`:
    BRIDGE's FA strategy, its internal passage and the contexts)."""
    outcomes = evaluation.test_outcomes[condition]
    correct = correct_of(outcomes, settings.metric, settings.top_k)[1]
    signals = evaluation.test_signals[condition]
    own = gate.retrieve_contexts(signals, evaluation.contexts[condition], evaluation.maker)
    if own:
        items = [(signals.questions[i], contexts) for i, contexts in own.items()]
        for i, answer in zip(own, evaluation.store.answer(items)):
            correct[i] = bool(getattr(score_answer(answer, outcomes[i].answers), settings.metric))
    return correct


@dataclass
class GateResults:
    rows: list[GateRow]
    fits: dict[str, dict[str, Any]]  # gate -> split, questions and seconds of its fit
    decisions: dict[str, dict[str, list[str]]]  # condition -> gate -> decision per test question
    fitted: dict[str, Gate]


def run_gates(
    evaluation: GateEvaluation, settings: GateSettings, seed: int, gates: dict[str, Gate] | None = None
) -> GateResults:
    """Each gate of `settings.names` fitted on its training split and deciding on the test questions; `gates`:
    the run's gates, already built (the comparison prepared its signals for them), else built here."""
    rows, fits, decisions, fitted = [], {}, {c: {} for c in CONDITIONS}, {}
    for name in settings.names:
        gate = gates[name] if gates is not None else settings.build(name)
        train = training_data(gate, evaluation, settings)
        start = time.perf_counter()
        with settings.fitting(name):
            gate.fit(train)
        fits[name] = {
            "split": None if train is None else train.split,
            "qids": [] if train is None else list(train.signals.qids),
            "seconds": time.perf_counter() - start,
        }
        fitted[name] = gate
        for condition in CONDITIONS:
            signals = evaluation.test_signals[condition]
            start = time.perf_counter()
            decided = gate.decide(signals)
            decide_seconds = time.perf_counter() - start
            closed_book, rag = correct_of(evaluation.test_outcomes[condition], settings.metric, settings.top_k)
            correct = score_decisions(decided, closed_book, retrieval_correct(gate, evaluation, condition, settings))
            wall = wall_time_per_question(gate.needs, decided, evaluation.timings, decide_seconds)
            costs = GateCosts(gate.llm_forward_passes(decided), wall, gate.retriever_calls(decided))
            # The same labels and the same always-retrieve outcomes (top-K RAG answers) for every gate.
            reference = RowReference(retrieval_helped(closed_book, rag), rag, settings.n_resamples, seed)
            rows.append(gate_row(name, condition, decided, correct, costs, gate.retrieve_scores(signals), reference))
            decisions[condition][name] = [Decision(d).value for d in decided]
    return GateResults(rows, fits, decisions, fitted)


def threshold_curves(evaluation: GateEvaluation, settings: GateSettings, results: GateResults) -> list[CurvePoint]:
    """Accuracy and retrieval rate over each threshold gate's grid, from the cached answers only."""
    points = []
    for name, spec in settings.curves.items():
        base = results.fitted[name]
        train = training_data(base, evaluation, settings)
        for condition in CONDITIONS:
            signals = evaluation.test_signals[condition]
            closed_book, rag = correct_of(evaluation.test_outcomes[condition], settings.metric, settings.top_k)
            values = spec.values or quantile_grid(base.threshold_scores(signals), settings.curve_points)
            for value in values:
                with settings.fitting(name):
                    gate = settings.build(name, **{spec.param: value}).fit(train)
                decided = gate.decide(signals)
                correct = score_decisions(decided, closed_book, rag)
                points.append(
                    CurvePoint(
                        name,
                        condition,
                        spec.param,
                        float(value),
                        float(np.mean([d is Decision.RETRIEVE for d in decided])),
                        float(correct.mean()),
                    )
                )
    return points
