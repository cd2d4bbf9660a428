"""CBDR: the gate's decision, its single prefill (the skip path equals plain generation), probe refusal,
and the β sweep arithmetic (Table 3, β choice, Figure 8, flips) on hand-computed outcomes."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
import torch

from confrag.cbdr import (
    ConfidenceGate,
    SweepData,
    check_betas,
    choose_beta,
    default_beta_grid,
    evaluate_gate,
    flip_analysis,
    flips_markdown,
    plot_beta_curve,
    question_confidences,
    report_beta,
    should_retrieve,
    sweep,
    table3_markdown,
)
from confrag.llm.generation import generate_greedy
from confrag.llm.hidden_states import HiddenStateEngine
from confrag.llm.loading import load_llm
from confrag.llm.prompted import PromptedLLM
from confrag.probe.module import ProbeMismatchError, SavedProbe
from confrag.rag.answers import ScoredAnswer
from confrag.rag.pipeline import QuestionOutcome, RagAnswer

from helpers.models import TINY_SHAPE, cpu_llm
from helpers.modules import probe_module

MAX_NEW = 10


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one intra-op thread


# The conftest tiny models, with weights initialised at std 0.02, greedily emit "\n" forever, which would make
# "the skip path's answer equals plain generation's" hold trivially; std 0.2 gives varied token sequences.
@pytest.fixture(scope="module", params=["llama", "qwen2"])
def varied(request):
    return load_llm(
        cpu_llm(
            name=f"varied_{request.param}",
            source="tiny",
            tiny=dict(arch=request.param, initializer_range=0.2, **TINY_SHAPE),
        )
    )


def activations(llm, templates, layer):
    return {"activations": {"llm": llm.identity, "prompts": templates.identity(llm.tokenizer), "layer": layer}}


def random_probe(llm, templates, layer=None, seed=0) -> SavedProbe:
    layer = llm.mid_layer if layer is None else layer
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        module = probe_module(input_dim=llm.model.config.hidden_size, layer=layer)
    return SavedProbe(module, activations(llm, templates, layer))


def constant_probe(llm, templates, confidence: float) -> SavedProbe:
    """A probe whose Conf is `confidence` for every state: zero weights, output bias [0, logit(conf)]."""
    probe = random_probe(llm, templates)
    with torch.no_grad():
        for parameter in probe.module.net.parameters():
            parameter.zero_()
        probe.module.net[-1].bias[1] = math.log(confidence / (1 - confidence))
    return probe


class ScriptedProbe(SavedProbe):
    """Returns the given confidences in turn (to mix the two paths in one batch)."""

    def __init__(self, base: SavedProbe, confidences):
        super().__init__(base.module, base.meta)
        self.script = iter(confidences)

    def confidence(self, hidden_states):
        return np.array([next(self.script)], dtype=np.float32)


def plain(llm, prompts, max_new=MAX_NEW):
    return generate_greedy(llm.model, llm.tokenizer, prompts, max_new, batch_size=1, progress=False)


def refuse_retrieval(question):
    raise AssertionError(f"the skip path must not retrieve (asked for {question!r})")


# ---------------------------------------------------------------- the gate


def test_skip_path_answer_equals_plain_generation(varied, templates, nq_rows):
    gate = ConfidenceGate(
        PromptedLLM(varied, templates),
        random_probe(varied, templates),
        beta=1e-6,
        retrieve_fn=refuse_retrieval,
        max_new_tokens=MAX_NEW,
        progress=False,
    )
    for row in nq_rows[:3]:
        answer, retrieved, confidence = gate.answer(row.question)
        assert not retrieved and 0 < confidence < 1
        assert answer == plain(varied, [templates.qa_prompt(varied.tokenizer, row.question)])[0]
        assert len(varied.tokenizer(answer)["input_ids"]) >= MAX_NEW - 2  # a real, non-empty generation


def test_skip_path_prefills_the_prompt_once(varied, templates, nq_rows):
    """One forward over the prompt, then one token per step: the KV cache of the decision pass is reused."""
    gate = ConfidenceGate(
        PromptedLLM(varied, templates),
        random_probe(varied, templates),
        beta=1e-6,
        retrieve_fn=refuse_retrieval,
        max_new_tokens=MAX_NEW,
        progress=False,
    )
    widths = []
    handle = varied.model.base_model.register_forward_pre_hook(
        lambda module, args, kwargs: widths.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    try:
        gate.answer(nq_rows[0].question)
    finally:
        handle.remove()
    prompt_len = len(
        varied.tokenizer(templates.qa_prompt(varied.tokenizer, nq_rows[0].question), add_special_tokens=False)[
            "input_ids"
        ]
    )
    assert widths == [prompt_len] + [1] * (MAX_NEW - 1)


@pytest.mark.parametrize("layer", ["embeddings", "mid", "final"])
def test_gate_state_and_confidence_equal_the_engine(varied, templates, nq_rows, layer):
    layer = {"embeddings": 0, "mid": varied.mid_layer, "final": varied.num_layers}[layer]
    probe = random_probe(varied, templates, layer=layer)
    gate = ConfidenceGate(
        PromptedLLM(varied, templates),
        probe,
        beta=0.0,
        retrieve_fn=lambda q: nq_rows[0].contexts,
        max_new_tokens=2,
        progress=False,
    )
    questions = [row.question for row in nq_rows[:3]]
    engine = HiddenStateEngine(varied.model, varied.tokenizer, progress=False)
    reference = engine.extract([templates.qa_prompt(varied.tokenizer, q) for q in questions], [layer])[0]
    for question, expected in zip(questions, reference):
        _, _, confidence = gate.answer(question)
        error = np.abs(gate.last_state - expected).max() / np.abs(expected).max()
        assert error <= 1e-5
        assert confidence == pytest.approx(float(probe.confidence(expected)[0]), abs=1e-6)
    batch = question_confidences(PromptedLLM(varied, templates), probe, questions, progress=False)
    np.testing.assert_allclose(batch, probe.confidence(reference), atol=1e-6)


def test_batch_confidences_are_cached(tiny_llama, templates, nq_rows, tmp_path, monkeypatch):
    probe = random_probe(tiny_llama, templates)
    questions = [row.question for row in nq_rows[:5]]
    first = question_confidences(
        PromptedLLM(tiny_llama, templates), probe, questions, cache_dir=tmp_path, shard_size=2, progress=False
    )
    monkeypatch.setattr(HiddenStateEngine, "extract", lambda *a, **k: pytest.fail("the cached states were recomputed"))
    again = question_confidences(
        PromptedLLM(tiny_llama, templates), probe, questions, cache_dir=tmp_path, shard_size=2, progress=False
    )
    np.testing.assert_array_equal(first, again)
    assert first.shape == (5,) and ((0 < first) & (first < 1)).all()


def test_retrieval_path_reranks_keeps_top_k_and_answers_with_the_rag_prompt(varied, templates, nq_rows):
    pool = [row.contexts[0] for row in nq_rows[:3]]
    asked = []

    def retrieve(question):
        asked.append(question)
        return pool

    reverse = lambda question, texts: np.arange(len(texts), dtype=float)  # noqa: E731 (last passage first)
    gate = ConfidenceGate(
        PromptedLLM(varied, templates),
        random_probe(varied, templates),
        beta=1.0,
        retrieve_fn=retrieve,
        rerank_fn=reverse,
        top_k=2,
        max_new_tokens=MAX_NEW,
        progress=False,
    )
    question = nq_rows[5].question
    answer, retrieved, confidence = gate.answer(question)
    assert retrieved and confidence < 1.0 and asked == [question]
    assert answer == plain(varied, [templates.rag_prompt(varied.tokenizer, question, [pool[2], pool[1]])])[0]


def test_decision_rule_and_beta_zero_always_retrieves(tiny_llama, templates, nq_rows):
    assert should_retrieve([0.0, 0.3, 0.999999], 0.0).all()  # β = 0: CBDR off
    assert should_retrieve([0.49, 0.5, 0.51], 0.5).tolist() == [True, False, False]  # skip iff Conf ≥ β
    assert should_retrieve(1.0, 1.0).item() is False
    context = [nq_rows[0].contexts[0]]
    question = nq_rows[0].question
    half = constant_probe(tiny_llama, templates, 0.5)  # softmax([0, 0]) = exactly 0.5
    for beta, retrieved in ((0.5, False), (0.51, True), (0.0, True), (0.01, False)):
        gate = ConfidenceGate(
            PromptedLLM(tiny_llama, templates),
            half,
            beta=beta,
            retrieve_fn=lambda q: context,
            max_new_tokens=3,
            progress=False,
        )
        result = gate.answer(question)
        assert result.confidence == 0.5 and result.retrieved is retrieved, beta
    sure = constant_probe(tiny_llama, templates, 0.999)
    off = ConfidenceGate(
        PromptedLLM(tiny_llama, templates),
        sure,
        beta=0.0,
        retrieve_fn=lambda q: context,
        max_new_tokens=3,
        progress=False,
    )
    assert off.answer(question).retrieved


def test_answer_batch_mixes_paths_and_is_scored(varied, templates, nq_rows):
    rows = nq_rows[:4]
    probe = ScriptedProbe(random_probe(varied, templates), [0.9, 0.2, 0.8, 0.1])
    gate = ConfidenceGate(
        PromptedLLM(varied, templates),
        probe,
        beta=0.5,
        retrieve_fn=lambda q: [rows[0].contexts[0]],
        top_k=1,
        max_new_tokens=MAX_NEW,
        progress=False,
    )
    report = evaluate_gate(gate, [row.question for row in rows], [row.answers for row in rows])
    records = report["records"]
    assert [r["retrieved"] for r in records] == [False, True, False, True]
    assert report["retrieval_rate"] == 0.5 and report["n"] == 4
    assert [r["confidence"] for r in records] == pytest.approx([0.9, 0.2, 0.8, 0.1])
    tok = varied.tokenizer
    assert records[0]["answer"] == plain(varied, [templates.qa_prompt(tok, rows[0].question)])[0]
    assert (
        records[1]["answer"] == plain(varied, [templates.rag_prompt(tok, rows[1].question, [rows[0].contexts[0]])])[0]
    )
    assert report["accuracy"] == sum(r["has_answer"] for r in records) / 4


def test_gate_refuses_bad_input(tiny_llama, tiny_qwen2, templates, nq_rows, caplog):
    probe = random_probe(tiny_llama, templates)
    context = lambda q: [nq_rows[0].contexts[0]]  # noqa: E731
    for beta in (-0.01, 1.5, float("nan"), True, "0.9"):
        with pytest.raises(ValueError, match=r"^beta must be a number in \[0, 1\]"):
            ConfidenceGate(PromptedLLM(tiny_llama, templates), probe, beta=beta, retrieve_fn=context)
    with pytest.raises(ProbeMismatchError, match="llm: trained on"):
        ConfidenceGate(PromptedLLM(tiny_qwen2, templates), probe, beta=0.5, retrieve_fn=context)  # another model
    with pytest.raises(ProbeMismatchError, match="layer: trained on 2, asked for 3"):
        ConfidenceGate(PromptedLLM(tiny_llama, templates), probe, beta=0.5, retrieve_fn=context, layer=3)
    other_template = type(templates)(**{**templates.__dict__, "qa": "Answer: {question}"})
    with pytest.raises(ProbeMismatchError, match="prompts: trained on"):
        ConfidenceGate(PromptedLLM(tiny_llama, other_template), probe, beta=0.5, retrieve_fn=context)
    with pytest.raises(ValueError, match="^top_k must be an integer >= 1"):
        ConfidenceGate(PromptedLLM(tiny_llama, templates), probe, beta=0.5, retrieve_fn=context, top_k=0)
    nothing = ConfidenceGate(
        PromptedLLM(tiny_llama, templates), probe, beta=1.0, retrieve_fn=lambda q: [], max_new_tokens=2
    )
    with pytest.raises(ValueError, match="retrieval returned no context for question 'who is it'"):
        nothing.answer("who is it")
    capped = ConfidenceGate(
        PromptedLLM(tiny_llama, templates),
        probe,
        beta=1.0,
        retrieve_fn=context,
        top_k=3,
        max_new_tokens=2,
        progress=False,
    )
    with caplog.at_level(logging.WARNING):
        assert capped.answer("who is it").retrieved
    assert "top_k=3 but only 1 contexts were retrieved" in caplog.text


@pytest.mark.heavy
def test_smollm2_skip_path_equals_plain_generation(smollm2, templates, nq_rows):
    """A real chat model on real questions: the answers end at EOS before the limit, as plain generation's do."""
    gate = ConfidenceGate(
        PromptedLLM(smollm2, templates),
        random_probe(smollm2, templates),
        beta=1e-6,
        retrieve_fn=refuse_retrieval,
        max_new_tokens=32,
        progress=False,
    )
    for row in nq_rows[:3]:
        answer, retrieved, _ = gate.answer(row.question)
        assert not retrieved
        assert answer == plain(smollm2, [templates.qa_prompt(smollm2.tokenizer, row.question)], 32)[0]
        assert 5 < len(smollm2.tokenizer(answer, add_special_tokens=False)["input_ids"]) < 31


# ---------------------------------------------------------------- the β sweep

# Five questions, worked out by hand below.
CONF = [0.95, 0.99, 0.50, 0.97, 0.20]
CLOSED = [1, 1, 0, 0, 0]
RAG1 = [0, 1, 1, 1, 0]
RAG3 = [1, 0, 1, 1, 1]


def outcomes(conf=CONF, closed=CLOSED, rag1=RAG1, rag3=RAG3, prefix="q"):
    out = []
    for i, c in enumerate(conf):
        rag = {
            1: RagAnswer(f"rag1 answer {i}", bool(rag1[i]), False, 0.0, ("p",)),
            3: RagAnswer(f"rag3 answer {i}", bool(rag3[i]), False, 0.0, ("p", "p2", "p3")),
        }
        out.append(
            QuestionOutcome(
                f"{prefix}{i}",
                f"question {i}",
                (f"gold {i}",),
                ScoredAnswer(f"closed answer {i}", bool(closed[i]), False, 0.0),
                rag,
                c,
            )
        )
    return out


def test_sweep_matches_hand_computed_values():
    data = SweepData.from_outcomes(outcomes())
    result = sweep(data, [0.0, 0.01, 0.5, 0.96, 0.98, 1.0])
    # β=0 always retrieves; 0.01 never (no Conf below it); 0.5 retrieves q4 only (Conf 0.5 is not < 0.5);
    # 0.96: q0, q2, q4; 0.98: all but q1; 1.0: all.
    np.testing.assert_allclose(result.retrieval_rate, [1.0, 0.0, 0.2, 0.6, 0.8, 1.0])
    np.testing.assert_allclose(result.accuracy[1], [0.6, 0.4, 0.4, 0.4, 0.6, 0.6])
    np.testing.assert_allclose(result.accuracy[3], [0.8, 0.4, 0.6, 0.8, 1.0, 0.8])
    assert result.rows()[4] == {"beta": 0.98, "retrieval_rate": 0.8, "top1": 0.6, "top3": 1.0}


def test_beta_zero_equals_always_retrieve_and_the_sweep_equals_a_loop():
    rng = np.random.default_rng(0)
    n = 200
    conf = np.round(rng.random(n), 2)  # rounded so that many confidences sit exactly on grid values
    closed, rag1, rag3 = (rng.integers(0, 2, n) for _ in range(3))
    data = SweepData.from_outcomes(outcomes(conf, closed, rag1, rag3))
    grid = default_beta_grid()
    result = sweep(data, grid)
    assert result.accuracy[1][0] == rag1.mean() and result.accuracy[3][0] == rag3.mean()
    assert result.retrieval_rate[0] == 1.0
    for i, beta in enumerate(grid):
        retrieve = [beta == 0 or c < beta for c in conf]
        for k, rag in ((1, rag1), (3, rag3)):
            assert result.accuracy[k][i] == np.mean([r if ret else c for r, c, ret in zip(rag, closed, retrieve)])
        assert result.retrieval_rate[i] == np.mean(retrieve)


def test_default_grid_and_bad_betas():
    grid = default_beta_grid()
    assert grid[0] == 0.0 and grid[-1] == 1.0 and len(grid) == 29
    assert np.allclose(np.diff(grid[grid >= 0.9]), 0.01) and np.allclose(np.diff(grid[grid <= 0.9]), 0.05)
    for bad in ([0.5, 1.01], [-0.1], []):
        with pytest.raises(ValueError, match=r"^betas must"):
            check_betas(bad)
    with pytest.raises(ValueError, match=r"^beta must be a number in \[0, 1\]"):
        SweepData.from_outcomes(outcomes()).correct(3, 2.0)


def test_choose_beta_on_dev_for_accuracy_or_budget_and_report_on_test():
    dev = SweepData.from_outcomes(outcomes())
    grid = [0.0, 0.01, 0.5, 0.96, 0.98, 1.0]
    best3 = choose_beta(dev, 3, betas=grid)
    assert (best3.beta, best3.dev_accuracy, best3.dev_retrieval_rate) == (0.98, 1.0, 0.8)
    # Top-1: 0.6 at β 0, 0.98 and 1.0; the tie goes to the lowest retrieval rate (0.98: 80 %).
    assert choose_beta(dev, 1, betas=grid).beta == 0.98
    assert choose_beta(dev, 3, objective="budget", budget=0.6, betas=grid).beta == 0.96  # 0.8 at RR 0.6
    assert choose_beta(dev, 3, objective="budget", budget=0.1, betas=grid).beta == 0.01
    with pytest.raises(ValueError, match=r"cbdr.retrieval_budget=0.5; the lowest reachable is 0.800"):
        choose_beta(dev, 3, objective="budget", budget=0.5, betas=[0.0, 0.98, 1.0])
    with pytest.raises(ValueError, match="^objective=budget needs budget"):
        choose_beta(dev, 3, objective="budget")
    with pytest.raises(ValueError, match="^objective='speed' is not one of"):
        choose_beta(dev, 3, objective="speed")
    # Test split: the same questions with flipped closed-book outcomes.
    test = SweepData.from_outcomes(outcomes(closed=[0, 0, 1, 1, 1], prefix="t"))
    report = report_beta(dev, test, 3, betas=grid)
    # At β=0.98 test retrieves q0, q2, q3, q4 (RAG3 1, 1, 1, 1) and answers q1 closed-book (0): 0.8.
    assert report["beta"] == 0.98 and report["test/accuracy"] == 0.8 and report["test/retrieval_rate"] == 0.8
    assert report["test/always_retrieve_accuracy"] == 0.8 and report["test/n"] == 5


def test_flip_analysis_counts_and_examples():
    data = SweepData.from_outcomes(outcomes())
    up = flip_analysis(data, 3, 0.96, 0.98)
    assert (up.turned_right, up.turned_wrong) == (1, 0)  # q3 starts retrieving and RAG3 gets it right
    assert up.examples_right[0] == {
        "qid": "q3",
        "question": "question 3",
        "gold": ["gold 3"],
        "confidence": 0.97,
        "retrieved_a": False,
        "retrieved_b": True,
        "answer_a": "closed answer 3",
        "answer_b": "rag3 answer 3",
    }
    top = flip_analysis(data, 3, 0.98, 1.0)
    assert (top.turned_right, top.turned_wrong) == (0, 1) and top.examples_wrong[0]["qid"] == "q1"
    wide = flip_analysis(data, 1, 0.5, 0.98)
    assert (wide.turned_right, wide.turned_wrong) == (2, 1)
    assert [e["qid"] for e in wide.examples_right] == ["q3", "q2"]  # most confident first
    assert [e["qid"] for e in wide.examples_wrong] == ["q0"]
    # Flips are the difference of the two accuracies, counted.
    result = sweep(data, [0.5, 0.98], [1])
    assert (wide.turned_right - wide.turned_wrong) / 5 == pytest.approx(result.accuracy[1][1] - result.accuracy[1][0])
    text = flips_markdown(wide)
    assert text.startswith("β 0.5 → 0.98 (Top-1): 2 answers turned right, 1 turned wrong")
    assert "| question 3 | gold 3 | 0.970 | [closed] closed answer 3 | [RAG] rag1 answer 3 |" in text


def test_table3_and_beta_curve(tmp_path):
    base = SweepData.from_outcomes(outcomes(rag3=[0, 0, 1, 1, 1]))
    tuned = SweepData.from_outcomes(outcomes())
    table = table3_markdown([("bge-base", base, 0.0), ("bge-ft", tuned, 0.0), ("bge-ft", tuned, 0.98)])
    lines = table.splitlines()
    assert lines[0] == "| Reranker | NQ Top-1 | NQ Top-3 | β | RR (%) ↓ |"
    assert lines[2] == "| bge-base | 60.00 | 60.00 | 0 | 100.00 |"
    assert lines[3] == "| bge-ft | 60.00 | 80.00 | 0 | 100.00 |"
    assert lines[4] == "| bge-ft | 60.00 | 100.00 | 0.98 | 80.00 |"
    png = plot_beta_curve(sweep(tuned), tmp_path / "beta_curve.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    with pytest.raises(ValueError, match="no β of the sweep lies in"):
        plot_beta_curve(sweep(tuned, [0.1, 0.2]), tmp_path / "empty.png")
    with pytest.raises(ValueError, match="outcomes without a confidence"):
        SweepData.from_outcomes([QuestionOutcome("x", "q", ("a",), ScoredAnswer("", False, False, 0.0), {}, None)])
