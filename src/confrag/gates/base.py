"""The gate interface: what every retrieval gate sees, decides and costs.

A gate looks at per-question signals that were computed beforehand (the probe's confidence, a closed-
book draft with its token entropies and attention, hidden states, embeddings, matching scores) and
decides, per question, to answer from parametric knowledge, to retrieve, or (BRIDGE only) to refuse.
`decide` is a pure function of those arrays, so each decision rule is testable on hand-made numbers;
computing them is the job of the signal registry (`confrag.gates.registry`, `signal_table`).

Gates that learn (SKR-kNN, CCSK, BRIDGE's allocator, CtrlA's direction) learn in `fit` from a
`GateTrainingData` of the *training split only*: the cached per-question outcomes of the RAG pipeline
(closed-book right/wrong, RAG right/wrong) and the training questions' signals.
"""

from __future__ import annotations

import abc
import inspect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, ClassVar

import numpy as np

from confrag.gates.directions import ConfidenceDirection
from confrag.gates.registry import SIGNALS, check_signal_names
from confrag.infra.digests import fingerprint


class Decision(str, Enum):
    PARAMETRIC = "parametric"  # answer closed-book with the QA prompt
    RETRIEVE = "retrieve"  # retrieve (and rerank), answer with the RAG prompt
    REFUSE = "refuse"  # answer "I don't know"


class MissingSignalError(ValueError):
    """A gate was asked to decide without a signal it reads."""


class MissingTrainingDataError(ValueError):
    """A gate that learns was asked to fit (or decide) without the training data it needs."""


# Where each piece of training data comes from (the signals a gate trains on: `registry.SIGNALS`).
TRAINING_SOURCES = {
    "outcomes": (
        "closed_book_correct and rag_correct of the training split: the RAG pipeline's cached "
        "per-question outcomes (closed-book and RAG answers scored with has_answer)"
    ),
    "answers": "the gold answers of the training questions (their NQ rows)",
    "answer_embedding": "confrag.gates.signals.embed_texts(encoder, first gold answer of each training question)",
    "confidence_direction": (
        "CtrlAGate.training_extras: the contrastive direction (as confrag.gates.signals.contrastive_direction) "
        "of paired prompts built from the training questions (confrag.gates.ctrla.contrastive_prompts)"
    ),
}


def _sources() -> dict[str, str]:
    return {**{name: signal.description for name, signal in SIGNALS.items()}, **TRAINING_SOURCES}


@dataclass(frozen=True)
class DraftSignals:
    """A closed-book draft per question and, per generated token, what DRAGIN's RIND and the uncertainty
    baselines (mean token entropy, max token probability, perplexity) read."""

    texts: list[str]
    tokens: list[list[str]]  # each generated token decoded on its own
    entropy: list[np.ndarray]  # nats, entropy of the next-token distribution that produced each token
    attention: list[np.ndarray]  # per token: max attention it receives from later draft tokens
    logprob: list[np.ndarray]  # per token: log-probability of the generated token (natural log)
    max_prob: list[np.ndarray]  # per token: the highest probability of its next-token distribution

    def __post_init__(self) -> None:
        n = len(self.texts)
        fields = ("tokens", "entropy", "attention", "logprob", "max_prob")
        for name in fields:
            if len(getattr(self, name)) != n:
                raise ValueError(f"draft.{name} has {len(getattr(self, name))} rows, draft.texts has {n}")
        for i, row in enumerate(zip(*(getattr(self, name) for name in fields))):
            if len({len(values) for values in row}) != 1:
                raise ValueError(
                    f"draft row {i}: "
                    + ", ".join(f"{len(values)} {name}" for name, values in zip(fields, row))
                    + "; they must be aligned per token"
                )
            for name, values in zip(fields[2:], row[2:]):
                if not np.all(np.isfinite(values)):
                    raise ValueError(f"draft row {i}: draft.{name} holds a NaN or inf")


class GateSignals:
    """Per-question signals, aligned with `qids`: any signal of the registry (`registry.SIGNALS`) by name,
    as a keyword (`GateSignals(qids, questions, confidence=...)`) and read back as an attribute
    (`signals.confidence`, None when absent). Only the ones a gate `needs` must be present; each value is
    checked by its entry. `hidden_layers` names the layer of each slice of `hidden_states`."""

    def __init__(
        self,
        qids: Sequence[str],
        questions: Sequence[str],
        hidden_layers: tuple[int, ...] | None = None,
        **values: Any,
    ) -> None:
        self.qids, self.questions, self.hidden_layers = list(qids), list(questions), hidden_layers
        if len(self.questions) != len(self.qids):
            raise ValueError(f"signals: {len(self.questions)} questions for {len(self.qids)} qids")
        check_signal_names(values, "signals")
        self._values: dict[str, Any] = {}
        for name, value in values.items():
            if value is not None:
                self._values[name] = SIGNALS[name].checked(value, self)

    def __getattr__(self, name: str) -> Any:
        # Only reached when ordinary lookup fails: a registered signal this object does not hold is None.
        if name in SIGNALS:
            return self.__dict__.get("_values", {}).get(name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def values(self) -> dict[str, Any]:
        """The signals held, by name."""
        return dict(self._values)

    def with_values(self, **values: Any) -> GateSignals:
        """A copy holding `values` too (replacing those of the same name)."""
        return GateSignals(self.qids, self.questions, self.hidden_layers, **{**self._values, **values})

    def __len__(self) -> int:
        return len(self.qids)

    def require(self, names: Iterable[str], gate: str) -> None:
        check_signal_names(names, gate)
        missing = sorted(name for name in names if getattr(self, name) is None)
        if missing:
            raise MissingSignalError(
                f"gate '{gate}' needs the signal(s) {', '.join(missing)}; compute them with: "
                + "; ".join(f"{name}: {SIGNALS[name].description}" for name in missing)
            )


@dataclass
class GateTrainingData:
    """What gates learn from: the training split's signals and cached outcomes."""

    signals: GateSignals
    closed_book_correct: np.ndarray | None = None  # (n,) bool
    rag_correct: np.ndarray | None = None  # (n,) bool
    answers: list[tuple[str, ...]] | None = None  # gold answers, first = the "best answer"
    answer_embedding: np.ndarray | None = None  # (n, d): embedding of each first gold answer
    confidence_direction: ConfidenceDirection | None = None
    split: str = "train"

    def __post_init__(self) -> None:
        n = len(self.signals)
        for name in ("closed_book_correct", "rag_correct"):
            value = getattr(self, name)
            if value is not None:
                value = np.asarray(value)
                if value.shape != (n,) or value.dtype != bool:
                    raise ValueError(
                        f"training data {name} must be a bool array of shape ({n},); got {value.dtype} {value.shape}"
                    )
                setattr(self, name, value)
        for name in ("answers", "answer_embedding"):
            value = getattr(self, name)
            if value is not None and len(value) != n:
                raise ValueError(f"training data {name} has {len(value)} rows for {n} questions")

    @property
    def retrieval_helped(self) -> np.ndarray:
        """SKR's and CCSK's label: retrieval turns a wrong closed-book answer into a right one. Both
        right (no need), both wrong (no help) and right-then-wrong (harm) are all 'no'."""
        return retrieval_helped(self.closed_book_correct, self.rag_correct)

    def require(self, names: Iterable[str], gate: str) -> None:
        missing = []
        for name in names:
            if name == "outcomes":
                absent = self.closed_book_correct is None or self.rag_correct is None
            elif name in SIGNALS:
                absent = getattr(self.signals, name) is None
            else:
                absent = getattr(self, name) is None
            if absent:
                missing.append(name)
        if missing:
            sources = _sources()
            raise MissingTrainingDataError(
                f"gate '{gate}' cannot be trained without " + "; ".join(f"{m} ({sources[m]})" for m in missing)
            )


def retrieval_helped(closed_book_correct: np.ndarray, rag_correct: np.ndarray) -> np.ndarray:
    return np.asarray(rag_correct, dtype=bool) & ~np.asarray(closed_book_correct, dtype=bool)


# Every gate class, by its `name` (a short stable id): filled as each concrete subclass is defined, so a
# gate is registered by its own module; a run builds gates from their `_target_` configs
# (`gates.settings.gate_from_config`), which import that module.
GATES: dict[str, type[Gate]] = {}


class Gate(abc.ABC):
    """Decides per question: parametric answer, retrieval, or refusal.

    Subclasses set `name`, `needs` (the signals `decide` reads), `training_needs` (what `fit` reads;
    empty for gates that do not learn), their LLM cost, and implement `_decide` (and `_fit`). What a
    comparison must do for a particular gate is asked of the gate (`threshold_scores`, `state_layers`,
    `extras_key` / `training_extras`, `retrieve_contexts`, `curve_refusal`), never decided by its type."""

    name: ClassVar[str] = "gate"
    needs: ClassVar[frozenset[str]] = frozenset()
    training_needs: ClassVar[frozenset[str]] = frozenset()
    # LLM calls (one prompt prefill and its greedy decode) spent to reach the decision ...
    decision_passes: ClassVar[int] = 0
    # ... and whether that call already is the closed-book answer (a parametric decision costs nothing more).
    decision_is_closed_book: ClassVar[bool] = False
    # Whether the gate retrieves before it decides (BRIDGE matches the retrieved passages): then every
    # question costs a retriever call, not only those it decides to retrieve for.
    decision_retrieves: ClassVar[bool] = False
    # Threshold gates: True when a score below the threshold retrieves, False when one above does; None
    # for gates without a single threshold score (their retrieve score is the decision itself).
    retrieves_below: ClassVar[bool | None] = None
    # Why no threshold curve can be drawn for this gate from cached answers (None: it can).
    curve_refusal: ClassVar[str | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "name" not in cls.__dict__ or inspect.isabstract(cls):
            return  # an intermediate class (UncertaintyGate) or a variant keeping its parent's id
        known = GATES.get(cls.name)
        if known is not None and (known.__module__, known.__qualname__) != (cls.__module__, cls.__qualname__):
            raise ValueError(
                f"gate id {cls.name!r} of {cls.__module__}.{cls.__qualname__} is taken by "
                f"{known.__module__}.{known.__qualname__}"
            )
        GATES[cls.name] = cls

    def __init__(self, **config: Any) -> None:
        self.config = config  # the constructor's values: the gate's identity
        self._fitted = not self.training_needs

    def identity(self) -> str:
        return fingerprint({"gate": self.name, **self.config})

    @property
    def fitted(self) -> bool:
        return self._fitted

    def fit(self, train: GateTrainingData | None = None) -> Gate:
        if not self.training_needs:
            return self
        if train is None:
            sources = _sources()
            raise MissingTrainingDataError(
                f"gate '{self.name}' needs training data and got none: "
                + "; ".join(f"{m} ({sources[m]})" for m in sorted(self.training_needs))
            )
        if train.split != "train":
            raise ValueError(
                f"gate '{self.name}' must be trained on the training split only; got split={train.split!r}"
            )
        if len(train.signals) == 0:
            raise ValueError(f"gate '{self.name}': the training split holds no questions")
        train.require(sorted(self.training_needs), self.name)
        self._fit(train)
        self._fitted = True
        return self

    def _fit(self, train: GateTrainingData) -> None:
        # Only gates with training_needs reach this; those override it.
        raise TypeError(f"gate '{self.name}' declares training_needs {sorted(self.training_needs)} but no _fit")

    def _ready(self, signals: GateSignals) -> None:
        if not self._fitted:
            raise MissingTrainingDataError(
                f"gate '{self.name}' is not trained: call fit(train) with the training split's data first"
            )
        signals.require(self.needs, self.name)

    def decide(self, signals: GateSignals) -> list[Decision]:
        self._ready(signals)
        decisions = self._decide(signals)
        assert len(decisions) == len(signals)
        return decisions

    @abc.abstractmethod
    def _decide(self, signals: GateSignals) -> list[Decision]:
        """The gate's rule over precomputed signals, one decision per question."""

    def threshold_scores(self, signals: GateSignals) -> np.ndarray:
        """Per question, the number a threshold gate compares with its threshold (threshold gates override)."""
        raise ValueError(
            f"gate '{self.name}' has no single threshold score; curves are drawn for threshold gates "
            f"(give explicit values for other parameters)"
        )

    def state_layers(self, default_layer: int) -> tuple[int, ...]:
        """The layers of the `hidden_states` signal this gate reads (none unless it reads them);
        `default_layer` is the LLM's Layer/2."""
        return ()

    def extras_key(self, default_layer: int) -> Any:
        """What `training_extras` computes, as a hashable key (gates with equal keys share one computation),
        or None when the gate needs nothing beyond the signals and outcomes."""
        return None

    def training_extras(self, maker: Any, rows: Sequence[Any]) -> dict[str, Any]:
        """Training data the gate computes with the LLM from the training questions `rows` (fields of
        `GateTrainingData`, e.g. CtrlA's `confidence_direction`), through the comparison's signal maker
        (`confrag.gates.signal_maker.SignalMaker`: cached states, drafts, embeddings)."""
        return {}

    def retrieve_contexts(self, signals: GateSignals, contexts: Sequence[Any], maker: Any) -> dict[int, list[Any]]:
        """Per question index, the contexts a RETRIEVE decision answers with when they are not the top-K
        retrieved ones (BRIDGE's FA strategy puts its internal passage first); those answers are generated
        (through the answer cache) rather than read from the run's top-K outcomes. Empty by default."""
        return {}

    def retrieve_scores(self, signals: GateSignals) -> np.ndarray:
        """Per question, how strongly the gate leans to retrieving (higher: retrieve sooner), what its AUROC
        and PRR are scored on: the threshold score oriented so, or 1 for a retrieve decision and 0 for any
        other when the gate has no threshold score. A threshold gate's non-finite score (DRAGIN's empty
        draft) is +-inf: always or never retrieved."""
        if self.retrieves_below is None:
            return np.array([Decision(d) is Decision.RETRIEVE for d in self.decide(signals)], dtype=np.float64)
        self._ready(signals)
        scores = np.asarray(self.threshold_scores(signals), dtype=np.float64)
        if np.isnan(scores).any():
            bad = int(np.flatnonzero(np.isnan(scores))[0])
            raise ValueError(f"gate '{self.name}': NaN score for question {bad} ({signals.qids[bad]!r})")
        return -scores if self.retrieves_below else scores

    def retriever_calls(self, decisions: Sequence[Decision]) -> np.ndarray:
        """Retriever calls per question (retrieval and reranking of its candidates)."""
        return np.array(
            [1 if self.decision_retrieves or Decision(d) is Decision.RETRIEVE else 0 for d in decisions],
            dtype=np.int64,
        )

    def llm_forward_passes(self, decisions: Sequence[Decision]) -> np.ndarray:
        """LLM calls per question for deciding and answering (a refusal answers without the LLM)."""
        answer = {
            Decision.PARAMETRIC: 0 if self.decision_is_closed_book else 1,
            Decision.RETRIEVE: 1,
            Decision.REFUSE: 0,
        }
        return np.array([self.decision_passes + answer[Decision(d)] for d in decisions], dtype=np.int64)
