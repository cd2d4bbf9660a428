"""The gates' comparison: every retrieval gate on the same questions, with clean and conflicting contexts.

rerank stage (cached: probe, retriever, rerankers) → evaluation questions (the cbdr task's: NQ questions
the probe never saw, split by question with `eval.dev_fraction`; the part the cbdr task calls dev is
the gates' *training* split, the rest the test split) → per test question, the clean contexts (retrieved,
reranked by `gates.reranker`, top K) and the conflicting contexts → closed-book and RAG answers through
the `AnswerStore` (shared with the cbdr task) → per-gate signals → each gate fitted on the training split
only and deciding on the test split → the table and the threshold curves.

Conflicting contexts (`data/conflicts.py` builds the passages, BRIDGE's FI construction): the gold
paragraph with every occurrence of its answer replaced by a same-kind answer of another evaluation
question. The contexts are that paragraph first, then the clean ranking's best K − 1 passages that were
not split from the gold paragraph (every piece of the original gold paragraph is replaced by its one
rewritten version, retrieved or not). Test questions whose gold paragraph does not contain an answer, or
have no usable substitute, are left out of *both* conditions, so clean and conflicting are the same
questions. Only BRIDGE's signals depend on the contexts (it matches them against its own knowledge);
every other gate decides before retrieving, so only its RAG answers change.

Outcomes: parametric → the closed-book answer, retrieve → the RAG answer (BRIDGE's FA strategy answers
with its internal passage before the retrieved ones, `gates.bridge.answer_contexts`), refuse → a
refusal. Wall time: see `confrag.gates.evaluation` (measured parts, combined per decision).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from confrag.cbdr.settings import AnswerSettings
from confrag.data.conflicts import ConflictExample, build_conflicts
from confrag.data.nq import QARow
from confrag.data.splits import split_dev_test
from confrag.gates import (
    BridgeGate,
    CtrlAGate,
    Decision,
    Gate,
    GateSignals,
    GateTrainingData,
    retrieval_helped,
)
from confrag.gates.bridge import answer_contexts
from confrag.gates.directions import ConfidenceDirection
from confrag.gates.evaluation import (
    CurvePoint,
    GateRow,
    decision_parts,
    gate_row,
    quantile_grid,
    score_decisions,
    threshold_scores,
    wall_time_per_question,
)
from confrag.gates.settings import GateSettings
from confrag.gates.signal_maker import (
    SignalMaker,
    check_llm_signals,
    confidence_direction,
    ctrla_key,
    ctrla_layers,
    question_signals,
    text_encoder,
    with_matching,
)
from confrag.gates.signals import bridge_matching_scores, external_knowledge
from confrag.llm.generation import generate_greedy
from confrag.llm.loading import LoadedLLM
from confrag.llm.prompts import PromptTemplates
from confrag.rag import AnswerStore, QuestionOutcome, rank_contexts, run_rag, score_answer
from confrag.retrieval import Candidates
from confrag.retrieval.candidates import make_candidates
from confrag.stages.evaluation import check_held_out
from confrag.stages.rerank import RerankStage, Scorer
from confrag.stages.retrieval import Retrieval, question_candidates

CLEAN, CONFLICTING = "clean", "conflicting"
CONDITIONS = (CLEAN, CONFLICTING)


# --- questions and contexts ------------------------------------------------------------------------


@dataclass
class QuestionSets:
    train: list[QARow]
    test: list[QARow]  # test questions with a conflicting version
    conflicts: dict[str, ConflictExample]  # test qid -> its conflicting gold paragraph
    report: dict[str, Any]


def question_sets(rows: Sequence[QARow], dev_fraction: float, seed: int) -> QuestionSets:
    """The cbdr task's evaluation questions: its dev split trains the gates, its test split (where a
    conflicting version exists) evaluates them."""
    parts = split_dev_test(rows, dev_fraction, seed)
    # Substitutes are drawn from every evaluation question (a larger pool of same-kind answers).
    conflict_set = build_conflicts(rows, seed)
    conflicts = {e.qid: e for e in conflict_set.examples}
    test = [r for r in parts["test"] if r.qid in conflicts]
    if not test:
        raise ValueError(
            f"none of the {len(parts['test'])} test questions has a conflicting version (skipped: "
            f"{dict(conflict_set.skipped)}); raise eval.num_questions"
        )
    kinds = sorted({e.kind for e in conflicts.values()})
    report = {
        "evaluation_questions": len(rows),
        "train": len(parts["dev"]),
        "test_all": len(parts["test"]),
        "test": len(test),
        "conflicts_skipped": dict(conflict_set.skipped),
        "kinds": {k: sum(conflicts[r.qid].kind == k for r in test) for k in kinds},
    }
    return QuestionSets(parts["dev"], test, {r.qid: conflicts[r.qid] for r in test}, report)


def reranked(candidates: Sequence[Candidates], scorer: Scorer) -> list[Candidates]:
    """Each question's candidates in the reranker's order (ranked once; `run_rag` then keeps the order)."""
    out = []
    for c in candidates:
        order = rank_contexts(c.question, c.passages, scorer, where=f"question {c.qid!r}: ")
        out.append(
            make_candidates(
                c.qid,
                c.question,
                c.answers,
                [c.passages[i] for i in order],
                [c.scores[i] for i in order],
                c.gold_source,
            )
        )
    return out


def conflicting_candidates(ranked: Candidates, example: ConflictExample, k: int) -> Candidates:
    """The conflicting paragraph first, then the best K − 1 passages not split from the gold paragraph."""
    rest = [(p, s) for p, s, gold in zip(ranked.passages, ranked.scores, ranked.from_gold) if not gold][: k - 1]
    # The conflicting paragraph was placed, not retrieved: it has no retrieval score.
    return make_candidates(
        ranked.qid,
        ranked.question,
        ranked.answers,
        [example.passage, *(p for p, _ in rest)],
        [math.nan, *(s for _, s in rest)],
        ranked.gold_source,
    )


# --- timing ----------------------------------------------------------------------------------------


def measure_parts(
    maker: SignalMaker,
    retrieval: Retrieval,
    scorer: Scorer,
    rows: Sequence[QARow],
    clean: Sequence[Candidates],
    parts: set[str],
    layers: Sequence[int],
    k: int,
    answers: AnswerSettings,
) -> dict[str, float]:
    """Seconds per question of each part, computed fresh (no cache) on `rows` with the run's batch sizes."""
    fresh = maker.without_cache()
    llm = maker.llm
    questions = [r.question for r in rows]
    qa_prompts = fresh.qa_prompts(questions)
    rag_prompts = [maker.templates.rag_prompt(llm.tokenizer, c.question, c.passages[:k]) for c in clean]
    generate = dict(max_new_tokens=answers.max_new_tokens, batch_size=answers.batch_size, progress=False)
    generate_greedy(llm.model, llm.tokenizer, qa_prompts[:1], max_new_tokens=1, progress=False)  # warm-up, untimed
    responses: list[str] = []

    def closed_book() -> None:
        responses.extend(generate_greedy(llm.model, llm.tokenizer, qa_prompts, **generate))

    def retrieve() -> None:
        reranked(question_candidates(retrieval, rows, retrieval.settings.candidates_path)[0], scorer)

    steps = {
        "closed_book": closed_book,
        "rag_answer": lambda: generate_greedy(llm.model, llm.tokenizer, rag_prompts, **generate),
        "retrieve": retrieve,
        "qa_states": lambda: fresh.confidence(questions),
        "ctrla_states": lambda: fresh.states(qa_prompts, layers),
        "draft": lambda: fresh.draft(questions),
        "internal": lambda: fresh.internal(questions),
        "p_true": lambda: fresh.p_true(questions, responses),
        "embed_question": lambda: fresh.embed(questions),
        "embed_response": lambda: fresh.embed(responses),
        "matching": lambda: bridge_matching_scores(
            maker.encoder, fresh.internal(questions), responses, *external_knowledge([c.passages[:k] for c in clean])
        ),
    }
    timings = {}
    # closed_book first: the response parts read its answers. `matching` times its internal passages
    # again, so `internal` is subtracted from it.
    for part in ["closed_book", *sorted(parts - {"closed_book"})]:
        start = time.perf_counter()
        steps[part]()
        timings[part] = (time.perf_counter() - start) / len(rows)
    if "matching" in timings:
        timings["matching"] = max(timings["matching"] - timings.get("internal", 0.0), 0.0)
    return timings


# --- everything the gates decide from --------------------------------------------------------------


@dataclass
class GateEvaluation:
    """The answers, signals and timings every gate of the comparison decides from and is scored on."""

    sets: QuestionSets
    train_outcomes: list[QuestionOutcome]
    test_outcomes: dict[str, list[QuestionOutcome]]  # condition -> outcomes of the test questions
    contexts: dict[str, list[list[Any]]]  # condition -> the contexts of each test question's RAG prompt
    train_signals: GateSignals
    test_signals: dict[str, GateSignals]  # condition -> signals (only BRIDGE's differ)
    directions: dict[tuple, ConfidenceDirection]  # CtrlA's, by (layers, templates)
    timings: dict[str, float]  # part -> seconds per question
    store: AnswerStore | None
    maker: SignalMaker | None


def correct_of(outcomes: Sequence[QuestionOutcome], metric: str, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(closed-book correct, top-K RAG correct) per question."""
    return (
        np.array([bool(getattr(o.closed_book, metric)) for o in outcomes]),
        np.array([bool(getattr(o.rag[k], metric)) for o in outcomes]),
    )


def prepare_gate_evaluation(
    stage: RerankStage,
    rows: Sequence[QARow],
    settings: GateSettings,
    gates: dict[str, Gate],
    llm: LoadedLLM,
    templates: PromptTemplates,
    answers: AnswerSettings,
    dev_fraction: float,
    cache_dir: str,
    seed: int,
    progress: bool = True,
) -> GateEvaluation:
    """Everything that runs the LLM before the gates decide: answers in both conditions (cached per
    prompt), the signals the configured gates read, CtrlA's directions, and the timed parts."""
    if settings.reranker not in stage.scorers:
        raise ValueError(f"gates.reranker={settings.reranker!r} is not a Table 1 row; rows: {list(stage.scorers)}")
    check_llm_signals(gates, llm)
    check_held_out(stage, rows)
    scorer, k = stage.scorers[settings.reranker], settings.top_k
    sets = question_sets(rows, dev_fraction, seed)
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

    store = answers.store(llm, templates, cache_dir, progress)
    # The clean ranking is already the reranker's: run_rag without a reranker keeps it (same prompts as cbdr's).
    clean_run = run_rag([*sets.train, *sets.test], ranked, store, [k])
    conflict_run = run_rag(sets.test, conflict_test, store, [k])
    train_outcomes, clean_outcomes = clean_run.outcomes[: len(sets.train)], clean_run.outcomes[len(sets.train) :]

    maker = SignalMaker(
        llm,
        templates,
        stage.probe,
        text_encoder(stage.retrieval.retriever),
        settings.draft_max_new_tokens,
        settings.internal_max_new_tokens,
        settings.batch_size,
        cache_dir,
        answers.extract_batch_size,
        progress,
    )
    needs = set().union(*(g.needs for g in gates.values()))
    train_needs = set().union(*(g.training_needs for g in gates.values()))
    ctrla = [g for g in gates.values() if isinstance(g, CtrlAGate)]
    layers = sorted({layer for g in ctrla for layer in ctrla_layers(g, llm)})
    train_signals = question_signals(maker, sets.train, train_needs, [o.closed_book.answer for o in train_outcomes])
    base = question_signals(
        maker, sets.test, needs - {"matching_scores"}, [o.closed_book.answer for o in clean_outcomes], layers
    )
    contexts = {CLEAN: [c.passages[:k] for c in clean_test], CONFLICTING: [c.passages for c in conflict_test]}
    test_signals = {
        condition: with_matching(maker, base, contexts[condition]) if "matching_scores" in needs else base
        for condition in CONDITIONS
    }
    directions: dict[tuple, ConfidenceDirection] = {}
    for gate in ctrla:
        if ctrla_key(gate, llm) not in directions:
            directions[ctrla_key(gate, llm)] = confidence_direction(maker, gate, sets.train)
    parts = {"closed_book", "rag_answer", "retrieve"} | set(decision_parts(needs))
    timing_rows = sets.test[: settings.timing_questions]
    timings = measure_parts(
        maker,
        stage.retrieval,
        scorer,
        timing_rows,
        clean_test[: len(timing_rows)],
        parts,
        layers or (llm.mid_layer,),
        k,
        answers,
    )
    return GateEvaluation(
        sets,
        train_outcomes,
        {CLEAN: clean_outcomes, CONFLICTING: conflict_run.outcomes},
        contexts,
        train_signals,
        test_signals,
        directions,
        timings,
        store,
        maker,
    )


# --- fitting, deciding, scoring ----------------------------------------------------------------------


def training_data(gate: Gate, evaluation: GateEvaluation, settings: GateSettings) -> GateTrainingData | None:
    """The training split's data for a gate that learns (None for one that does not): its signals, its
    cached outcomes (clean contexts), gold answers, and CtrlA's direction."""
    if not gate.training_needs:
        return None
    rows, signals = evaluation.sets.train, evaluation.train_signals
    closed_book, rag = correct_of(evaluation.train_outcomes, settings.metric, settings.top_k)
    answer_embedding = (
        evaluation.maker.embed([r.answers[0] for r in rows]) if "answer_embedding" in gate.training_needs else None
    )
    direction = evaluation.directions[ctrla_key(gate, evaluation.maker.llm)] if isinstance(gate, CtrlAGate) else None
    return GateTrainingData(
        signals,
        closed_book_correct=closed_book,
        rag_correct=rag,
        answers=[tuple(r.answers) for r in rows],
        answer_embedding=answer_embedding,
        confidence_direction=direction,
        split="train",
    )


def retrieval_correct(gate: Gate, evaluation: GateEvaluation, condition: str, settings: GateSettings) -> np.ndarray:
    """Per test question, whether the answer a RETRIEVE decision of this gate gives is correct: the top-K
    RAG answer, or for BRIDGE's FA strategy the answer over its internal passage and the contexts."""
    outcomes = evaluation.test_outcomes[condition]
    correct = correct_of(outcomes, settings.metric, settings.top_k)[1]
    if not isinstance(gate, BridgeGate):
        return correct
    signals = evaluation.test_signals[condition]
    strategies = gate.strategies(signals)
    full = [i for i, s in enumerate(strategies) if s == "FA"]
    if full:
        internal = evaluation.maker.internal(signals.questions)
        items = [
            (signals.questions[i], answer_contexts("FA", internal[i], evaluation.contexts[condition][i])) for i in full
        ]
        for i, answer in zip(full, evaluation.store.answer(items)):
            correct[i] = bool(getattr(score_answer(answer, outcomes[i].answers), settings.metric))
    return correct


@dataclass
class GateResults:
    rows: list[GateRow]
    fits: dict[str, dict[str, Any]]  # gate -> split, questions and seconds of its fit
    decisions: dict[str, dict[str, list[str]]]  # condition -> gate -> decision per test question
    fitted: dict[str, Gate]


def run_gates(evaluation: GateEvaluation, settings: GateSettings, seed: int) -> GateResults:
    rows, fits, decisions, fitted = [], {}, {c: {} for c in CONDITIONS}, {}
    for name in settings.names:
        gate = settings.build(name)
        train = training_data(gate, evaluation, settings)
        start = time.perf_counter()
        gate.fit(train)
        fits[name] = {
            "split": None if train is None else train.split,
            "qids": [] if train is None else list(train.signals.qids),
            "seconds": time.perf_counter() - start,
        }
        fitted[name] = gate
        for condition in CONDITIONS:
            signals = evaluation.test_signals[condition]
            start = time.perf_counter()
            decided = gate.decide(signals)
            decide_seconds = time.perf_counter() - start
            closed_book, rag = correct_of(evaluation.test_outcomes[condition], settings.metric, settings.top_k)
            correct = score_decisions(decided, closed_book, retrieval_correct(gate, evaluation, condition, settings))
            wall = wall_time_per_question(gate.needs, decided, evaluation.timings, decide_seconds)
            rows.append(
                gate_row(
                    name,
                    condition,
                    decided,
                    correct,
                    gate.llm_forward_passes(decided),
                    wall,
                    settings.n_resamples,
                    seed,
                    retriever_calls=gate.retriever_calls(decided),
                    retrieve_scores=gate.retrieve_scores(signals),
                    # The same labels and the same always-retrieve outcomes (top-K RAG answers) for every gate.
                    helped=retrieval_helped(closed_book, rag),
                    always_correct=rag,
                )
            )
            decisions[condition][name] = [Decision(d).value for d in decided]
    return GateResults(rows, fits, decisions, fitted)


def threshold_curves(evaluation: GateEvaluation, settings: GateSettings, results: GateResults) -> list[CurvePoint]:
    """Accuracy and retrieval rate over each threshold gate's grid, from the cached answers only."""
    points = []
    for name, spec in settings.curves.items():
        base = results.fitted[name]
        train = training_data(base, evaluation, settings)
        for condition in CONDITIONS:
            signals = evaluation.test_signals[condition]
            closed_book, rag = correct_of(evaluation.test_outcomes[condition], settings.metric, settings.top_k)
            values = spec.values or quantile_grid(threshold_scores(base, signals), settings.curve_points)
            for value in values:
                gate = settings.build(name, **{spec.param: value}).fit(train)
                decided = gate.decide(signals)
                correct = score_decisions(decided, closed_book, rag)
                points.append(
                    CurvePoint(
                        name,
                        condition,
                        spec.param,
                        float(value),
                        float(np.mean([d is Decision.RETRIEVE for d in decided])),
                        float(correct.mean()),
                    )
                )
    return points
