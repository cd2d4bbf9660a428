"""Task `rerank`: probe (cached) → retrieved candidates → confidence shifts → NQ_Rerank → rerankers → Table 1.

Every step reads the artifacts of the steps before it from the cache (see `confrag.stages.rerank`).
"""

from __future__ import annotations

from omegaconf import DictConfig

from confrag.distributed import rank_info
from confrag.instantiators import output_dir, task_loggers
from confrag.recipes import rerank_recipe
from confrag.reports.rerank import write_rerank_report
from confrag.stages.rerank import RerankRecipe, rerank_stage, table1


def check(cfg: DictConfig) -> RerankRecipe:
    """Every setting of the stage, before anything runs: a typo must not surface after an hour of probing."""
    return rerank_recipe(cfg)


def run(cfg: DictConfig) -> dict[str, float]:
    recipe = check(cfg)
    out = output_dir(cfg)
    run_config, loggers = task_loggers(cfg)
    stage = rerank_stage(recipe, out, loggers, run_config)
    if not rank_info().is_main:  # ranks > 0 of a launch helped fill the shared caches; rank 0 writes the run
        return {}
    stage.rerankers[stage.main].export(out / "reranker")
    test_rows = stage.preferences.splits["test"]
    rows = table1(stage.scorers, test_rows, cfg.seed)
    print(
        write_rerank_report(out, cfg.llm.name, stage.preferences.report, len(test_rows), rows, stage.training, loggers),
        flush=True,
    )
    main = next(r for r in rows if r["system"] == stage.main)
    return {f"test/{k}": v / 100 for k, v in main.items() if k != "system"}
