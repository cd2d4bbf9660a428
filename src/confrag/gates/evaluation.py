"""Scoring gate decisions against cached answers: the per-gate table, threshold curves, the wall-time
model and the accuracy-against-retrieval-rate plot. Nothing here runs an LLM.

Outcome of one question under a gate: PARAMETRIC is scored by the closed-book answer, RETRIEVE by the
answer with retrieved contexts, REFUSE counts as a refusal (never correct; excluded from "accuracy on
answered questions").

Wall time per question is a cost model over measured parts, because the answers themselves come from
the cache: each LLM-bound part (closed-book answer, RAG answer, retrieval + reranking, draft, internal
passage, hidden states, embeddings, matching scores) is timed fresh (no cache) on a sample of
questions, giving seconds per question; a gate's wall time is the parts its signals need, plus its
own measured `decide` time, plus the mean over its decisions of the answer each implies.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from confrag.artifacts import atomic_save_png
from confrag.gates.base import Decision, Gate, GateSignals
from confrag.gates.ctrla import CtrlAGate
from confrag.gates.dragin import DraginGate
from confrag.gates.simple import CBDRGate
from confrag.gates.skr import SKRKnnGate
from confrag.rag.stats import accuracy_ci

# The measured parts (seconds per question) each signal costs before the gate can decide.
SIGNAL_PARTS: dict[str, tuple[str, ...]] = {
    "confidence": ("qa_states",),
    "draft": ("draft",),
    "hidden_states": ("ctrla_states",),
    "question_embedding": ("embed_question",),
    "responses": ("closed_book",),
    "response_embedding": ("closed_book", "embed_response"),
    # BRIDGE decides after retrieving: internal passage, closed-book answer (K_gen), retrieval, matching.
    "matching_scores": ("internal", "closed_book", "retrieve", "matching"),
}
# Parts that already produce the closed-book answer: a parametric decision then costs nothing more.
CLOSED_BOOK_PARTS = frozenset({"closed_book", "draft"})


def decision_parts(needs: frozenset[str] | set[str]) -> list[str]:
    """The measured parts a gate reading `needs` pays for every question, in a stable order."""
    return sorted({part for name in needs for part in SIGNAL_PARTS[name]})


def wall_time_per_question(
    needs: frozenset[str] | set[str], decisions: Sequence[Decision], timings: Mapping[str, float], decide_seconds: float
) -> float:
    """Mean seconds per question of deciding (signals + `decide_seconds`, the whole set's decide time)
    and answering as decided (see the module docstring)."""
    if not decisions:
        raise ValueError("no decisions to time")
    parts = decision_parts(needs)
    missing = [p for p in parts if p not in timings]
    if missing:
        raise ValueError(f"no timing for {missing}; measured: {sorted(timings)}")
    deciding = sum(timings[p] for p in parts) + decide_seconds / len(decisions)
    parametric = 0.0 if CLOSED_BOOK_PARTS & set(parts) else timings["closed_book"]
    retrieve = timings["rag_answer"] + (0.0 if "retrieve" in parts else timings["retrieve"])
    cost = {Decision.PARAMETRIC: parametric, Decision.RETRIEVE: retrieve, Decision.REFUSE: 0.0}
    return deciding + float(np.mean([cost[Decision(d)] for d in decisions]))


def score_decisions(
    decisions: Sequence[Decision], closed_book_correct: np.ndarray, retrieve_correct: np.ndarray
) -> np.ndarray:
    """Per question: correct under the gate's decision (a refusal is never correct)."""
    closed_book_correct = np.asarray(closed_book_correct, dtype=bool)
    retrieve_correct = np.asarray(retrieve_correct, dtype=bool)
    if not len(decisions) == len(closed_book_correct) == len(retrieve_correct):
        raise ValueError(
            f"{len(decisions)} decisions for {len(closed_book_correct)} closed-book and "
            f"{len(retrieve_correct)} retrieval outcomes"
        )
    decided = np.array([Decision(d).value for d in decisions])
    return np.where(
        decided == Decision.PARAMETRIC.value,
        closed_book_correct,
        np.where(decided == Decision.RETRIEVE.value, retrieve_correct, False),
    )


def rates(decisions: Sequence[Decision]) -> tuple[float, float]:
    """(retrieval rate, refusal rate)."""
    decided = [Decision(d) for d in decisions]
    return (
        float(np.mean([d is Decision.RETRIEVE for d in decided])),
        float(np.mean([d is Decision.REFUSE for d in decided])),
    )


@dataclass(frozen=True)
class GateRow:
    gate: str
    contexts: str  # clean / conflicting
    n: int
    accuracy: float
    accuracy_low: float
    accuracy_high: float
    retrieval_rate: float
    refusal_rate: float
    answered_accuracy: float  # nan when every question was refused
    llm_passes: float  # mean per question
    wall_s: float  # per question

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def gate_row(
    gate: str,
    contexts: str,
    decisions: Sequence[Decision],
    correct: np.ndarray,
    passes: np.ndarray,
    wall_s: float,
    n_resamples: int,
    seed: int,
) -> GateRow:
    correct = np.asarray(correct, dtype=bool)
    answered = np.array([Decision(d) is not Decision.REFUSE for d in decisions])
    accuracy = accuracy_ci(correct, n_resamples=n_resamples, seed=seed)
    retrieval_rate, refusal_rate = rates(decisions)
    return GateRow(
        gate=gate,
        contexts=contexts,
        n=len(correct),
        accuracy=accuracy.value,
        accuracy_low=accuracy.low,
        accuracy_high=accuracy.high,
        retrieval_rate=retrieval_rate,
        refusal_rate=refusal_rate,
        answered_accuracy=float(correct[answered].mean()) if answered.any() else float("nan"),
        llm_passes=float(np.mean(passes)),
        wall_s=float(wall_s),
    )


def gates_markdown(rows: Sequence[GateRow], metric: str) -> str:
    lines = [
        f"| Gate | n | Accuracy ({metric}, %) [95 % CI] | Retrieval rate (%) | Refusal rate (%) | "
        "Accuracy on answered (%) | LLM passes / q | Wall s / q |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        answered = "—" if np.isnan(r.answered_accuracy) else f"{100 * r.answered_accuracy:.1f}"
        lines.append(
            f"| {r.gate} | {r.n} | {100 * r.accuracy:.1f} [{100 * r.accuracy_low:.1f}, "
            f"{100 * r.accuracy_high:.1f}] | {100 * r.retrieval_rate:.1f} | {100 * r.refusal_rate:.1f} | "
            f"{answered} | {r.llm_passes:.2f} | {r.wall_s:.3f} |"
        )
    return "\n".join(lines)


# --- threshold curves ------------------------------------------------------------------------------


def threshold_scores(gate: Gate, signals: GateSignals) -> np.ndarray:
    """Per question, the number a threshold gate compares with its threshold (to place a curve's grid)."""
    if isinstance(gate, CBDRGate):
        return np.asarray(signals.confidence, dtype=np.float64)
    if isinstance(gate, DraginGate):  # an empty draft always retrieves: no threshold moves it
        return np.array([s.max() if len(s) else np.inf for s in gate.scores(signals)])
    if isinstance(gate, (CtrlAGate, SKRKnnGate)):
        return np.asarray(gate.scores(signals), dtype=np.float64)
    raise ValueError(
        f"gate '{gate.name}' has no single threshold score; curves are drawn for cbdr, dragin, ctrla "
        f"and skr_knn (give explicit values for other parameters)"
    )


def quantile_grid(scores: np.ndarray, points: int) -> list[float]:
    """Thresholds at `points` evenly spaced quantiles of the finite scores, so that a curve spans the
    retrieval rates whatever the scale of the score."""
    finite = np.asarray(scores, dtype=np.float64)
    finite = finite[np.isfinite(finite)]
    if finite.size == 0:
        return []
    return sorted({float(v) for v in np.quantile(finite, np.linspace(0.0, 1.0, points))})


@dataclass(frozen=True)
class CurvePoint:
    gate: str
    contexts: str
    param: str
    value: float
    retrieval_rate: float
    accuracy: float

    def to_dict(self) -> dict:
        return dict(self.__dict__)


# --- plot ------------------------------------------------------------------------------------------


def plot_gates(rows: Sequence[GateRow], curves: Sequence[CurvePoint], path: str | Path, title: str) -> Path:
    """One panel per context condition: each gate's operating point, and a curve per threshold gate."""
    conditions = list(dict.fromkeys(r.contexts for r in rows))
    figure = Figure(figsize=(5.2 * len(conditions), 4.4), dpi=120)
    colours = {gate: f"C{i % 10}" for i, gate in enumerate(dict.fromkeys(r.gate for r in rows))}
    for index, condition in enumerate(conditions):
        axis = figure.add_subplot(1, len(conditions), index + 1)
        for gate in dict.fromkeys(c.gate for c in curves if c.contexts == condition):
            points = sorted(
                (c.retrieval_rate, c.accuracy) for c in curves if c.gate == gate and c.contexts == condition
            )
            axis.plot(
                [100 * x for x, _ in points],
                [100 * y for _, y in points],
                color=colours.get(gate, "gray"),
                alpha=0.6,
                linewidth=1.2,
            )
        for r in rows:
            if r.contexts == condition:
                axis.scatter(
                    100 * r.retrieval_rate,
                    100 * r.accuracy,
                    color=colours[r.gate],
                    s=36,
                    zorder=3,
                    label=r.gate,
                    marker="X" if r.refusal_rate > 0 else "o",
                )
        axis.set_xlim(-3, 103)
        axis.set_xlabel("retrieval rate (%)")
        axis.set_ylabel("accuracy (%)")
        axis.set_title(f"{condition} contexts (n = {next(r.n for r in rows if r.contexts == condition)})")
        axis.grid(alpha=0.3)
        if index == 0:
            axis.legend(fontsize="small", loc="best")
    figure.suptitle(title)
    figure.tight_layout()
    return atomic_save_png(figure, path)
