"""The question budget and the evaluation file, checked before any stage runs (from the files and settings alone).

Every stage takes its questions from one file in a fixed order (`confrag.data.splits.plan_questions`): the probe's,
then NQ_Rerank's, then the base reranker's; what is left is the evaluation's. A file too small for the settings
used to fail inside a stage after the LLM had loaded ("2 of its 2 questions are used before ..."); here the
budget is computed first (what the file holds, what each stage takes, what is left, what to lower) and refused
whole. The same plan then checks the evaluation file (`eval.questions_path`) against every training pool, naming the
file, the line and the question: the evaluation stage checked it only after the probe and the rerankers. A question
file without any gold paragraph (FlashRAG's `{id, question, golden_answers}`) is refused here, once, with every
setting of the run that reads gold paragraphs and the override that does without (`recipes.gold_paragraph_needs`):
each stage used to refuse its own, one run at a time.

The plan is drawn as the stages draw it (same rows, seeds and order), from the questions as written: the stages
fit an overlong question to the LLM's context, which may cut its text but keeps its qid, and so its place.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from confrag.data.gold_needs import GoldNeed, refuse_without_gold
from confrag.data.nq import QARow, load_questions_jsonl
from confrag.data.records import read_records
from confrag.data.splits import (
    QuestionPlan,
    cross_fit_plan,
    drop_duplicate_questions,
    plan_questions,
    question_key,
    select_questions,
)
from confrag.probe.datamodule import NQConfidenceDataModule
from confrag.rag.settings import EvalSettings
from confrag.stages.base_reranker import BaseRerankerSettings
from confrag.stages.nq_rerank import PreferenceSettings
from confrag.stages.rerank import RerankRecipe
from confrag.stages.retrieval import EVAL_IDS, evaluation_file_rows

log = logging.getLogger(__name__)

MIN_LEFT = 2  # questions the plan must leave after the probe, NQ_Rerank and the base reranker (plan_questions)


@dataclass(frozen=True)
class ProbeQuestions:
    """The probe data settings the budget reads (`probe.data.*`: the file, its format, the sample)."""

    questions_path: str
    questions_format: str
    num_questions: int | None
    seed: int
    node: str  # the probe data's config node ("probe.data"), so that advice names a working override

    @classmethod
    def of(cls, datamodule: NQConfidenceDataModule) -> ProbeQuestions:
        """From the probe's data module as configured (nothing is built)."""
        return cls(
            str(datamodule.questions_path),
            datamodule.questions_format,
            datamodule.num_questions,
            int(datamodule.seed),
            datamodule.config_node,
        )


@dataclass(frozen=True)
class QuestionBudget:
    """How many questions each stage takes from the file, and what is left for the evaluation."""

    file: str
    holds: int  # distinct questions (repeats of an earlier question are dropped by every stage)
    probe: int
    preference: int
    base: int  # 0 when the base reranker is not trained, or when it draws from a file of its own
    left: int  # held out: the evaluation's pool (cross-fitted: every preference and held-out question)
    evaluation: int  # the evaluation questions (from the left ones, or from eval.questions_path)
    dev: int
    problems: tuple[str, ...]

    def table(self) -> str:
        return (
            f"{self.file} holds {self.holds} distinct questions; the probe takes {self.probe}, NQ_Rerank "
            f"{self.preference}, the base reranker {self.base}, leaving {self.left}; the evaluation takes "
            f"{self.evaluation} (dev {self.dev}, test {self.evaluation - self.dev})"
        )


def _taken(requested: int | None, available: int) -> int:
    """What `select_questions` gives: all of them for None or a request beyond what is there."""
    return available if requested is None else min(int(requested), available)


def question_budget(
    probe: ProbeQuestions,
    preferences: PreferenceSettings,
    base: BaseRerankerSettings,
    evaluation: EvalSettings | None,
    rows: Sequence[QARow],
) -> QuestionBudget:
    """The counts `plan_questions` (and the evaluation's sample and dev/test split) will reach for `rows`, with
    every shortfall as a problem naming the settings to lower."""
    holds = len(drop_duplicate_questions(rows))
    n_probe = _taken(probe.num_questions, holds)
    n_pref = _taken(preferences.num_questions, holds - n_probe)
    own_base = base.train and not base.questions_path
    n_base = _taken(base.num_questions, holds - n_probe - n_pref) if own_base else 0
    left = holds - n_probe - n_pref - n_base
    problems = []
    if left < MIN_LEFT:
        problems.append(
            f"at least {MIN_LEFT} must be left after the probe, NQ_Rerank and the base reranker (here {left}): lower "
            f"{probe.node}.num_questions={probe.num_questions}, preferences.num_questions={preferences.num_questions}"
            + (f" or base_reranker.num_questions={base.num_questions}" if own_base else "")
            + f" by {MIN_LEFT - left} in all, or use a file with more questions"
        )
    folds = int(preferences.cross_fit or 0)
    if folds and n_pref + left < 2 * folds:
        problems.append(
            f"preferences.cross_fit={folds} folds need at least {2 * folds} questions beside the probe's and the "
            f"base reranker's; {n_pref + left} are left: lower preferences.cross_fit or the probe's questions"
        )
    n_eval = dev = 0
    if evaluation is not None:
        pool = n_pref + left if folds else left
        where = (
            "the questions left"
            if not evaluation.questions_path
            else f"eval.questions_path={evaluation.questions_path}"
        )
        if evaluation.questions_path:
            pool = len(drop_duplicate_questions(evaluation_file_rows(evaluation.questions_path)))
        n_eval = _taken(evaluation.num_questions, pool)
        dev = int(round(n_eval * float(evaluation.dev_fraction)))
        if not 0 < dev < n_eval:
            problems.append(
                f"eval.dev_fraction={evaluation.dev_fraction} of the {n_eval} evaluation questions ({where}) leaves "
                f"an empty dev or test split: raise eval.num_questions={evaluation.num_questions} (or leave more "
                "questions to the evaluation), or change eval.dev_fraction"
            )
    return QuestionBudget(probe.questions_path, holds, n_probe, n_pref, n_base, left, n_eval, dev, tuple(problems))


def check_recipe_questions(
    recipe: RerankRecipe,
    evaluation: EvalSettings | None,
    seed: int,
    gold_needs: Sequence[GoldNeed | str] = (),
    advice: str = "",
) -> QuestionPlan:
    """`check_question_plan` for a task's rerank recipe (and its `eval` settings): what the tasks call in `check`.
    `gold_needs`: the task's settings that read gold paragraphs (`recipes.gold_paragraph_needs`), or why the task
    itself needs them (the gates task's conflicting contexts), with `advice` after them."""
    probe = ProbeQuestions.of(recipe.probe.make_datamodule())
    return check_question_plan(probe, recipe.preferences, recipe.base, evaluation, seed, gold_needs, advice)


def check_question_plan(
    probe: ProbeQuestions,
    preferences: PreferenceSettings,
    base: BaseRerankerSettings,
    evaluation: EvalSettings | None,
    seed: int,
    gold_needs: Sequence[GoldNeed | str] = (),
    advice: str = "",
) -> QuestionPlan:
    """The budget (refused whole, with every count, when a stage would run short) and the plan the stages will
    draw; with `eval.questions_path`, that file checked against every training pool of the plan. A file without
    any gold paragraph is refused first when `gold_needs` (what reads them) is not empty, all at once."""
    rows = load_questions_jsonl(probe.questions_path, questions_format=probe.questions_format)
    refuse_without_gold(probe.questions_path, rows, gold_needs, advice)
    budget = question_budget(probe, preferences, base, evaluation, rows)
    if budget.problems:
        raise ValueError(f"Too few questions: {budget.table()}. " + "; ".join(budget.problems))
    log.info("Question budget: %s", budget.table())
    probe_rows = select_questions(rows, probe.num_questions, probe.seed)
    base_rows = load_questions_jsonl(base.questions_path) if base.questions_path else None
    plan = plan_questions(
        rows,
        probe_rows,
        preferences.num_questions,
        base.num_questions if base.train else 0,
        seed,
        probe.questions_path,
        base_rows=base_rows,
    )
    if preferences.cross_fit:
        plan = cross_fit_plan(plan, preferences.cross_fit, seed)
    if evaluation is not None and evaluation.questions_path:
        check_evaluation_file(evaluation.questions_path, plan, rows, probe.questions_path)
    return plan


def check_evaluation_file(path: str, plan: QuestionPlan, file_rows: Sequence[QARow], questions_path: str) -> None:
    """No question of the evaluation file is one the probe, the base reranker or the rerankers train on (by
    normalized text, as `check_disjoint`): refused naming each such question's line and text and the pool it is
    in: the preference questions, unless cross-fitted (then each fold's questions are answered by rerankers that
    never saw them, and `check_held_out` checks an evaluation question against its fold's training folds).
    The file's qids carry `EVAL_IDS`; a training file whose own ids start with it is refused too."""
    clashing = [r.qid for r in file_rows if r.qid.startswith(EVAL_IDS)]
    if clashing:
        raise ValueError(
            f"{questions_path}: ids {clashing[:3]} start with {EVAL_IDS!r}, the prefix of the evaluation file's "
            "(eval.questions_path) questions: rename them"
        )
    pools: Mapping[str, Sequence[QARow]] = {
        "the probe's": plan.probe,
        "the base reranker's": plan.base,
        **({} if plan.folds else {"NQ_Rerank's (the aligned rerankers')": plan.preference}),
    }
    owner = {question_key(r): (name, r) for name, rows in pools.items() for r in rows}
    rows = evaluation_file_rows(path)
    positions = [position for position, _ in read_records(Path(path), "one JSON object")]
    shared = [
        (position, row, *owner[question_key(row)])
        for position, row in zip(positions, rows)
        if question_key(row) in owner
    ]
    if shared:
        examples = "; ".join(
            f"{position} {row.question!r} is {name} question {used.qid} ({used.question!r})"
            for position, row, name, used in shared[:5]
        )
        raise ValueError(
            f"eval.questions_path={path}: {len(shared)} of its {len(rows)} questions are training questions of "
            f"{questions_path} (compared by normalized text): {examples}. Training and evaluation questions must be "
            "disjoint: remove them from the evaluation file"
        )
