"""Computing the gates' signals with the LLM: Conf(H(Q)), drafts, hidden states, internal passages,
embeddings, BRIDGE's matching scores; the LLM-bound ones through the cache (`gates.cache`). Which ones
a set of gates needs, and how each is produced, is the signal registry's (`gates.registry.SIGNALS`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from confrag.cbdr import question_confidences
from confrag.data.nq import Passage, QARow
from confrag.gates.base import TRAINING_SOURCES, Gate, GateSignals
from confrag.gates.cache import cached_drafts, cached_internal_passages, cached_p_true, cached_states
from confrag.gates.registry import SIGNALS, UnavailableSignalError, check_signal_names, with_required
from confrag.gates.signals import bridge_matching_scores, embed_texts, external_knowledge
from confrag.llm.config import LLMConfig
from confrag.llm.loading import LoadedLLM, prompt_tokenizer
from confrag.llm.prompted import PromptedLLM
from confrag.retrieval import DenseRetriever, corpus_from_gold_paragraphs


def text_encoder(retriever: Any) -> DenseRetriever:
    """The pipeline's MiniLM bi-encoder. Without a dense index (retrieval.bi_encoder: false) it is loaded over
    a one-passage corpus: only its `encode` is used, and indexing the real corpus would cost minutes."""
    if isinstance(retriever, DenseRetriever):
        return retriever
    stub = corpus_from_gold_paragraphs([QARow("encoder", "encoder", ("encoder",), (Passage("encoder", "encoder"),))])
    return DenseRetriever(stub, progress=False, device="cpu")


@dataclass
class SignalMaker:
    """Computes gate signals for a set of questions; the LLM-bound ones through the cache."""

    prompted: PromptedLLM
    probe: Any  # SavedProbe
    encoder: DenseRetriever
    draft_max_new_tokens: int
    internal_max_new_tokens: int
    batch_size: int
    cache_dir: str | None
    extract_batch_size: int
    progress: bool

    @property
    def llm(self) -> LoadedLLM:
        return self.prompted.llm

    def without_cache(self) -> SignalMaker:
        return dataclasses.replace(self, cache_dir=None, progress=False)

    def qa_prompts(self, questions: Sequence[str]) -> list[str]:
        return [self.prompted.qa_prompt(q) for q in questions]

    def confidence(self, questions: Sequence[str]) -> np.ndarray:
        return question_confidences(
            self.prompted,
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


@dataclass(frozen=True)
class SignalInputs:
    """What a signal's producer (`registry.Signal.produce`) reads: the maker, the questions, their
    closed-book answers, the hidden-state layers the gates read and, for per-context signals, the contexts."""

    maker: SignalMaker
    rows: Sequence[QARow]
    questions: list[str]
    responses: Sequence[str]
    layers: Sequence[int] = ()
    contexts: Sequence[Sequence[Any]] | None = None


def question_signals(
    maker: SignalMaker, rows: Sequence[QARow], names: set[str], responses: Sequence[str], layers: Sequence[int] = ()
) -> GateSignals:
    """The signals in `names` (and those they require) that do not depend on the contexts, in the
    registry's order; names that are not signals (training data such as `outcomes`) are skipped.
    Per-context signals (BRIDGE's matching scores) are added by `context_signals`."""
    wanted = with_required(names)
    inputs = SignalInputs(maker, rows, [r.question for r in rows], responses, layers)
    fields: dict[str, Any] = {}
    for name, signal in SIGNALS.items():
        if name in wanted and not signal.per_context:
            fields.update(signal.produce(inputs))
    return GateSignals(qids=[r.qid for r in rows], questions=inputs.questions, **fields)


def context_signals(
    maker: SignalMaker, signals: GateSignals, names: set[str], contexts: Sequence[Sequence[Any]]
) -> GateSignals:
    """`signals` with the per-context signals in `names` computed over `contexts` (one list per question)."""
    wanted = [name for name, signal in SIGNALS.items() if signal.per_context and name in names]
    if not wanted:
        return signals
    inputs = SignalInputs(maker, [], signals.questions, signals.responses, contexts=contexts)
    fields: dict[str, Any] = {}
    for name in wanted:
        fields.update(SIGNALS[name].produce(inputs))
    return signals.with_values(**fields)


@dataclass(frozen=True)
class TokenizerOnly:
    """What the signals' LLM checks read (the tokenizer, and the identity their messages name), without weights."""

    tokenizer: Any
    identity: str


def check_signals_before_loading(gates: dict[str, Gate], llm_cfg: LLMConfig | dict[str, Any]) -> None:
    """`check_llm_signals` from the LLM's tokenizer alone, before any stage loads the weights: a gate asking for
    a signal the LLM cannot give is refused before the probe, NQ_Rerank and the rerankers run."""
    cfg = llm_cfg if isinstance(llm_cfg, LLMConfig) else LLMConfig(**dict(llm_cfg))
    check_llm_signals(gates, TokenizerOnly(prompt_tokenizer(cfg)[0], cfg.name))


def check_llm_signals(gates: dict[str, Gate], llm: LoadedLLM | TokenizerOnly) -> None:
    """Refuse, before anything runs, a gate that reads a signal this LLM (or confrag) cannot give."""
    for name, gate in gates.items():
        signals = gate.needs | (gate.training_needs - set(TRAINING_SOURCES))  # what it reads to decide or to fit
        check_signal_names(signals, name)
        for signal in sorted(signals):
            if SIGNALS[signal].llm_check is not None:
                try:
                    SIGNALS[signal].llm_check(llm)
                except UnavailableSignalError as err:
                    raise UnavailableSignalError(
                        f"gate '{name}' reads the signal {signal}, which the LLM {llm.identity!r} cannot give: {err}"
                    ) from err
