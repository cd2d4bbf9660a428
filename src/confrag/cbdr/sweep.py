"""The β sweep from cached per-question outcomes: Table 3, the β curve (Figure 8), choosing β on a dev
split, and the phase-difference (flip) analysis of appendix F.

Under CBDR a question's outcome at threshold β is its RAG outcome when the gate retrieves
(`should_retrieve`: β = 0 always, else Conf < β) and its closed-book outcome otherwise, so every β of a
grid is evaluated from the closed-book and RAG answers already generated: no LLM call here. β = 0
reproduces the always-retrieve accuracy exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure

from confrag.cbdr.gate import check_beta, should_retrieve
from confrag.infra import checks
from confrag.infra.atomic import atomic_save_png
from confrag.rag.pipeline import DEFAULT_KS, QuestionOutcome

METRICS = ("has_answer", "em", "f1")
OBJECTIVES = ("accuracy", "budget")


def default_beta_grid() -> np.ndarray:
    """0.00..0.90 in steps of 0.05, then 0.90..1.00 in steps of 0.01 (where the papers' choices lie)."""
    coarse, fine = np.arange(0, 18) * 0.05, 0.90 + np.arange(0, 11) * 0.01
    return np.unique(np.round(np.concatenate([coarse, fine]), 2))


def check_betas(betas: Sequence[float] | None, key: str = "betas") -> np.ndarray:
    if betas is None:
        return default_beta_grid()
    values = [check_beta(b, key) for b in np.atleast_1d(np.asarray(betas, dtype=object)).tolist()]
    if not values:
        raise ValueError(f"{key} must list at least one threshold in [0, 1]")
    return np.asarray(values, dtype=np.float64)


def beta_grid(betas: Any, step: Any) -> np.ndarray:
    """`betas` when it lists thresholds; else 0 to 0.90 by `step` (the `beta_step` key), then 0.90 to 1.00 by 0.01
    (with step 0.05, the papers' range and `default_beta_grid()`)."""
    if betas is not None:
        return check_betas(list(betas) if isinstance(betas, (list, tuple)) else [betas], "betas")
    checks.number(step, "beta_step", 0, 0.9, low_open=True, hint="(the grid's step below 0.90), or set betas")
    coarse = np.arange(0.0, 0.9 - 1e-9, step)
    return np.unique(np.round(np.concatenate([coarse, 0.90 + np.arange(11) * 0.01]), 6))


def with_conf_quantiles(grid: np.ndarray, dev_confidence: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray]:
    """The grid plus `count` evenly spaced quantiles of the dev split's Conf(H(Q)) (rounded to 1e-4), and those
    quantiles. A probe may squeeze every confidence into a band narrower than the grid's step; its quantiles
    put thresholds inside the band. Only dev confidences are read, and no label, so test stays unseen."""
    if count == 0:
        return grid, np.zeros(0)
    quantiles = np.round(np.quantile(dev_confidence, np.arange(1, count + 1) / (count + 1)), 4)
    return np.unique(np.concatenate([grid, quantiles])), quantiles


@dataclass
class SweepData:
    """Per-question arrays for the sweep, aligned by position."""

    qids: list[str]
    questions: list[str]
    gold: list[tuple[str, ...]]
    confidence: np.ndarray  # (n,) Conf(H(Q))
    closed: np.ndarray  # (n,) closed-book score (0/1, or F1)
    closed_answers: list[str]
    rag: dict[int, np.ndarray]  # K -> (n,) RAG score
    rag_answers: dict[int, list[str]] = field(default_factory=dict)
    metric: str = "has_answer"

    @classmethod
    def from_outcomes(
        cls, outcomes: Sequence[QuestionOutcome], metric: str = "has_answer", ks: Sequence[int] | None = None
    ) -> SweepData:
        if metric not in METRICS:
            raise ValueError(f"metric={metric!r} is not one of {METRICS}")
        if not outcomes:
            raise ValueError("the β sweep needs at least one question outcome")
        no_conf = [o.qid for o in outcomes if o.confidence is None]
        if no_conf:
            raise ValueError(f"outcomes without a confidence (run the probe first): {no_conf[:5]}")
        ks = sorted(set(ks) if ks is not None else set.intersection(*(set(o.rag) for o in outcomes)))
        missing = [(o.qid, k) for o in outcomes for k in ks if k not in o.rag]
        if not ks or missing:
            raise ValueError(f"every outcome needs RAG answers for K in {ks}; missing (qid, K): {missing[:5]}")
        return cls(
            qids=[o.qid for o in outcomes],
            questions=[o.question for o in outcomes],
            gold=[o.answers for o in outcomes],
            confidence=np.array([o.confidence for o in outcomes], dtype=np.float64),
            closed=np.array([float(getattr(o.closed_book, metric)) for o in outcomes]),
            closed_answers=[o.closed_book.answer for o in outcomes],
            rag={k: np.array([float(getattr(o.rag[k], metric)) for o in outcomes]) for k in ks},
            rag_answers={k: [o.rag[k].answer for o in outcomes] for k in ks},
            metric=metric,
        )

    @property
    def ks(self) -> list[int]:
        return sorted(self.rag)

    def _k(self, k: int) -> np.ndarray:
        if k not in self.rag:
            raise ValueError(f"no RAG outcomes for K={k}; available: {self.ks}")
        return self.rag[k]

    def correct(self, k: int, beta: float) -> np.ndarray:
        """Per-question score of CBDR with top-K contexts at threshold β."""
        return np.where(should_retrieve(self.confidence, check_beta(beta)), self._k(k), self.closed)


@dataclass
class SweepResult:
    betas: np.ndarray
    retrieval_rate: np.ndarray  # (len(betas),)
    accuracy: dict[int, np.ndarray]  # K -> (len(betas),)
    n: int
    metric: str

    def rows(self) -> list[dict[str, float]]:
        return [
            {
                "beta": float(b),
                "retrieval_rate": float(r),
                **{f"top{k}": float(acc[i]) for k, acc in sorted(self.accuracy.items())},
            }
            for i, (b, r) in enumerate(zip(self.betas, self.retrieval_rate))
        ]


def sweep(data: SweepData, betas: Sequence[float] | None = None, ks: Sequence[int] | None = None) -> SweepResult:
    """Accuracy (mean score) and retrieval rate at every β, for every K; one vectorised pass."""
    betas = check_betas(betas)
    retrieve = should_retrieve(data.confidence[None, :], betas[:, None])  # (betas, questions)
    accuracy = {k: np.where(retrieve, data._k(k)[None, :], data.closed[None, :]).mean(axis=1) for k in (ks or data.ks)}
    return SweepResult(betas, retrieve.mean(axis=1), accuracy, len(data.qids), data.metric)


# ---------------------------------------------------------------- Table 3


def table3_markdown(
    entries: Sequence[tuple[str, SweepData, float]], ks: Sequence[int] = DEFAULT_KS, dataset: str = "NQ"
) -> str:
    """The papers' Table 3: one row per (reranker, β) with Top-K accuracy (%) and retrieval rate RR (%)."""
    header = ["Reranker"] + [f"{dataset} Top-{k}" for k in ks] + ["β", "RR (%) ↓"]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for reranker, data, beta in entries:
        result = sweep(data, [beta], ks)
        cells = [f"{result.accuracy[k][0] * 100:.2f}" for k in ks]
        lines.append("| " + " | ".join([reranker, *cells, f"{beta:g}", f"{result.retrieval_rate[0] * 100:.2f}"]) + " |")
    lines += ["", "β = 0: CBDR off (always retrieve); β > 0: retrieve iff Conf(H(Q)) < β."]
    return "\n".join(lines)


# ---------------------------------------------------------------- choosing β


@dataclass(frozen=True)
class BetaChoice:
    beta: float
    k: int
    objective: str
    budget: float | None
    dev_accuracy: float
    dev_retrieval_rate: float


def choose_beta(
    dev: SweepData,
    k: int,
    objective: str = "accuracy",
    budget: float | None = None,
    betas: Sequence[float] | None = None,
) -> BetaChoice:
    """β from the dev split: the highest accuracy (objective "accuracy"), or the highest accuracy whose
    retrieval rate is at most `budget` (objective "budget"); ties go to the lower retrieval rate, then the
    smaller β."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective={objective!r} is not one of {OBJECTIVES}")
    result = sweep(dev, betas, [k])
    accuracy, rate = result.accuracy[k], result.retrieval_rate
    feasible = np.ones_like(rate, dtype=bool)
    if objective == "budget":
        if budget is None:
            raise ValueError("objective=budget needs budget, a fraction in [0, 1]")
        budget = check_beta(budget, "budget")
        feasible = rate <= budget + 1e-12
        if not feasible.any():
            raise ValueError(
                f"no β on the grid keeps the dev retrieval rate within cbdr.retrieval_budget={budget}; "
                f"the lowest reachable is {rate.min():.3f} (β = {result.betas[rate.argmin()]:g})"
            )
    # np.lexsort sorts by the last key first: accuracy (descending), then retrieval rate, then β.
    candidates = np.flatnonzero(feasible)
    best = candidates[np.lexsort((result.betas[candidates], rate[candidates], -np.round(accuracy[candidates], 12)))[0]]
    return BetaChoice(float(result.betas[best]), k, objective, budget, float(accuracy[best]), float(rate[best]))


def report_beta(
    dev: SweepData,
    test: SweepData,
    k: int,
    objective: str = "accuracy",
    budget: float | None = None,
    betas: Sequence[float] | None = None,
) -> dict[str, Any]:
    """β chosen on dev, with its accuracy and retrieval rate on test beside test's always-retrieve accuracy."""
    choice = choose_beta(dev, k, objective, budget, betas)
    test_result = sweep(test, [choice.beta, 0.0], [k])
    return {
        "beta": choice.beta,
        "k": k,
        "objective": objective,
        "budget": choice.budget,
        "dev/accuracy": choice.dev_accuracy,
        "dev/retrieval_rate": choice.dev_retrieval_rate,
        "test/accuracy": float(test_result.accuracy[k][0]),
        "test/retrieval_rate": float(test_result.retrieval_rate[0]),
        "test/always_retrieve_accuracy": float(test_result.accuracy[k][1]),
        "test/n": test_result.n,
    }


# ---------------------------------------------------------------- Figure 8


def plot_beta_curve(
    result: SweepResult, path: str | Path, beta_range: tuple[float, float] = (0.90, 1.00), title: str | None = None
) -> Path:
    """Accuracy (left axis, one line per K) and skip-retrieval ratio (right axis) against β, as in the
    papers' Figure 8; written atomically as PNG."""
    low, high = beta_range
    shown = (result.betas >= low - 1e-12) & (result.betas <= high + 1e-12)
    if not shown.any():
        raise ValueError(f"no β of the sweep lies in beta_range={beta_range}")
    betas = result.betas[shown]
    figure = Figure(figsize=(6.4, 4.0), dpi=120)
    left = figure.add_subplot()
    for k, accuracy in sorted(result.accuracy.items()):
        left.plot(betas, accuracy[shown] * 100, marker="o", markersize=3, label=f"accuracy, Top-{k}")
    left.set_xlabel("threshold β")
    left.set_ylabel(f"RAG system score ({result.metric}, %)")
    right = left.twinx()
    right.plot(betas, (1 - result.retrieval_rate[shown]) * 100, color="gray", linestyle="--", label="skip retrieval")
    right.set_ylabel("skip retrieval ratio (%)")
    handles = left.get_legend_handles_labels()[0] + right.get_legend_handles_labels()[0]
    left.legend(handles, [h.get_label() for h in handles], loc="best", fontsize="small")
    left.set_title(title or f"CBDR: accuracy and skipped retrieval against β (n = {result.n})")
    figure.tight_layout()
    return atomic_save_png(figure, path)


# ---------------------------------------------------------------- appendix F: flips


@dataclass
class FlipReport:
    k: int
    beta_a: float
    beta_b: float
    turned_right: int  # wrong at β_a, right at β_b
    turned_wrong: int  # right at β_a, wrong at β_b
    examples_right: list[dict[str, Any]]
    examples_wrong: list[dict[str, Any]]

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def flip_analysis(data: SweepData, k: int, beta_a: float, beta_b: float, max_examples: int = 5) -> FlipReport:
    """Questions whose correctness changes going from β_a to β_b with top-K contexts (the papers' phase
    difference analysis). Examples are the most confident such questions first."""
    if data.metric == "f1":
        raise ValueError("flips need a 0/1 metric (has_answer or em), not f1")
    beta_a, beta_b = check_beta(beta_a, "beta_a"), check_beta(beta_b, "beta_b")
    retrieve_a, retrieve_b = should_retrieve(data.confidence, beta_a), should_retrieve(data.confidence, beta_b)
    right_a, right_b = data.correct(k, beta_a).astype(bool), data.correct(k, beta_b).astype(bool)
    by_confidence = np.argsort(-data.confidence, kind="stable")

    def examples(mask: np.ndarray) -> list[dict[str, Any]]:
        picked = [int(i) for i in by_confidence if mask[i]][:max_examples]
        answer = lambda i, retrieved: data.rag_answers[k][i] if retrieved else data.closed_answers[i]  # noqa: E731
        return [
            {
                "qid": data.qids[i],
                "question": data.questions[i],
                "gold": list(data.gold[i]),
                "confidence": float(data.confidence[i]),
                "retrieved_a": bool(retrieve_a[i]),
                "retrieved_b": bool(retrieve_b[i]),
                "answer_a": answer(i, retrieve_a[i]),
                "answer_b": answer(i, retrieve_b[i]),
            }
            for i in picked
        ]

    turned_right, turned_wrong = ~right_a & right_b, right_a & ~right_b
    return FlipReport(
        k,
        beta_a,
        beta_b,
        int(turned_right.sum()),
        int(turned_wrong.sum()),
        examples(turned_right),
        examples(turned_wrong),
    )


def flips_markdown(report: FlipReport) -> str:
    lines = [
        f"β {report.beta_a:g} → {report.beta_b:g} (Top-{report.k}): {report.turned_right} answers turned right, "
        f"{report.turned_wrong} turned wrong",
        "",
    ]
    for title, examples in (("Turned right", report.examples_right), ("Turned wrong", report.examples_wrong)):
        if not examples:
            continue
        lines += [
            f"**{title}**",
            "",
            "| question | gold | Conf | answer at β_a | answer at β_b |",
            "| --- | --- | --- | --- | --- |",
        ]
        for e in examples:
            cells = [
                e["question"],
                " / ".join(e["gold"]),
                f"{e['confidence']:.3f}",
                ("[RAG] " if e["retrieved_a"] else "[closed] ") + e["answer_a"],
                ("[RAG] " if e["retrieved_b"] else "[closed] ") + e["answer_b"],
            ]
            lines.append("| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") for c in cells) + " |")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"
