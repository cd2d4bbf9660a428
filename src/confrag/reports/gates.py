"""The gates task's report: gates.md (both conditions' tables, the curves' plot), metrics.json, W&B."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning.pytorch.loggers import Logger

from confrag.gates.evaluation import CurvePoint, GateRow, gates_markdown
from confrag.gates.settings import GateSettings
from confrag.reports.small_samples import SMALL_N, auroc_interval, interval_fields, proportion_text
from confrag.reports.tables import RunHeader, log_rows, wandb_loggers
from confrag.reranker.systems import label
from confrag.stages.gate_comparison import GateEvaluation
from confrag.stages.gate_questions import CONDITIONS
from confrag.stages.gate_scoring import GateResults


def gate_record(
    settings: GateSettings,
    evaluation: GateEvaluation,
    results: GateResults,
    curves: list[CurvePoint],
    answers: dict[str, int],
    seconds: float,
) -> dict[str, Any]:
    """metrics.json: the scalar metrics (returned to sweepers) and every table's data."""
    metrics = {
        f"{r.contexts}/{r.gate}/{key}": getattr(r, key)
        for r in results.rows
        for key in (
            "accuracy",
            "retrieval_rate",
            "refusal_rate",
            "llm_passes",
            "retriever_calls",
            "wall_s",
            "auroc",
            "prr",
            "mcnemar_p",
        )
    }
    return {
        "metrics": metrics,
        "table": [{**r.to_dict(), **small_sample_fields(r)} for r in results.rows],
        "curves": [c.to_dict() for c in curves],
        "questions": {"train": [r.qid for r in evaluation.sets.train], "test": [r.qid for r in evaluation.sets.test]},
        "fits": results.fits,
        "decisions": results.decisions,
        "sets": evaluation.sets.report,
        "timings": evaluation.timings,
        "answers": answers,
        "gates": {name: settings.configs[name] for name in settings.names},
        "wall_seconds": seconds,
    }


def _auroc_ci(row: GateRow) -> tuple[float, float] | None:
    """Hanley and McNeil's interval of the row's AUROC (against "retrieval helped"), when it is defined."""
    if row.auroc != row.auroc or row.helped in (0, row.n):  # NaN, or one class of labels
        return None
    return auroc_interval(row.auroc, row.helped, row.n - row.helped)


def small_sample_fields(row: GateRow) -> dict[str, object]:
    """metrics.json's version of `small_sample_note` for one row: intervals of its rates and AUROC below SMALL_N
    questions (the accuracy has its interval in every row: `rag.stats.accuracy_ci`); nothing for larger samples."""
    if row.n >= SMALL_N:
        return {}
    fields: dict[str, object] = interval_fields(
        {"retrieval_rate": row.retrieval_rate, "refusal_rate": row.refusal_rate}, row.n
    )
    ci = _auroc_ci(row)
    fields["auroc_ci"] = list(ci) if ci else None
    fields["sample"] = f"{row.n} test questions, below {SMALL_N}: 95 % intervals"
    return fields


def small_sample_note(rows: Sequence[GateRow]) -> list[str]:
    """Below SMALL_N test questions, the lines under a condition's table: every gate's retrieval rate and AUROC with
    their 95 % intervals (the accuracy carries its own in the table), or why the AUROC and PRR are undefined."""
    if not rows or rows[0].n >= SMALL_N:
        return []
    n, helped = rows[0].n, rows[0].helped
    rates = ", ".join(f"{r.gate} {proportion_text(r.retrieval_rate, n, 1, 100.0)}" for r in rows)
    if helped in (0, n):
        auroc = f"AUROC and PRR undefined: retrieval helped on {helped} of {n} (one class only, not a result)"
    else:
        cells = [f"{r.gate} {r.auroc:.3f} [{ci[0]:.3f}, {ci[1]:.3f}]" for r in rows if (ci := _auroc_ci(r))]
        auroc = f"AUROC (Hanley-McNeil): {', '.join(cells) or 'undefined for every gate'}"
    return ["", f"Below {SMALL_N} test questions (n = {n}), 95 % intervals: retrieval rate (%) {rates}; {auroc}."]


def tables_text(rows: Sequence[GateRow], metric: str) -> str:
    parts = {c: [r for r in rows if r.contexts == c] for c in CONDITIONS}
    return "\n\n".join(
        f"{c}:\n" + "\n".join([gates_markdown(part, metric), *small_sample_note(part)]) for c, part in parts.items()
    )


def report_markdown(
    run: RunHeader,
    settings: GateSettings,
    evaluation: GateEvaluation,
    results: GateResults,
    plot: Path,
    answers: dict[str, int],
    seconds: float,
) -> str:
    sets = evaluation.sets.report
    timing = ", ".join(f"{part} {1000 * s:.0f} ms" for part, s in sorted(evaluation.timings.items()))
    lines = [
        f"# Retrieval gates — {run.llm_name}",
        "",
        f"Run folder: `{run.run_folder}`; wall time {seconds:.0f} s; answers generated "
        f"{answers['generated']}, read from the cache {answers['reused']}.",
        "",
        f"Questions: {sets['evaluation_questions']} {sets.get('questions', 'NQ')} questions the probe never saw (the "
        "cbdr task's evaluation "
        f"questions), split by question: the gates are trained on {sets['train']} (training split: cached "
        f"closed-book / RAG outcomes with clean contexts) and evaluated on the {sets['test']} of the other "
        f"{sets['test_all']} that have a conflicting version (skipped: {sets['conflicts_skipped'] or 'none'}).",
        f"Contexts: clean = top-{settings.top_k} of {run.retriever} top-{run.top_n} reranked by "
        f"{label(settings.reranker)}; conflicting = the gold paragraph with its answer replaced by a same-kind "
        f"answer of another question (kinds: {sets['kinds']}), placed first, then the best {settings.top_k - 1} clean "
        "passages not from the gold paragraph "
        f"({100 * sets['conflicting_contexts_with_a_gold_answer_elsewhere']:.0f} % "
        f"of them still hold a gold answer in another passage).",
        "",
        "Outcome per question: parametric → the closed-book answer, retrieve → the RAG answer (BRIDGE's FA: "
        "its internal passage and the contexts), refuse → a refusal (not correct). Accuracy on answered "
        "excludes refusals. LLM passes: `gate.llm_forward_passes` (prompt prefill + greedy decode each; "
        "P(True)'s extra forward counts as one); retriever calls: retrieval + reranking of a question's "
        "candidates (BRIDGE retrieves for every question before it decides).",
        "",
        "Is the gate's retrieve decision well placed? Each gate's retrieve score (a threshold gate's own "
        "score, oriented so that higher retrieves sooner; the decision itself, 1 or 0, for the others) is "
        "scored against *retrieval helped* (wrong closed-book, right with the top-K retrieved contexts; the "
        "same labels for every gate, "
        + ", ".join(
            f"{condition} {next((r.helped for r in results.rows if r.contexts == condition), 0)}"
            for condition in CONDITIONS
        )
        + f" of {sets['test']}): AUROC (0.5 = chance) and PRR (prediction-rejection ratio: 1 = the oracle "
        "order, 0 = random or constant, — when the labels are all one class). McNemar: an exact test of "
        "the gate's per-question outcomes against always-retrieve's on the same questions (questions only "
        "the gate gets right / only always-retrieve gets right, two-sided p).",
        "",
        f"Wall time per question: a cost model over measured parts. Each part was timed fresh (no cache) on "
        f"{min(settings.timing_questions, sets['test'])} test questions ({timing}); a gate pays the parts its "
        "signals need, its own measured decide time, and per question the answer its decision implies "
        "(closed-book unless its signals already produced it, retrieval + RAG answer, or nothing for a refusal).",
        "",
    ]
    for condition in CONDITIONS:
        rows = [r for r in results.rows if r.contexts == condition]
        lines += [f"## {condition.capitalize()} contexts", "", gates_markdown(rows, settings.metric)]
        lines += [*small_sample_note(rows), ""]
    lines += [
        "## Accuracy against retrieval rate",
        "",
        f"Points: each gate as configured; lines: {', '.join(settings.curves) or 'none'} over their "
        "thresholds (cached answers only).",
        "",
        f"![gates]({plot.name})",
        "",
        "## Config",
        "",
        "```yaml",
        run.config_yaml.rstrip(),
        "```",
        "",
    ]
    return "\n".join(lines)


def log_results(
    loggers: Sequence[Logger],
    metrics: dict[str, float],
    rows: Sequence[GateRow],
    curves: Sequence[CurvePoint],
    plot: Path,
) -> None:
    for logger in loggers:
        logger.log_metrics(metrics)
        logger.save()
    for logger in wandb_loggers(loggers):
        for condition in CONDITIONS:
            log_rows(logger, f"gates_{condition}", [r.to_dict() for r in rows if r.contexts == condition])
        log_rows(logger, "gate_curves", [c.to_dict() for c in curves])
        logger.log_image("gates", [str(plot)])
