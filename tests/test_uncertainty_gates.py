"""The uncertainty baselines as gates (mean token entropy, max token probability, perplexity, P(True)):
their signals on the tiny llama with known logits, their rules, the AUROC / PRR of a retrieve score,
the cost counts, and the refusal of a signal the LLM cannot give."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import PreTrainedTokenizerFast

from confrag.gates import (
    AlwaysGate,
    Decision,
    DraftSignals,
    Gate,
    GateSignals,
    NeverGate,
    UnavailableSignalError,
)
from confrag.gates.cache import cached_drafts, cached_p_true
from confrag.gates.drafts import draft_token_signals
from confrag.gates.evaluation import (
    GateCosts,
    GateRow,
    RowReference,
    gate_row,
    gates_markdown,
    retrieve_auroc,
    retrieve_prr,
)
from confrag.gates.p_true import p_true_from_verdicts, p_true_prompts, verdict_probabilities, verdict_token_ids
from confrag.gates.signal_maker import check_llm_signals
from confrag.instantiators import run_context

from helpers.gates import SHIPPED_GATES, make_gate

R, P, X = Decision.RETRIEVE, Decision.PARAMETRIC, Decision.REFUSE
NEG = -1e4  # a logit whose probability underflows to 0 (and 0 * log p stays 0, unlike -inf)


def signals(n: int, **fields) -> GateSignals:
    return GateSignals(qids=[f"q{i}" for i in range(n)], questions=[f"question {i}" for i in range(n)], **fields)


def draft_of(rows) -> DraftSignals:
    """rows: per question, (entropies, log-probabilities, max probabilities) of its tokens."""
    return DraftSignals(
        texts=["x" * len(e) for e, _, _ in rows],
        tokens=[["x"] * len(e) for e, _, _ in rows],
        entropy=[np.array(e, dtype=float) for e, _, _ in rows],
        attention=[np.zeros(len(e)) for e, _, _ in rows],
        logprob=[np.array(lp, dtype=float) for _, lp, _ in rows],
        max_prob=[np.array(mp, dtype=float) for _, _, mp in rows],
    )


class FixedLogits:
    """Replaces the tiny llama's output logits at every position by one known vector (a forward hook on
    lm_head), so that every signal has a value computable by hand."""

    def __init__(self, llm, logits: dict[int, float]) -> None:
        vocab = llm.model.config.vocab_size
        self.vector = torch.full((vocab,), NEG)
        for token, value in logits.items():
            self.vector[token] = value
        self.model = llm.model

    def __enter__(self):
        def hook(module, inputs, output):
            return self.vector.to(output.dtype).expand(*output.shape[:-1], -1).clone()

        self.handle = self.model.lm_head.register_forward_hook(hook)
        return self

    def __exit__(self, *exc):
        self.handle.remove()


def word_level_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer that knows neither 'True' nor 'False': both are its unknown-word token."""
    model = Tokenizer(WordLevel({"[UNK]": 0, "yes": 1, "no": 2}, unk_token="[UNK]"))
    model.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=model, unk_token="[UNK]", pad_token="[UNK]")


# ------------------------------------------------------------------ signals with known logits


def test_draft_signals_from_known_logits(tiny_llama, templates):
    # Every step: p(Paris) = 2/3, p(London) = 1/3, the rest 0. Greedy picks " Paris" each time.
    paris = tiny_llama.tokenizer(" Paris", add_special_tokens=False)["input_ids"][0]
    london = tiny_llama.tokenizer(" London", add_special_tokens=False)["input_ids"][0]
    prompts = [templates.qa_prompt(tiny_llama.tokenizer, q) for q in ("capital of france", "why")]
    with FixedLogits(tiny_llama, {paris: math.log(2.0), london: 0.0}):
        out = draft_token_signals(tiny_llama, prompts, max_new_tokens=3, batch_size=2)
    expected_entropy = math.log(3) - 2 / 3 * math.log(2)
    for row in range(2):
        assert out.tokens[row] == [" Paris"] * 3
        np.testing.assert_allclose(out.entropy[row], [expected_entropy] * 3, rtol=1e-5)
        np.testing.assert_allclose(out.max_prob[row], [2 / 3] * 3, rtol=1e-5)
        np.testing.assert_allclose(out.logprob[row], [math.log(2 / 3)] * 3, rtol=1e-5)
    sig = signals(2, draft=out)
    np.testing.assert_allclose(make_gate("entropy").threshold_scores(sig), [expected_entropy] * 2, rtol=1e-5)
    np.testing.assert_allclose(make_gate("max_prob").threshold_scores(sig), [2 / 3] * 2, rtol=1e-5)
    np.testing.assert_allclose(make_gate("perplexity").threshold_scores(sig), [1.5] * 2, rtol=1e-5)
    # 0.6365 nats > 0.5 retrieves; max prob 2/3 >= 0.7 retrieves; perplexity 1.5 > 1.4 retrieves.
    assert make_gate("entropy", threshold=0.5).decide(sig) == [R, R] and make_gate("entropy", threshold=0.7).decide(
        sig
    ) == [P, P]
    assert make_gate("max_prob", threshold=0.7).decide(sig) == [R, R] and make_gate("max_prob", threshold=0.6).decide(
        sig
    ) == [P, P]
    assert make_gate("perplexity", threshold=1.4).decide(sig) == [R, R] and make_gate(
        "perplexity", threshold=1.6
    ).decide(sig) == [P, P]


def test_p_true_from_known_logits(tiny_llama, templates):
    ids = verdict_token_ids(tiny_llama.tokenizer)
    other = tiny_llama.tokenizer(" Paris", add_special_tokens=False)["input_ids"][0]
    assert other not in ids["True"] + ids["False"]
    # p(True) = 0.3, p(False) = 0.1, p(Paris) = 0.6: P(True) among the two verdicts = 0.75.
    logits = {ids["True"][0]: math.log(3.0), ids["False"][0]: 0.0, other: math.log(6.0)}
    prompts = p_true_prompts(tiny_llama.tokenizer, ["capital of france", "who wrote hamlet"], ["Paris", ""])
    assert "Proposed answer: Paris" in prompts[0] and prompts[0] != prompts[1]
    with FixedLogits(tiny_llama, logits):
        verdicts = verdict_probabilities(tiny_llama, prompts, batch_size=2)
    np.testing.assert_allclose(verdicts, [[0.3, 0.1], [0.3, 0.1]], rtol=1e-5)
    np.testing.assert_allclose(p_true_from_verdicts(verdicts), [0.75, 0.75], rtol=1e-5)
    assert make_gate("p_true", threshold=0.8).decide(signals(2, p_true=p_true_from_verdicts(verdicts))) == [R, R]


def test_p_true_batches_with_padding_like_one_at_a_time(tiny_llama):
    prompts = p_true_prompts(
        tiny_llama.tokenizer, ["who wrote hamlet", "what is the longest river in the world by length"], ["a", "b c d"]
    )
    together = verdict_probabilities(tiny_llama, prompts, batch_size=2)
    alone = np.concatenate([verdict_probabilities(tiny_llama, [p], batch_size=1) for p in prompts])
    np.testing.assert_allclose(together, alone, rtol=1e-4, atol=1e-8)


def test_p_true_and_drafts_are_cached(tiny_llama, templates, tmp_path, monkeypatch):
    questions, answers = ["who wrote hamlet", "why"], ["Shakespeare", "because"]
    first = cached_p_true(tiny_llama, questions, answers, tmp_path, batch_size=2)
    prompts = [templates.qa_prompt(tiny_llama.tokenizer, q) for q in questions]
    drafts = cached_drafts(tiny_llama, prompts, tmp_path, max_new_tokens=3, batch_size=2)

    def fail(*args, **kwargs):
        raise AssertionError("recomputed instead of read from the cache")

    monkeypatch.setattr("confrag.gates.cache.verdict_probabilities", fail)
    monkeypatch.setattr("confrag.gates.cache.draft_token_signals", fail)
    np.testing.assert_array_equal(cached_p_true(tiny_llama, questions, answers, tmp_path, batch_size=2), first)
    again = cached_drafts(tiny_llama, prompts, tmp_path, max_new_tokens=3, batch_size=2)
    for name in ("entropy", "logprob", "max_prob"):
        for a, b in zip(getattr(drafts, name), getattr(again, name)):
            np.testing.assert_array_equal(a, b)


# ------------------------------------------------------------------ the rules and their costs


def test_uncertainty_gates_on_hand_made_drafts():
    rows = [
        ([0.2, 0.4], [-0.1, -0.3], [0.9, 0.7]),  # sure: mean entropy 0.3, min max-prob 0.7, perplexity e^0.2
        ([2.0, 1.0], [-1.5, -0.5], [0.3, 0.6]),  # unsure: 1.5, 0.3, e^1.0
        ([], [], []),  # an empty draft has nothing to answer with: it retrieves
    ]
    sig = signals(3, draft=draft_of(rows))
    assert make_gate("entropy", threshold=1.0).decide(sig) == [P, R, R]
    assert make_gate("max_prob", threshold=0.5).decide(sig) == [P, R, R]
    assert make_gate("perplexity", threshold=2.0).decide(sig) == [P, R, R]
    np.testing.assert_allclose(make_gate("perplexity").threshold_scores(sig)[:2], [math.exp(0.2), math.e])
    # Retrieve scores are oriented so that higher retrieves sooner; the empty draft sits at the top.
    for gate in (make_gate("entropy"), make_gate("max_prob"), make_gate("perplexity")):
        scores = gate.retrieve_scores(sig)
        assert scores[0] < scores[1] < scores[2] == np.inf
    sig = signals(3, p_true=np.array([0.9, 0.5, 0.1]))
    assert make_gate("p_true", threshold=0.5).decide(sig) == [P, P, R]
    np.testing.assert_allclose(make_gate("p_true").retrieve_scores(sig), [-0.9, -0.5, -0.1])


def test_costs_of_the_uncertainty_gates_and_retriever_calls():
    # The draft is the closed-book answer; P(True) adds one forward over it.
    for gate in (make_gate("entropy"), make_gate("max_prob"), make_gate("perplexity")):
        assert gate.llm_forward_passes([P, R]).tolist() == [1, 2]
    assert make_gate("p_true").llm_forward_passes([P, R]).tolist() == [2, 3]
    assert make_gate("p_true").retriever_calls([P, R, R]).tolist() == [0, 1, 1]
    assert AlwaysGate().retriever_calls([R, R]).tolist() == [1, 1]
    assert NeverGate().retriever_calls([P, P]).tolist() == [0, 0]
    # BRIDGE matches the retrieved passages before it decides: every question costs a retriever call.
    assert make_gate("bridge", allocator="none").retriever_calls([P, R, X]).tolist() == [1, 1, 1]


@pytest.mark.parametrize(
    ("name", "config", "message"),
    [
        ("entropy", {"threshold": -0.1}, r"threshold must be a number >= 0.0; got -0.1"),
        ("max_prob", {"threshold": 1.5}, r"threshold must be a number in \[0.0, 1.0\]; got 1.5"),
        ("perplexity", {"threshold": 0.5}, r"threshold must be a number >= 1.0; got 0.5"),
        ("p_true", {"threshold": "high"}, "threshold must be a number"),
    ],
)
def test_uncertainty_gate_thresholds_are_checked(name, config, message):
    with pytest.raises(ValueError, match=rf"^gates\.configs\.{name}\.{message}"):
        make_gate(name, **config)


# ------------------------------------------------------------------ AUROC, PRR, the row


def test_auroc_and_prr_of_a_retrieve_score_by_hand():
    helped = np.array([True, False, False, True])
    scores = np.array([0.9, 0.1, 0.5, 0.3])
    # Pairs (helped, not helped): 0.9 > 0.1, 0.9 > 0.5, 0.3 > 0.1, 0.3 < 0.5 -> 3/4.
    assert retrieve_auroc(scores, helped) == pytest.approx(0.75)
    # Kept (lowest scores first) quality "did not need it": 1, 1/2, 2/3, 1/2 -> area 2/3; oracle
    # 1, 1, 2/3, 1/2 -> 19/24; random 1/2: PRR = (2/3 - 1/2) / (19/24 - 1/2) = 4/7.
    assert retrieve_prr(scores, helped) == pytest.approx(4 / 7)
    assert retrieve_auroc(-scores + 1, helped) == pytest.approx(0.25)
    assert retrieve_prr(helped.astype(float), helped) == pytest.approx(1.0)
    assert retrieve_auroc(helped.astype(float), helped) == pytest.approx(1.0)
    # A constant score (always / never retrieve) is chance, whatever the question order.
    assert retrieve_auroc(np.ones(4), helped) == 0.5 and retrieve_prr(np.ones(4), helped) == pytest.approx(0.0)
    assert retrieve_prr(np.ones(4), helped[::-1]) == pytest.approx(0.0)
    # Infinite scores (an empty draft) rank at the end; one class only: undefined.
    assert retrieve_auroc(np.array([np.inf, -np.inf, 2.0, 1.0]), helped) == pytest.approx(0.75)
    assert math.isnan(retrieve_auroc(scores, np.zeros(4, bool))) and math.isnan(retrieve_prr(scores, np.ones(4, bool)))
    with pytest.raises(ValueError, match="retrieve score of question 1 is NaN"):
        retrieve_auroc(np.array([0.1, np.nan, 0.2, 0.3]), helped)


def test_gate_row_scores_the_retrieve_decision_and_pairs_it_with_always_retrieve():
    closed_book = np.array([True, False, False, True, False])
    rag = np.array([True, True, False, False, True])
    helped = rag & ~closed_book  # questions 1 and 4
    gate = make_gate("cbdr", beta=0.5)
    sig = signals(5, confidence=np.array([0.9, 0.2, 0.6, 0.8, 0.4]))
    decided = gate.decide(sig)
    assert decided == [P, R, P, P, R]
    correct = np.where([d is R for d in decided], rag, closed_book)
    costs = GateCosts(gate.llm_forward_passes(decided), 0.1, gate.retriever_calls(decided))
    reference = RowReference(helped, rag, n_resamples=1000, seed=0)
    row = gate_row("cbdr", "clean", decided, correct, costs, gate.retrieve_scores(sig), reference)
    assert row.auroc == 1.0 and row.prr == pytest.approx(1.0) and row.helped == 2
    assert row.retriever_calls == pytest.approx(0.4) and row.llm_passes == pytest.approx(1.4)
    # The gate alone is right on question 3 (closed-book right, RAG wrong); always-retrieve alone on none.
    assert (row.only_gate, row.only_always) == (1, 0) and row.mcnemar_p == pytest.approx(1.0)
    table = gates_markdown([row], "has_answer")
    assert "| AUROC | PRR | LLM passes / q | Retriever calls / q |" in table
    assert "| 1.000 | 1.000 | 1.40 | 0.40 |" in table and "1 / 0, p = 1 |" in table
    undefined = GateRow(**{**row.to_dict(), "auroc": float("nan"), "prr": float("nan")})
    assert "| — | — |" in gates_markdown([undefined], "has_answer")


# ------------------------------------------------------------------ refusals


def test_p_true_is_refused_for_an_llm_that_cannot_give_it():
    tokenizer = word_level_tokenizer()
    with pytest.raises(UnavailableSignalError, match="signal p_true: .*cannot tell 'True' from 'False'"):
        verdict_token_ids(tokenizer)
    llm = SimpleNamespace(tokenizer=tokenizer, identity="word-level-llm")
    with pytest.raises(
        UnavailableSignalError, match="gate 'p_true' reads the signal p_true, which the LLM 'word-level-llm' cannot"
    ):
        check_llm_signals({"entropy": make_gate("entropy"), "p_true": make_gate("p_true")}, llm)
    check_llm_signals({"entropy": make_gate("entropy"), "cbdr": make_gate("cbdr")}, llm)  # the others are fine


@pytest.mark.task
def test_the_gates_task_refuses_an_unavailable_signal_before_any_stage_runs(tmp_path, monkeypatch):
    """From the LLM's tokenizer alone: before, the refusal came after the probe, NQ_Rerank and the rerankers."""
    import confrag.gates.signal_maker as signal_maker
    from confrag.tasks import gates as gates_task

    from helpers.runs import compose_cfg

    monkeypatch.setattr(signal_maker, "prompt_tokenizer", lambda cfg: (word_level_tokenizer(), 2048))

    def no_stage(*args, **kwargs):
        raise AssertionError("a stage ran before the gates' signals were checked")

    monkeypatch.setattr(gates_task, "rerank_stage", no_stage)
    monkeypatch.setattr(gates_task, "load_llm", no_stage)
    cfg = compose_cfg(["+experiment=gates_tiny_llama", "gates.names=[always,never,p_true]"], tmp_path)
    with pytest.raises(
        UnavailableSignalError, match="gate 'p_true' reads the signal p_true, which the LLM 'tiny_llama'"
    ):
        gates_task.run(cfg, gates_task.check(cfg), run_context(cfg))

    # A question set without gold paragraphs (its conflicting contexts are edited gold paragraphs): refused as early.
    monkeypatch.undo()
    monkeypatch.setattr(gates_task, "rerank_stage", no_stage)
    monkeypatch.setattr(gates_task, "load_llm", no_stage)
    path = tmp_path / "popqa.jsonl"
    # Enough questions for the question budget (checked first), none with a paragraph.
    path.write_text(
        "".join(
            f'{{"id": "p{i}", "question": "Who wrote part {i}?", "golden_answers": ["Someone"]}}\n' for i in range(120)
        )
    )
    cfg = compose_cfg(["+experiment=gates_tiny_llama", f"dataset.questions_path={path}"], tmp_path)
    with pytest.raises(ValueError, match=r"none of its \d+ questions has a gold paragraph .*the cbdr task runs"):
        gates_task.run(cfg, gates_task.check(cfg), run_context(cfg))


def test_a_gate_reading_a_signal_nothing_computes_is_refused_by_name(tiny_llama):
    class LogitLensGate(Gate):
        name = "logit_lens"
        needs = frozenset({"logit_lens"})

        def _decide(self, signals):
            return [Decision.RETRIEVE] * len(signals)

    with pytest.raises(UnavailableSignalError, match="gate 'mine' reads the signal.*logit_lens.*signals: confidence"):
        check_llm_signals({"mine": LogitLensGate()}, tiny_llama)
    with pytest.raises(UnavailableSignalError, match="gate 'logit_lens' reads the signal.*logit_lens"):
        LogitLensGate().decide(signals(2))
    check_llm_signals({name: make_gate(name) for name in SHIPPED_GATES}, tiny_llama)  # every shipped gate can run
