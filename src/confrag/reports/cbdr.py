"""The cbdr task's report: Table 3, the β curves, the chosen β, the flips and the live gate check around the
sections of `reports.cbdr_setup`, `reports.cbdr_answers` (Table 2) and `reports.cbdr_chain` (report.md),
every number in metrics.json, the tables and plots on W&B."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from lightning.pytorch.loggers import Logger

from confrag.cbdr import flips_markdown, plot_beta_curve
from confrag.cbdr.analysis import CBDRResults
from confrag.cbdr.settings import CBDRSettings
from confrag.reports.cbdr_chain import chain_intro, chain_markdown
from confrag.reports.cbdr_setup import evaluation_pool_line, reading_guide, stage_line, table1_labels_line
from confrag.reports.rerank import base_line, lengths_line, retrieval_line
from confrag.reports.small_samples import SMALL_N, interval_fields, proportion_text, small_mark
from confrag.reports.tables import RunHeader, log_rows, markdown_table, plain, wandb_loggers
from confrag.reranker.systems import label
from confrag.stages.evaluation import HOTPOTQA, NQ, RagEvaluation, slug
from confrag.stages.rerank import RerankStage

CURVE_RANGE = (0.90, 1.00)  # the papers' Figure 8
PROPORTIONS = ("has_answer", "em")  # 0/1 per question: their means have Wilson intervals (token F1 is no proportion)


@dataclass(frozen=True)
class ReportHeader(RunHeader):
    """What the report says about the run beside its results."""

    gold_known: bool  # passages cut from the questions' own paragraphs: "own paragraph in the contexts" is known
    candidates_source: str  # where the candidates come from (RetrievalSettings.source)
    questions: str = NQ  # the evaluation's question set, by its dataset (NQ, PopQA, ...) or file
    eval_file: str | None = None  # the evaluation file's name (`eval.questions_path`), when the questions come from one


def candidates_phrase(run) -> str:
    """How the candidates were found: a retriever's top n, or a candidates file's lists as ranked there."""
    if run.candidates_source.startswith("the candidates file"):
        return f"the first {run.top_n} of each question's list in {run.candidates_source} (its own ranking)"
    return f"top-{run.top_n} by {run.retriever} over {run.candidates_source}"


def run_record(
    settings: CBDRSettings,
    evaluation: RagEvaluation,
    rows1: list[dict],
    rows2: list[dict],
    results: CBDRResults,
    seconds: float,
) -> dict[str, Any]:
    """metrics.json: the scalar metrics (also returned to sweepers and loggers) and every table's data."""
    chosen = results.chosen
    metrics = {
        **results.at_beta,
        "chosen/beta": chosen["beta"],
        "chosen/test_accuracy": chosen["test/accuracy"],
        "chosen/test_retrieval_rate": chosen["test/retrieval_rate"],
        "test/always_retrieve_accuracy": chosen["test/always_retrieve_accuracy"],
        "answers/generated": float(evaluation.answers["generated"]),
    }
    return {
        "metrics": metrics,
        "table1": rows1,
        "table2": plain(rows2),
        "table3": with_intervals(results.table3_rows, results.grid.n, settings.metric),
        "sweep": {
            "reranker": label(settings.reranker),
            "reranker_id": settings.reranker,
            "k": settings.k,
            "metric": settings.metric,
            "split": "test",
            "rows": with_intervals(results.grid.rows(), results.grid.n, settings.metric),
            **sample_fields(results.grid.n, settings.metric),
        },
        "chosen_beta": chosen,
        "flips": [f.to_dict() for f in results.flips],
        "answers": evaluation.answers,
        "confidence": results.confidence,
        "conf_quantiles": results.quantiles.tolist(),
        "gate_check": evaluation.gate_check,
        "ks": list(settings.ks),
        "diagnostics": evaluation.diagnostics,
        "eval": {
            "dev": [r.qid for r in evaluation.splits["dev"]],
            "test": [r.qid for r in evaluation.splits["test"]],
            # The main question set's name in the tables, and the folder of its outcomes (confrag-compare-runs).
            "questions": evaluation.main,
            "outcomes": slug(evaluation.main),
            "retrieval": {s.dataset: s.retrieval for s in evaluation.sets},
            "capped": {d: {n: r.capped for n, r in by.items()} for d, by in evaluation.runs.items()},
            "hotpotqa_questions": sum(len(s.rows) for s in evaluation.sets if s.dataset == HOTPOTQA),
        },
        # Choices between rerankers (the rule of `ours`, the probe option) are made on dev, never on test.
        "dev_accuracy": dev_accuracy(evaluation, settings),
        "wall_seconds": seconds,
        "seconds": evaluation.seconds,
    }


def with_intervals(rows: list[dict[str, Any]], n: int, metric: str) -> list[dict[str, Any]]:
    """Table 3's or the β sweep's rows over `n` test questions; below SMALL_N each carries the Wilson intervals of
    its retrieval rate, and of its Top-K accuracies when the metric is a proportion (`<name>_ci`)."""
    if n >= SMALL_N:
        return rows
    shares = ("retrieval_rate",) + (("top",) if metric in PROPORTIONS else ())
    return [{**row, **interval_fields({k: v for k, v in row.items() if k.startswith(shares)}, n)} for row in rows]


def sample_fields(n: int, metric: str) -> dict[str, Any]:
    """What the sweep's record says of its sample below SMALL_N questions (nothing for larger ones)."""
    if n >= SMALL_N:
        return {}
    what = (
        "95 % intervals"
        if metric in PROPORTIONS
        else f"intervals of the retrieval rate only ({metric} is no proportion)"
    )
    return {"n": n, "sample": f"{n} test questions, below {SMALL_N}: {what}"}


def table3_note(rows: Sequence[dict[str, Any]], n: int, metric: str, ks: Sequence[int]) -> list[str]:
    """Below SMALL_N test questions, the lines under Table 3: each row's Top-K accuracies (a proportion's) and
    retrieval rate with their 95 % intervals, or the mark when the metric has none."""
    if n >= SMALL_N:
        return []
    if metric not in PROPORTIONS:
        return ["", f"Table 3 is on {n} test questions{small_mark(n)}."]
    lines = ["", f"Below {SMALL_N} test questions (n = {n}), 95 % intervals (Wilson):", ""]
    for row in rows:
        cells = [f"Top-{k} {proportion_text(row[f'top{k}'], n, 2, 100.0)}" for k in ks]
        rate = proportion_text(row["retrieval_rate"], n, 2, 100.0)
        lines.append(f"- {row['reranker']}, β {row['beta']:g}: {', '.join(cells)}, RR {rate}")
    return lines


def share(value: float, n: int, metric: str) -> str:
    """An accuracy in % (with its interval below SMALL_N when the metric is a proportion)."""
    return proportion_text(value, n, 2, 100.0, " %") if metric in PROPORTIONS else f"{100 * value:.2f} %"


def dev_accuracy(evaluation: RagEvaluation, settings: CBDRSettings) -> dict[str, dict[str, float]]:
    """Every row's accuracy (eval.metric) per K on the main set's dev questions, by system id (diagnostic rows are
    test-only)."""
    dev = {r.qid for r in evaluation.splits["dev"]}
    out = {}
    for name, run in evaluation.runs[evaluation.main].items():
        outcomes = [o for o in run.outcomes if o.qid in dev]
        if outcomes:
            out[name] = {
                f"top{k}": float(np.mean([getattr(o.rag[k], settings.eval_metric) for o in outcomes]))
                for k in settings.ks
            } | {"n": len(outcomes)}
    return out


def write_plots(out: Path, llm_name: str, results: CBDRResults, questions: str = NQ) -> dict[str, Path]:
    """Figure 8's range (0.90-1.00), the whole [0, 1], and (with cbdr.conf_quantiles) the probe's band."""
    title = f"{llm_name}: CBDR on {questions} test (n = {results.grid.n})"  # the reranker is named in the report
    plots = {}
    if ((results.grid.betas >= CURVE_RANGE[0] - 1e-12) & (results.grid.betas <= CURVE_RANGE[1] + 1e-12)).any():
        plots["beta_curve"] = plot_beta_curve(results.grid, out / "beta_curve.png", CURVE_RANGE, title)
    plots["beta_curve_full"] = plot_beta_curve(results.grid, out / "beta_curve_full.png", (0.0, 1.0), title)
    if results.quantiles.size:  # the band of the probe's confidences, where the dev quantiles lie
        band = (max(0.0, float(results.quantiles.min()) - 0.01), min(1.0, float(results.quantiles.max()) + 0.01))
        plots["beta_curve_band"] = plot_beta_curve(results.grid, out / "beta_curve_band.png", band, title)
    return plots


def conf_summary(values: Sequence[float]) -> str:
    return " / ".join(f"{v:.3f}" for v in values)


# wide: the report's parts are independent facts, each computed by its own step of the task (the header,
# the stage, the settings, Table 1's and Table 2's rows and Markdown, the β results, the plots, the run record);
# an object holding them would be built for this one call and read field by field here.
def report_markdown(
    run: ReportHeader,
    stage: RerankStage,
    settings: CBDRSettings,
    rows1: list[dict],
    table2_md: str,
    closed_line: str,
    secondary_md: str,
    results: CBDRResults,
    plots: dict[str, Path],
    record: dict[str, Any],
    rows2: list[dict],
) -> str:
    chosen, ev = results.chosen, record["eval"]
    chain = chain_markdown(stage, rows2, record.get("diagnostics", {}), settings.ks, run.questions)
    n_pref = len(stage.table1_rows)
    n_dev, n_test, metric = len(ev["dev"]), chosen["test/n"], settings.metric  # rates are proportions whatever it is
    capped = {
        f"{d} / {n}": {k: c for k, c in caps.items() if c}
        for d, by in ev["capped"].items()
        for n, caps in by.items()
        if any(caps.values())
    }
    budget = f", budget {chosen['budget']:.2f}" if chosen["budget"] is not None else ""
    lines = [
        f"# CBDR report — {run.llm_name}",
        "",
        f"Run folder: `{run.run_folder}`; wall time {record['wall_seconds']:.0f} s (probe, "
        f"preference data, rerankers and Table 1: {record['seconds']['stage']:.0f} s; evaluation answers: "
        f"{record['seconds']['answers']:.0f} s); answers generated {record['answers']['generated']}, read from "
        f"the cache {record['answers']['reused']}.",
        "",
        f"Evaluation questions: {len(ev['dev']) + len(ev['test'])} {run.questions} questions "
        f"{evaluation_pool_line(stage, run.eval_file)}: "
        f"dev {len(ev['dev'])} (choosing β), test {len(ev['test'])} (the tables). Candidates: "
        f"{candidates_phrase(run)}; {retrieval_line(ev['retrieval'][run.questions])}.",
        *(
            [
                f"HotpotQA: {ev['hotpotqa_questions']} questions (all in Table 2), candidates from the "
                f"{ev['retrieval'][HOTPOTQA]['corpus_passages']} passages of their pooled supporting paragraphs; "
                f"{retrieval_line(ev['retrieval'][HOTPOTQA])}."
            ]
            if HOTPOTQA in ev["retrieval"]
            else []
        ),
        *(f"Evaluation candidates, {line.strip()}." for line in [lengths_line(ev["retrieval"][run.questions])] if line),
        f"K larger than a question's candidates is capped to what it has: {capped or 'no question concerned'}.",
        "",
        stage_line(stage),
        "",
        reading_guide(run.gold_known or any(f"gold_top{settings.ks[0]}" in r for r in rows2)),
        "",
        "## Table 1 — reranking NQ_Rerank's test questions against the probe's labels"
        + (" (cross-fitted: every question, each by its fold's rerankers)" if stage.questions.folds else ""),
        "",
        f"{table1_labels_line(stage)} Base reranker: {base_line(stage.training.get('base', {}))}.",
        "",
        markdown_table(rows1, f"{run.llm_name}, {n_pref} questions{small_mark(n_pref)} (P/R/MRR @K, %)"),
        "",
        f"## Table 2 — the LLM's answers on the evaluation test questions ({settings.eval_metric})",
        "",
        f"Each row gives the LLM a ranker's Top-K passages as contexts and scores its answer ({settings.eval_metric}); "
        "the questions are the evaluation's test questions, none of Table 1's.",
        "",
        table2_md,
        "",
        closed_line,
        "",
        "## From probe to answer",
        "",
        chain_intro(record.get("diagnostics", {}), run.questions),
        "",
        chain,
        "",
        "has_answer / exact match / token F1 (%), same questions"
        + ("; own ¶ in Top-K as above:" if run.gold_known else ":"),
        "",
        secondary_md,
        "",
        f"## Table 3 — CBDR on {run.questions} test ({settings.metric}, {label(settings.reranker)} retrieving when "
        "it does)",
        "",
        results.table3,
        *table3_note(results.table3_rows, results.grid.n, settings.metric, settings.ks),
        "",
        "## β curve",
        "",
        f"Conf(H(Q)) min / median / max: dev {conf_summary(results.confidence['dev'])}, test "
        f"{conf_summary(results.confidence['test'])}. Grid: {len(results.grid.betas)} thresholds"
        + (f", with {results.quantiles.size} quantiles of the dev confidences" if results.quantiles.size else "")
        + ".",
        "",
        *[f"![{name}]({path.name})" for name, path in plots.items()],
        "",
        f"## β chosen on dev, reported on test (Top-{settings.k}, objective {chosen['objective']}{budget})"
        + (small_mark(n_test) if settings.metric not in PROPORTIONS else ""),
        "",
        f"β = {chosen['beta']:g}: dev accuracy {share(chosen['dev/accuracy'], n_dev, metric)} at retrieval rate "
        f"{share(chosen['dev/retrieval_rate'], n_dev, 'has_answer')}; test accuracy "
        f"{share(chosen['test/accuracy'], n_test, metric)} at retrieval rate "
        f"{share(chosen['test/retrieval_rate'], n_test, 'has_answer')} against "
        f"{share(chosen['test/always_retrieve_accuracy'], n_test, metric)} always retrieving (n = {n_test}).",
        f"At cbdr.beta = {settings.beta:g}: test accuracy "
        f"{share(results.at_beta['test/accuracy_at_beta'], n_test, metric)}, retrieval rate "
        f"{share(results.at_beta['test/retrieval_rate_at_beta'], n_test, 'has_answer')}.",
        "",
        f"## Phase-difference analysis (appendix F), {run.questions} test",
        "",
        *[flips_markdown(f) for f in results.flips],
    ]
    check = record["gate_check"]
    if check:
        lines += [
            "## The gate run live",
            "",
            f"`ConfidenceGate` at β = {check['beta']:g}, Top-{check['k']}, on the first {check['questions']} test "
            f"questions: {check['decisions_agree']} decisions and {check['answers_agree']} answers agree with "
            f"the sweep's (largest |Conf live − Conf batch| = {check['max_confidence_difference']:.2e}).",
            "",
        ]
    lines += ["## Config", "", "```yaml", run.config_yaml.rstrip(), "```", ""]
    return "\n".join(lines)


def log_results(
    loggers: Sequence[Logger],
    metrics: dict[str, float],
    rows1: list[dict],
    rows2: list[dict],
    results: CBDRResults,
    plots: dict[str, Path],
) -> None:
    for logger in loggers:
        logger.log_metrics(metrics)
        logger.save()
    for logger in wandb_loggers(loggers):
        log_rows(logger, "table1", rows1)
        log_rows(
            logger,
            "table2",
            [
                {
                    "llm": r["llm"],
                    "reranker": r["reranker"],
                    "id": r["id"],
                    "dataset": r["dataset"],
                    "n": r["n"],
                    # Accuracies and paired differences by their value; Holm p and detectable differences as they are.
                    **{
                        k: getattr(r[k], "value", r[k]) for k in r if k.startswith("top") and not k.endswith("_vs_base")
                    },
                }
                for r in rows2
            ],
        )
        log_rows(logger, "table3", results.table3_rows)
        log_rows(logger, "beta_sweep", results.grid.rows())  # their intervals (below 30 questions) in metrics.json
        for name, path in plots.items():
            logger.log_image(name, [str(path)])
