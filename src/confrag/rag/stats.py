"""Uncertainty for small-sample accuracies, and the papers' Table 2.

Samples here are small, so every accuracy carries a 95 % confidence interval: a percentile bootstrap
(`scipy.stats.bootstrap`, seeded) from SMALL_N outcomes on, Wilson's score interval (scipy's
`binomtest(k, n).proportion_ci(method="wilson")`) below SMALL_N and wherever every outcome is the same (where
the bootstrap has nothing to resample and would print `0.00 [0.00, 0.00]`). Each reranker is compared with a base
reranker on the same questions: the paired difference with its bootstrap interval (questions resampled; when
every question's difference is the same, the bound Wilson's interval puts on the share of questions that could
differ), the exact McNemar test (a two-sided binomial test on the discordant pairs), its p-value Holm-corrected
across the rows compared with the base, and the smallest difference the design detects at 80 % power (from the
pair's discordance, Connor's normal approximation). The papers report none of these.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy.optimize import brentq
from scipy.stats import binomtest, bootstrap, norm

from confrag.rag.pipeline import DEFAULT_KS, QuestionOutcome
from confrag.retrieval.candidates import same_question

BINARY_METRICS = ("has_answer", "has_answer_dpr", "em")
# Below this many outcomes a proportion's interval is Wilson's (a percentile bootstrap of so few 0/1 outcomes covers
# less than it says), and the reports print their small-sample marks (confrag.reports.small_samples).
SMALL_N = 30


def wilson(successes: float, n: int, confidence_level: float = 0.95) -> tuple[float, float]:
    """Wilson's score interval of a proportion of `successes` (rounded to a count) in `n`, scipy's; (0, 1) for n = 0."""
    if n <= 0:
        return (0.0, 1.0)
    k = min(max(round(successes), 0), n)
    interval = binomtest(k, n).proportion_ci(confidence_level=confidence_level, method="wilson")
    return float(interval.low), float(interval.high)


@dataclass(frozen=True)
class Accuracy:
    value: float
    low: float
    high: float
    n: int

    def format(self, scale: float = 100.0, digits: int = 2) -> str:
        return f"{self.value * scale:.{digits}f} [{self.low * scale:.{digits}f}, {self.high * scale:.{digits}f}]"


@dataclass(frozen=True)
class McNemar:
    only_a: int  # questions a gets right and b wrong
    only_b: int  # questions b gets right and a wrong
    pvalue: float


def _binary(values: Sequence[Any], name: str) -> np.ndarray:
    array = np.asarray(values, dtype=np.float64).reshape(-1)
    if not np.isin(array, (0.0, 1.0)).all():
        raise ValueError(f"{name} must hold 0/1 (or bool) outcomes")
    return array


def accuracy_ci(
    correct: Sequence[Any], confidence_level: float = 0.95, n_resamples: int = 10_000, seed: int = 0
) -> Accuracy:
    """Mean of 0/1 outcomes with a percentile-bootstrap interval (deterministic for a given seed); Wilson's below
    SMALL_N outcomes or when all are equal, so that no interval has zero width."""
    values = _binary(correct, "correct")
    if values.size == 0:
        raise ValueError("accuracy of an empty set of questions is undefined")
    if not 0 < confidence_level < 1:
        raise ValueError(f"confidence_level must be in (0, 1); got {confidence_level}")
    mean = float(values.mean())
    if values.size < SMALL_N or np.all(values == values[0]):
        low, high = wilson(float(values.sum()), int(values.size), confidence_level)
        return Accuracy(mean, low, high, int(values.size))
    low, high = _percentile_interval(values, confidence_level, n_resamples, seed)
    return Accuracy(mean, low, high, int(values.size))


def _percentile_interval(
    values: np.ndarray, confidence_level: float, n_resamples: int, seed: int
) -> tuple[float, float]:
    """The seeded percentile-bootstrap interval of the mean of `values` (questions resampled)."""
    interval = bootstrap(
        (values,),
        np.mean,
        confidence_level=confidence_level,
        n_resamples=n_resamples,
        method="percentile",
        rng=np.random.default_rng(seed),
        vectorized=True,
    ).confidence_interval
    return float(interval.low), float(interval.high)


def mcnemar_exact(a: Sequence[Any], b: Sequence[Any]) -> McNemar:
    """Exact McNemar test of paired 0/1 outcomes of two systems on the same questions (two-sided)."""
    a, b = _binary(a, "a"), _binary(b, "b")
    if a.shape != b.shape:
        raise ValueError(f"paired outcomes must have equal length; got {a.size} and {b.size}")
    only_a, only_b = int(((a == 1) & (b == 0)).sum()), int(((a == 0) & (b == 1)).sum())
    discordant = only_a + only_b
    pvalue = 1.0 if discordant == 0 else float(binomtest(only_a, discordant, 0.5).pvalue)
    return McNemar(only_a, only_b, pvalue)


@dataclass(frozen=True)
class PairedDifference:
    value: float  # mean of a - b over the questions
    low: float
    high: float
    n: int

    def format(self, scale: float = 100.0, digits: int = 1) -> str:
        return f"{self.value * scale:+.{digits}f} [{self.low * scale:+.{digits}f}, {self.high * scale:+.{digits}f}]"


def paired_difference(
    a: Sequence[Any], b: Sequence[Any], confidence_level: float = 0.95, n_resamples: int = 10_000, seed: int = 0
) -> PairedDifference:
    """Mean paired difference of 0/1 outcomes (a - b, same questions) with a percentile-bootstrap interval
    that resamples questions, so the pairing is kept. When every question's difference is the same value v, the
    bootstrap has nothing to resample: the interval is then what Wilson's lower bound l on the share of questions
    with difference v allows, the other 1 - l moving the mean by at most their largest step away from v
    (v = 0: [-(1 - l), 1 - l]; v = 1: [1 - 2(1 - l), 1])."""
    a, b = _binary(a, "a"), _binary(b, "b")
    if a.shape != b.shape:
        raise ValueError(f"paired outcomes must have equal length; got {a.size} and {b.size}")
    if a.size == 0:
        raise ValueError("a paired difference over no questions is undefined")
    diff = a - b
    mean = float(diff.mean())
    if np.all(diff == diff[0]):  # nothing varies under resampling
        share_low = wilson(a.size, a.size, confidence_level)[0]
        low, high = mean - (mean + 1) * (1 - share_low), mean + (1 - mean) * (1 - share_low)
        return PairedDifference(mean, max(low, -1.0), min(high, 1.0), int(a.size))
    low, high = _percentile_interval(diff, confidence_level, n_resamples, seed)
    return PairedDifference(mean, low, high, int(a.size))


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm's step-down adjustment of a family of p-values (same order as given): controls the chance of any
    false rejection among them, without assuming independence. Written here, not taken from a library: scipy has
    no Holm adjustment (`scipy.stats.false_discovery_control` is Benjamini-Hochberg's, another error rate), and
    statsmodels' `multipletests(method="holm")` computes the same adjustment but would add a dependency
    (with pandas and patsy) for these eight lines."""
    p = np.asarray(pvalues, dtype=np.float64)
    order = np.argsort(p, kind="stable")
    adjusted = np.empty_like(p)
    running = 0.0
    for rank, index in enumerate(order):
        running = max(running, min(1.0, (len(p) - rank) * p[index]))
        adjusted[index] = running
    return adjusted.tolist()


def detectable_difference(n: int, discordant: float, alpha: float = 0.05, power: float = 0.8) -> float | None:
    """The smallest paired difference in accuracy a two-sided McNemar test on `n` questions detects with
    `power`, when a share `discordant` of the questions is answered right by exactly one system (Connor
    1987: n = (z_a sqrt(psi) + z_b sqrt(psi - d^2))^2 / d^2, solved for d). None when nothing is discordant."""
    if n < 1 or not 0 < discordant <= 1:
        return None
    z_a, z_b = norm.ppf(1 - alpha / 2), norm.ppf(power)

    def needed(d: float) -> float:
        return (z_a * np.sqrt(discordant) + z_b * np.sqrt(max(discordant - d * d, 0.0))) ** 2 / (d * d) - n

    upper = np.sqrt(discordant)
    if needed(upper) > 0:  # even the largest difference this discordance allows needs more questions
        return float(upper)
    return float(brentq(needed, 1e-9, upper))


# ---------------------------------------------------------------- Table 2


RunKey = tuple[str, str, str]  # (LLM, reranker, dataset)


def _correct_by_qid(outcomes: Sequence[QuestionOutcome], k: int, metric: str, where: str) -> dict[str, float]:
    missing = [o.qid for o in outcomes if k not in o.rag]
    if missing:
        raise ValueError(f"{where}: no top-{k} answers for questions {missing[:5]}; run the pipeline with K={k}")
    unscored = [o.qid for o in outcomes if getattr(o.rag[k], metric) is None]
    if unscored:
        raise ValueError(
            f"{where}: the top-{k} answers of questions {unscored[:5]} carry no {metric} (records written before it "
            "was scored); rerun the evaluation or choose eval.metric=has_answer"
        )
    return {o.qid: float(getattr(o.rag[k], metric)) for o in outcomes}


def table2_rows(
    runs: Mapping[RunKey, Sequence[QuestionOutcome]],
    base_reranker: str,
    ks: Sequence[int] = DEFAULT_KS,
    metric: str = "has_answer",
    n_resamples: int = 10_000,
    seed: int = 0,
    *,
    expected_discordance: float,
) -> list[dict[str, Any]]:
    """One dict per (LLM, reranker, dataset): accuracy with CI and McNemar vs `base_reranker` (same LLM and
    dataset, paired by qid) for every K. `top{k}_mde`, the smallest difference the comparison detects at 80 %
    power, comes from the design (`expected_discordance`, fixed before the run), not from the row's own observed
    discordance, which would make a row that barely moves look well powered."""
    if metric not in BINARY_METRICS:
        raise ValueError(f"metric={metric!r} is not one of {BINARY_METRICS} (the tests need 0/1 outcomes)")
    if not any(reranker == base_reranker for _, reranker, _ in runs):
        raise ValueError(f"base_reranker={base_reranker!r} names no run; rerankers: {sorted({r for _, r, _ in runs})}")
    rows = []
    for (llm, reranker, dataset), outcomes in runs.items():
        where = f"run ({llm}, {reranker}, {dataset})"
        base = runs.get((llm, base_reranker, dataset))
        row: dict[str, Any] = {"llm": llm, "reranker": reranker, "dataset": dataset, "n": len(outcomes)}
        for k in ks:
            mine = _correct_by_qid(outcomes, k, metric, where)
            row[f"top{k}"] = accuracy_ci(list(mine.values()), n_resamples=n_resamples, seed=seed)
            # Every row holds every key (None where it is not compared): the tables logged from them are columns.
            row.update({f"top{k}_{key}": None for key in ("vs_base", "diff", "mde", "discordance", "p_holm")})
            if base is None or reranker == base_reranker:
                continue
            theirs = _correct_by_qid(base, k, metric, f"run ({llm}, {base_reranker}, {dataset})")
            if set(mine) != set(theirs):
                raise ValueError(
                    f"{where} and its base run answer different questions "
                    f"({len(set(mine) ^ set(theirs))} differ); a paired test needs the same ones"
                )
            qids = sorted(mine)
            asked = {o.qid: o.question for o in outcomes}
            base_asked = {o.qid: o.question for o in base}
            differ = [q for q in qids if not same_question(asked[q], base_asked[q])]
            if differ:  # paired by qid, so the qids must name the same questions in both runs
                raise ValueError(
                    f"{where} and its base run hold other questions under {len(differ)} qid(s), e.g. "
                    f"{differ[0]!r}: {asked[differ[0]]!r} vs {base_asked[differ[0]]!r}; a paired test "
                    f"needs the same questions"
                )
            a, b = [mine[q] for q in qids], [theirs[q] for q in qids]
            row[f"top{k}_vs_base"] = test = mcnemar_exact(a, b)
            row[f"top{k}_diff"] = paired_difference(a, b, n_resamples=n_resamples, seed=seed)
            row[f"top{k}_mde"] = detectable_difference(len(qids), expected_discordance)
            row[f"top{k}_discordance"] = (test.only_a + test.only_b) / max(len(qids), 1)  # observed, for the record
        rows.append(row)
    add_holm(rows, ks)
    return rows


def add_holm(rows: list[dict[str, Any]], ks: Sequence[int]) -> None:
    """`top{k}_p_holm`: each row's McNemar p Holm-corrected across the rows compared with the base on the same
    dataset and K (the family a reader scans for 'which reranker beats the base')."""
    for k in ks:
        for dataset in dict.fromkeys(row["dataset"] for row in rows):
            family = [r for r in rows if r["dataset"] == dataset and r.get(f"top{k}_vs_base") is not None]
            for row, adjusted in zip(family, holm([r[f"top{k}_vs_base"].pvalue for r in family])):
                row[f"top{k}_p_holm"] = adjusted


def paired_cell(row: Mapping[str, Any], k: int) -> str:
    """'+3.3 [-1.3, +8.0] · 0.412 · 6.1' for a row compared with the base at Top-k; 'base' or '—' otherwise."""
    diff = row.get(f"top{k}_diff")
    if diff is None:
        return "—"
    mde = row.get(f"top{k}_mde")
    holm_p = row.get(f"top{k}_p_holm")
    return (
        f"{diff.format()} · {'—' if holm_p is None else f'{holm_p:.3f}'} · {'—' if mde is None else f'{100 * mde:.1f}'}"
    )


def difference_cell(row: Mapping[str, Any], k: int) -> str:
    """'+3.3 [-1.3, +8.0] · 6.1' (the paired difference in points and the detectable one) for a row compared with
    the base at Top-k; '—' otherwise."""
    diff = row.get(f"top{k}_diff")
    if diff is None:
        return "—"
    mde = row.get(f"top{k}_mde")
    return f"{diff.format()} · {'—' if mde is None else f'{100 * mde:.1f}'}"


def table2_markdown(
    rows: Sequence[Mapping[str, Any]],
    base_reranker: str,
    ks: Sequence[int] = DEFAULT_KS,
    reranker_params: Mapping[str, str] | None = None,
) -> str:
    """The papers' Table 2 (rows: LLM, reranker; columns: Top-K accuracy per dataset), in percent with CIs,
    plus per dataset one column of p-values against the base reranker (exact McNemar, Holm-corrected: the only
    p a reader needs to scan for "which reranker beats the base") and the paired difference at the first K."""
    datasets = list(dict.fromkeys(row["dataset"] for row in rows))
    systems = list(dict.fromkeys((row["llm"], row["reranker"]) for row in rows))
    cells = {(row["llm"], row["reranker"], row["dataset"]): row for row in rows}
    sizes = {d: sorted({row["n"] for row in rows if row["dataset"] == d}) for d in datasets}
    header = ["LLM", "Reranker"] + (["Params"] if reranker_params else [])
    # The share of questions whose own paragraph is among the contexts, when the caller measured it.
    gold = {d: any(f"gold_top{ks[0]}" in row for row in rows if row["dataset"] == d) for d in datasets}
    ks_label = " / ".join(f"Top-{k}" for k in ks)
    for d in datasets:
        header += [f"{d} Top-{k}" for k in ks] + [f"{d} Holm p vs base ({ks_label})"]
        header += [f"{d} Top-{ks[0]} − base [95 % CI] · detectable"]
        header += [f"{d} own ¶ in Top-K ({ks_label})"] if gold[d] else []
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for llm, reranker in systems:
        line = [llm, reranker] + ([reranker_params.get(reranker, "")] if reranker_params else [])
        for d in datasets:
            row = cells.get((llm, reranker, d))
            if row is None:
                line += ["—"] * (len(ks) + 2 + gold[d])
                continue
            line += [row[f"top{k}"].format() for k in ks]
            held = [row.get(f"top{k}_p_holm") for k in ks]
            line.append(
                "base" if reranker == base_reranker else " / ".join("—" if p is None else f"{p:.3f}" for p in held)
            )
            line.append(difference_cell(row, ks[0]))
            if gold[d]:  # None: the question's own paragraph is not known (a corpus of your own)
                shares = [row.get(f"gold_top{k}") for k in ks]
                line.append("unknown" if None in shares else " / ".join(f"{100 * v:.1f}" for v in shares))
        lines.append("| " + " | ".join(line) + " |")
    notes = ", ".join(f"{d}: n = {'/'.join(map(str, sizes[d]))}" for d in datasets)
    lines.append("")
    lines.append(
        f"Accuracy in % with 95 % percentile-bootstrap CI (Wilson's below {SMALL_N} questions or when every answer "
        f"is scored the same). Holm p: the exact McNemar test against {base_reranker} "
        f"on the same questions (same LLM), Holm-corrected across the rows compared with it (per dataset and K). "
        f"Top-{ks[0]} − base: the paired difference in points with its bootstrap CI over questions, and the smallest "
        f"difference the design detects at 80 % power (α 0.05, at the discordance expected before the run, "
        f"eval.expected_discordance). {notes}."
    )
    return "\n".join(lines)
