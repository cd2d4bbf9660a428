"""Task `rerank`: probe (cached) → retrieved candidates → confidence shifts → NQ_Rerank → rerankers → Table 1.

Every step reads the artifacts of the steps before it from the cache (see `confrag.stages.rerank`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig

from confrag.infra.distributed import rank_info
from confrag.instantiators import output_dir, run_command, settings_from, task_loggers
from confrag.recipes import rerank_recipe
from confrag.reports.hub import HubSettings, RerankRun, push_folder, write_dataset, write_reranker_card
from confrag.reports.rerank import write_rerank_report
from confrag.reports.tables import metric_columns
from confrag.reports.wandb_artifacts import log_exports
from confrag.stages.rerank import RerankRecipe, RerankStage, rerank_stage, table1


@dataclass(frozen=True)
class Checked:
    recipe: RerankRecipe
    hub: HubSettings


def check(cfg: DictConfig) -> Checked:
    """Every setting of the stage, before anything runs: a typo must not surface after an hour of probing."""
    hub = hub_settings(cfg)
    return Checked(rerank_recipe(cfg), hub)


def hub_settings(cfg: DictConfig) -> HubSettings:
    return settings_from(HubSettings, cfg.get("hub"), "hub").require("reranker_repo", "dataset_repo")


def run(cfg: DictConfig, checked: Checked) -> dict[str, float]:
    """The task on the settings `check(cfg)` returned (checked once, before the run folder got a file)."""
    recipe, hub = checked.recipe, checked.hub
    out = output_dir(cfg)
    run_config, loggers = task_loggers(cfg)
    stage = rerank_stage(recipe, out, loggers, run_config)
    if not rank_info().is_main:  # ranks > 0 of a launch helped fill the shared caches; rank 0 writes the run
        return {}
    stage.rerankers[stage.main].export(out / "reranker")
    test_rows = stage.table1_rows
    rows = table1(stage.scorers, test_rows, cfg.seed)
    print(
        write_rerank_report(out, cfg.llm.name, stage.preferences.report, len(test_rows), rows, stage.training, loggers),
        flush=True,
    )
    publish(cfg, recipe, stage, rows, len({r["qid"] for r in test_rows}), hub, out)
    # The probe whose confidence labelled the rows (the cached one this run used) beside the run's exports.
    exports = {"reranker": out / "reranker", "nq_rerank": out / "nq_rerank_dataset"}
    if stage.probe.directory is not None:
        exports["probe"] = stage.probe.directory
    log_exports(loggers, exports, str(cfg.llm.name), {"rule": recipe.preferences.selection})
    main = next(r for r in rows if r["id"] == stage.main)
    return {f"test/{k}": main[k] / 100 for k in metric_columns(main)}


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
        backbone=str(cfg.model.get("backbone") or "minilm"),
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
    )
    write_reranker_card(out / "reranker", run)
    write_dataset(stage.preferences.splits, out / "nq_rerank_dataset", run)
    if hub.push:
        for folder, repo, kind in (
            (out / "reranker", hub.reranker_repo, "model"),
            (out / "nq_rerank_dataset", hub.dataset_repo, "dataset"),
        ):
            print(f"Pushed {folder} to {kind} repo {repo}: {push_folder(folder, repo, kind, hub.private)}", flush=True)
