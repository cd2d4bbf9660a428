"""The built-in gate signals, one `register_signal` entry each (see `confrag.gates.registry`).

Producers and timed parts are written against the comparison's inputs (`signal_maker.SignalInputs`, the
timing run of `confrag.stages.gate_timing`) by attribute, so this table imports no LLM code but P(True)'s
tokenizer check."""

from __future__ import annotations

from typing import Any

import numpy as np

from confrag.gates.p_true import verdict_token_ids
from confrag.gates.registry import Part, Signal, one_row_each, register_signal


def probabilities(name: str) -> Any:
    rows = one_row_each(name)

    def check(value: Any, signals: Any) -> np.ndarray:
        value = np.asarray(rows(value, signals), dtype=np.float64)
        inside = (value >= 0) & (value <= 1)  # NaN fails too
        if not np.all(inside):
            bad = int(np.flatnonzero(~inside)[0])
            raise ValueError(
                f"signals.{name} must hold probabilities in [0, 1]; question {bad} "
                f"({signals.qids[bad]!r}) has {value[bad]!r}"
            )
        return value

    return check


def _draft(value: Any, signals: Any) -> Any:
    if len(value.texts) != len(signals):
        raise ValueError(f"signals.draft has {len(value.texts)} rows for {len(signals)} questions")
    return value


def _hidden_states(value: Any, signals: Any) -> Any:
    states = np.asarray(value)
    if states.ndim != 3 or states.shape[1] != len(signals):
        raise ValueError(f"signals.hidden_states must have shape (layers, {len(signals)}, hidden); got {states.shape}")
    if signals.hidden_layers is None or len(signals.hidden_layers) != states.shape[0]:
        raise ValueError("signals.hidden_layers must name the layer of each slice of signals.hidden_states")
    return value


def _matching_scores(value: Any, signals: Any) -> Any:
    one_row_each("matching_scores")(value, signals)
    if np.asarray(value).shape[1:] != (4, 2):
        raise ValueError(
            f"signals.matching_scores must have shape (n, 4, 2) (S1..S4 x dense, sparse); got {np.asarray(value).shape}"
        )
    return value


def _hidden_state_fields(inputs: Any) -> dict[str, Any]:
    states, layers = inputs.maker.states(inputs.maker.qa_prompts(inputs.questions), inputs.layers)
    return {"hidden_states": states, "hidden_layers": layers}


register_signal(
    Signal(
        "confidence",
        "the confidence probe's Conf(H(Q)) on the QA prompt (confrag.cbdr.question_confidences)",
        lambda inputs: {"confidence": inputs.maker.confidence(inputs.questions)},
        parts=(Part("qa_states", lambda run: run.fresh.confidence(run.questions)),),
        check=probabilities("confidence"),
    )
)
register_signal(
    Signal(
        "draft",
        "confrag.gates.drafts.draft_token_signals (one greedy closed-book generation)",
        lambda inputs: {"draft": inputs.maker.draft(inputs.questions)},
        # The draft is the closed-book answer.
        parts=(Part("draft", lambda run: run.fresh.draft(run.questions), gives_closed_book=True),),
        check=_draft,
    )
)
register_signal(
    Signal(
        "hidden_states",
        "HiddenStateEngine.extract on the QA prompts at the gate's layers (with hidden_layers)",
        _hidden_state_fields,
        parts=(Part("ctrla_states", lambda run: run.fresh.states(run.qa_prompts, run.layers)),),
        check=_hidden_states,
    )
)
register_signal(
    Signal(
        "question_embedding",
        "confrag.gates.signals.embed_texts(encoder, questions) with the MiniLM DenseRetriever",
        lambda inputs: {"question_embedding": inputs.maker.embed(inputs.questions)},
        parts=(Part("embed_question", lambda run: run.fresh.embed(run.questions)),),
    )
)
register_signal(
    Signal(
        "responses",
        "the closed-book answers of the RAG pipeline's cached outcomes",
        lambda inputs: {"responses": list(inputs.responses)},
        parts=("closed_book",),
    )
)
register_signal(
    Signal(
        "response_embedding",
        "confrag.gates.signals.embed_texts(encoder, responses)",
        lambda inputs: {"response_embedding": inputs.maker.embed(inputs.responses)},
        parts=("closed_book", Part("embed_response", lambda run: run.fresh.embed(run.responses))),
        requires=("responses",),
    )
)
register_signal(
    Signal(
        "p_true",
        "confrag.gates.p_true.p_true_prompts and verdict_probabilities (one forward per question: the LLM "
        "asked whether its closed-book answer is true)",
        lambda inputs: {"p_true": inputs.maker.p_true(inputs.questions, inputs.responses)},
        # P(True) judges the closed-book answer: that answer, then one forward over it.
        parts=("closed_book", Part("p_true", lambda run: run.fresh.p_true(run.questions, run.responses))),
        check=probabilities("p_true"),
        llm_check=lambda llm: verdict_token_ids(llm.tokenizer),
    )
)
register_signal(
    Signal(
        "matching_scores",
        "confrag.gates.signals.bridge_matching_scores (internal vs retrieved knowledge)",
        lambda inputs: {"matching_scores": inputs.maker.matching(inputs.questions, inputs.responses, inputs.contexts)},
        # BRIDGE decides after retrieving: internal passage, closed-book answer (K_gen), retrieval, matching
        # (whose measurement writes the internal passages again).
        parts=(
            Part("internal", lambda run: run.fresh.internal(run.questions)),
            "closed_book",
            "retrieve",
            Part(
                "matching",
                lambda run: run.fresh.matching(run.questions, run.responses, run.contexts),
                repeats=("internal",),
            ),
        ),
        requires=("responses",),
        per_context=True,
        check=_matching_scores,
    )
)
