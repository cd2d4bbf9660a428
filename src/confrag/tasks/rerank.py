"""Task `rerank`: probe (cached) → retrieved candidates → confidence shifts → NQ_Rerank → rerankers → Table 1.

Every step reads the artifacts of the steps before it from the cache (see `confrag.stages.rerank`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lightning.pytorch.loggers import Logger
from omegaconf import DictConfig

from confrag.infra.atomic import atomic_write_text
from confrag.infra.run_context import RunContext
from confrag.instantiators import run_command, task_loggers
from confrag.recipes import OWN_QUESTIONS, Exported, exported, gold_paragraph_needs, rerank_recipe
from confrag.reports.hub import HubSettings, RerankRun, push_folder, write_dataset, write_reranker_card
from confrag.reports.rerank import write_rerank_report
from confrag.reports.tables import metric_columns
from confrag.reports.wandb_artifacts import log_exports
from confrag.stages.own_rows import OwnRowsStage, check_own_rows_settings, own_rows_card, own_rows_stage
from confrag.stages.question_budget import check_recipe_questions
from confrag.stages.rerank import RerankRecipe, RerankStage, rerank_stage, table1

Checked = Exported[RerankRecipe]


@dataclass
class Staged:
    stage: RerankStage | OwnRowsStage
    loggers: list[Logger]


def check(cfg: DictConfig) -> Checked:
    """Every setting of the stage, before anything runs: a typo must not surface after an hour of probing."""
    checked = exported(cfg, lambda: rerank_recipe(cfg), "reranker_repo", "dataset_repo")
    if checked.recipe.preferences.rows_path:  # your rows: what needs the probe's candidates is refused now
        check_own_rows_settings(checked.recipe)
        if checked.hub.push:
            raise ValueError(
                "hub.push=true with preferences.rows_path: the Hub cards describe NQ_Rerank and a confidence-aligned "
                "reranker, not your rows; push the exported `reranker/` folder yourself"
            )
    else:
        # The question budget before any stage; a set without gold paragraphs refused naming every need.
        check_recipe_questions(checked.recipe, None, int(cfg.seed), gold_paragraph_needs(checked.recipe), OWN_QUESTIONS)
    return checked


def run(cfg: DictConfig, checked: Checked, ctx: RunContext) -> Staged:
    """The stage on the settings `check(cfg)` returned (every rank of a launch helps fill the shared caches)."""
    run_config, loggers = task_loggers(cfg)
    if checked.recipe.preferences.rows_path:
        return Staged(own_rows_stage(checked.recipe, ctx, loggers, run_config), loggers)
    return Staged(rerank_stage(checked.recipe, ctx, loggers, run_config), loggers)


def write(cfg: DictConfig, checked: Checked, ctx: RunContext, staged: Staged) -> dict[str, float]:
    """Rank 0: the exported reranker, Table 1, the report, NQ_Rerank as a dataset, the cards and uploads."""
    recipe, hub, out, stage, loggers = checked.recipe, checked.hub, ctx.output_dir, staged.stage, staged.loggers
    stage.rerankers[stage.main].export(out / "reranker")
    aligned = aligned_exports(recipe, stage, out)  # each listwise row: aligned/<teacher>/
    test_rows = stage.table1_rows
    rows = table1(stage.table1_systems, test_rows, ctx.seed)
    main = next(r for r in rows if r["id"] == stage.main)
    metrics = {f"test/{k}": main[k] / 100 for k in metric_columns(main)}
    report = stage.preferences.report
    print(
        write_rerank_report(out, cfg.llm.name, report, len(test_rows), rows, metrics, stage.training, loggers),
        flush=True,
    )
    if isinstance(stage, OwnRowsStage):  # your rows: no NQ_Rerank dataset, a card that says what it is
        atomic_write_text(out / "reranker" / "README.md", own_rows_card(stage.preferences.report, rows))
        exports = {"reranker": out / "reranker"}
    else:
        publish(cfg, recipe, stage, rows, len({r["qid"] for r in test_rows}), hub, out)
        # The probe whose confidence labelled the rows (the cached one this run used) beside the run's exports.
        exports = {"reranker": out / "reranker", "nq_rerank": out / "nq_rerank_dataset"}
        exports |= {"aligned": out / "aligned"} if aligned else {}
    if stage.probe is not None and stage.probe.directory is not None:
        exports["probe"] = stage.probe.directory
    log_exports(loggers, exports, str(cfg.llm.name), {"rule": recipe.preferences.selection})
    return metrics


def aligned_exports(recipe: RerankRecipe, stage: RerankStage | OwnRowsStage, out: Path) -> dict[str, Path]:
    """The alignment node's listwise rows exported to `<run>/aligned/<teacher>/` (a cross-fitted row, one folder a
    fold): what `confrag.reranker.aligned.load_aligned` reads."""
    folders = {}
    for row in recipe.alignment.rows:
        folders[row] = stage.rerankers[row].export(out / "aligned" / row.partition(".")[2])
    return folders


def publish(
    cfg: DictConfig,
    recipe: RerankRecipe,
    stage: RerankStage,
    rows: list[dict],
    test_questions: int,
    hub: HubSettings,
    out: Path,
) -> None:
    """The reranker's model card, NQ_Rerank as a parquet dataset with its card, and (hub.push only) the upload."""
    run = RerankRun(
        llm=str(cfg.llm.name),
        backbone=str(cfg.model.backbone),
        exported=stage.main,
        rule=recipe.preferences.selection,
        reference=recipe.preferences.reference,
        top_k=recipe.preferences.top_k,
        rows={split: len(split_rows) for split, split_rows in stage.preferences.splits.items()},
        test_questions=test_questions,
        table1=rows,
        command=run_command(cfg),
        base_trained=bool(recipe.base.train),
        questions=str((cfg.get("dataset") or {}).get("name") or "nq"),
        kept_base=stage.rerankers[stage.main] is stage.base.module,  # `as_trained`: the guard kept the base
        kind=str(cfg.model.kind),
    )
    write_reranker_card(out / "reranker", run)
    write_dataset(stage.preferences.splits, out / "nq_rerank_dataset", run)
    if hub.push:
        for folder, repo, kind in (
            (out / "reranker", hub.reranker_repo, "model"),
            (out / "nq_rerank_dataset", hub.dataset_repo, "dataset"),
        ):
            print(f"Pushed {folder} to {kind} repo {repo}: {push_folder(folder, repo, kind, hub.private)}", flush=True)
