"""The fair-student study's tables: the rows against the base (Holm across every row compared), the fit of each row
per fold, the controls, the pre-check, the verdict against the design's success criterion, and the same students
on questions outside the study."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from confrag.data.nq import QARow
from confrag.infra.atomic import atomic_write_text
from confrag.rag.stats import accuracy_ci, detectable_difference, holm, mcnemar_exact, paired_difference
from confrag.reranker.listwise_teachers import ALIGNMENT_TEACHERS
from confrag.retrieval.corpus import corpus_from_gold_paragraphs
from confrag.studies.fair_student import TOP_K, Choice
from confrag.studies.frozen_precheck import PrecheckRow
from confrag.studies.likelihood_study import Outcomes, Study, candidates_for, listwise_data

PRIMARY = "residual_ce@0"
# The design's discordance: a tie-breaker's (fusion moved 28 of 1,400 answers), taken as 2.5 %.
EXPECTED_DISCORDANCE = 0.025
# The success criterion, fixed with the design: held-out agreement with ℓ's top-1 at least the base's + 2 points in
# every fold, Top-1 at least +1 point with Holm p < 0.05, token F1 not below the base's, every seed the same sign.
AGREEMENT_GAIN, MIN_GAIN, ALPHA = 0.02, 0.01, 0.05


@dataclass(frozen=True)
class RowResult:
    name: str
    has_answer: list[float]  # value, low, high
    f1: float
    diff: list[float] | None = None  # value, low, high (points of has_answer against the base)
    only_row: int | None = None
    only_base: int | None = None
    holm: float | None = None
    f1_diff: float | None = None


def control_lines(controls: Sequence[dict]) -> list[str]:
    """One line per control: its fit in its teacher's measure and in its own loss, where it trained and held out,
    the base's beside each, and how many of its training questions' top-1s it moved."""
    pct = lambda v: f"{100 * v:.1f} %"  # noqa: E731

    def temperatures(c: dict) -> str:  # τ_T only where the teacher divides its scores by it
        graded = ALIGNMENT_TEACHERS[c["teacher"]].graded
        return f"τ {c['tau']:g}" + (f", τ_T {c['teacher_tau']:.3g}" if graded else "")

    return [
        f"- `{c['name']}`, {temperatures(c)}, {c['training_questions']} questions: "
        f"{pct(c['trained'])} where it trained (base {pct(c['trained_base'])}), {pct(c['held_out'])} held out (base "
        f"{pct(c['held_out_base'])}); loss {c['loss_trained_base']:.3f} → {c['loss_trained']:.3f} where it trained, "
        f"{c['loss_held_out_base']:.3f} → {c['loss_held_out']:.3f} held out; top-1 moved on "
        f"{pct(c['moved_where_trained'])} of its training questions, mean |f − base| {c['mean_correction']:.2f}"
        for c in controls
    ]


def compare(names: Sequence[str], outcomes: dict[str, list]) -> list[RowResult]:
    """Each of `names` against `outcomes["base"]` (paired by question): exact McNemar, Holm across all of `names`."""
    right = {k: np.array([o.has_answer for o in v], dtype=float) for k, v in outcomes.items()}
    f1 = {k: np.array([o.f1 for o in v]) for k, v in outcomes.items()}
    tests = {k: mcnemar_exact(right[k], right["base"]) for k in names}
    adjusted = dict(zip(names, holm([tests[k].pvalue for k in names])))

    def accuracy(k: str) -> list[float]:
        a = accuracy_ci(right[k])
        return [a.value, a.low, a.high]

    rows = [RowResult("base", accuracy("base"), float(f1["base"].mean()))]
    for k in names:
        d = paired_difference(right[k], right["base"])
        rows.append(
            RowResult(
                k, accuracy(k), float(f1[k].mean()), [d.value, d.low, d.high], tests[k].only_a, tests[k].only_b,
                adjusted[k], float(f1[k].mean() - f1["base"].mean()),
            )
        )  # fmt: skip
    return rows


def table_lines(rows: Sequence[RowResult], extra: dict[str, dict[str, str]] | None = None) -> list[str]:
    extra = extra or {}
    columns = sorted({c for e in extra.values() for c in e})
    lines = [
        "| row | Top-1 has_answer % [95 % CI] | − base, points [95 % CI] | row / base alone | Holm p | token F1 "
        "| F1 − base" + "".join(f" | {c}" for c in columns) + " |",
        "| --- | --- | --- | --- | ---: | ---: | ---:" + " | ---:" * len(columns) + " |",
    ]  # fmt: skip
    for r in rows:
        acc = f"{100 * r.has_answer[0]:.1f} [{100 * r.has_answer[1]:.1f}, {100 * r.has_answer[2]:.1f}]"
        diff = f"{100 * r.diff[0]:+.1f} [{100 * r.diff[1]:+.1f}, {100 * r.diff[2]:+.1f}]" if r.diff else ""
        alone = f"{r.only_row} / {r.only_base}" if r.diff else ""
        holm_p = f"{r.holm:.3g}" if r.holm is not None else ""
        f1_diff = f"{100 * r.f1_diff:+.2f}" if r.f1_diff is not None else ""
        cells = "".join(f" | {extra.get(r.name, {}).get(c, '')}" for c in columns)
        lines.append(f"| {r.name} | {acc} | {diff} | {alone} | {holm_p} | {100 * r.f1:.1f} | {f1_diff}{cells} |")
    return lines


def verdict(
    rows: Sequence[RowResult],
    seeds: dict[str, float],
    fits: Sequence[dict],
    base_agreement: float,
    primary: str = PRIMARY,
) -> tuple[bool, list[str]]:
    """The design's success criterion, checked: (met, one line per part). The agreement bar is the design's words, the
    base's agreement over every test question (`base_agreement`) + 2 points, in every fold; the other reading (each
    fold's own base + 2) is printed beside it and does not decide. Seeds "in the same direction" as the gain the
    criterion asks for: every seed above the base."""
    row = next(r for r in rows if r.name == primary)
    name = primary.split("@")[0]
    folds = [f for f in fits if f["row"] == name]
    bar = base_agreement + AGREEMENT_GAIN
    parts = {
        f"held-out agreement with ℓ's top-1 ≥ {100 * bar:.1f} % (the base's {100 * base_agreement:.1f} + 2) in every "
        "fold": all(f["held_out"] >= bar for f in folds),
        f"Top-1 ≥ +{100 * MIN_GAIN:.0f} point with Holm p < {ALPHA}": row.diff[0] >= MIN_GAIN and row.holm < ALPHA,
        "token F1 not below the base's": row.f1_diff >= 0,
        "every seed a gain over the base": all(v > 0 for k, v in seeds.items() if k.startswith(name + "@")),
    }
    other = all(f["held_out"] >= f["held_out_base"] + AGREEMENT_GAIN for f in folds)
    lines = [f"- {'met' if ok else 'not met'}: {what}" for what, ok in parts.items()]
    lines.insert(1, f"  (the other reading, each fold's own base + 2: {'met' if other else 'not met'})")
    return all(parts.values()), lines


def precheck_lines(rows: Sequence[PrecheckRow]) -> list[str]:
    lines = [
        "| model | features | held-out AUROC [95 % CI] | top-1 = ℓ's choice among the base's top 3 |",
        "| --- | --- | --- | ---: |",
    ]
    for r in rows:
        lines.append(f"| {r.model} | {r.features} | {r.auroc:.3f} [{r.auroc_ci[0]:.3f}, {r.auroc_ci[1]:.3f}] | "
                     f"{100 * r.top1_is_ells:.1f} % |")  # fmt: skip
    return lines


def outside_eval(study: Study, rows: list[QARow], students: dict[str, tuple], cache) -> tuple[list[str], dict]:
    """The chosen students (each `(student, w)`) on questions outside the study: the file's paragraphs join the
    corpus, BM25's top 20, the base's top k reordered; every row's Top-1 answered and paired against the base."""
    tagged = [QARow(f"eval:{r.qid}", r.question, r.answers, r.contexts) for r in rows]
    corpus = corpus_from_gold_paragraphs([*study.rows, *tagged])
    sets = candidates_for(tagged, corpus, cache)
    data = listwise_data(sets, cache).top_k(TOP_K)
    at = list(range(len(sets)))
    outcomes = Outcomes(study.prompted, sets, cache)
    answered = {"base": outcomes(at, [int(np.argmax(s)) for s in data.base_scores])}
    for name, (student, weight) in students.items():
        student.weight_at_scoring = weight
        answered[name] = outcomes(at, [int(np.argmax(s)) for s in student.score(data)])
    names = [k for k in answered if k != "base"]
    result = compare(names, answered)
    n = len(at)
    lines = [
        f"Questions outside the study: {n} (fold 0's seed-0 student of each row, its dev-chosen settings; nothing "
        f"chosen on these questions). Detectable difference {100 * detectable_difference(n, EXPECTED_DISCORDANCE):.1f}"
        f" points (discordance {100 * EXPECTED_DISCORDANCE:.1f} %, n = {n}); Holm across {len(names)} rows.",
        "",
        *table_lines(result),
    ]
    return lines, {"n": n, "rows": [asdict(r) for r in result]}


def choices_lines(chosen: dict[str, Choice], dev_base: float) -> list[str]:
    lines = [f"Dev chose (base {100 * dev_base:.0f} % on dev):"]
    for row, c in chosen.items():
        s = c.settings
        head = f", head lr {s.head_lr:g}" if s.head_lr is not None else ""
        lines.append(f"- `{row}`: lr {s.lr:g}{head}, λ {s.anchor:g}, τ {s.tau:g}, τ_T {c.teacher_tau:g}, "
                     f"w {c.weight:g} (dev {100 * c.dev_has_answer:.0f} %)")  # fmt: skip
    return lines


def write(out: Path, lines: list[str], payload: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "report.md", "\n".join(lines) + "\n")
    atomic_write_text(out / "metrics.json", json.dumps(payload, indent=2, default=str))


def holm_from_counts(counts: dict[str, tuple[int, int]]) -> dict[str, tuple[float, float]]:
    """Exact McNemar p and Holm-adjusted p of rows given by their discordant counts (row alone, base alone), Holm
    across all of them: a published table's Holm column recomputed from its own counts."""
    raw = {}
    for name, (only_row, only_base) in counts.items():
        a = [1] * only_row + [0] * only_base
        raw[name] = mcnemar_exact(a, [1 - x for x in a]).pvalue if a else 1.0
    return dict(zip(raw, zip(raw.values(), holm(list(raw.values())))))
