"""Computing the gates' signals with the LLM: Conf(H(Q)), drafts, hidden states, internal passages,
embeddings, BRIDGE's matching scores; the LLM-bound ones through the cache (`gates.cache`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from confrag.cbdr import question_confidences
from confrag.data.nq import Passage, QARow
from confrag.gates.base import TRAINING_SOURCES, Gate, GateSignals, UnavailableSignalError, check_signal_names
from confrag.gates.cache import cached_drafts, cached_internal_passages, cached_p_true, cached_states
from confrag.gates.ctrla import CtrlAGate
from confrag.gates.directions import ConfidenceDirection, direction_from_states
from confrag.gates.signals import (
    bridge_matching_scores,
    contrastive_prompts,
    embed_texts,
    external_knowledge,
    verdict_token_ids,
)
from confrag.llm.loading import LoadedLLM
from confrag.llm.prompts import PromptTemplates
from confrag.retrieval import DenseRetriever, corpus_from_nq


def text_encoder(retriever: Any) -> DenseRetriever:
    """The pipeline's MiniLM bi-encoder. Without a dense index (retrieval.bi_encoder: false) it is loaded over
    a one-passage corpus: only its `encode` is used, and indexing the real corpus would cost minutes."""
    if isinstance(retriever, DenseRetriever):
        return retriever
    stub = corpus_from_nq([QARow("encoder", "encoder", ("encoder",), (Passage("encoder", "encoder"),))])
    return DenseRetriever(stub, progress=False, device="cpu")


@dataclass
class SignalMaker:
    """Computes gate signals for a set of questions; the LLM-bound ones through the cache."""

    llm: LoadedLLM
    templates: PromptTemplates
    probe: Any  # SavedProbe
    encoder: DenseRetriever
    draft_max_new_tokens: int
    internal_max_new_tokens: int
    batch_size: int
    cache_dir: str | None
    extract_batch_size: int
    progress: bool

    def without_cache(self) -> SignalMaker:
        return dataclasses.replace(self, cache_dir=None, progress=False)

    def qa_prompts(self, questions: Sequence[str]) -> list[str]:
        return [self.templates.qa_prompt(self.llm.tokenizer, q) for q in questions]

    def confidence(self, questions: Sequence[str]) -> np.ndarray:
        return question_confidences(
            self.llm,
            self.templates,
            self.probe,
            questions,
            self.cache_dir,
            batch_size=self.extract_batch_size,
            progress=self.progress,
        )

    def draft(self, questions: Sequence[str]):
        return cached_drafts(
            self.llm,
            self.qa_prompts(questions),
            self.cache_dir,
            self.draft_max_new_tokens,
            self.batch_size,
            self.progress,
        )

    def states(self, prompts: Sequence[str], layers: Sequence[int]) -> tuple[np.ndarray, tuple[int, ...]]:
        return cached_states(self.llm, prompts, layers, self.cache_dir, self.extract_batch_size, self.progress)

    def internal(self, questions: Sequence[str]) -> list[str]:
        return cached_internal_passages(
            self.llm, questions, self.cache_dir, self.internal_max_new_tokens, self.batch_size, self.progress
        )

    def p_true(self, questions: Sequence[str], responses: Sequence[str]) -> np.ndarray:
        return cached_p_true(self.llm, questions, responses, self.cache_dir, self.batch_size, self.progress)

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        return embed_texts(self.encoder, texts)

    def matching(
        self, questions: Sequence[str], responses: Sequence[str], contexts: Sequence[Sequence[Any]]
    ) -> np.ndarray:
        external, rest = external_knowledge(contexts)
        return bridge_matching_scores(self.encoder, self.internal(questions), responses, external, rest)


def ctrla_layers(gate: CtrlAGate, llm: LoadedLLM) -> tuple[int, ...]:
    """The gate's layers, or Layer/2 (the state the CBDR probe reads) when it leaves them to the direction."""
    return tuple(sorted(gate.layers)) if gate.layers else (llm.mid_layer,)


def ctrla_key(gate: CtrlAGate, llm: LoadedLLM) -> tuple:
    return ctrla_layers(gate, llm), gate.confident_template, gate.unconfident_template


def question_signals(
    maker: SignalMaker, rows: Sequence[QARow], names: set[str], responses: Sequence[str], layers: Sequence[int] = ()
) -> GateSignals:
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
    if "p_true" in names:
        fields["p_true"] = maker.p_true(questions, responses)
    return GateSignals(qids=[r.qid for r in rows], questions=questions, **fields)


# What an LLM must offer for a signal that not every LLM gives; each check raises UnavailableSignalError
# with the reason. Signals not listed here every causal LM of the project gives.
LLM_SIGNAL_CHECKS = {"p_true": lambda llm: verdict_token_ids(llm.tokenizer)}


def check_llm_signals(gates: dict[str, Gate], llm: LoadedLLM) -> None:
    """Refuse, before anything runs, a gate that reads a signal this LLM (or confrag) cannot give."""
    for name, gate in gates.items():
        signals = gate.needs | (gate.training_needs - set(TRAINING_SOURCES))  # what it reads to decide or to fit
        check_signal_names(signals, name)
        for signal in sorted(signals):
            if signal in LLM_SIGNAL_CHECKS:
                try:
                    LLM_SIGNAL_CHECKS[signal](llm)
                except UnavailableSignalError as err:
                    raise UnavailableSignalError(
                        f"gate '{name}' reads the signal {signal}, which the LLM {llm.identity!r} cannot give: {err}"
                    ) from err


def with_matching(maker: SignalMaker, signals: GateSignals, contexts: Sequence[Sequence[Any]]) -> GateSignals:
    return dataclasses.replace(signals, matching_scores=maker.matching(signals.questions, signals.responses, contexts))


def confidence_direction(maker: SignalMaker, gate: CtrlAGate, rows: Sequence[QARow]) -> ConfidenceDirection:
    """CtrlA's direction from the training questions' paired prompts (states cached)."""
    confident, unconfident = contrastive_prompts(
        maker.llm.tokenizer, [r.question for r in rows], gate.confident_template, gate.unconfident_template
    )
    layers = ctrla_layers(gate, maker.llm)
    confident_states, layers = maker.states(confident, layers)
    unconfident_states, _ = maker.states(unconfident, layers)
    return direction_from_states(confident_states, unconfident_states, layers)
