"""The rerank stage: probe (cached) → retrieval → the question plan → NQ_Rerank → the base reranker → the base
fine-tuned on relevance labels (the control), on each preference rule and by the alignment node's listwise teachers
(`stages.alignment`; cached) → every Table 1 row as a scorer.

As in the paper, alignment starts from a relevance reranker and is compared with that reranker before
alignment and with the same reranker fine-tuned for the same number of steps on relevance labels of the
same questions. The cbdr and gates tasks reuse this stage as it is: every piece comes from the cache once
a run of the same settings has built it, so a sweep over τ or K recomputes only what it reaches.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from lightning.pytorch.loggers import Logger
from tqdm.auto import tqdm

from confrag.data.nq import QARow, load_questions_jsonl
from confrag.data.splits import QuestionPlan, cross_fit_plan, plan_questions, select_questions
from confrag.infra.digests import fingerprint
from confrag.infra.locks import claimed_first
from confrag.infra.run_context import RunContext
from confrag.llm.context import PromptLimit, fit_questions
from confrag.llm.loading import prompt_tokenizer
from confrag.llm.prompts import PromptTemplates
from confrag.probe.datamodule import NQConfidenceDataModule
from confrag.probe.module import SavedProbe
from confrag.rag.settings import AnswerSettings
from confrag.reranker.metrics import ranking_table
from confrag.reranker.module import RerankerModule
from confrag.reranker.preferences import relevance_rows
from confrag.reranker.rows import candidate_lists
from confrag.reranker.selection import DevTop1, dev_set, kept_start
from confrag.reranker.systems import BASE, BI_ENCODER, BM25, RELEVANCE_FT, confidence_ft, labelled
from confrag.retrieval import document_text
from confrag.stages import label_checks
from confrag.stages.alignment import AlignmentSettings, alignment_material, fusion_rows, with_listwise
from confrag.stages.base_reranker import BaseReranker, BaseRerankerSettings, ensure_base_reranker
from confrag.stages.cross_fit import FoldedReranker
from confrag.stages.nq_rerank import PreferenceSettings, PreferenceStage, build_nq_rerank
from confrag.stages.passage_budget import checked_corpus, llm_passage_budget
from confrag.stages.probe import ProbeRecipe, ensure_probe
from confrag.stages.rerankers import RerankerRecipe, ensure_reranker, place_on_device, reranker_budget
from confrag.stages.retrieval import Retrieval, RetrievalSettings, build_retrieval, question_candidates
from confrag.stages.teachers import ROW_TEACHERS

KS = (1, 3, 5)

Scorer = Callable[[str, list[str]], np.ndarray]  # (query, passages) -> one score per passage
Reranker = RerankerModule | FoldedReranker  # what a cross-encoder row scores with


@dataclass
class RerankRecipe:
    """Everything the stage is built from (beside the run's context: cache, seed, progress, run folder); the task
    fills it from the config (`rerank_recipe`)."""

    alignment: AlignmentSettings  # the `alignment` node: the listwise rows beside the paper's, the fusion row
    probe: ProbeRecipe
    llm: dict[str, Any]  # the `llm` node (confrag.llm.loading.LLMConfig fields)
    templates: PromptTemplates
    retrieval: RetrievalSettings
    preferences: PreferenceSettings
    answers: AnswerSettings  # the `rag` node: the utility rule's answers are Table 2's Top-1 answers
    base: BaseRerankerSettings
    reranker: RerankerRecipe


@dataclass
class RerankStage:
    """Everything the later stages (RAG evaluation, CBDR, gates) take from this one."""

    probe: SavedProbe
    probe_data: NQConfidenceDataModule
    retrieval: Retrieval
    questions: QuestionPlan  # who uses which question; the evaluation samples `questions.held_out`
    preferences: PreferenceStage
    base: BaseReranker
    rerankers: dict[str, Reranker]  # Table 1's cross-encoder rows by id: the base first, the aligned ones last
    scorers: dict[str, Scorer]  # every Table 1 row as (query, passages) -> scores, by id (`reranker.systems`)
    training: dict[str, Any]
    main: str  # the id of the selection rule's reranker
    alignment: AlignmentSettings | None = None  # what Table 2's fusion row reads (`alignment.fusion_weight`)
    diagnostics: dict[str, Scorer] = field(default_factory=dict)  # Table 1's rows that read the answer (fusion)

    @property
    def table1_systems(self) -> dict[str, Scorer]:  # the rerankers, then the diagnostic rows
        return {**self.scorers, **self.diagnostics}

    @property
    def table1_rows(self) -> list[dict]:
        """Table 1's rows: NQ_Rerank's test split; cross-fitted, every row (each scored out of its fold)."""
        if self.questions.folds:
            return [r for split in self.preferences.splits.values() for r in split]
        return self.preferences.splits["test"]


def fitted_questions(recipe: RerankRecipe, probe_data: NQConfidenceDataModule) -> list[QARow]:
    """Every question of the NQ file, checked against the LLM's context before anything loads it (only the data
    settings of `probe_data` are read: it need not be built): the preference, base-reranker and evaluation questions
    are answered closed-book and under passages too, and an overlong one failed only inside generation (tens of GB
    asked, no row named). Checked, and cut with `data.truncate_questions`, exactly as the probe's data module fits
    its own questions, so a question both see reads the same (the plan's disjointness holds on the fitted text)."""
    rows = load_questions_jsonl(probe_data.questions_path, questions_format=probe_data.questions_format)
    tokenizer, context = prompt_tokenizer(recipe.llm)
    where = str(probe_data.questions_path)
    rows = fit_questions(
        rows,
        PromptLimit(recipe.templates, tokenizer, context, probe_data.answers.max_new_tokens),
        probe_data.truncate_questions,
        where,
        option=f"{probe_data.config_node}.truncate_questions",
        room=(context - probe_data.answers.max_new_tokens) // 2 if probe_data.rag_prompts else 0,
    )
    if recipe.answers.max_new_tokens > probe_data.answers.max_new_tokens:  # the answers may generate more
        answers_limit = PromptLimit(recipe.templates, tokenizer, context, recipe.answers.max_new_tokens)
        fit_questions(rows, answers_limit, False, where)
    return rows


def rerank_stage(
    recipe: RerankRecipe, ctx: RunContext, loggers: list[Logger], run_config: dict | None = None
) -> RerankStage:
    # Every question checked against the LLM's context first, from the data settings alone: on a fresh cache
    # the probe's own stage loads the LLM.
    probe_settings = recipe.probe.make_datamodule()
    rows = fitted_questions(recipe, probe_settings)
    # Every passage too (corpus and candidates file, in the LLM's tokens), and a ranked-ids file's ids.
    max_new_tokens = max(probe_settings.answers.max_new_tokens, recipe.answers.max_new_tokens)
    budget = llm_passage_budget(recipe.llm, recipe.templates, rows, max_new_tokens, recipe.retrieval)
    corpus, lengths = checked_corpus(recipe.retrieval, budget, rows)
    retrieval = build_retrieval(recipe.retrieval, ctx.cache_dir, corpus=corpus, llm_budget=budget)  # no LLM either
    retrieval.lengths = lengths
    # Every candidate list from here on is counted against the reranker's budget (its tokenizer only, no weights).
    retrieval.reranker_budget = reranker_budget(recipe.reranker)
    # What the controls label by (own paragraphs, answers) is in the candidates alone: the preference questions drawn
    # as the plan below draws them, checked now (a file's cut unsaid: NQ_Rerank reads the same set and says it).
    if label_checks.checks_candidates(recipe.preferences):
        probe_rows = select_questions(rows, probe_settings.num_questions, probe_settings.seed)
        early = question_plan(recipe, rows, probe_rows, ctx.seed, str(probe_settings.questions_path))
        found, _ = question_candidates(retrieval, early.preference, recipe.retrieval.candidates_path, log_cut=False)
        label_checks.check_label_sources(recipe.preferences, found, ctx.seed)
    probe, probe_data = ensure_probe(recipe.probe, ctx)
    questions = question_plan(recipe, rows, probe_data.data.rows, ctx.seed, probe_data.questions_path)
    stage = build_nq_rerank(
        recipe.preferences, recipe.answers, recipe.llm, recipe.templates, probe, questions.preference, retrieval, ctx
    )
    train_rows, test_rows = stage.splits["train"], stage.splits["test"]
    if not train_rows or not test_rows:
        sizes, dropped = {"train": len(train_rows), "test": len(test_rows)}, stage.report["dropped"]
        raise ValueError(label_checks.empty_split_message(recipe.preferences, len(stage.candidates), sizes, dropped))
    base = ensure_base_reranker(recipe.base, recipe.reranker, retrieval, questions.base, ctx)
    # What the listwise rows read (None: none asked); `trained`: the paper's rows and the listwise ones.
    material = alignment_material(recipe, stage, base, ctx)

    def trained(qids: set[str], suffix: str, run_loggers: list[Logger]) -> tuple[dict[str, Reranker], dict]:
        found = aligned_rerankers(recipe, ctx, stage, qids, base, suffix, run_loggers, run_config)
        return with_listwise(found, recipe, material, qids, ctx, suffix)

    rerankers: dict[str, Reranker] = {BASE: base.module}
    training: dict[str, Any] = {"base": base.info}
    if questions.folds:
        train_qids = [{r.qid for r in questions.training_questions(f)} for f in range(len(questions.folds))]

        def fold_claim(f: int) -> Path:  # which process trains which fold's rerankers (a scheduling hint only)
            base_key = base.directory.name if base.directory else None
            key = fingerprint({"train": sorted(train_qids[f]), "rules": recipe.preferences.rules, "base": base_key})
            return ctx.cache_dir / "rerankers" / f".fold-{key}.claim"

        by_fold = claimed_first(
            range(len(questions.folds)),
            fold_claim,
            lambda f: trained(train_qids[f], f"_fold{f}", []),
            "the aligned rerankers of fold",
        )
        for name in by_fold[0][0]:
            folds = [fold[0][name] for fold in by_fold]
            # Every fold kept the base's weights (the dev guard): the row is the base (its card says so); a fold that
            # alone kept them shares the base's scores through `scorer_for`.
            if all(module is base.module for module in folds):
                rerankers[name] = base.module
            else:
                rerankers[name] = FoldedReranker(folds, questions.fold_of_question)
        training.update({f"fold{f}": fold[1] for f, fold in enumerate(by_fold)})
    else:
        # Every question outside NQ_Rerank's test split (each rule keeps its own subset of them).
        test_qids = {r["qid"] for splits in stage.splits_by_rule.values() for r in splits["test"]}
        train_qids = {c.qid for c in stage.candidates} - test_qids
        aligned, info = trained(train_qids, "", loggers)
        rerankers, training = {**rerankers, **aligned}, {**training, **info}
    if RELEVANCE_FT in rerankers:  # the control right after the base, the aligned rows last
        first = [BASE, RELEVANCE_FT]
        rerankers = {k: rerankers[k] for k in [*first, *(r for r in rerankers if r not in first)]}
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
        recipe.alignment,
        fusion_rows(recipe.alignment, material, scorers[BASE]),
    )


def question_plan(
    recipe: RerankRecipe, rows: list[QARow], probe_rows: list[QARow], seed: int, where: str
) -> QuestionPlan:
    """Who uses which question (`plan_questions`, cross-fitted with `preferences.cross_fit`)."""
    questions = plan_questions(
        rows,
        probe_rows,
        recipe.preferences.num_questions,
        recipe.base.num_questions if recipe.base.train else 0,
        seed,
        where,
        base_rows=load_questions_jsonl(recipe.base.questions_path) if recipe.base.questions_path else None,
    )
    if recipe.preferences.cross_fit:
        questions = cross_fit_plan(questions, recipe.preferences.cross_fit, seed)
    return questions


def aligned_rerankers(
    recipe: RerankRecipe,
    ctx: RunContext,
    stage: PreferenceStage,
    train_qids: set[str],
    base: BaseReranker,
    suffix: str,
    loggers: list[Logger],
    run_config: dict | None,
) -> tuple[dict[str, RerankerModule], dict[str, Any]]:
    """The base fine-tuned on each rule's rows of the questions `train_qids` (the cache keeps each by its rows),
    and the relevance control on the same questions for as many steps as the selection rule's."""
    rerankers: dict[str, RerankerModule] = {}
    training: dict[str, Any] = {}
    settings = recipe.preferences
    teacher = ROW_TEACHERS[settings.teacher].rewrite
    dev = None
    if settings.select_on == "dev_top1":  # dev questions leave the rows and choose the weights
        train_qids, dev = dev_top1_split(stage, train_qids, settings.dev_fraction, ctx.seed)
    for rule in settings.rules:
        rows = [r for split in stage.splits_by_rule[rule].values() for r in split if r["qid"] in train_qids]
        if not rows:  # a compared rule that keeps no row: reported, not trained
            if rule == settings.selection:  # the reranker the run exports and CBDR uses: named, with the counts
                raise ValueError(label_checks.no_training_rows_message(settings, len(train_qids), suffix))
            training[rule] = {"train_rows": 0}
            continue
        if settings.mix_relevance:  # the same questions' relevance rows beside the rule's
            rows = rows + relevance_rows(stage.candidates, {r["qid"] for r in rows}, settings.top_k)
        rows = teacher(rows, base.module, recipe.reranker.eval_batch_size)
        module, training[rule] = ensure_reranker(
            recipe.reranker,
            ctx,
            rows,
            f"confidence_{rule}{suffix}",
            loggers if rule == recipe.preferences.selection else [],
            run_config,
            start_from=base.directory,
            dev=dev,
        )
        rerankers[confidence_ft(rule)] = as_trained(module, training[rule], base)
    if recipe.preferences.relevance_baseline:
        # The control: the same base, the same questions, as many steps, labels from answer containment.
        # On the questions the selection rule kept rows for: the control sees what the aligned reranker saw.
        kept = {r["qid"] for split in stage.splits_by_rule[recipe.preferences.selection].values() for r in split}
        relevance = label_checks.relevance_control_rows(
            stage.candidates, train_qids & kept, recipe.preferences.top_k, recipe.preferences.selection, suffix
        )
        # The aligned rerankers' teacher too: distilling toward the base, the control distils as they do.
        relevance = teacher(relevance, base.module, recipe.reranker.eval_batch_size)
        steps = int(training[recipe.preferences.selection].get("steps", 0))
        module, training["relevance"] = ensure_reranker(
            recipe.reranker,
            ctx,
            relevance,
            f"relevance{suffix}",
            [],
            run_config,
            start_from=base.directory,
            trainer_settings={"max_steps": max(steps, 1), "max_epochs": -1},
            dev=dev,
        )
        rerankers[RELEVANCE_FT] = as_trained(module, training["relevance"], base)
    return rerankers, training


def as_trained(module: RerankerModule, info: dict[str, Any], base: BaseReranker) -> RerankerModule:
    """The base's own module where the dev guard kept the weights training started from (the base's), so that
    its rows share the base's scores (`table1_systems`) instead of scoring the same weights again."""
    return base.module if kept_start(info) else module


def dev_top1_split(
    stage: PreferenceStage, train_qids: set[str], dev_fraction: float, seed: int
) -> tuple[set[str], DevTop1]:
    """A seeded `dev_fraction` of `train_qids` as the dev questions whose Top-1 answers choose the weights (their
    candidates and the LLM's answer under each), and the rest, which train."""
    if stage.utility is None:
        raise ValueError("preferences.select_on=dev_top1 needs the LLM's answer under every candidate")
    ordered = sorted(train_qids)
    n_dev = round(len(ordered) * dev_fraction)
    if not 0 < n_dev < len(ordered):
        raise ValueError(
            f"preferences.dev_fraction={dev_fraction} of {len(ordered)} training questions leaves no dev or no "
            "training question"
        )
    dev_qids = set(np.random.default_rng(seed).permutation(ordered)[:n_dev].tolist())
    chosen = [(c, u) for c, u in zip(stage.candidates, stage.utility) if c.qid in dev_qids]
    dev = dev_set(
        [c.question for c, _ in chosen],
        [[document_text(p) for p in c.passages] for c, _ in chosen],
        [u.tolist() for _, u in chosen],
    )
    return train_qids - dev_qids, dev


def planned_rows(recipe: RerankRecipe) -> list[str]:
    """The ids of the Table 1 rows `recipe` builds, known before anything runs (so a config naming another row is
    refused at once); a compared rule that keeps no preference row is still left out when the stage runs."""
    rows = [BM25]
    if recipe.retrieval.retriever == "dense" or recipe.retrieval.bi_encoder:  # the dense index exists
        rows.append(BI_ENCODER)
    rows.append(BASE)
    if recipe.preferences.relevance_baseline:
        rows.append(RELEVANCE_FT)
    return rows + [confidence_ft(rule) for rule in recipe.preferences.rules] + recipe.alignment.rows


def table1_systems(
    retrieval: Retrieval | None, rerankers: dict[str, Reranker], eval_batch_size: int
) -> dict[str, Scorer]:
    """The rows of Table 1 as scoring functions (query, passages) → scores, by id: BM25 and the bi-encoder over
    the retrieval corpus (the passages must be in it; none without a corpus), then each cross-encoder."""
    systems: dict[str, Scorer] = {}
    if retrieval is not None:
        systems.update(corpus_systems(retrieval))
    # Scores by (model, query, passages): rows that are one model (an aligned reranker whose dev guard kept the
    # base's weights, in every fold or in the query's fold) score each question once; at full size a row of Table 1
    # or 2 is minutes of scoring.
    scored: dict[tuple[int, str, tuple[str, ...]], np.ndarray] = {}

    def cross_encoder(row: Reranker) -> Scorer:
        def score(query: str, passages: list[str]) -> np.ndarray:
            module = row.scorer_for(query)
            key = (id(module), query, tuple(passages))
            if key not in scored:
                scores = np.array(module.score([query] * len(passages), passages, batch_size=eval_batch_size))
                scores.flags.writeable = False  # shared by every caller: none may change it in place
                scored[key] = scores
            return scored[key]

        return score

    for name, module in rerankers.items():  # insertion order: the tuned rows last
        systems[name] = cross_encoder(module)
    return systems


def corpus_systems(retrieval: Retrieval) -> dict[str, Scorer]:
    """BM25 and (with a dense index) the bi-encoder as Table 1 rows, over the retrieval corpus's passages."""
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
    return systems


def table1(systems: dict[str, Scorer], test_rows: list[dict], seed: int, progress: bool = True) -> list[dict]:
    """P@K, R@K, MRR@K (K = 1, 3, 5) of every system on the preference test split's candidate lists: one row
    each, its label in `system` and its id in `id`."""
    lists = candidate_lists(test_rows, seed)
    labels = [c["labels"] for c in lists]
    scores = {
        name: [
            np.asarray(score(c["query"], c["passages"]), dtype=np.float64).tolist()
            for c in tqdm(lists, desc=f"Table 1: {name}", unit="query", disable=not progress)
        ]
        for name, score in systems.items()
    }
    return [labelled(row, "system") for row in ranking_table(scores, labels, KS)]
