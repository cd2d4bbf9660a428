"""Task `gates`: every retrieval gate on the same questions, with clean and with conflicting contexts.

rerank stage (cached) → the cbdr task's evaluation questions → answers, signals and timings
(`confrag.stages.gate_comparison`) → each gate fitted on the training split, deciding on the test split
(`confrag.stages.gate_scoring`) → the table, the threshold curves, the plot, gates.md (`confrag.reports.gates`).
"""

from __future__ import annotations

import gc
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning.pytorch.loggers import Logger
from omegaconf import DictConfig

from confrag.gates import Gate
from confrag.gates.evaluation import plot_gates
from confrag.gates.settings import GateSettings, gate_settings
from confrag.infra.atomic import atomic_write_text
from confrag.infra.run_context import RunContext
from confrag.instantiators import config_yaml, question_set_label, task_loggers
from confrag.llm.loading import load_llm
from confrag.llm.prompted import PromptedLLM
from confrag.rag.settings import AnswerSettings, EvalSettings
from confrag.recipes import evaluation_recipe
from confrag.reports import gates as report
from confrag.reports.tables import RunHeader
from confrag.reports.wandb_artifacts import log_table_exports
from confrag.stages.evaluation import check_row
from confrag.stages.gate_comparison import GateEvaluation, prepare_gate_evaluation
from confrag.stages.gate_questions import WITHOUT_GOLD, check_before_any_stage
from confrag.stages.gate_scoring import run_gates, threshold_curves
from confrag.stages.question_budget import check_recipe_questions
from confrag.stages.rerank import RerankRecipe, planned_rows, rerank_stage


@dataclass(frozen=True)
class Checked:
    recipe: RerankRecipe
    answers: AnswerSettings
    evaluation: EvalSettings
    gates: GateSettings


def check(cfg: DictConfig) -> Checked:
    """The rerank stage's settings, the shared `rag` / `eval` nodes and the `gates` node, before anything runs."""
    recipe, answers, evaluation = evaluation_recipe(cfg)
    gates = gate_settings(
        cfg.get("gates"), cfg.get("gate"), recipe.retrieval.top_n, bool(recipe.retrieval.candidates_path)
    )
    check_row("gates.reranker", gates.reranker, planned_rows(recipe))  # refused before anything runs
    # The question budget, the evaluation file's overlap, and a question set without gold paragraphs refused.
    check_recipe_questions(recipe, evaluation, int(cfg.seed), [WITHOUT_GOLD])
    return Checked(recipe, answers, evaluation, gates)


@dataclass
class Prepared:
    evaluation: GateEvaluation
    gates: dict[str, Gate]
    loggers: list[Logger]
    start: float  # time.perf_counter() when the run began
    reranker: Any  # the module of `gates.reranker`'s row (None for bm25, bi_encoder), linked in W&B
    probe_directory: Path | None


def run(cfg: DictConfig, checked: Checked, ctx: RunContext) -> Prepared:
    """The stage, the answers, signals and timings on the settings `check(cfg)` returned (every rank of a
    launch helps fill the shared caches)."""
    start = time.perf_counter()
    settings, recipe = checked.gates, checked.recipe
    gates = {name: settings.build(name) for name in settings.names}
    check_before_any_stage(gates, recipe.llm, recipe.probe.make_datamodule())
    run_config, loggers = task_loggers(cfg)
    stage = rerank_stage(recipe, ctx, loggers, run_config)
    prompted = PromptedLLM(load_llm(recipe.llm), recipe.templates)
    evaluation = prepare_gate_evaluation(stage, checked.evaluation, settings, gates, prompted, checked.answers, ctx)
    reranker = stage.rerankers.get(settings.reranker)
    return Prepared(evaluation, gates, loggers, start, reranker, stage.probe.directory)


def write(cfg: DictConfig, checked: Checked, ctx: RunContext, prepared: Prepared) -> dict[str, float]:
    """Rank 0: each gate fitted and scored, the curves, the plot, metrics.json and gates.md; the metrics."""
    settings, recipe, out = checked.gates, checked.recipe, ctx.output_dir
    evaluation, loggers, start = prepared.evaluation, prepared.loggers, prepared.start
    results = run_gates(evaluation, settings, ctx.seed, prepared.gates)
    curves = threshold_curves(evaluation, settings, results)
    answers = {"generated": evaluation.store.generated, "reused": evaluation.store.reused}
    evaluation.store = evaluation.maker = None  # the LLM is not needed any more: free it before reporting
    gc.collect()
    questions = evaluation.sets.report["questions"] = question_set_label(cfg)  # by its dataset or file
    plot = plot_gates(
        results.rows,
        curves,
        out / "gates.png",
        f"{cfg.llm.name}: retrieval gates on {questions} test ({settings.metric})",
    )
    record = report.gate_record(settings, evaluation, results, curves, answers, time.perf_counter() - start)
    atomic_write_text(out / "metrics.json", json.dumps(record, indent=2, ensure_ascii=False, default=float))
    atomic_write_text(
        out / "gates.md",
        report.report_markdown(
            RunHeader(cfg.llm.name, out.name, recipe.retrieval.retriever, recipe.retrieval.top_n, config_yaml(cfg)),
            settings,
            evaluation,
            results,
            plot,
            answers,
            record["wall_seconds"],
        ),
    )
    report.log_results(loggers, record["metrics"], results.rows, curves, plot)
    log_table_exports(loggers, prepared.reranker, settings.reranker, prepared.probe_directory, out, str(cfg.llm.name))
    print(f"Gates report: {out / 'gates.md'}\n\n{report.tables_text(results.rows, settings.metric)}", flush=True)
    return record["metrics"]
