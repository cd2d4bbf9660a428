"""The evaluation stage: held-out questions → candidates → Conf(H(Q)) → answers under every reranker and K.

Evaluation questions are a seeded sample of the NQ questions no stage trained on: not the probe's, not the
preference questions, not the base reranker's (`QuestionPlan`); `check_disjoint` asserts it again here.
They are split by question into dev (choosing β, or fitting the gates) and test (every table). Their
candidates come from the stage's retriever over the NQ paragraphs, which hold their own gold paragraphs,
as for the preference questions. With `eval.diagnostics`, Table 2 also gets the probe as a reranker and
the utility oracle (`stages.diagnostics`), on the test questions (and every HotpotQA question).

HotpotQA (`eval.hotpotqa_path`) gets a corpus of its own: the supporting paragraphs of the sampled
questions, indexed by the same kind of retriever; a question's candidates are therefore its gold
paragraphs among the other questions' (the file's own distractor paragraphs are not used). It appears in
Table 2 only, over all sampled questions, as in the papers.

Every answer goes through one `AnswerStore`: another K, β grid or reranker subset, or a rerun, generates
nothing it has generated before.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from confrag.cbdr import ConfidenceGate, SweepData, question_confidences
from confrag.cbdr.gate import gate_check
from confrag.cbdr.settings import CBDRSettings
from confrag.data.hotpotqa import load_hotpotqa
from confrag.data.nq import QARow
from confrag.data.splits import check_disjoint, select_questions, split_dev_test
from confrag.infra.run_context import RunContext
from confrag.llm.loading import load_llm
from confrag.llm.prompted import PromptedLLM
from confrag.llm.prompts import PromptTemplates
from confrag.rag import AnswerStore, QuestionOutcome, RagRun, run_rag, save_outcomes_jsonl
from confrag.rag.settings import AnswerSettings, EvalSettings
from confrag.reranker.systems import FUSION
from confrag.retrieval import Candidates, Corpus
from confrag.retrieval.lengths import TokenBudget
from confrag.stages.diagnostics import candidate_diagnostics, fusion_scorer, lookup_scorer
from confrag.stages.likelihood import likelihood_stage
from confrag.stages.passage_budget import checked_paragraphs, llm_passage_budget
from confrag.stages.rerank import RerankStage, Scorer, table1_systems
from confrag.stages.retrieval import (
    RetrievalSettings,
    build_retrieval,
    evaluation_file_rows,
    question_candidates,
    retrieve_fn,
)

log = logging.getLogger(__name__)

# The main question set's name when none is given (the shared NQ sample), and HotpotQA's (Table 2 beside it).
NQ, HOTPOTQA = "NQ", "HotpotQA"


@dataclass
class EvalSet:
    dataset: str
    rows: list[QARow]
    candidates: list[Candidates]
    scorers: dict[str, Scorer]
    retrieval: dict[str, Any]


def evaluation_rows(
    stage: RerankStage, num_questions: int | None, seed: int, questions_path: str | None = None
) -> list[QARow]:
    """A seeded sample of the NQ questions no stage trained on; with `questions_path` (`eval.questions_path`), of that
    file's questions instead, each checked by normalized text against every training pool."""
    pool = evaluation_file_rows(questions_path) if questions_path else stage.questions.evaluation_pool
    rows = select_questions(pool, num_questions, seed)
    check_held_out(stage, rows)
    return rows


def check_held_out(stage: RerankStage, rows: Sequence[QARow]) -> None:
    """No evaluation question was used by the probe, the base reranker, or the preference rows of the rerankers
    that answer it: with cross-fitting, a question of fold f against the other folds' questions (those fold f's
    rerankers trained on); a question outside every fold against all preference questions."""
    plan = stage.questions
    fixed = {"the probe's questions": stage.probe_data.data.rows, "the base reranker's questions": plan.base}
    by_fold: dict[int | None, list[QARow]] = {}
    for row in rows:
        by_fold.setdefault(plan.fold_of(row) if plan.folds else None, []).append(row)
    for fold, fold_rows in by_fold.items():
        if fold is None:
            check_disjoint(fold_rows, {**fixed, "the preference questions": plan.preference})
        else:
            check_disjoint(
                fold_rows,
                {**fixed, f"the questions fold {fold}'s rerankers trained on": plan.training_questions(fold)},
                f"the evaluation questions of fold {fold}",
            )


def check_row(key: str, system: str, rows: Collection[str]) -> str:
    """`system` (a config value, an id) if this run has that Table 1 row: checked against the rows the recipe
    plans before anything runs (`planned_rows`), and against the rows built once the stage has run."""
    if system not in rows:
        raise ValueError(
            f"{key}={system!r} is not a Table 1 row of this run; rows: {list(rows)} (confidence_ft.<rule> needs "
            "the rule in preferences.selection or preferences.compare, relevance_ft "
            "preferences.relevance_baseline=true, bi_encoder retrieval.bi_encoder=true)"
        )
    return system


def check_chosen_rows(settings: CBDRSettings, rows: Collection[str]) -> list[str]:
    """Table 2's rows by id (`eval.rerankers`, or every row of `rows`), each of `eval.base_reranker`,
    `cbdr.reranker` and `eval.rerankers` checked to be one of `rows`."""
    names = list(rows) if settings.rerankers is None else list(settings.rerankers)
    for key, name in [("eval.base_reranker", settings.base), ("cbdr.reranker", settings.reranker)] + [
        ("eval.rerankers", n) for n in names
    ]:
        check_row(key, name, rows)
    return names


def chosen_scorers(settings: CBDRSettings, scorers: dict[str, Scorer]) -> dict[str, Scorer]:
    """Table 2's rows by id: `eval.rerankers` (or every Table 1 row); the base and CBDR's reranker always."""
    names = check_chosen_rows(settings, scorers)
    keep = set(names) | {settings.base, settings.reranker}
    return {name: score for name, score in scorers.items() if name in keep}


@dataclass
class HotpotQAMaterial:
    """HotpotQA's sampled questions and the corpus of their supporting paragraphs, every passage checked against
    the LLM's budget for their prompts (`passage_budget.checked_paragraphs`)."""

    rows: list[QARow]
    corpus: Corpus
    budget: TokenBudget
    lengths: dict[str, Any]


def hotpotqa_material(
    evaluation: EvalSettings,
    answers: AnswerSettings,
    llm_config: dict,
    templates: PromptTemplates,
    retrieval: RetrievalSettings,
    seed: int,
) -> HotpotQAMaterial | None:
    """`eval.hotpotqa_path`'s sample, its passages measured in the LLM's tokens from the tokenizer alone (refused
    naming the file and question, or cut with `retrieval.cut_passages`), as the NQ corpus is: the cbdr task calls
    it before any stage loads the LLM, and the evaluation retrieves from what it returns. None without the file."""
    if not evaluation.hotpotqa_path:
        return None
    rows = select_questions(load_hotpotqa(evaluation.hotpotqa_path), evaluation.hotpotqa_num_questions, seed)
    budget = llm_passage_budget(llm_config, templates, rows, answers.max_new_tokens, retrieval)
    corpus, lengths = checked_paragraphs(retrieval, budget, rows, evaluation.hotpotqa_path)
    return HotpotQAMaterial(rows, corpus, budget, lengths)


def hotpotqa_eval_set(
    material: HotpotQAMaterial | None,
    stage: RerankStage,
    settings: CBDRSettings,
    eval_batch_size: int,
    ctx: RunContext,
) -> EvalSet | None:
    """HotpotQA questions with candidates retrieved from their pooled supporting paragraphs (see the
    module docstring), scored by the same systems (BM25 / bi-encoder rebuilt over that corpus)."""
    if material is None:
        return None
    rows = material.rows
    retrieval = build_retrieval(
        stage.retrieval.settings, ctx.cache_dir, rows=rows, corpus=material.corpus, llm_budget=material.budget
    )
    retrieval.lengths = material.lengths
    retrieval.reranker_budget = stage.retrieval.reranker_budget  # the same rerankers score these candidates
    # The NQ candidates file (retrieval.candidates_path) does not cover HotpotQA questions: always retrieve.
    candidates, stats = question_candidates(retrieval, rows)
    scorers = chosen_scorers(settings, table1_systems(retrieval, stage.rerankers, eval_batch_size))
    return EvalSet(HOTPOTQA, rows, candidates, scorers, {**stats, "corpus_passages": len(retrieval.corpus)})


def answer_set(
    eval_set: EvalSet, store: AnswerStore, ks: Sequence[int], confidences: dict[str, float] | None = None
) -> dict[str, RagRun]:
    """Closed-book and top-K RAG answers of every question under every reranker (one store for all)."""
    runs = {}
    for name, scorer in eval_set.scorers.items():
        before = store.generated
        runs[name] = run_rag(eval_set.rows, eval_set.candidates, store, ks, scorer, confidences)
        log.info(
            "%s / %s: %d answers generated, the rest from the cache", eval_set.dataset, name, store.generated - before
        )
    return runs


def only(outcomes: Sequence[QuestionOutcome], rows: Sequence[QARow]) -> list[QuestionOutcome]:
    qids = {row.qid for row in rows}
    return [o for o in outcomes if o.qid in qids]


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def confidence_gate(
    stage: RerankStage, settings: CBDRSettings, prompted: PromptedLLM, beta: float | None = None
) -> ConfidenceGate:
    """CBDR for one question at a time: the stage's probe, retriever and `cbdr.reranker`, at `cbdr.beta`
    (or `beta`). Refuses a probe trained on another LLM, prompt template or layer."""
    check_row("cbdr.reranker", settings.reranker, stage.scorers)
    return ConfidenceGate(
        prompted,
        stage.probe,
        settings.beta if beta is None else beta,
        retrieve_fn=retrieve_fn(stage.retrieval),
        rerank_fn=stage.scorers[settings.reranker],
        top_k=settings.k,
        max_new_tokens=settings.gate_max_new_tokens,
        batch_size=settings.gate_batch_size,
        progress=False,
    )


@dataclass
class RagEvaluation:
    """Everything generated for the evaluation questions (the only part of the cbdr task that runs the LLM)."""

    splits: dict[str, list[QARow]]  # the main set's dev / test
    sets: list[EvalSet]
    runs: dict[str, dict[str, RagRun]]  # dataset -> system id -> outcomes (diagnostic rows: test questions only)
    answers: dict[str, int]  # AnswerStore counts: generated, reused
    gate_check: dict[str, Any]
    diagnostics: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)  # dataset -> summary
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)  # wall time by part of the run
    # The main question set's name (`evaluate(questions=...)`: its dataset's label or the evaluation file's name),
    # the key of its runs and the name every table, plot, log line and outcome folder gives it.
    main: str = NQ

    def gold_sources(self) -> dict[str, dict[str, str | None]]:
        """dataset -> qid -> the source id of the question's own (gold) paragraph in its corpus."""
        return {s.dataset: {c.qid: c.gold_source for c in s.candidates} for s in self.sets}

    def tables(self) -> dict[str, dict[str, list[QuestionOutcome]]]:
        """Table 2's outcomes: the main set's test questions; HotpotQA (Table 2 only) all its sampled questions."""
        main = {name: only(r.outcomes, self.splits["test"]) for name, r in self.runs[self.main].items()}
        tables = {self.main: main}
        tables.update(
            {d: {name: r.outcomes for name, r in by.items()} for d, by in self.runs.items() if d != self.main}
        )
        return tables

    def sweep_data(self, settings: CBDRSettings) -> tuple[SweepData, SweepData, SweepData]:
        """CBDR's reranker on dev and test, and the base reranker on test."""
        ours = self.runs[self.main][settings.reranker].outcomes
        dev, test = (
            SweepData.from_outcomes(only(ours, self.splits[s]), settings.metric, settings.ks) for s in ("dev", "test")
        )
        base = SweepData.from_outcomes(
            only(self.runs[self.main][settings.base].outcomes, self.splits["test"]), settings.metric, settings.ks
        )
        return dev, test, base


# wide: the settings nodes it reads (cbdr, eval, rag), the LLM node with its templates (apart until the LLM loads),
# the rerankers' batch size, the run's context and the question set's name (the run's dataset label or evaluation
# file, which no settings node holds) are independent; an object holding them would be built for this one call.
def evaluate(
    stage: RerankStage,
    settings: CBDRSettings,
    evaluation: EvalSettings,
    answers: AnswerSettings,
    llm_config: dict,
    templates: PromptTemplates,
    eval_batch_size: int,
    ctx: RunContext,
    questions: str = NQ,
) -> RagEvaluation:
    """Held-out questions (sampled and split with the run's seed) → candidates → Conf(H(Q)) → answers under
    every reranker and K (cached per prompt in the run's cache), saved as outcomes in the run folder; then the
    live gate on a few test questions. `questions`: the question set's name in every table, log line and folder
    (`outcomes/<its slug>/`: `nq` for NQ, as before)."""
    eval_rows = evaluation_rows(stage, evaluation.num_questions, ctx.seed, evaluation.questions_path)
    splits = split_dev_test(eval_rows, float(evaluation.dev_fraction), ctx.seed)
    candidates, stats = question_candidates(stage.retrieval, eval_rows, stage.retrieval.settings.candidates_path)
    if stage.retrieval.joined:  # the evaluation file's paragraphs in the corpus (the report says how many)
        stats["eval_file"] = dict(stage.retrieval.joined)
    sets = [EvalSet(questions, eval_rows, candidates, chosen_scorers(settings, stage.scorers), stats)]
    material = hotpotqa_material(evaluation, answers, llm_config, templates, stage.retrieval.settings, ctx.seed)
    hotpot = hotpotqa_eval_set(material, stage, settings, eval_batch_size, ctx)
    sets += [hotpot] if hotpot else []
    prompted = PromptedLLM(load_llm(llm_config), templates)
    try:
        store = answers.store(prompted, ctx.cache_dir, ctx.progress)
        confidence = question_confidences(
            prompted,
            stage.probe,
            [r.question for r in eval_rows],
            ctx.cache_dir,
            batch_size=answers.extract_batch_size,
            progress=ctx.progress,
        )
        confidences = {row.qid: float(c) for row, c in zip(eval_rows, confidence)}
        runs = {
            s.dataset: answer_set(s, store, settings.ks, confidences if s.dataset == questions else None) for s in sets
        }
        summaries = {}
        if evaluation.diagnostics:
            test = {r.qid for r in splits["test"]}
            for s in sets:
                rows = [r for r in s.rows if s.dataset != questions or r.qid in test]
                chosen = [c for c in s.candidates if s.dataset != questions or c.qid in test]
                diagnostics = candidate_diagnostics(
                    prompted, stage.probe, chosen, store, answers.extract_batch_size, ctx,
                    within=stage.preferences.candidates,
                )  # fmt: skip
                summaries[s.dataset] = diagnostics.summary()
                for name, scorer in diagnostics.scorers().items():
                    runs[s.dataset][name] = run_rag(
                        rows, chosen, store, settings.ks, scorer, confidences if s.dataset == questions else None
                    )
        if stage.alignment is not None and stage.alignment.fusion_weight is not None:
            for s in sets:
                runs[s.dataset][FUSION] = fusion_run(stage, s, splits, store, settings, prompted, ctx, confidences)
        log.info("answers: %d generated, %d from the cache", store.generated, store.reused)
        counts = {"generated": store.generated, "reused": store.reused}
        check = (
            gate_check(
                confidence_gate(stage, settings, prompted),
                splits["test"][: settings.gate_check_questions],
                runs[questions][settings.reranker].outcomes,
                settings.k,
            )
            if settings.gate_check_questions
            else {}
        )
    finally:
        del prompted
        gc.collect()
    ctx.on_main(save_outcomes, runs, ctx.output_dir / "outcomes")
    return RagEvaluation(splits, sets, runs, counts, check, summaries, main=questions)


# wide: the fusion row's answers read the evaluation's parts that `evaluate` holds (its set, splits, answer store,
# settings, the loaded LLM, context and question confidences); `evaluate` is the one caller.
def fusion_run(
    stage: RerankStage,
    eval_set: EvalSet,
    splits: dict[str, list[QARow]],
    store: AnswerStore,
    settings: CBDRSettings,
    prompted: PromptedLLM,
    ctx: RunContext,
    confidences: dict[str, float],
) -> RagRun:
    """Table 2's diagnostic row `fusion` on the test questions (every question of a set other than NQ): z(base) +
    w · z(ℓ) over each question's candidates, ℓ from the ℓ stage (cached), the base Table 2 pairs every row with."""
    test = {r.qid for r in splits["test"]}
    keep = eval_set.dataset != NQ
    rows = [r for r in eval_set.rows if keep or r.qid in test]
    chosen = [c for c in eval_set.candidates if keep or c.qid in test]
    alignment = stage.alignment
    ell = likelihood_stage(prompted, chosen, ctx, alignment.extract_batch_size, alignment.max_answers)
    base = eval_set.scorers[settings.base]
    fused = fusion_scorer(base, lookup_scorer(chosen, ell.per_question), alignment.fusion_weight)
    return run_rag(rows, chosen, store, settings.ks, fused, None if keep else confidences)


def save_outcomes(runs: dict[str, dict[str, RagRun]], folder: Path) -> None:
    """Every question's outcomes as `folder/<dataset's slug>/<system id>.jsonl` (e.g. `nq/confidence_ft.sign.jsonl`,
    `popqa/base.jsonl`)."""
    for dataset, by_reranker in runs.items():
        for name, rag_run in by_reranker.items():
            save_outcomes_jsonl(rag_run.outcomes, folder / slug(dataset) / f"{name}.jsonl")
