"""Task `gates`: every retrieval gate on the same questions, with clean and with conflicting contexts.

rerank stage (cached: probe, retriever, rerankers) → evaluation questions (the cbdr task's: NQ questions
the probe never saw, split by question with `eval.dev_fraction`; the part the cbdr task calls dev is
the gates' *training* split, the rest the test split) → per test question, the clean contexts (retrieved,
reranked by `gates.reranker`, top K) and the conflicting contexts → closed-book and RAG answers through
the `AnswerStore` (shared with the cbdr task) → per-gate signals → each gate fitted on the training split
only and deciding on the test split → the table, the threshold curves, the plot.

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

import dataclasses
import gc
import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from hydra.utils import instantiate
from lightning.pytorch.loggers import Logger, WandbLogger
from omegaconf import DictConfig, OmegaConf

from confrag.artifacts import atomic_write_text
from confrag.cbdr import question_confidences
from confrag.data.conflicts import ConflictExample, build_conflicts
from confrag.data.nq import Passage, QARow
from confrag.gates import GATES, BridgeGate, CtrlAGate, Decision, Gate, GateSignals, GateTrainingData
from confrag.gates.bridge import answer_contexts
from confrag.gates.cache import cached_drafts, cached_internal_passages, cached_states
from confrag.gates.ctrla import ConfidenceDirection, direction_from_states
from confrag.gates.evaluation import (
    CurvePoint,
    GateRow,
    decision_parts,
    gate_row,
    gates_markdown,
    plot_gates,
    quantile_grid,
    score_decisions,
    threshold_scores,
    wall_time_per_question,
)
from confrag.gates.signals import bridge_matching_scores, contrastive_prompts, embed_texts, external_knowledge
from confrag.llm.generation import generate_greedy
from confrag.llm.loading import LoadedLLM, load_llm
from confrag.llm.prompts import PromptTemplates
from confrag.rag import AnswerStore, QuestionOutcome, rank_contexts, run_rag, score_answer
from confrag.rag.stats import BINARY_METRICS
from confrag.retrieval import Candidates, DenseRetriever, corpus_from_nq
from confrag.retrieval.candidates import make_candidates
from confrag.tasks.cbdr import evaluation_rows, split_dev_test
from confrag.tasks.probe import task_loggers
from confrag.tasks.rerank import RerankStage, Scorer, question_candidates, rerank_stage

log = logging.getLogger(__name__)

CLEAN, CONFLICTING = "clean", "conflicting"
CONDITIONS = (CLEAN, CONFLICTING)


# --- settings --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class CurveSpec:
    param: str  # the constructor parameter swept (cbdr: beta; dragin, ctrla, skr_knn: threshold)
    values: tuple[float, ...] | None  # None: quantiles of the gate's own score on the test questions


@dataclass(frozen=True)
class GateSettings:
    names: tuple[str, ...]
    configs: dict[str, dict[str, Any]]  # gates.configs.<name>: the `_target_` node of conf/gate/<name>.yaml
    top_k: int
    reranker: str
    metric: str
    curves: dict[str, CurveSpec]
    curve_points: int
    timing_questions: int
    draft_max_new_tokens: int
    internal_max_new_tokens: int
    batch_size: int
    n_resamples: int


def build_gate(name: str, config: dict[str, Any], **overrides: Any) -> Gate:
    """The gate of `gates.configs.<name>` (with `overrides`); a bad value is reported under that key."""
    try:
        gate = instantiate({**config, **overrides}, _convert_="all")
    except Exception as err:  # Hydra wraps the constructor's ValueError; show the constructor's message
        raise ValueError(f"gates.configs.{name}: {err.__cause__ or err}") from err
    if not isinstance(gate, Gate):
        raise ValueError(f"gates.configs.{name} builds a {type(gate).__name__}, not a gate; its _target_ must be one "
                         f"of {', '.join(f'{c.__module__}.{c.__name__}' for c in GATES.values())}")
    return gate


def selected_gate(cfg: DictConfig, configs: dict[str, dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    """The gate chosen with `gate=<name>` (conf/gate/<name>.yaml, plus any `gate.<key>=` overrides), named as
    in gates.configs by its _target_ (a gate of the user's own keeps its class name)."""
    node = OmegaConf.to_container(cfg.gate, resolve=True)
    target = node.get("_target_") if isinstance(node, dict) else None
    if not target:
        raise ValueError(f"gate: expected a gate config with a _target_ (gate=<name>, one of "
                         f"{', '.join(sorted(configs))}); got {node!r}")
    same = [name for name, config in configs.items() if config.get("_target_") == target]
    return (same[0] if same else str(target).rsplit(".", 1)[-1]), node


def _int(value: Any, key: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{key} must be an integer >= {minimum}; got {value!r}")
    return value


def check_settings(cfg: DictConfig) -> GateSettings:
    """Every bad value of the `gates` section, named by its key, before anything expensive runs."""
    section = cfg.get("gates")
    if section is None:
        raise ValueError("task gates needs a `gates` section: compose conf/gates/default.yaml (see "
                         "conf/experiment/gates_smollm2.yaml)")
    configs = OmegaConf.to_container(section.configs, resolve=True)
    names = [str(n) for n in section.names]
    if cfg.get("gate") is not None:  # `gate=<name>` on the command line: that gate between the two bounds
        name, configs[name] = selected_gate(cfg, configs)
        names = list(dict.fromkeys(["always", "never", name]))
    if not names:
        raise ValueError(f"gates.names is empty; available gates: {', '.join(sorted(configs))}")
    for name in names:
        if name not in configs:
            raise ValueError(f"unknown gate {name!r} in gates.names; available gates: {', '.join(sorted(configs))} "
                             f"(each gates.configs.<name>, from conf/gate/<name>.yaml)")
    if len(set(names)) != len(names):
        raise ValueError(f"gates.names lists a gate twice: {names}")
    gates = {name: build_gate(name, configs[name]) for name in names}
    curves = {}
    curve_section = section.get("curves")
    for name, spec in (OmegaConf.to_container(curve_section, resolve=True) if curve_section else {}).items():
        if name not in gates:  # a curve of a gate that is not run this time
            continue
        if isinstance(gates[name], BridgeGate):
            raise ValueError("gates.curves.bridge: BRIDGE's FA answers are new generations for every new decision, so "
                             "its curve cannot come from cached answers; curves are for cbdr, dragin, ctrla, skr_knn")
        param = spec.get("param")
        if param not in configs[name] or param == "_target_":
            raise ValueError(f"gates.curves.{name}.param={param!r} is not a parameter of gates.configs.{name}; "
                             f"parameters: {sorted(k for k in configs[name] if k != '_target_')}")
        values = spec.get("values")
        if values is not None:
            values = tuple(float(v) for v in values)
            for value in values:  # out-of-range thresholds fail here, named by the gate's config key
                build_gate(name, configs[name], **{param: value})
        curves[name] = CurveSpec(param, values)
    top_k = _int(section.top_k, "gates.top_k", 1)
    if top_k > int(cfg.data.top_n) and not cfg.data.candidates_path:
        raise ValueError(f"gates.top_k={top_k} asks for more contexts than the data.top_n={cfg.data.top_n} retrieved")
    if section.metric not in BINARY_METRICS:
        raise ValueError(f"gates.metric={section.metric!r} is not one of {BINARY_METRICS}")
    fraction = cfg.eval.dev_fraction
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction < 1:
        raise ValueError(f"eval.dev_fraction must be in (0, 1): the share of evaluation questions the gates are "
                         f"trained on; got {fraction!r}")
    return GateSettings(
        names=tuple(names), configs=configs, top_k=top_k, reranker=str(section.reranker), metric=str(section.metric),
        curves=curves, curve_points=_int(section.curve_points, "gates.curve_points", 2),
        timing_questions=_int(section.timing_questions, "gates.timing_questions", 1),
        draft_max_new_tokens=_int(section.draft_max_new_tokens, "gates.draft_max_new_tokens", 1),
        internal_max_new_tokens=_int(section.internal_max_new_tokens, "gates.internal_max_new_tokens", 1),
        batch_size=_int(section.batch_size, "gates.batch_size", 1),
        n_resamples=_int(section.n_resamples, "gates.n_resamples", 100))


# --- questions and contexts ------------------------------------------------------------------------

@dataclass
class QuestionSets:
    train: list[QARow]
    test: list[QARow]  # test questions with a conflicting version
    conflicts: dict[str, ConflictExample]  # test qid -> its conflicting gold paragraph
    report: dict[str, Any]


def question_sets(cfg: DictConfig, stage: RerankStage) -> QuestionSets:
    """The cbdr task's evaluation questions: its dev split trains the gates, its test split (where a
    conflicting version exists) evaluates them."""
    rows = evaluation_rows(cfg, stage.probe_data.data.rows)
    parts = split_dev_test(rows, float(cfg.eval.dev_fraction), cfg.seed)
    # Substitutes are drawn from every evaluation question (a larger pool of same-kind answers).
    conflict_set = build_conflicts(rows, cfg.seed)
    conflicts = {e.qid: e for e in conflict_set.examples}
    test = [r for r in parts["test"] if r.qid in conflicts]
    if not test:
        raise ValueError(f"none of the {len(parts['test'])} test questions has a conflicting version (skipped: "
                         f"{dict(conflict_set.skipped)}); raise eval.num_questions")
    report = {"evaluation_questions": len(rows), "train": len(parts["dev"]), "test_all": len(parts["test"]),
              "test": len(test), "conflicts_skipped": dict(conflict_set.skipped),
              "kinds": {k: sum(conflicts[r.qid].kind == k for r in test) for k in sorted({e.kind for e in conflicts.values()})}}
    return QuestionSets(parts["dev"], test, {r.qid: conflicts[r.qid] for r in test}, report)


def reranked(candidates: Sequence[Candidates], scorer: Scorer) -> list[Candidates]:
    """Each question's candidates in the reranker's order (ranked once; `run_rag` then keeps the order)."""
    out = []
    for c in candidates:
        order = rank_contexts(c.question, c.passages, scorer, where=f"question {c.qid!r}: ")
        out.append(make_candidates(c.qid, c.question, c.answers, [c.passages[i] for i in order],
                                   [c.scores[i] for i in order], c.gold_source))
    return out


def conflicting_candidates(ranked: Candidates, example: ConflictExample, k: int) -> Candidates:
    """The conflicting paragraph first, then the best K − 1 passages not split from the gold paragraph."""
    rest = [(p, s) for p, s, gold in zip(ranked.passages, ranked.scores, ranked.from_gold) if not gold][:k - 1]
    # The conflicting paragraph was placed, not retrieved: it has no retrieval score.
    return make_candidates(ranked.qid, ranked.question, ranked.answers, [example.passage, *(p for p, _ in rest)],
                           [math.nan, *(s for _, s in rest)], ranked.gold_source)


# --- signals ---------------------------------------------------------------------------------------

def text_encoder(stage: RerankStage) -> DenseRetriever:
    """The pipeline's MiniLM bi-encoder. Without a dense index (data.bi_encoder: false) it is loaded over
    a one-passage corpus: only its `encode` is used, and indexing the real corpus would cost minutes."""
    if isinstance(stage.retriever, DenseRetriever):
        return stage.retriever
    stub = corpus_from_nq([QARow("encoder", "encoder", ("encoder",), (Passage("encoder", "encoder"),))])
    return DenseRetriever(stub, progress=False, device="cpu")


@dataclass
class SignalMaker:
    """Computes gate signals for a set of questions; the LLM-bound ones through the cache."""

    llm: LoadedLLM
    templates: PromptTemplates
    probe: Any
    encoder: DenseRetriever
    settings: GateSettings
    cache_dir: str | None
    extract_batch_size: int
    progress: bool

    def without_cache(self) -> "SignalMaker":
        return dataclasses.replace(self, cache_dir=None, progress=False)

    def qa_prompts(self, questions: Sequence[str]) -> list[str]:
        return [self.templates.qa_prompt(self.llm.tokenizer, q) for q in questions]

    def confidence(self, questions: Sequence[str]) -> np.ndarray:
        return question_confidences(self.llm, self.templates, self.probe, questions, self.cache_dir,
                                    batch_size=self.extract_batch_size, progress=self.progress)

    def draft(self, questions: Sequence[str]):
        return cached_drafts(self.llm, self.qa_prompts(questions), self.cache_dir, self.settings.draft_max_new_tokens,
                             self.settings.batch_size, self.progress)

    def states(self, prompts: Sequence[str], layers: Sequence[int]) -> tuple[np.ndarray, tuple[int, ...]]:
        return cached_states(self.llm, prompts, layers, self.cache_dir, self.extract_batch_size, self.progress)

    def internal(self, questions: Sequence[str]) -> list[str]:
        return cached_internal_passages(self.llm, questions, self.cache_dir, self.settings.internal_max_new_tokens,
                                        self.settings.batch_size, self.progress)

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        return embed_texts(self.encoder, texts)

    def matching(self, questions: Sequence[str], responses: Sequence[str],
                 contexts: Sequence[Sequence[Any]]) -> np.ndarray:
        external, rest = external_knowledge(contexts)
        return bridge_matching_scores(self.encoder, self.internal(questions), responses, external, rest)


def ctrla_layers(gate: CtrlAGate, llm: LoadedLLM) -> tuple[int, ...]:
    """The gate's layers, or Layer/2 (the state the CBDR probe reads) when it leaves them to the direction."""
    return tuple(sorted(gate.layers)) if gate.layers else (llm.mid_layer,)


def question_signals(maker: SignalMaker, rows: Sequence[QARow], names: set[str], responses: Sequence[str],
                     layers: Sequence[int] = ()) -> GateSignals:
    """The signals in `names` that do not depend on the contexts (BRIDGE's matching scores do: `with_matching`)."""
    questions = [r.question for r in rows]
    fields: dict[str, Any] = {}
    if "confidence" in names:
        fields["confidence"] = maker.confidence(questions)
    if "draft" in names:
        fields["draft"] = maker.draft(questions)
    if "hidden_states" in names:
        fields["hidden_states"], fields["hidden_layers"] = maker.states(maker.qa_prompts(questions), layers)
    if "question_embedding" in names:
        fields["question_embedding"] = maker.embed(questions)
    if names & {"responses", "response_embedding", "matching_scores"}:
        fields["responses"] = list(responses)
    if "response_embedding" in names:
        fields["response_embedding"] = maker.embed(responses)
    return GateSignals(qids=[r.qid for r in rows], questions=questions, **fields)


def with_matching(maker: SignalMaker, signals: GateSignals, contexts: Sequence[Sequence[Any]]) -> GateSignals:
    return dataclasses.replace(signals, matching_scores=maker.matching(signals.questions, signals.responses, contexts))


def confidence_direction(maker: SignalMaker, gate: CtrlAGate, rows: Sequence[QARow]) -> ConfidenceDirection:
    """CtrlA's direction from the training questions' paired prompts (states cached)."""
    confident, unconfident = contrastive_prompts(maker.llm.tokenizer, [r.question for r in rows],
                                                 gate.confident_template, gate.unconfident_template)
    layers = ctrla_layers(gate, maker.llm)
    confident_states, layers = maker.states(confident, layers)
    unconfident_states, _ = maker.states(unconfident, layers)
    return direction_from_states(confident_states, unconfident_states, layers)


# --- timing ----------------------------------------------------------------------------------------

def measure_parts(maker: SignalMaker, cfg: DictConfig, stage: RerankStage, scorer: Scorer, rows: Sequence[QARow],
                  clean: Sequence[Candidates], parts: set[str], layers: Sequence[int]) -> dict[str, float]:
    """Seconds per question of each part, computed fresh (no cache) on `rows` with the run's batch sizes."""
    fresh = maker.without_cache()
    llm, k = maker.llm, maker.settings.top_k
    questions = [r.question for r in rows]
    qa_prompts = fresh.qa_prompts(questions)
    rag_prompts = [maker.templates.rag_prompt(llm.tokenizer, c.question, c.passages[:k]) for c in clean]
    generate = dict(max_new_tokens=int(cfg.rag.max_new_tokens), batch_size=int(cfg.rag.batch_size), progress=False)
    generate_greedy(llm.model, llm.tokenizer, qa_prompts[:1], max_new_tokens=1, progress=False)  # warm-up, untimed
    responses: list[str] = []

    def closed_book() -> None:
        responses.extend(generate_greedy(llm.model, llm.tokenizer, qa_prompts, **generate))

    def retrieve() -> None:
        reranked(question_candidates(cfg.data, rows, stage.corpus, stage.retriever)[0], scorer)

    steps = {
        "closed_book": closed_book,
        "rag_answer": lambda: generate_greedy(llm.model, llm.tokenizer, rag_prompts, **generate),
        "retrieve": retrieve,
        "qa_states": lambda: fresh.confidence(questions),
        "ctrla_states": lambda: fresh.states(qa_prompts, layers),
        "draft": lambda: fresh.draft(questions),
        "internal": lambda: fresh.internal(questions),
        "embed_question": lambda: fresh.embed(questions),
        "embed_response": lambda: fresh.embed(responses),
        "matching": lambda: bridge_matching_scores(maker.encoder, fresh.internal(questions), responses,
                                                   *external_knowledge([c.passages[:k] for c in clean])),
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


# --- running the gates -----------------------------------------------------------------------------

@dataclass
class Evaluation:
    sets: QuestionSets
    train_outcomes: list[QuestionOutcome]
    test_outcomes: dict[str, list[QuestionOutcome]]  # condition -> outcomes of the test questions
    contexts: dict[str, list[list[Any]]]  # condition -> the contexts of each test question's RAG prompt
    train_signals: GateSignals
    test_signals: dict[str, GateSignals]  # condition -> signals (only BRIDGE's differ)
    directions: dict[tuple, ConfidenceDirection]  # CtrlA's, by (layers, templates)
    timings: dict[str, float]  # part -> seconds per question
    store: AnswerStore
    maker: SignalMaker


def correct_of(outcomes: Sequence[QuestionOutcome], metric: str, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(closed-book correct, top-K RAG correct) per question."""
    return (np.array([bool(getattr(o.closed_book, metric)) for o in outcomes]),
            np.array([bool(getattr(o.rag[k], metric)) for o in outcomes]))


def ctrla_key(gate: CtrlAGate, llm: LoadedLLM) -> tuple:
    return ctrla_layers(gate, llm), gate.confident_template, gate.unconfident_template


def evaluate(cfg: DictConfig, settings: GateSettings, stage: RerankStage, gates: dict[str, Gate],
             llm: LoadedLLM) -> Evaluation:
    """Everything that runs the LLM before the gates decide: answers in both conditions (cached per
    prompt), the signals the configured gates read, CtrlA's directions, and the timed parts."""
    if settings.reranker not in stage.scorers:
        raise ValueError(f"gates.reranker={settings.reranker!r} is not a Table 1 row; rows: {list(stage.scorers)}")
    scorer, k = stage.scorers[settings.reranker], settings.top_k
    sets = question_sets(cfg, stage)
    candidates, retrieval = question_candidates(cfg.data, [*sets.train, *sets.test], stage.corpus, stage.retriever)
    ranked = reranked(candidates, scorer)
    clean_test = ranked[len(sets.train):]
    conflict_test = [conflicting_candidates(c, sets.conflicts[c.qid], k) for c in clean_test]
    sets.report.update(retrieval=retrieval, conflicting_contexts_with_a_gold_answer_elsewhere=float(np.mean(
        [any(c.has_answer[1:]) for c in conflict_test])))

    templates = PromptTemplates(**OmegaConf.to_container(cfg.prompts, resolve=True))
    progress = bool(cfg.data.progress)
    store = AnswerStore(llm, templates, cfg.paths.cache_dir, max_new_tokens=int(cfg.rag.max_new_tokens),
                        batch_size=int(cfg.rag.batch_size), chunk_size=int(cfg.rag.chunk_size), progress=progress)
    # The clean ranking is already the reranker's: run_rag without a reranker keeps it (same prompts as cbdr's).
    clean_run = run_rag([*sets.train, *sets.test], ranked, store, [k])
    conflict_run = run_rag(sets.test, conflict_test, store, [k])
    train_outcomes, clean_outcomes = clean_run.outcomes[:len(sets.train)], clean_run.outcomes[len(sets.train):]

    maker = SignalMaker(llm, templates, stage.probe, text_encoder(stage), settings, cfg.paths.cache_dir,
                        int(cfg.data.extract_batch_size), progress)
    needs = set().union(*(g.needs for g in gates.values()))
    train_needs = set().union(*(g.training_needs for g in gates.values()))
    ctrla = [g for g in gates.values() if isinstance(g, CtrlAGate)]
    layers = sorted({layer for g in ctrla for layer in ctrla_layers(g, llm)})
    train_signals = question_signals(maker, sets.train, train_needs, [o.closed_book.answer for o in train_outcomes])
    base = question_signals(maker, sets.test, needs - {"matching_scores"},
                            [o.closed_book.answer for o in clean_outcomes], layers)
    contexts = {CLEAN: [c.passages[:k] for c in clean_test], CONFLICTING: [c.passages for c in conflict_test]}
    test_signals = {condition: with_matching(maker, base, contexts[condition]) if "matching_scores" in needs else base
                    for condition in CONDITIONS}
    directions: dict[tuple, ConfidenceDirection] = {}
    for gate in ctrla:
        if ctrla_key(gate, llm) not in directions:
            directions[ctrla_key(gate, llm)] = confidence_direction(maker, gate, sets.train)
    parts = {"closed_book", "rag_answer", "retrieve"} | set(decision_parts(needs))
    timing_rows = sets.test[:settings.timing_questions]
    timings = measure_parts(maker, cfg, stage, scorer, timing_rows, clean_test[:len(timing_rows)], parts,
                            layers or (llm.mid_layer,))
    return Evaluation(sets, train_outcomes, {CLEAN: clean_outcomes, CONFLICTING: conflict_run.outcomes}, contexts,
                      train_signals, test_signals, directions, timings, store, maker)


def training_data(gate: Gate, evaluation: Evaluation, settings: GateSettings) -> GateTrainingData | None:
    """The training split's data for a gate that learns (None for one that does not): its signals, its
    cached outcomes (clean contexts), gold answers, and CtrlA's direction."""
    if not gate.training_needs:
        return None
    rows, signals = evaluation.sets.train, evaluation.train_signals
    closed_book, rag = correct_of(evaluation.train_outcomes, settings.metric, settings.top_k)
    answer_embedding = (evaluation.maker.embed([r.answers[0] for r in rows])
                        if "answer_embedding" in gate.training_needs else None)
    direction = (evaluation.directions[ctrla_key(gate, evaluation.maker.llm)]
                 if isinstance(gate, CtrlAGate) else None)
    return GateTrainingData(signals, closed_book_correct=closed_book, rag_correct=rag,
                            answers=[tuple(r.answers) for r in rows], answer_embedding=answer_embedding,
                            confidence_direction=direction, split="train")


def retrieval_correct(gate: Gate, evaluation: Evaluation, condition: str, settings: GateSettings) -> np.ndarray:
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
        items = [(signals.questions[i], answer_contexts("FA", internal[i], evaluation.contexts[condition][i]))
                 for i in full]
        for i, answer in zip(full, evaluation.store.answer(items)):
            correct[i] = bool(getattr(score_answer(answer, outcomes[i].answers), settings.metric))
    return correct


@dataclass
class GateResults:
    rows: list[GateRow]
    fits: dict[str, dict[str, Any]]  # gate -> split, questions and seconds of its fit
    decisions: dict[str, dict[str, list[str]]]  # condition -> gate -> decision per test question
    fitted: dict[str, Gate]


def run_gates(evaluation: Evaluation, settings: GateSettings, seed: int) -> GateResults:
    rows, fits, decisions, fitted = [], {}, {c: {} for c in CONDITIONS}, {}
    for name in settings.names:
        gate = build_gate(name, settings.configs[name])
        train = training_data(gate, evaluation, settings)
        start = time.perf_counter()
        gate.fit(train)
        fits[name] = {"split": None if train is None else train.split,
                      "qids": [] if train is None else list(train.signals.qids),
                      "seconds": time.perf_counter() - start}
        fitted[name] = gate
        for condition in CONDITIONS:
            signals = evaluation.test_signals[condition]
            start = time.perf_counter()
            decided = gate.decide(signals)
            decide_seconds = time.perf_counter() - start
            closed_book = correct_of(evaluation.test_outcomes[condition], settings.metric, settings.top_k)[0]
            correct = score_decisions(decided, closed_book, retrieval_correct(gate, evaluation, condition, settings))
            wall = wall_time_per_question(gate.needs, decided, evaluation.timings, decide_seconds)
            rows.append(gate_row(name, condition, decided, correct, gate.llm_forward_passes(decided), wall,
                                 settings.n_resamples, seed))
            decisions[condition][name] = [Decision(d).value for d in decided]
    return GateResults(rows, fits, decisions, fitted)


def threshold_curves(evaluation: Evaluation, settings: GateSettings, results: GateResults) -> list[CurvePoint]:
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
                gate = build_gate(name, settings.configs[name], **{spec.param: value}).fit(train)
                decided = gate.decide(signals)
                correct = score_decisions(decided, closed_book, rag)
                points.append(CurvePoint(name, condition, spec.param, float(value),
                                         float(np.mean([d is Decision.RETRIEVE for d in decided])),
                                         float(correct.mean())))
    return points


# --- report ----------------------------------------------------------------------------------------

def report_markdown(cfg: DictConfig, settings: GateSettings, evaluation: Evaluation, results: GateResults,
                    plot: Path, answers: dict[str, int], seconds: float) -> str:
    sets = evaluation.sets.report
    timing = ", ".join(f"{part} {1000 * s:.0f} ms" for part, s in sorted(evaluation.timings.items()))
    lines = [
        f"# Retrieval gates — {cfg.llm.name}", "",
        f"Run folder: `{Path(cfg.paths.output_dir).name}`; wall time {seconds:.0f} s; answers generated "
        f"{answers['generated']}, read from the cache {answers['reused']}.", "",
        f"Questions: {sets['evaluation_questions']} NQ questions the probe never saw (the cbdr task's evaluation "
        f"questions), split by question: the gates are trained on {sets['train']} (training split: cached "
        f"closed-book / RAG outcomes with clean contexts) and evaluated on the {sets['test']} of the other "
        f"{sets['test_all']} that have a conflicting version (skipped: {sets['conflicts_skipped'] or 'none'}).",
        f"Contexts: clean = top-{settings.top_k} of {cfg.data.retriever} top-{cfg.data.top_n} reranked by "
        f"{settings.reranker}; conflicting = the gold paragraph with its answer replaced by a same-kind answer of "
        f"another question (kinds: {sets['kinds']}), placed first, then the best {settings.top_k - 1} clean "
        f"passages not from the gold paragraph ({100 * sets['conflicting_contexts_with_a_gold_answer_elsewhere']:.0f} % "
        f"of them still hold a gold answer in another passage).", "",
        "Outcome per question: parametric → the closed-book answer, retrieve → the RAG answer (BRIDGE's FA: "
        "its internal passage and the contexts), refuse → a refusal (not correct). Accuracy on answered "
        "excludes refusals. LLM passes: `gate.llm_forward_passes` (prompt prefill + greedy decode each).", "",
        f"Wall time per question: a cost model over measured parts. Each part was timed fresh (no cache) on "
        f"{min(settings.timing_questions, sets['test'])} test questions ({timing}); a gate pays the parts its "
        "signals need, its own measured decide time, and per question the answer its decision implies "
        "(closed-book unless its signals already produced it, retrieval + RAG answer, or nothing for a refusal).",
        "",
    ]
    for condition in CONDITIONS:
        rows = [r for r in results.rows if r.contexts == condition]
        lines += [f"## {condition.capitalize()} contexts", "", gates_markdown(rows, settings.metric), ""]
    lines += ["## Accuracy against retrieval rate", "",
              f"Points: each gate as configured; lines: {', '.join(settings.curves) or 'none'} over their "
              "thresholds (cached answers only).", "", f"![gates]({plot.name})", "",
              "## Config", "", "```yaml", OmegaConf.to_yaml(cfg, resolve=True).rstrip(), "```", ""]
    return "\n".join(lines)


def log_results(loggers: list[Logger], metrics: dict[str, float], rows: list[GateRow], curves: list[CurvePoint],
                plot: Path) -> None:
    for logger in loggers:
        logger.log_metrics(metrics)
        logger.save()
        if not isinstance(logger, WandbLogger):
            continue
        for condition in CONDITIONS:
            table = [r.to_dict() for r in rows if r.contexts == condition]
            logger.log_table(f"gates_{condition}", columns=list(table[0]), data=[list(r.values()) for r in table])
        if curves:
            table = [c.to_dict() for c in curves]
            logger.log_table("gate_curves", columns=list(table[0]), data=[list(r.values()) for r in table])
        logger.log_image("gates", [str(plot)])


def run(cfg: DictConfig) -> dict[str, float]:
    from confrag.train import output_dir

    start = time.perf_counter()
    settings = check_settings(cfg)
    gates = {name: build_gate(name, settings.configs[name]) for name in settings.names}
    out = output_dir(cfg)
    run_config, loggers = task_loggers(cfg)
    stage = rerank_stage(cfg, out, loggers, run_config)
    llm = load_llm(OmegaConf.to_container(cfg.llm, resolve=True))
    evaluation = evaluate(cfg, settings, stage, gates, llm)
    results = run_gates(evaluation, settings, cfg.seed)
    curves = threshold_curves(evaluation, settings, results)
    answers = {"generated": evaluation.store.generated, "reused": evaluation.store.reused}
    evaluation.store = evaluation.maker = llm = None  # the LLM is not needed any more: free it before reporting
    gc.collect()
    plot = plot_gates(results.rows, curves, out / "gates.png",
                      f"{cfg.llm.name}: retrieval gates on NQ test ({settings.metric})")
    metrics = {f"{r.contexts}/{r.gate}/{key}": getattr(r, key) for r in results.rows
               for key in ("accuracy", "retrieval_rate", "refusal_rate", "llm_passes", "wall_s")}
    seconds = time.perf_counter() - start
    record = {
        "metrics": metrics, "table": [r.to_dict() for r in results.rows], "curves": [c.to_dict() for c in curves],
        "questions": {"train": [r.qid for r in evaluation.sets.train], "test": [r.qid for r in evaluation.sets.test]},
        "fits": results.fits, "decisions": results.decisions, "sets": evaluation.sets.report,
        "timings": evaluation.timings, "answers": answers,
        "gates": {name: settings.configs[name] for name in settings.names}, "wall_seconds": seconds}
    atomic_write_text(out / "metrics.json", json.dumps(record, indent=2, ensure_ascii=False, default=float))
    report = report_markdown(cfg, settings, evaluation, results, plot, answers, seconds)
    atomic_write_text(out / "gates.md", report)
    log_results(loggers, metrics, results.rows, curves, plot)
    tables = "\n\n".join(f"{c}:\n" + gates_markdown([r for r in results.rows if r.contexts == c], settings.metric)
                         for c in CONDITIONS)
    print(f"Gates report: {out / 'gates.md'}\n\n{tables}", flush=True)
    return metrics
