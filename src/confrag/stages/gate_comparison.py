"""The gates' comparison: every retrieval gate on the same questions, with clean and conflicting contexts.

rerank stage (cached: probe, retriever, rerankers) → evaluation questions (the cbdr task's: NQ questions
the probe never saw, split by question with `eval.dev_fraction`; the part the cbdr task calls dev is
the gates' *training* split, the rest the test split) → per test question, the clean contexts (retrieved,
reranked by `gates.reranker`, top K) and the conflicting contexts → closed-book and RAG answers through
the `AnswerStore` (shared with the cbdr task) → per-gate signals → each gate fitted on the training split
only and deciding on the test split → the table and the threshold curves.

The comparison in three modules beside this one (which prepares everything that runs the LLM): the
question sets and both conditions' contexts (`stages.gate_questions`), the timed parts
(`stages.gate_timing`), fitting, deciding and scoring (`stages.gate_scoring`). Only per-context signals
(BRIDGE's matching scores) depend on the contexts; every other gate decides before retrieving, so only
its RAG answers change.

Outcomes: parametric → the closed-book answer, retrieve → the RAG answer (BRIDGE's FA strategy answers
with its internal passage before the retrieved ones, `gates.bridge.answer_contexts`), refuse → a
refusal. Wall time: see `confrag.gates.evaluation` (measured parts, combined per decision)."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import numpy as np

from confrag.gates import Gate, GateSignals
from confrag.gates.evaluation import decision_parts
from confrag.gates.settings import GateSettings
from confrag.gates.signal_maker import SignalMaker, check_llm_signals, context_signals, question_signals, text_encoder
from confrag.infra.run_context import RunContext
from confrag.llm.prompted import PromptedLLM
from confrag.rag import AnswerStore, QuestionOutcome, run_rag
from confrag.rag.settings import AnswerSettings, EvalSettings
from confrag.stages.evaluation import check_held_out, check_row, evaluation_rows
from confrag.stages.gate_questions import (
    CLEAN,
    CONDITIONS,
    CONFLICTING,
    QuestionSets,
    conflicting_candidates,
    question_sets,
    reranked,
)
from confrag.stages.gate_timing import TimingRun, measure_parts
from confrag.stages.rerank import RerankStage
from confrag.stages.retrieval import question_candidates


@dataclass
class GateEvaluation:
    """The answers, signals and timings every gate of the comparison decides from and is scored on."""

    sets: QuestionSets
    train_outcomes: list[QuestionOutcome]
    test_outcomes: dict[str, list[QuestionOutcome]]  # condition -> outcomes of the test questions
    contexts: dict[str, list[list[Any]]]  # condition -> the contexts of each test question's RAG prompt
    train_signals: GateSignals
    test_signals: dict[str, GateSignals]  # condition -> signals (only the per-context ones differ)
    extras: dict[Hashable, dict[str, Any]]  # Gate.extras_key -> its Gate.training_extras (CtrlA's direction)
    timings: dict[str, float]  # part -> seconds per question
    store: AnswerStore | None
    maker: SignalMaker | None
    default_layer: int = 0  # the LLM's Layer/2: the layer of gates that leave theirs open


def prepare_gate_evaluation(
    stage: RerankStage,
    evaluation: EvalSettings,
    settings: GateSettings,
    gates: dict[str, Gate],
    prompted: PromptedLLM,
    answers: AnswerSettings,
    ctx: RunContext,
) -> GateEvaluation:
    """Everything that runs the LLM before the gates decide, on the evaluation questions (`evaluation`'s sample,
    as the cbdr task's): answers in both conditions (cached per prompt in the run's cache), the signals the
    configured gates read, CtrlA's directions, and the timed parts. The question sets are split with the run's
    seed, by `evaluation.dev_fraction`."""
    rows = evaluation_rows(stage, evaluation.num_questions, ctx.seed, evaluation.questions_path)
    check_row("gates.reranker", settings.reranker, stage.scorers)
    llm = prompted.llm
    check_llm_signals(gates, llm)
    check_held_out(stage, rows)
    scorer, k = stage.scorers[settings.reranker], settings.top_k
    sets = question_sets(rows, evaluation.dev_fraction, ctx.seed)
    candidates, retrieval = question_candidates(
        stage.retrieval, [*sets.train, *sets.test], stage.retrieval.settings.candidates_path
    )
    ranked = reranked(candidates, scorer)
    clean_test = ranked[len(sets.train) :]
    conflict_test = [conflicting_candidates(c, sets.conflicts[c.qid], k) for c in clean_test]
    sets.report.update(
        retrieval=retrieval,
        conflicting_contexts_with_a_gold_answer_elsewhere=float(
            np.mean([any(c.has_answer[1:]) for c in conflict_test])
        ),
    )

    store = answers.store(prompted, ctx.cache_dir, ctx.progress)
    # The clean ranking is already the reranker's: run_rag without a reranker keeps it (same prompts as cbdr's).
    clean_run = run_rag([*sets.train, *sets.test], ranked, store, [k])
    conflict_run = run_rag(sets.test, conflict_test, store, [k])
    train_outcomes, clean_outcomes = clean_run.outcomes[: len(sets.train)], clean_run.outcomes[len(sets.train) :]

    maker = SignalMaker(
        prompted,
        stage.probe,
        text_encoder(stage.retrieval.retriever),
        settings.draft_max_new_tokens,
        settings.internal_max_new_tokens,
        settings.batch_size,
        ctx.cache_dir,
        answers.extract_batch_size,
        ctx.progress,
    )
    needs = set().union(*(g.needs for g in gates.values()))
    train_needs = set().union(*(g.training_needs for g in gates.values()))
    layers = sorted({layer for g in gates.values() for layer in g.state_layers(llm.mid_layer)})
    train_signals = question_signals(maker, sets.train, train_needs, [o.closed_book.answer for o in train_outcomes])
    base = question_signals(maker, sets.test, needs, [o.closed_book.answer for o in clean_outcomes], layers)
    contexts = {CLEAN: [c.passages[:k] for c in clean_test], CONFLICTING: [c.passages for c in conflict_test]}
    test_signals = {condition: context_signals(maker, base, needs, contexts[condition]) for condition in CONDITIONS}
    extras: dict[Hashable, dict[str, Any]] = {}
    for gate in gates.values():
        key = gate.extras_key(llm.mid_layer)
        if key is not None and key not in extras:
            extras[key] = gate.training_extras(maker, sets.train)
    parts = {"closed_book", "rag_answer", "retrieve"} | set(decision_parts(needs))
    timing_rows = sets.test[: settings.timing_questions]
    timed = TimingRun(
        maker,
        stage.retrieval,
        scorer,
        timing_rows,
        clean_test[: len(timing_rows)],
        layers or (llm.mid_layer,),
        k,
        answers,
    )
    timings = measure_parts(timed, parts)
    return GateEvaluation(
        sets,
        train_outcomes,
        {CLEAN: clean_outcomes, CONFLICTING: conflict_run.outcomes},
        contexts,
        train_signals,
        test_signals,
        extras,
        timings,
        store,
        maker,
        llm.mid_layer,
    )
