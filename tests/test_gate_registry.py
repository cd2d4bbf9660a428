"""A new gate with a new signal, added the registered way and nothing else: the gate's class (its
module), its signal's entry (`register_signal`) and its config (a `_target_` node, as
`conf/gate/<name>.yaml`). Then the comparison's own code computes the signal, times its part, fits,
decides, scores and draws its curve, on tiny hand-made data (the tiny llama only generates the timed
answers). The "where to change what" entry of docs/architecture.md describes this test."""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import pytest
from omegaconf import DictConfig, OmegaConf

from confrag.data.nq import Passage, QARow
from confrag.gates import GATES, SIGNALS, Decision, Gate, GateSignals, Part, Signal, register_signal
from confrag.gates.evaluation import decision_parts, wall_time_per_question
from confrag.gates.settings import gate_settings
from confrag.gates.signal_maker import SignalMaker, check_llm_signals, question_signals
from confrag.infra import checks
from confrag.llm.prompted import PromptedLLM
from confrag.rag.answers import ScoredAnswer
from confrag.rag.pipeline import QuestionOutcome, RagAnswer
from confrag.rag.settings import AnswerSettings
from confrag.retrieval.candidates import make_candidates
from confrag.retrieval.corpus import CorpusPassage
from confrag.stages.gate_comparison import GateEvaluation
from confrag.stages.gate_questions import CLEAN, CONDITIONS, CONFLICTING, QuestionSets
from confrag.stages.gate_scoring import run_gates, threshold_curves
from confrag.stages.gate_timing import TimingRun, measure_parts

from helpers.gates import shipped_config
from helpers.settings import shipped_settings


# --- place 1: the gate's module ------------------------------------------------------------------
class QuestionLengthGate(Gate):
    """Retrieve for long questions: words per question above `threshold`."""

    name = "question_length"
    needs = frozenset({"question_words"})
    retrieves_below: ClassVar[bool] = False
    decision_passes = 0  # counting words costs no LLM call

    def __init__(self, threshold: float = 4.0) -> None:
        checks.number(threshold, "threshold", 0.0)
        super().__init__(threshold=threshold)
        self.threshold = float(threshold)

    def threshold_scores(self, signals: GateSignals) -> np.ndarray:
        return np.asarray(signals.question_words, dtype=np.float64)

    def _decide(self, signals: GateSignals) -> list[Decision]:
        return [
            Decision.RETRIEVE if s > self.threshold else Decision.PARAMETRIC for s in self.threshold_scores(signals)
        ]


# --- place 2: its signal's entry ------------------------------------------------------------------
def words(questions) -> np.ndarray:
    return np.array([len(q.split()) for q in questions], dtype=np.float64)


QUESTION_WORDS = Signal(
    "question_words",
    "words per question (tests/test_gate_registry.py: words)",
    lambda inputs: {"question_words": words(inputs.questions)},
    parts=(Part("count_words", lambda run: words(run.questions)),),
)

# --- place 3: its config (conf/gate/question_length.yaml would hold the same two keys) -------------
CONFIG = {"_target_": f"{QuestionLengthGate.__module__}.{QuestionLengthGate.__qualname__}", "threshold": 4.0}


def outcome(row: QARow, closed_book: bool, rag: bool) -> QuestionOutcome:
    def scored(cls, right, **extra):
        return cls(answer="Paris" if right else "Lyon", has_answer=right, em=right, f1=float(right), **extra)

    return QuestionOutcome(
        row.qid, row.question, row.answers, scored(ScoredAnswer, closed_book), {1: scored(RagAnswer, rag)}
    )


QUESTIONS = [
    "capital of france",  # 3 words
    "who wrote the play hamlet",  # 5
    "when did the second world war end",  # 7
    "tallest mountain",  # 2
    "what is the boiling point of water at sea level",  # 10
    "largest ocean",  # 2
]


def gates_node(configs: dict) -> DictConfig:
    """The run's `gates` node over `configs` (run in this order), the new gate's curve asked for."""
    return OmegaConf.create(
        {
            "names": list(configs),
            "configs": configs,
            "top_k": 1,
            "reranker": "bm25",
            "metric": "has_answer",
            "curves": {"question_length": {"param": "threshold", "values": None}},
            "curve_points": 3,
            "timing_questions": 2,
            "draft_max_new_tokens": 2,
            "internal_max_new_tokens": 2,
            "batch_size": 2,
            "n_resamples": 100,
        }
    )


@pytest.fixture
def registered():
    """The signal registered the way a module would at import (the registries are restored after the test)."""
    register_signal(QUESTION_WORDS)
    yield


def test_a_toy_gate_with_a_new_signal_runs_through_the_comparison(registered, tiny_llama, templates):
    assert GATES["question_length"] is QuestionLengthGate and SIGNALS["question_words"] is QUESTION_WORDS
    rows = [QARow(f"q{i}", q, ("Paris",), (Passage("Gold", "Paris"),)) for i, q in enumerate(QUESTIONS)]
    train, test = rows[:3], rows[3:]
    # The run's settings path: the `gates` node with the new gate's config beside a shipped one.
    section = gates_node({"always": shipped_config("always"), "question_length": CONFIG})
    settings = gate_settings(section, None, top_n=3, candidates_file=False)
    gates = {name: settings.build(name) for name in settings.names}
    check_llm_signals(gates, tiny_llama)  # the new signal is known, and needs nothing of the LLM
    needs = set().union(*(g.needs for g in gates.values()))

    # The signal, computed by the comparison's own code from the registry entry.
    train_signals = question_signals(None, train, needs, ["Paris"] * len(train))
    test_signals = question_signals(None, test, needs, ["Paris"] * len(test))
    np.testing.assert_array_equal(test_signals.question_words, [2, 10, 2])

    # Its part, timed by the comparison's timing with the answer paths.
    maker = SignalMaker(PromptedLLM(tiny_llama, templates), None, None, 2, 2, 2, None, 2, False)
    clean = [
        make_candidates(
            r.qid, r.question, r.answers, [CorpusPassage(f"{r.qid}#0", "Gold", "Paris", r.qid)], [1.0], r.qid
        )
        for r in test
    ]
    parts = {"closed_book", "rag_answer"} | set(decision_parts(needs))
    assert decision_parts(needs) == ["count_words"]
    answers = shipped_settings(AnswerSettings, "rag", max_new_tokens=2)
    timings = measure_parts(TimingRun(maker, None, None, test[:2], clean[:2], (), 1, answers), parts)
    assert set(timings) == {"closed_book", "rag_answer", "count_words"} and all(t >= 0 for t in timings.values())

    # Fit, decide, score and curve, as a run does.
    right = {"q0": (True, True), "q1": (False, True), "q2": (False, False), "q3": (True, True), "q4": (False, True)}
    outcomes = [outcome(r, *right.get(r.qid, (True, False))) for r in rows]
    evaluation = GateEvaluation(
        sets=QuestionSets(train, test, {}, {}),
        train_outcomes=outcomes[:3],
        test_outcomes={condition: outcomes[3:] for condition in CONDITIONS},
        contexts={condition: [c.passages[:1] for c in clean] for condition in (CLEAN, CONFLICTING)},
        train_signals=train_signals,
        test_signals={condition: test_signals for condition in CONDITIONS},
        extras={},
        timings={**timings, "retrieve": 0.5},
        store=None,
        maker=None,
    )
    results = run_gates(evaluation, settings, seed=0)
    rows_of = {(r.gate, r.contexts): r for r in results.rows}
    toy = rows_of[("question_length", CLEAN)]
    # q3 (2 words) and q5 (2 words) answered closed-book (right, right); q4 (10 words) retrieves (right).
    assert results.decisions[CLEAN]["question_length"] == ["parametric", "retrieve", "parametric"]
    assert toy.accuracy == 1.0 and toy.retrieval_rate == pytest.approx(1 / 3) and toy.llm_passes == pytest.approx(1.0)
    assert rows_of[("always", CLEAN)].accuracy == pytest.approx(2 / 3)  # q5 loses its answer with retrieval
    decided = [Decision(d) for d in results.decisions[CLEAN]["question_length"]]
    # The wall time pays the new part for every question, plus the answers the decisions imply.
    assert toy.wall_s >= wall_time_per_question({"question_words"}, decided, evaluation.timings, 0.0)
    assert toy.auroc == 1.0  # the one question retrieval helped (q4) has the highest score

    curves = threshold_curves(evaluation, settings, results)
    mine = [c for c in curves if c.gate == "question_length" and c.contexts == CLEAN]
    assert [c.value for c in mine] == [2.0, 10.0]  # the quantiles of its scores 2, 10, 2
    assert [c.retrieval_rate for c in mine] == pytest.approx([1 / 3, 0.0])
    assert [c.accuracy for c in mine] == pytest.approx([1.0, 2 / 3])


def test_a_signal_name_is_taken_once_and_cannot_shadow_the_signals_own_fields():
    with pytest.raises(ValueError, match="signal 'confidence' is already registered"):
        register_signal(Signal("confidence", "another confidence", lambda inputs: {}))
    with pytest.raises(ValueError, match="signal name 'qids' must be"):
        register_signal(Signal("qids", "question ids", lambda inputs: {}))
    with pytest.raises(ValueError, match="costs the part 'nowhere', which is not registered"):
        register_signal(Signal("lost", "a signal without its part", lambda inputs: {}, parts=("nowhere",)))
    assert "lost" not in SIGNALS


def test_a_users_gate_chosen_with_gate_equals_is_named_by_its_id(registered):
    """`gate=<name>` with a gate of the user's own: its rows, metrics and curves are keyed by `Gate.name`, not by
    the class name; a curve naming no gate is refused instead of silently dropped."""
    section = gates_node({"always": shipped_config("always"), "never": shipped_config("never")})
    settings = gate_settings(section, OmegaConf.create(CONFIG), top_n=3, candidates_file=False)
    assert settings.names == ("always", "never", "question_length") and "question_length" in settings.curves
    section.curves = {"question_lenght": {"param": "threshold", "values": None}}
    with pytest.raises(ValueError, match=r"gates\.curves\.question_lenght: no gate has the id"):
        gate_settings(section, OmegaConf.create(CONFIG), top_n=3, candidates_file=False)
    with pytest.raises(ValueError, match=r"gate\._target_='builtins\.dict' is not a Gate subclass"):
        gate_settings(section, OmegaConf.create({"_target_": "builtins.dict"}), top_n=3, candidates_file=False)
