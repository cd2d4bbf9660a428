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
from scipy.stats import rankdata
from sklearn.metrics import roc_auc_score

from confrag.gates.base import Decision
from confrag.gates.registry import gives_closed_book, signal_parts
from confrag.infra.atomic import atomic_save_png
from confrag.rag.stats import accuracy_ci, mcnemar_exact


def decision_parts(needs: frozenset[str] | set[str]) -> list[str]:
    """The measured parts a gate reading `needs` pays for every question, in a stable order (each signal's
    cost in the signal registry)."""
    return signal_parts(needs)


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
    parametric = 0.0 if gives_closed_book(parts) else timings["closed_book"]
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


# --- how well a gate's retrieve score finds the questions retrieval helps --------------------------


def _checked_scores(scores: np.ndarray, helped: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    scores = np.asarray(scores, dtype=np.float64)
    helped = np.asarray(helped, dtype=bool)
    if scores.shape != helped.shape or scores.ndim != 1:
        raise ValueError(f"{scores.shape} retrieve scores for {helped.shape} 'retrieval helped' labels")
    if np.isnan(scores).any():
        raise ValueError(f"retrieve score of question {int(np.flatnonzero(np.isnan(scores))[0])} is NaN")
    return scores, helped


def retrieve_auroc(scores: np.ndarray, helped: np.ndarray) -> float:
    """AUROC of the retrieve score against "retrieval helped" (ties count one half; +-inf allowed: the
    scores' ranks are what counts). NaN when every question has the same label (undefined)."""
    scores, helped = _checked_scores(scores, helped)
    if helped.all() or not helped.any():
        return float("nan")
    return float(roc_auc_score(helped, rankdata(scores)))


def _rejection_area(order_key: np.ndarray, quality: np.ndarray) -> float:
    """Mean, over keeping the k = n, n-1, ..., 1 lowest-key questions, of the kept questions' mean quality;
    questions of equal key count at their group's mean quality (the expectation over tie orders)."""
    order = np.argsort(order_key, kind="stable")
    key, q = order_key[order], quality[order].astype(np.float64)
    _, group, counts = np.unique(key, return_inverse=True, return_counts=True)
    q = (np.bincount(group, weights=q) / counts)[group]
    kept = np.cumsum(q) / np.arange(1, len(q) + 1)
    return float(kept.mean())


def retrieve_prr(scores: np.ndarray, helped: np.ndarray) -> float:
    """Prediction-rejection ratio (Malinin et al.; AdaRAGUE's second score) of the retrieve score as an
    uncertainty, with "retrieval did not help" as the quality: questions are handed to retrieval from the
    highest score down, and the rejection curve is the share of the questions left closed-book that did
    not need it. PRR = (area(score) - area(random)) / (area(oracle) - area(random)): 1 for a perfect
    ordering, 0 for a random (or constant) one, negative when worse. NaN when the labels are all one."""
    scores, helped = _checked_scores(scores, helped)
    if helped.all() or not helped.any():
        return float("nan")
    quality = ~helped
    random = float(quality.mean())
    oracle = _rejection_area(helped.astype(np.float64), quality)
    return (_rejection_area(scores, quality) - random) / (oracle - random)


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
    retriever_calls: float  # mean per question
    auroc: float  # of the retrieve score against "retrieval helped"; nan when undefined
    prr: float  # prediction-rejection ratio of the same; nan when undefined
    helped: int  # test questions retrieval helped (wrong closed-book, right with the retrieved contexts)
    only_gate: int  # McNemar against always-retrieve: questions the gate gets right and always-retrieve wrong
    only_always: int  # ... and the other way round
    mcnemar_p: float  # exact McNemar p-value (two-sided)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass(frozen=True)
class GateCosts:
    """What a gate's decisions cost, per question."""

    llm_passes: np.ndarray  # LLM forward passes
    wall_s: float  # seconds (the mean, from the timed parts)
    retriever_calls: np.ndarray


@dataclass(frozen=True)
class RowReference:
    """What every gate's row on the same questions is measured against: per question, whether retrieval
    helped (the labels of AUROC and PRR), the always-retrieve gate's outcomes (McNemar's pair), and the
    bootstrap of the accuracy's interval."""

    helped: np.ndarray
    always_correct: np.ndarray
    n_resamples: int
    seed: int


def gate_row(
    gate: str,
    contexts: str,
    decisions: Sequence[Decision],
    correct: np.ndarray,
    costs: GateCosts,
    retrieve_scores: np.ndarray,
    reference: RowReference,
) -> GateRow:
    """One gate's row on the questions of `reference`."""
    helped = reference.helped
    correct = np.asarray(correct, dtype=bool)
    mcnemar = mcnemar_exact(correct, reference.always_correct)
    answered = np.array([Decision(d) is not Decision.REFUSE for d in decisions])
    accuracy = accuracy_ci(correct, n_resamples=reference.n_resamples, seed=reference.seed)
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
        llm_passes=float(np.mean(costs.llm_passes)),
        wall_s=float(costs.wall_s),
        retriever_calls=float(np.mean(costs.retriever_calls)),
        auroc=retrieve_auroc(retrieve_scores, helped),
        prr=retrieve_prr(retrieve_scores, helped),
        helped=int(np.sum(helped)),
        only_gate=mcnemar.only_a,
        only_always=mcnemar.only_b,
        mcnemar_p=mcnemar.pvalue,
    )


def _number(value: float, digits: int = 3) -> str:
    return "—" if np.isnan(value) else f"{round(value, digits) + 0.0:.{digits}f}"  # + 0.0: no "-0.000"


def gates_markdown(rows: Sequence[GateRow], metric: str) -> str:
    lines = [
        f"| Gate | n | Accuracy ({metric}, %) [95 % CI] | Retrieval rate (%) | Refusal rate (%) | "
        "Accuracy on answered (%) | AUROC | PRR | LLM passes / q | Retriever calls / q | Wall s / q | "
        "McNemar vs always (gate only / always only, p) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        answered = "—" if np.isnan(r.answered_accuracy) else f"{100 * r.answered_accuracy:.1f}"
        lines.append(
            f"| {r.gate} | {r.n} | {100 * r.accuracy:.1f} [{100 * r.accuracy_low:.1f}, "
            f"{100 * r.accuracy_high:.1f}] | {100 * r.retrieval_rate:.1f} | {100 * r.refusal_rate:.1f} | "
            f"{answered} | {_number(r.auroc)} | {_number(r.prr)} | {r.llm_passes:.2f} | {r.retriever_calls:.2f} | "
            f"{r.wall_s:.3f} | {r.only_gate} / {r.only_always}, p = {r.mcnemar_p:.3g} |"
        )
    return "\n".join(lines)


# --- threshold curves ------------------------------------------------------------------------------


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

COLOURS = tuple(f"C{i}" for i in range(10))  # matplotlib's ten-colour cycle
LINE_STYLES = ("-", "--", "-.", ":")
MARKERS = ("o", "s", "^", "D", "v", "P", "*", "<", ">", "h", "p", "d", "H", "8")


@dataclass(frozen=True)
class GateStyle:
    colour: str
    line_style: str
    marker: str


def gate_styles(gates: Sequence[str]) -> dict[str, GateStyle]:
    """Each gate's colour, line style and marker, all three distinct between any two of the first 20 gates in
    colour and line style together (colour i mod 10, style i mod 4) and of the first 14 in marker: ten colours
    alone drew the 11th and 12th gate as the 1st and 2nd."""
    return {
        gate: GateStyle(COLOURS[i % len(COLOURS)], LINE_STYLES[i % len(LINE_STYLES)], MARKERS[i % len(MARKERS)])
        for i, gate in enumerate(dict.fromkeys(gates))
    }


def gates_figure(rows: Sequence[GateRow], curves: Sequence[CurvePoint], title: str) -> Figure:
    """One panel per context condition: each gate's operating point (an edge-less marker; outlined in black where
    the gate refuses some questions), and a curve per threshold gate in the gate's line style; one legend beside
    the panels naming every gate with its colour, line style and marker."""
    from matplotlib.lines import Line2D

    conditions = list(dict.fromkeys(r.contexts for r in rows))
    styles = gate_styles([r.gate for r in rows] + [c.gate for c in curves])
    figure = Figure(figsize=(5.2 * len(conditions) + 2.0, 4.4), dpi=120, layout="constrained")
    for index, condition in enumerate(conditions):
        axis = figure.add_subplot(1, len(conditions), index + 1)
        for gate in dict.fromkeys(c.gate for c in curves if c.contexts == condition):
            points = sorted(
                (c.retrieval_rate, c.accuracy) for c in curves if c.gate == gate and c.contexts == condition
            )
            style = styles[gate]
            axis.plot(
                [100 * x for x, _ in points],
                [100 * y for _, y in points],
                color=style.colour,
                linestyle=style.line_style,
                alpha=0.7,
                linewidth=1.4,
                gid=gate,
            )
        for r in rows:
            if r.contexts == condition:
                style = styles[r.gate]
                axis.scatter(
                    100 * r.retrieval_rate,
                    100 * r.accuracy,
                    color=style.colour,
                    marker=style.marker,
                    s=40,
                    zorder=3,
                    edgecolors="black" if r.refusal_rate > 0 else "none",
                    linewidths=1.2,
                    gid=r.gate,
                )
        axis.set_xlim(-3, 103)
        axis.set_xlabel("retrieval rate (%)")
        axis.set_ylabel("accuracy (%)")
        axis.set_title(f"{condition} contexts (n = {next(r.n for r in rows if r.contexts == condition)})")
        axis.grid(alpha=0.3)
    curved = {c.gate for c in curves}
    refusing = {r.gate for r in rows if r.refusal_rate > 0}
    handles = [
        Line2D(
            [],
            [],
            color=style.colour,
            linestyle=style.line_style if gate in curved else "none",
            marker=style.marker,
            markeredgecolor="black" if gate in refusing else style.colour,
            label=gate + (" (refuses)" if gate in refusing else ""),
        )
        for gate, style in styles.items()
    ]
    figure.legend(handles=handles, loc="outside right center", fontsize="small", title="gate")
    figure.suptitle(title)
    return figure


def plot_gates(rows: Sequence[GateRow], curves: Sequence[CurvePoint], path: str | Path, title: str) -> Path:
    """`gates_figure` written to `path` as PNG."""
    return atomic_save_png(gates_figure(rows, curves, title), path)
