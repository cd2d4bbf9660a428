"""The rerank stage: probe (cached) → retrieval → the question plan → NQ_Rerank → the base reranker →
the base fine-tuned on relevance labels (the control) and on each preference rule (cached) → every
Table 1 row as a scorer.

As in the paper, alignment starts from a relevance reranker and is compared with that reranker before
alignment and with the same reranker fine-tuned for the same number of steps on relevance labels of the
same questions. The cbdr and gates tasks reuse this stage as it is: every piece comes from the cache once
a run of the same settings has built it, so a sweep over τ or K recomputes only what it reaches.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from lightning.pytorch.loggers import Logger
from tqdm.auto import tqdm

from confrag.data.nq import load_nq_jsonl
from confrag.data.splits import QuestionPlan, plan_questions
from confrag.llm.prompts import PromptTemplates
from confrag.preferences import relevance_rows
from confrag.probe.datamodule import NQConfidenceDataModule
from confrag.probe.module import SavedProbe
from confrag.reranker.data import candidate_lists
from confrag.reranker.metrics import ranking_table
from confrag.reranker.module import RerankerModule
from confrag.retrieval import document_text
from confrag.stages.base_reranker import BaseReranker, BaseRerankerSettings, ensure_base_reranker
from confrag.stages.nq_rerank import PreferenceSettings, PreferenceStage, build_nq_rerank
from confrag.stages.probe import ProbeRecipe, ensure_probe
from confrag.stages.rerankers import RerankerRecipe, ensure_reranker, place_on_device
from confrag.stages.retrieval import Retrieval, RetrievalSettings, build_retrieval

KS = (1, 3, 5)
BM25, BI_ENCODER = "BM25", "bi-encoder (MiniLM cosine)"
BASE = "base reranker"
RELEVANCE_FT = "base + relevance FT"


def confidence_ft(rule: str) -> str:
    """The Table 1 / Table 2 name of the base fine-tuned on a preference rule's rows."""
    return f"base + confidence FT ({rule})"


Scorer = Callable[[str, list[str]], np.ndarray]  # (query, passages) -> one score per passage


@dataclass
class RerankRecipe:
    """Everything the stage is built from; the task fills it from the config (`rerank_recipe`)."""

    probe: ProbeRecipe
    llm: dict[str, Any]  # the `llm` node (confrag.llm.loading.LLMConfig fields)
    templates: PromptTemplates
    retrieval: RetrievalSettings
    preferences: PreferenceSettings
    base: BaseRerankerSettings
    reranker: RerankerRecipe
    cache_dir: str
    seed: int
    progress: bool = True


@dataclass
class RerankStage:
    """Everything the later stages (RAG evaluation, CBDR, gates) take from this one."""

    probe: SavedProbe
    probe_data: NQConfidenceDataModule
    retrieval: Retrieval
    questions: QuestionPlan  # who uses which question; the evaluation samples `questions.held_out`
    preferences: PreferenceStage
    base: BaseReranker
    rerankers: dict[str, RerankerModule]  # Table 1's cross-encoder rows: the base first, the aligned ones last
    scorers: dict[str, Scorer]  # every Table 1 row as (query, passages) -> scores
    training: dict[str, Any]
    main: str  # the row of the selection rule's reranker


def rerank_stage(recipe: RerankRecipe, out: Path, loggers: list[Logger], run_config: dict | None = None) -> RerankStage:
    probe, probe_data = ensure_probe(recipe.probe, recipe.cache_dir, workdir=out / "probe_stage")
    retrieval = build_retrieval(recipe.retrieval, recipe.cache_dir)
    questions = plan_questions(
        load_nq_jsonl(probe_data.nq_path, questions_format=probe_data.questions_format),
        probe_data.data.rows,
        recipe.preferences.num_questions,
        recipe.base.num_questions if recipe.base.train else 0,
        recipe.seed,
        probe_data.nq_path,
        base_rows=load_nq_jsonl(recipe.base.nq_path) if recipe.base.nq_path else None,
    )
    stage = build_nq_rerank(
        recipe.preferences,
        recipe.llm,
        recipe.templates,
        probe,
        questions.preference,
        retrieval,
        recipe.retrieval.candidates_path,
        recipe.cache_dir,
        recipe.seed,
        out,
        recipe.progress,
    )
    train_rows, test_rows = stage.splits["train"], stage.splits["test"]
    if not train_rows or not test_rows:
        raise ValueError(
            f"NQ_Rerank ({recipe.preferences.selection}) has {len(train_rows)} train and {len(test_rows)} "
            f"test rows after dropping {stage.report['dropped']}; raise preferences.num_questions or "
            "retrieval.top_n, or try another preferences.reference / preferences.selection"
        )
    base = ensure_base_reranker(recipe.base, recipe.reranker, retrieval, questions.base)
    rerankers: dict[str, RerankerModule] = {BASE: base.module}
    training: dict[str, Any] = {"base": base.info}
    for rule in recipe.preferences.rules:
        rows = stage.splits_by_rule[rule]["train"]
        if not rows:  # a compared rule that keeps no row: reported, not trained
            training[rule] = {"train_rows": 0}
            continue
        rerankers[confidence_ft(rule)], training[rule] = ensure_reranker(
            recipe.reranker,
            rows,
            f"confidence_{rule}",
            loggers if rule == recipe.preferences.selection else [],
            run_config,
            start_from=base.directory,
        )
    if recipe.preferences.relevance_baseline:
        # The control: the same base, the same questions, as many steps, labels from answer containment.
        relevance = relevance_rows(stage.candidates, {r["qid"] for r in train_rows}, recipe.preferences.top_k)
        steps = int(training[recipe.preferences.selection]["steps"])
        rerankers[RELEVANCE_FT], training["relevance"] = ensure_reranker(
            recipe.reranker,
            relevance,
            "relevance",
            [],
            run_config,
            start_from=base.directory,
            trainer_settings={"max_steps": max(steps, 1), "max_epochs": -1},
        )
        rerankers = {
            k: rerankers[k] for k in [BASE, RELEVANCE_FT, *(r for r in rerankers if r not in (BASE, RELEVANCE_FT))]
        }
    place_on_device(recipe.reranker, rerankers.values())
    scorers = table1_systems(retrieval, rerankers, recipe.reranker.eval_batch_size)
    return RerankStage(
        probe,
        probe_data,
        retrieval,
        questions,
        stage,
        base,
        rerankers,
        scorers,
        training,
        confidence_ft(recipe.preferences.selection),
    )


def table1_systems(
    retrieval: Retrieval, rerankers: dict[str, RerankerModule], eval_batch_size: int
) -> dict[str, Scorer]:
    """The rows of Table 1 as scoring functions (query, passages) → scores: BM25 and the bi-encoder over the
    retrieval corpus (the passages must be in it), then each cross-encoder."""
    index_of = {document_text(p): i for i, p in enumerate(retrieval.corpus.passages)}

    def corpus_indices(passages: list[str]) -> list[int]:
        missing = [p[:60] for p in passages if p not in index_of]
        if missing:
            raise ValueError(f"passages not in the retrieval corpus (BM25/bi-encoder rows need them): {missing[:2]}")
        return [index_of[p] for p in passages]

    bm25, dense = retrieval.bm25, retrieval.dense
    systems: dict[str, Scorer] = {BM25: lambda q, ps: bm25.scores(q)[corpus_indices(ps)]}
    if dense is not None:
        systems[BI_ENCODER] = lambda q, ps: dense.passage_vectors(corpus_indices(ps)) @ dense.encode([q])[0]
    for name, module in rerankers.items():  # insertion order: the tuned rows last
        systems[name] = lambda q, ps, m=module: m.score([q] * len(ps), ps, batch_size=eval_batch_size)
    return systems


def table1(systems: dict[str, Scorer], test_rows: list[dict], seed: int, progress: bool = True) -> list[dict]:
    """P@K, R@K, MRR@K (K = 1, 3, 5) of every system on the preference test split's candidate lists."""
    lists = candidate_lists(test_rows, seed)
    labels = [c["labels"] for c in lists]
    scores = {
        name: [
            np.asarray(score(c["query"], c["passages"]), dtype=np.float64).tolist()
            for c in tqdm(lists, desc=f"Table 1: {name}", unit="query", disable=not progress)
        ]
        for name, score in systems.items()
    }
    return ranking_table(scores, labels, KS)
