"""Retrieval gates: each decision rule on hand-made signals, the registry and config errors, missing
signals and training data, and the signal computations on the tiny models and MiniLM."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra.utils import instantiate

from confrag.data.nq import Passage, QARow
from confrag.gates import (
    GATES,
    AlwaysGate,
    CBDRGate,
    Decision,
    DraftSignals,
    GateSignals,
    GateTrainingData,
    MissingSignalError,
    MissingTrainingDataError,
    NeverGate,
    retrieval_helped,
)
from confrag.gates.bridge import answer_contexts, combine_scores, soft_bias_tree, trust_scores
from confrag.gates.ccsk import ccsk_rule, leave_one_out_siamese, response_features, rqm_targets, siamese_scores
from confrag.gates.ctrla import contrastive_prompts
from confrag.gates.directions import direction_from_states
from confrag.gates.drafts import draft_token_signals
from confrag.gates.dragin import is_content_token, rind_scores
from confrag.gates.signals import (
    SparseMatcher,
    bridge_matching_scores,
    contrastive_direction,
    embed_texts,
    external_knowledge,
)
from confrag.llm.hidden_states import naive_hidden_states
from confrag.llm.prompts import encode_prompts
from confrag.retrieval import DenseRetriever, corpus_from_gold_paragraphs

from helpers.gates import SHIPPED_GATES, make_gate, shipped_config

ROOT = Path(__file__).resolve().parents[1]
R, P, X = Decision.RETRIEVE, Decision.PARAMETRIC, Decision.REFUSE


def signals(n: int, **fields) -> GateSignals:
    return GateSignals(qids=[f"q{i}" for i in range(n)], questions=[f"question {i}" for i in range(n)], **fields)


def training(sig: GateSignals, closed_book, rag, **fields) -> GateTrainingData:
    return GateTrainingData(sig, np.asarray(closed_book, dtype=bool), np.asarray(rag, dtype=bool), **fields)


# ------------------------------------------------------------------ registry and configs


def test_every_shipped_config_builds_its_registered_gate_and_every_gate_has_a_config():
    # The registry fills itself as gate classes are defined: the project's own are exactly the shipped configs.
    assert sorted(name for name, cls in GATES.items() if cls.__module__.startswith("confrag.")) == SHIPPED_GATES
    for name in SHIPPED_GATES:
        gate = make_gate(name)
        assert type(gate) is GATES[name] and gate.name == name
    assert make_gate("cbdr", beta=0.5).beta == 0.5


def test_a_gate_id_taken_by_another_class_is_refused():
    with pytest.raises(ValueError, match="gate id 'cbdr' of .*Impostor is taken by confrag.gates.simple.CBDRGate"):

        class Impostor(CBDRGate):
            name = "cbdr"


@pytest.mark.parametrize("name", SHIPPED_GATES)
def test_every_gate_config_instantiates_with_its_values(name):
    # The yaml is where a gate's defaults live (the constructors take none: tests/test_settings_defaults.py);
    # each of its values reaches the gate's config, which its identity (cache keys) is built from.
    config = shipped_config(name)
    gate = instantiate(config)
    assert type(gate) is GATES[name]
    assert gate.config == {key: value for key, value in config.items() if key != "_target_"}


def test_gate_identity_changes_with_its_config():
    assert make_gate("cbdr", beta=0.9).identity() != make_gate("cbdr", beta=0.95).identity()


@pytest.mark.parametrize(
    ("name", "config", "message"),
    [
        ("cbdr", {"beta": 1.5}, r"beta must be a number in \[0, 1\].*got 1.5"),
        ("cbdr", {"beta": -0.1}, "beta must be a number in"),
        ("cbdr", {"beta": "high"}, "beta must be a number"),
        ("cbdr", {"beta": True}, "beta must be a number"),
        ("dragin", {"threshold": -1.0}, r"threshold must be a number >= 0.0; got -1.0"),
        ("ctrla", {"threshold": math.nan}, "threshold must be a finite number; got nan"),
        ("ctrla", {"layers": []}, "layers must be null"),
        ("ctrla", {"confident_template": "no placeholder"}, "confident_template must be a string containing"),
        ("skr_knn", {"k": 0}, "k must be an integer >= 1; got 0"),
        ("skr_knn", {"k": 2.5}, "k must be an integer"),
        ("skr_knn", {"threshold": 1.2}, r"threshold must be a number in \[0.0, 1.0\]; got 1.2"),
        ("ccsk", {"thresholds": {"pred": 1.5}}, r"thresholds.pred must be a number in \[0.0, 1.0\]; got 1.5"),
        ("ccsk", {"thresholds": {"conf": -0.1}}, r"thresholds.conf must be a number in \[0.0, 1.0\]; got -0.1"),
        ("ccsk", {"thresholds": {"single": 2}}, r"thresholds.single must be a number in \[0.0, 1.0\]; got 2"),
        (
            "ccsk",
            {"rqm": {"rouge_weight": 0, "cosine_weight": 0}},
            "rqm.rouge_weight \\+ rqm.cosine_weight must be > 0",
        ),
        ("ccsk", {"fusion": {"lr": 0}}, r"fusion.lr must be a number in"),
        ("ccsk", {"novelty_threshold": 1.5}, "novelty_threshold"),
        ("bridge", {"alpha": 2.5}, r"alpha must be a number in \[0.0, 2.0\]; got 2.5"),
        ("bridge", {"alpha": 0.8, "beta": 0.6}, "beta=0.6 must be >= alpha=0.8"),
        ("bridge", {"allocator": "grpo"}, r"allocator='grpo' is not one of \('classifier', 'none'\)"),
        ("bridge", {"dense_weight": 0, "sparse_weight": 0}, "dense_weight \\+ sparse_weight must be > 0"),
    ],
)
def test_out_of_range_parameters_name_the_config_key(name, config, message):
    """The constructor names its parameter; built from `gates.configs.<name>`, the user reads that node's key."""
    with pytest.raises(ValueError, match=rf"^gates\.configs\.{name}\.{message}"):
        make_gate(name, **config)


def test_signals_are_validated_on_construction():
    with pytest.raises(ValueError, match="signals.confidence has 2 rows for 3 questions"):
        signals(3, confidence=np.array([0.1, 0.2]))
    with pytest.raises(ValueError, match="probabilities in"):
        signals(2, confidence=np.array([0.1, 1.2]))
    with pytest.raises(ValueError, match="matching_scores must have shape"):
        signals(2, matching_scores=np.zeros((2, 4)))
    with pytest.raises(ValueError, match="hidden_layers must name"):
        signals(2, hidden_states=np.zeros((2, 2, 3)), hidden_layers=(1,))


def test_missing_signal_names_the_function_that_computes_it():
    with pytest.raises(MissingSignalError, match="gate 'cbdr' needs the signal.*confidence.*probe"):
        make_gate("cbdr").decide(signals(2))
    with pytest.raises(MissingSignalError, match="draft.*draft_token_signals"):
        make_gate("dragin").decide(signals(2))


# ------------------------------------------------------------------ bounds and CBDR


def test_always_and_never_are_the_two_bounds_and_their_cost():
    sig = signals(3)
    assert AlwaysGate().decide(sig) == [R, R, R]
    assert NeverGate().decide(sig) == [P, P, P]
    assert AlwaysGate().llm_forward_passes([R, R, R]).tolist() == [1, 1, 1]
    assert NeverGate().llm_forward_passes([P, P, P]).tolist() == [1, 1, 1]


def test_cbdr_retrieves_below_beta_and_beta_zero_means_always_retrieve():
    sig = signals(5, confidence=np.array([0.1, 0.5, 0.949, 0.95, 0.99]))
    assert make_gate("cbdr", beta=0.95).decide(sig) == [R, R, R, P, P]
    assert make_gate("cbdr", beta=0.5).decide(sig) == [R, P, P, P, P]
    assert make_gate("cbdr", beta=0.0).decide(sig) == [R] * 5  # "CBDR off", although no confidence is < 0
    # The QA prefill that gives H(Q) continues as the closed-book answer: 1 call, or 2 with retrieval.
    assert make_gate("cbdr").llm_forward_passes([R, P]).tolist() == [2, 1]


# ------------------------------------------------------------------ DRAGIN


def test_content_tokens_exclude_stopwords_and_punctuation():
    assert is_content_token(" Paris") and is_content_token("1994") and is_content_token(" capital")
    assert not is_content_token(" the") and not is_content_token(" is") and not is_content_token(".")
    assert not is_content_token("\n") and not is_content_token(" ")


def test_rind_is_entropy_times_normalized_attention_times_content():
    tokens = [" Paris", " is", " the", " capital", "."]
    entropy = np.array([0.5, 3.0, 3.0, 1.0, 5.0])
    attention = np.array([0.2, 0.1, 0.1, 0.1, 0.0])  # mean 0.1 -> normalized 2, 1, 1, 1, 0
    np.testing.assert_allclose(rind_scores(tokens, entropy, attention), [1.0, 0.0, 0.0, 1.0, 0.0])


def draft(rows, logprob=None, max_prob=None):
    """A draft of (tokens, entropies, attentions) rows; log-probabilities and max probabilities given per
    row, or zeros and ones (what DRAGIN does not read)."""
    return DraftSignals(
        texts=["".join(t) for t, _, _ in rows],
        tokens=[t for t, _, _ in rows],
        entropy=[np.array(e, dtype=float) for _, e, _ in rows],
        attention=[np.array(a, dtype=float) for _, _, a in rows],
        logprob=[np.array(v, dtype=float) for v in logprob or [np.zeros(len(t)) for t, _, _ in rows]],
        max_prob=[np.array(v, dtype=float) for v in max_prob or [np.ones(len(t)) for t, _, _ in rows]],
    )


def test_dragin_retrieves_when_a_content_token_exceeds_the_threshold():
    rows = [
        ([" Paris", " is", " the", " capital", "."], [0.5, 3.0, 3.0, 1.0, 5.0], [0.2, 0.1, 0.1, 0.1, 0.0]),  # max 1.0
        ([" the", " Eiffel"], [9.0, 0.8], [0.1, 0.3]),  # the uncertain stopword does not count; Eiffel: 0.8*1.5=1.2
        ([" Lyon", " the"], [2.0, 0.1], [0.3, 0.1]),  # Lyon: 2.0 * 1.5 = 3.0
        ([], [], []),  # nothing to judge, nothing to answer with
    ]
    sig = signals(4, draft=draft(rows))
    assert make_gate("dragin", threshold=1.4).decide(sig) == [P, P, R, R]
    assert make_gate("dragin", threshold=1.1).decide(sig) == [P, R, R, R]
    assert make_gate("dragin", threshold=0.9).decide(sig) == [R, R, R, R]
    assert make_gate("dragin").llm_forward_passes([P, R]).tolist() == [1, 2]  # the draft is the closed-book answer


def test_draft_signals_are_validated():
    with pytest.raises(ValueError, match="draft row 0: 2 tokens, 1 entropy, 2 attention"):
        draft([([" a", " b"], [1.0], [0.1, 0.2])])
    with pytest.raises(ValueError, match="draft row 0: draft.logprob holds a NaN"):
        draft([([" a"], [1.0], [0.1])], logprob=[[math.nan]])


@pytest.mark.heavy
def test_draft_token_signals_match_a_teacher_forced_forward(tiny_llama, templates):
    prompts = [
        templates.qa_prompt(tiny_llama.tokenizer, q)
        for q in ("who wrote hamlet", "what is the capital of the country with the longest name in the world", "why")
    ]
    out = draft_token_signals(tiny_llama, prompts, max_new_tokens=6, batch_size=2)  # a padded batch and a single
    assert tiny_llama.model.config._attn_implementation == "sdpa"  # switched back after the call
    assert len(out.texts) == len(out.tokens) == len(out.entropy) == len(out.attention) == len(prompts)
    model = tiny_llama.model
    model.set_attn_implementation("eager")
    try:
        for prompt_ids, text, tokens, entropy, attention, logprob, max_prob in zip(
            encode_prompts(tiny_llama.tokenizer, prompts),
            out.texts,
            out.tokens,
            out.entropy,
            out.attention,
            out.logprob,
            out.max_prob,
        ):
            length = len(tokens)
            assert 1 <= length <= 6 and len(entropy) == len(attention) == length
            with torch.inference_mode():
                generated = model.generate(torch.tensor([prompt_ids]), max_new_tokens=length, do_sample=False)[0]
                full = model(generated[None], output_attentions=True)
            start = len(prompt_ids)
            draft_ids = generated[start:].tolist()
            assert [tiny_llama.tokenizer.decode([t]) for t in draft_ids] == tokens
            assert tiny_llama.tokenizer.decode(draft_ids, skip_special_tokens=True).strip() == text
            logits = full.logits[0, start - 1 : start - 1 + length].float()
            expected_entropy = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1).numpy()
            np.testing.assert_allclose(entropy, expected_entropy, rtol=1e-4)
            # The greedy token's log-probability, and its distribution's highest probability (the same token).
            log_probs = logits.log_softmax(-1)
            np.testing.assert_allclose(logprob, log_probs[torch.arange(length), draft_ids].numpy(), rtol=1e-4)
            np.testing.assert_allclose(max_prob, log_probs.exp().amax(-1).numpy(), rtol=1e-4)
            np.testing.assert_allclose(np.exp(logprob), max_prob, rtol=1e-4)
            last_layer = full.attentions[-1][0][:, start : start + length, start : start + length]  # heads, query, key
            expected = np.array([last_layer[:, i:, i].amax(dim=1).mean().item() for i in range(length)])
            np.testing.assert_allclose(attention, expected, rtol=1e-4, atol=1e-7)
    finally:
        model.set_attn_implementation("sdpa")


def test_drafts_end_at_eos_within_a_batch(tiny_llama, templates):
    # The tiny model repeats one token per prompt: "\n" after the chat prompt, " by" after the raw one.
    # Declaring "\n" an end token ends the first draft at once while its batch-mate goes on.
    newline = tiny_llama.tokenizer.convert_tokens_to_ids("Ċ")
    prompts = [templates.qa_prompt(tiny_llama.tokenizer, "who wrote hamlet"), "Hamlet was written by"]
    config = tiny_llama.model.generation_config
    saved = config.eos_token_id
    config.eos_token_id = [saved, newline]
    try:
        out = draft_token_signals(tiny_llama, prompts, max_new_tokens=4, batch_size=2)
    finally:
        config.eos_token_id = saved
    assert out.texts[0] == "" and out.tokens[0] == [] and len(out.entropy[0]) == len(out.attention[0]) == 0
    assert out.tokens[1] == [" by"] * 4 and len(out.entropy[1]) == len(out.attention[1]) == 4
    assert make_gate("dragin").decide(signals(2, draft=out))[0] == R  # an empty draft retrieves


# ------------------------------------------------------------------ CtrlA


def synthetic_pairs(d=16, pairs=12, seed=0):
    rng = np.random.default_rng(seed)
    true = rng.standard_normal((2, d))
    true /= np.linalg.norm(true, axis=1, keepdims=True)
    base = rng.standard_normal((2, pairs, d))
    confident = base + 2.0 * true[:, None] + 0.1 * rng.standard_normal((2, pairs, d))
    unconfident = base - 2.0 * true[:, None] + 0.1 * rng.standard_normal((2, pairs, d))
    return true, confident, unconfident


def test_ctrla_direction_recovers_a_known_direction_with_confident_above():
    true, confident, unconfident = synthetic_pairs()
    direction = direction_from_states(confident, unconfident, layers=[3, 5])
    assert direction.layers == (3, 5)
    assert np.all(np.sum(direction.directions * true, axis=1) > 0.99)
    flipped = direction_from_states(unconfident, confident, layers=[3, 5])
    np.testing.assert_allclose(flipped.directions, -direction.directions, atol=1e-12)
    np.testing.assert_allclose(direction.centers, (confident.mean(1) + unconfident.mean(1)) / 2)


def test_ctrla_retrieves_when_the_projection_is_below_the_threshold():
    true, confident, unconfident = synthetic_pairs()
    direction = direction_from_states(confident, unconfident, layers=[3, 5])
    states = np.stack([direction.centers + 1.0 * true, direction.centers - 1.0 * true], axis=1)  # (2 layers, 2 q, d)
    sig = signals(2, hidden_states=states, hidden_layers=(3, 5))
    train = GateTrainingData(signals(1), confidence_direction=direction)
    assert make_gate("ctrla", threshold=0.0).fit(train).decide(sig) == [P, R]
    assert make_gate("ctrla", threshold=1.5).fit(train).decide(sig) == [R, R]
    assert make_gate("ctrla", threshold=-1.5).fit(train).decide(sig) == [P, P]
    with pytest.raises(ValueError, match=r"lack layer\(s\) \[5\]"):
        make_gate("ctrla").fit(train).decide(signals(2, hidden_states=states[:1], hidden_layers=(3,)))


def test_ctrla_needs_its_direction_and_checks_its_layers():
    sig = signals(1, hidden_states=np.zeros((1, 1, 4)), hidden_layers=(2,))
    with pytest.raises(MissingTrainingDataError, match="gate 'ctrla' is not trained"):
        make_gate("ctrla").decide(sig)
    with pytest.raises(MissingTrainingDataError, match="confidence_direction.*contrastive_direction"):
        make_gate("ctrla").fit(GateTrainingData(signals(1)))
    _, confident, unconfident = synthetic_pairs()
    direction = direction_from_states(confident, unconfident, layers=[3, 5])
    with pytest.raises(ValueError, match=r"^layers=\[4\] but the confidence direction was computed at layers \[3, 5\]"):
        make_gate("ctrla", layers=[4]).fit(GateTrainingData(signals(1), confidence_direction=direction))


def test_contrastive_direction_through_the_engine_on_tiny_llama(tiny_llama):
    questions = ["who wrote hamlet", "when did the war end", "what is the largest planet", "who painted the mona lisa"]
    ctrla = shipped_config("ctrla")
    confident, unconfident = contrastive_prompts(
        tiny_llama.tokenizer, questions, ctrla["confident_template"], ctrla["unconfident_template"]
    )
    assert "very confident" in confident[0] and "unconfident" in unconfident[0] and questions[0] in confident[0]
    direction = contrastive_direction(tiny_llama, [2, 1], confident, unconfident)
    assert direction.layers == (1, 2)
    # The same direction from the reference per-prompt forward (independent of the engine's shortcuts).
    ids_c = encode_prompts(tiny_llama.tokenizer, confident)
    ids_u = encode_prompts(tiny_llama.tokenizer, unconfident)
    naive_c = np.stack([naive_hidden_states(tiny_llama.model, ids, [1, 2]) for ids in ids_c], axis=1)
    naive_u = np.stack([naive_hidden_states(tiny_llama.model, ids, [1, 2]) for ids in ids_u], axis=1)
    reference = direction_from_states(naive_c, naive_u, [1, 2])
    np.testing.assert_allclose(direction.directions, reference.directions, atol=1e-4)
    assert direction.project(naive_c, [1, 2]).mean() > direction.project(naive_u, [1, 2]).mean()


# ------------------------------------------------------------------ SKR-kNN


def clusters(n_per=6, d=4, seed=0):
    """Cluster A around e0 (retrieval helped), cluster B around e1 (closed-book right)."""
    rng = np.random.default_rng(seed)
    a = np.eye(d)[0] + 0.05 * rng.standard_normal((n_per, d))
    b = np.eye(d)[1] + 0.05 * rng.standard_normal((n_per, d))
    closed_book = np.array([False] * n_per + [True] * n_per)
    rag = np.array([True] * n_per + [True] * n_per)
    return np.vstack([a, b]), closed_book, rag


def test_retrieval_helped_is_rag_right_and_closed_book_wrong():
    closed_book = np.array([False, True, False, True])
    rag = np.array([True, True, False, False])
    assert retrieval_helped(closed_book, rag).tolist() == [True, False, False, False]


def test_skr_knn_votes_among_the_nearest_training_questions():
    embeddings, closed_book, rag = clusters()
    gate = make_gate("skr_knn", k=3).fit(training(signals(12, question_embedding=embeddings), closed_book, rag))
    query = np.array([[1.0, 0.1, 0, 0], [0.1, 1.0, 0, 0]])
    assert gate.decide(signals(2, question_embedding=query)) == [R, P]
    assert gate.llm_forward_passes([R, P]).tolist() == [1, 1]  # no LLM call to decide


def test_skr_knn_tie_retrieves():
    embeddings = np.array([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]])
    train = training(signals(3, question_embedding=embeddings), [False, True, True], [True, True, True])
    gate = make_gate("skr_knn", k=2).fit(train)
    query = np.array([[1.0, 1.0]])  # equally close to the helped and the not-helped question
    np.testing.assert_allclose(gate.scores(signals(1, question_embedding=query)), [0.5])
    assert gate.decide(signals(1, question_embedding=query)) == [R]
    assert make_gate("skr_knn", k=2, threshold=0.6).fit(train).decide(signals(1, question_embedding=query)) == [P]


def test_gates_that_learn_refuse_to_run_without_training_data():
    sig = signals(2, question_embedding=np.eye(2))
    with pytest.raises(MissingTrainingDataError, match="gate 'skr_knn' is not trained"):
        make_gate("skr_knn").decide(sig)
    with pytest.raises(
        MissingTrainingDataError, match="needs training data and got none.*outcomes.*cached per-question outcomes"
    ):
        make_gate("skr_knn").fit(None)
    with pytest.raises(MissingTrainingDataError, match="cannot be trained without outcomes"):
        make_gate("skr_knn").fit(GateTrainingData(sig, closed_book_correct=np.array([True, False])))
    with pytest.raises(MissingTrainingDataError, match="question_embedding.*embed_texts"):
        make_gate("skr_knn").fit(training(signals(2), [True, False], [True, True]))
    with pytest.raises(MissingTrainingDataError, match="answers.*gold answers"):
        make_gate("ccsk").fit(
            training(
                signals(2, question_embedding=np.eye(2), responses=["a", "b"], response_embedding=np.eye(2)),
                [True, False],
                [True, True],
                answer_embedding=np.eye(2),
            )
        )
    with pytest.raises(ValueError, match="training split only; got split='test'"):
        make_gate("skr_knn").fit(GateTrainingData(sig, np.array([True, False]), np.array([True, True]), split="test"))
    with pytest.raises(ValueError, match="the training split holds no questions"):
        make_gate("skr_knn").fit(training(signals(0, question_embedding=np.zeros((0, 2))), [], []))
    with pytest.raises(ValueError, match="rag_correct must be a bool array"):
        GateTrainingData(sig, np.array([True, False]), np.array([1, 0]))


# ------------------------------------------------------------------ CCSK


def test_ccsk_three_threshold_rule():
    tau = dict(tau_pred=0.5, tau_conf=0.55, tau_single=0.6)
    f = np.array([[0.9, 0.8], [0.9, 0.1], [0.8, 0.1], [0.8, 0.1], [0.1, 0.9], [0.7, 0.2]])
    g = np.array([[0.6, 0.4], [0.2, 0.8], [0.52, 0.48], [0.52, 0.48], [0.5, 0.5], [0.5, 0.5]])
    g_w = np.array([[0.9, 0.1], [0.9, 0.1], [0.7, 0.3], [0.3, 0.7], [0.5, 0.5], [0.5, 0.5]])
    expected = [
        True,  # trusted (0.6 > 0.55) and g.F = 0.86 > 0.5
        False,  # trusted (0.8) and g.F = 0.26: no IR, although SN alone (0.9, largest g_w) would say yes
        True,  # not trusted: the g_w-heavier module (SN) says 0.8 > 0.6
        False,  # not trusted: the g_w-heavier module (RQM) says 0.1
        False,  # g_w tie picks SN: 0.1
        True,  # g_w tie picks SN: 0.7
    ]
    assert ccsk_rule(f, g, g_w, **tau).tolist() == expected
    # tau_conf below 0.5 always trusts the fusion: max(g) >= 0.5 for two normalized weights.
    assert (
        ccsk_rule(f, g, g_w, tau_pred=0.5, tau_conf=0.3, tau_single=0.6).tolist() == (np.sum(g * f, 1) > 0.5).tolist()
    )


def test_ccsk_siamese_network_defaults_to_retrieval_for_new_queries():
    history = np.array([[1.0, 0.0, 0.0], [0.9, 0.1, 0.0], [0.0, 1.0, 0.0], [0.1, 0.9, 0.0]])
    labels = np.array([1, 1, 0, 1])
    queries = np.array([[1.0, 0.05, 0.0], [0.05, 1.0, 0.0], [0.0, 0.0, 1.0]])
    np.testing.assert_allclose(siamese_scores(queries, history, labels, k=2, novelty_threshold=0.5), [1.0, 0.5, 1.0])
    np.testing.assert_allclose(siamese_scores(queries, history, labels, k=4, novelty_threshold=0.5), [0.75, 0.75, 1.0])
    # Leave-one-out: a training question does not see its own label.
    loo = leave_one_out_siamese(history, labels, k=1, novelty_threshold=0.5)
    np.testing.assert_allclose(loo, [1.0, 1.0, 1.0, 0.0])


def test_ccsk_response_quality_features_and_target():
    responses = ["the the cat", "Paris is the capital of France", "London", ""]
    emb = np.array([[1.0, 0.0], [0.0, 1.0], [0.0, 1.0], [1.0, 0.0]])
    question = np.array([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])
    x = response_features(responses, emb, question)
    np.testing.assert_allclose(x[:, 0], [3, 6, 1, 0])  # L
    np.testing.assert_allclose(x[:, 1], [2 / 3, 1.0, 1.0, 0.0])  # E = unique / L
    np.testing.assert_allclose(x[:, 2], [1.0, 0.0, 1.0, 1.0])  # cos(r, q)
    answers = [("cat",), ("Paris",), ("Paris",), ("Paris",)]
    answer_emb = np.array([[1.0, 0.0], [0.0, 1.0], [0.0, 1.0], [1.0, 0.0]])
    y = rqm_targets(responses, answers, emb, answer_emb, rouge_weight=0.3, cosine_weight=0.7)
    # "the the cat" vs "cat": tokens [cat] after normalization -> ROUGE-1 = 1; "Paris is ... France" -> 2/6 tokens
    rouge_paris = 2 * (1 / 5) * 1 / (1 / 5 + 1)
    np.testing.assert_allclose(y, [1.0, 0.3 * rouge_paris + 0.7, 0.0, 0.0])  # no word of the answer -> 0


def ccsk_data(n, seed, d=8):
    """Questions near e0 needed retrieval (their closed-book answers are long refusals), near e1 not."""
    rng = np.random.default_rng(seed)
    helped = np.arange(n) % 2 == 0
    q = np.where(helped[:, None], np.eye(d)[0], np.eye(d)[1]) + 0.2 * rng.standard_normal((n, d))
    r = np.where(helped[:, None], np.eye(d)[2], np.eye(d)[3]) + 0.2 * rng.standard_normal((n, d))
    responses = ["I am not sure, I do not know the answer" if h else "Paris" for h in helped]
    sig = signals(n, question_embedding=q, responses=responses, response_embedding=r)
    return sig, helped


def test_ccsk_trains_deterministically_and_learns_a_separable_case():
    sig, helped = ccsk_data(40, seed=0)
    train = training(sig, ~helped, helped, answers=[("Paris",)] * 40, answer_embedding=np.tile(np.eye(8)[3], (40, 1)))
    config = dict(fusion={"heads": 2, "hidden": 16, "epochs": 60}, rqm={"max_rounds": 40, "early_stopping": 10})
    gate = make_gate("ccsk", **config).fit(train)
    test, test_helped = ccsk_data(20, seed=1)
    decisions = gate.decide(test)
    assert decisions == make_gate("ccsk", **config).fit(train).decide(test)  # seeded
    f = gate.module_scores(test)
    g, g_w = gate.fusion_weights(test, f)
    np.testing.assert_allclose(g.sum(axis=1), 1.0, rtol=1e-5)
    np.testing.assert_allclose(g_w.sum(axis=1), 1.0, rtol=1e-5)
    assert decisions == [R if r else P for r in ccsk_rule(f, g, g_w, 0.4, 0.3, 0.3)]
    assert np.mean([(d == R) == h for d, h in zip(decisions, test_helped)]) >= 0.9
    assert gate.llm_forward_passes([R, P]).tolist() == [2, 1]


def test_ccsk_heads_must_divide_the_embedding_width():
    sig, helped = ccsk_data(12, seed=0)
    train = training(sig, ~helped, helped, answers=[("Paris",)] * 12, answer_embedding=np.tile(np.eye(8)[3], (12, 1)))
    with pytest.raises(ValueError, match="^heads=3 must divide the embedding width 8"):
        make_gate("ccsk", fusion={"heads": 3, "epochs": 1}, rqm={"max_rounds": 2}).fit(train)


# ------------------------------------------------------------------ BRIDGE


def test_bridge_tree_reaches_all_four_strategies():
    #            S1   S2   S3   S4     r_p
    cases = [
        ([0.8, 0.5, 0.5, 0.7], 0.5, "FA"),  # S1 + S4 = 1.5 > 1: consistent sources
        ([0.2, 0.9, 0.1, 0.2], 0.2, "FI"),  # T_Ret 0.04 < T_LLM 1.44 > alpha
        ([0.2, 0.1, 0.9, 0.2], 0.8, "FE"),  # T_Ret 1.44 >= beta, T_LLM 0.04
        ([0.2, 0.2, 0.8, 0.2], 0.1, "RA"),  # T_Ret 0.16 < T_LLM 0.36 <= alpha: neither source trusted
        ([0.2, 0.8, 0.2, 0.2], 0.9, "RA"),  # T_Ret 0.36 >= T_LLM 0.16 but T_Ret < alpha
        ([0.2, 0.3, 0.6, 0.2], 0.45, "RA"),  # T_Ret 0.585 in [alpha, beta): reflection band -> fallback RA
    ]
    s = np.array([c[0] for c in cases])
    r_p = np.array([c[1] for c in cases])
    t_ret, t_llm = trust_scores(s, r_p)
    np.testing.assert_allclose(t_ret[1:], [0.04, 1.44, 0.16, 0.36, 0.585])
    np.testing.assert_allclose(t_llm[1:], [1.44, 0.04, 0.36, 0.16, 0.385])
    assert soft_bias_tree(s, r_p, alpha=0.5, beta=1.1) == [c[2] for c in cases]
    # A lower beta turns the reflection band into FE.
    assert soft_bias_tree(s[-1:], r_p[-1:], alpha=0.5, beta=0.55) == ["FE"]


def matching(s):
    """(n, 4, 2) matching scores whose dense and sparse channels both equal S."""
    s = np.asarray(s, dtype=float)
    return np.stack([s, s], axis=-1)


def test_bridge_gate_maps_strategies_to_decisions_and_costs():
    s = [[0.8, 0.5, 0.5, 0.7], [0.1, 0.9, 0.1, 0.1], [0.1, 0.1, 0.9, 0.1], [0.1, 0.5, 0.5, 0.1]]
    # Without the allocator (r_p = g_p = 1): T_Ret = S3 + 1 - S2, T_LLM = S2 + 1 - S3.
    gate = make_gate("bridge", allocator="none", alpha=0.5, beta=1.1)
    sig = signals(4, matching_scores=matching(s))  # without the allocator the question is not read
    assert gate.strategies(sig) == ["FA", "FI", "FE", "RA"]  # the last: T_Ret = T_LLM = 1 in the reflection band
    decisions = gate.decide(sig)
    assert decisions == [R, P, R, X]
    # K_int and the closed-book answer K_gen decide; FI answers with K_gen, FA/FE add a RAG call, RA refuses.
    assert gate.llm_forward_passes(decisions).tolist() == [3, 2, 3, 2]


def test_bridge_matching_weights_combine_dense_and_sparse():
    scores = np.zeros((1, 4, 2))
    scores[0, :, 0] = [0.9, 0.6, 0.3, 0.0]  # dense
    scores[0, :, 1] = [0.0, 0.3, 0.6, 1.5]  # sparse (clipped to 1)
    np.testing.assert_allclose(combine_scores(scores, 0.4, 0.2), [[0.6, 0.5, 0.4, 1 / 3]])
    np.testing.assert_allclose(combine_scores(scores, 1.0, 0.0), [[0.9, 0.6, 0.3, 0.0]])


def test_bridge_allocator_learns_the_soft_bias_from_closed_book_outcomes():
    embeddings, closed_book, rag = clusters()
    gate = make_gate("bridge").fit(training(signals(12, question_embedding=embeddings), closed_book, rag))
    query = np.array([[1.0, 0.0, 0, 0], [0.0, 1.0, 0, 0]])  # like closed-book wrong / right questions
    sig = signals(2, question_embedding=query, matching_scores=matching([[0.2, 0.5, 0.5, 0.2]] * 2))
    r_p, g_p = gate.soft_bias(sig)
    assert r_p[0] > 0.5 > r_p[1] and np.all((r_p >= 0.1) & (r_p <= 0.9))
    np.testing.assert_allclose(r_p + g_p, 1.0)
    with pytest.raises(MissingTrainingDataError, match="gate 'bridge' is not trained"):
        make_gate("bridge").decide(sig)
    assert make_gate("bridge", allocator="none").fitted  # the ablation needs no training data


def test_bridge_answer_contexts_follow_the_strategy():
    retrieved = [Passage("A", "first"), Passage("B", "second")]
    assert answer_contexts("FA", "my evidence", retrieved) == [Passage("", "my evidence"), *retrieved]
    assert answer_contexts("FI", "my evidence", retrieved) == []
    assert answer_contexts("FE", "my evidence", retrieved) == retrieved
    assert answer_contexts("RA", "my evidence", retrieved) is None
    with pytest.raises(ValueError, match="strategy='XX' is not one of"):
        answer_contexts("XX", "", retrieved)


def test_sparse_matcher_is_a_bounded_lexical_match():
    matcher = SparseMatcher(["paris is the capital of france", "berlin is in germany", "the moon orbits earth"])
    a = ["paris is the capital of france", "paris france", "the of and", "berlin germany"]
    b = ["paris is the capital of france", "capital of france is paris", "the of and", "the moon orbits earth"]
    s = matcher.similarity(a, b)
    np.testing.assert_allclose(s[[0, 2, 3]], [1.0, 0.0, 0.0])  # identical; stopwords only; disjoint
    assert 0.5 < s[1] < 1.0


@pytest.fixture(scope="module")
def minilm():
    # The pipeline's dense retriever is the encoder; its corpus does not matter here.
    corpus = corpus_from_gold_paragraphs([QARow("q0", "a question", ("an answer",), (Passage("t", "a passage"),))])
    return DenseRetriever(corpus, progress=False, device="cpu")


def test_embeddings_and_bridge_matching_scores_with_minilm(minilm):
    questions = ["who wrote hamlet", "who is the author of hamlet", "what is the boiling point of water"]
    emb = embed_texts(minilm, questions)
    assert emb.shape == (3, 384)
    np.testing.assert_allclose(np.linalg.norm(emb, axis=1), 1.0, rtol=1e-5)
    assert emb[0] @ emb[1] > emb[0] @ emb[2]
    internal = ["William Shakespeare wrote the tragedy Hamlet around 1600."]
    generated = ["Shakespeare"]
    external, rest = external_knowledge(
        [
            [
                Passage("Hamlet", "Hamlet is a tragedy written by William Shakespeare."),
                Passage("Water", "Water boils at 100 degrees Celsius at sea level."),
            ]
        ]
    )
    assert external == ["Hamlet\nHamlet is a tragedy written by William Shakespeare."]
    scores = bridge_matching_scores(minilm, internal, generated, external, rest)
    assert scores.shape == (1, 4, 2) and np.all((scores >= 0) & (scores <= 1))
    # S1 (internal vs top passage, same fact) beats S3 (top passage vs an unrelated one) on both channels.
    assert np.all(scores[0, 0] > scores[0, 2])
    same = bridge_matching_scores(minilm, internal, internal, internal, internal)
    np.testing.assert_allclose(same[0], 1.0, rtol=1e-5)


# ---------------------------------------------------------------- the plot


def test_the_gates_plot_names_every_gate_with_its_own_colour_line_style_and_marker():
    """Ten colours for twelve gates drew two pairs alike, and only the points were in the legend: every gate is in
    the legend now, each with a colour + line style pair and a marker no other gate has, its curve drawn so."""
    from matplotlib.colors import to_hex

    from confrag.gates.evaluation import CurvePoint, GateRow, gates_figure

    assert len(SHIPPED_GATES) == 12
    rows = [
        GateRow(
            g, c, 40, 0.3 + i / 100, 0.2, 0.4, i / 12, 0.1 if g == "bridge" else 0.0, *[0.5] * 4, 0.7, 0.1, 3, 1, 2, 0.5
        )
        for i, g in enumerate(SHIPPED_GATES)
        for c in ("clean", "conflicting")
    ]
    curves = [
        CurvePoint(g, c, "threshold", t, t, 0.3 + t / 10)
        for g in SHIPPED_GATES
        if g not in ("always", "never")
        for c in ("clean", "conflicting")
        for t in (0.0, 0.5, 1.0)
    ]
    figure = gates_figure(rows, curves, "tiny")
    (legend,) = figure.legends
    labels = [t.get_text() for t in legend.get_texts()]
    assert [label.removesuffix(" (refuses)") for label in labels] == SHIPPED_GATES and "bridge (refuses)" in labels
    handles = {label.removesuffix(" (refuses)"): h for label, h in zip(labels, legend.legend_handles)}
    looks = {g: (to_hex(h.get_color()), h.get_linestyle(), h.get_marker()) for g, h in handles.items()}
    assert len({(colour, style) for colour, style, _ in looks.values() if style != "None"}) == 10  # the curved gates
    assert len({marker for *_, marker in looks.values()}) == 12
    assert len(set(looks.values())) == 12
    for axis in figure.axes:
        drawn = {line.get_gid(): line for line in axis.get_lines()}
        assert set(drawn) == set(SHIPPED_GATES) - {"always", "never"}
        for gate, line in drawn.items():  # each curve in its legend entry's colour and line style
            assert (to_hex(line.get_color()), line.get_linestyle()) == looks[gate][:2]
