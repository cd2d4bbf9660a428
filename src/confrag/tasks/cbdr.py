"""Task `cbdr`: the rerank stage (cached) → RAG answers on held-out questions → Table 2 → the β sweep
(Table 3, β curve, β chosen on dev and reported on test, flips) → report.md.

The stages are in `confrag.stages` (evaluation questions, answers), the β analysis in
`confrag.cbdr.analysis`, the report in `confrag.reports.cbdr`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from lightning.pytorch.loggers import Logger
from omegaconf import DictConfig

from confrag.cbdr import ConfidenceGate
from confrag.cbdr.analysis import cbdr_results
from confrag.cbdr.settings import CBDRSettings
from confrag.infra.atomic import atomic_write_text
from confrag.infra.run_context import RunContext
from confrag.infra.timing import StageTimer
from confrag.instantiators import config_yaml, question_set_label, run_context, task_loggers
from confrag.llm.loading import load_llm
from confrag.llm.prompted import PromptedLLM
from confrag.rag.settings import AnswerSettings, EvalSettings
from confrag.recipes import OWN_QUESTIONS, cbdr_recipe, evaluation_recipe, gold_paragraph_needs, templates
from confrag.reports import cbdr as report
from confrag.reports import cbdr_answers
from confrag.reports.wandb_artifacts import log_table_exports
from confrag.stages.evaluation import (
    RagEvaluation,
    check_chosen_rows,
    confidence_gate,
    evaluate,
    hotpotqa_material,
)
from confrag.stages.question_budget import check_recipe_questions
from confrag.stages.rerank import RerankRecipe, RerankStage, planned_rows, rerank_stage, table1


@dataclass(frozen=True)
class Checked:
    recipe: RerankRecipe
    answers: AnswerSettings
    evaluation: EvalSettings
    cbdr: CBDRSettings


def check(cfg: DictConfig) -> Checked:
    """The rerank stage's settings and the task's own (`rag`, `eval`, `cbdr`), before anything runs."""
    recipe, answers, evaluation = evaluation_recipe(cfg)
    settings = cbdr_recipe(cfg, answers, evaluation, recipe.retrieval)
    check_chosen_rows(settings, planned_rows(recipe))  # a row this run does not build: refused before it runs
    # The question budget, the evaluation file's overlap; a set without gold paragraphs refused naming every need.
    check_recipe_questions(recipe, evaluation, int(cfg.seed), gold_paragraph_needs(recipe), OWN_QUESTIONS)
    return Checked(recipe, answers, evaluation, settings)


@dataclass
class Evaluated:
    stage: RerankStage
    rows1: list[dict]  # Table 1
    evaluation: RagEvaluation
    timer: StageTimer
    loggers: list[Logger]
    start: float  # time.perf_counter() when the run began


def run(cfg: DictConfig, checked: Checked, ctx: RunContext) -> Evaluated:
    """The stage and the answers on the settings `check(cfg)` returned (every rank fills the shared caches)."""
    start = time.perf_counter()
    recipe = checked.recipe
    run_config, loggers = task_loggers(cfg)
    timer = StageTimer()  # wall seconds and peak GPU memory of the two heavy parts (metrics.json "stages")
    # HotpotQA's passages in the LLM's tokens, before any stage loads the LLM (the stage checks the NQ corpus's).
    hotpotqa_material(checked.evaluation, checked.answers, recipe.llm, recipe.templates, recipe.retrieval, ctx.seed)
    with timer.stage("stage"):
        stage = rerank_stage(recipe, ctx, loggers, run_config)
        rows1 = table1(stage.table1_systems, stage.table1_rows, ctx.seed)
    with timer.stage("answers"):
        evaluation = evaluate(
            stage,
            checked.cbdr,
            checked.evaluation,
            checked.answers,
            recipe.llm,
            recipe.templates,
            recipe.reranker.eval_batch_size,
            ctx,
            questions=question_set_label(cfg),  # its dataset's label or file's name, in every table, log and folder
        )
    evaluation.seconds = timer.seconds()
    return Evaluated(stage, rows1, evaluation, timer, loggers, start)


def write(cfg: DictConfig, checked: Checked, ctx: RunContext, done: Evaluated) -> dict[str, float]:
    """Rank 0: Table 2, the β sweep, the plots, metrics.json and report.md; the metrics."""
    settings, recipe, out = checked.cbdr, checked.recipe, ctx.output_dir
    stage, rows1, evaluation, loggers = done.stage, done.rows1, done.evaluation, done.loggers
    tables, n_resamples = evaluation.tables(), checked.evaluation.n_resamples
    rows2, table2_md = cbdr_answers.table2(
        cfg.llm.name, tables, settings, n_resamples, ctx.seed, evaluation.gold_sources()
    )
    results = cbdr_results(settings, *evaluation.sweep_data(settings), questions=evaluation.main)
    plots = report.write_plots(out, cfg.llm.name, results, evaluation.main)
    record = report.run_record(settings, evaluation, rows1, rows2, results, time.perf_counter() - done.start)
    record["stages"] = done.timer.stages
    record["training"] = stage.training  # every fine-tuning's rows, steps and seconds (per fold when cross-fitted)
    record["folds"] = [[r.qid for r in fold] for fold in stage.questions.folds]
    atomic_write_text(out / "metrics.json", json.dumps(record, indent=2, ensure_ascii=False, default=float))
    run = report.ReportHeader(
        cfg.llm.name,
        out.name,
        recipe.retrieval.retriever,
        recipe.retrieval.top_n,
        config_yaml(cfg),
        gold_known=not (recipe.retrieval.corpus_path or recipe.retrieval.candidates_path),
        candidates_source=recipe.retrieval.source,
        questions=evaluation.main,
        eval_file=Path(checked.evaluation.questions_path).name if checked.evaluation.questions_path else None,
    )
    secondary = [
        cbdr_answers.closed_book_line(tables, settings.eval_metric, n_resamples, ctx.seed),
        cbdr_answers.secondary_markdown(tables, settings.ks, run.gold_known, evaluation.gold_sources()),
    ]
    atomic_write_text(
        out / "report.md",
        report.report_markdown(run, stage, settings, rows1, table2_md, *secondary, results, plots, record, rows2),
    )
    report.log_results(loggers, record["metrics"], rows1, rows2, results, plots)
    reranker = stage.rerankers.get(settings.reranker)  # Table 2's and CBDR's reranker, linked in W&B
    log_table_exports(loggers, reranker, settings.reranker, stage.probe.directory, out, str(cfg.llm.name))
    print(f"CBDR report: {out / 'report.md'}\n\n{table2_md}\n\n{results.table3}", flush=True)
    return record["metrics"]


def cbdr_gate(cfg: DictConfig, workdir: str | Path) -> ConfidenceGate:
    """The Python API on one question: `cbdr_gate(cfg, dir).answer("who ...")` -> (answer, retrieved, Conf).
    Runs the rerank stage (cheap once a run of the same experiment has filled the cache)."""
    checked = check(cfg)
    stage = rerank_stage(checked.recipe, run_context(cfg, workdir), [])
    return confidence_gate(stage, checked.cbdr, PromptedLLM(load_llm(checked.recipe.llm), templates(cfg)))
