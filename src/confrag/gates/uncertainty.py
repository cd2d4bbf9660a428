"""Uncertainty baselines as gates: retrieve when the LLM is unsure of its closed-book answer.

AdaRAGUE (Moskvoretskii et al., ACL 2025) compared 35 adaptive-retrieval methods and found these plain
estimates as good as elaborate gates at a fraction of the cost. Each reads the closed-book pass the
comparison runs anyway:

- `entropy`: the mean, over the greedy draft's tokens, of the entropy (nats) of the next-token
  distribution each was drawn from; retrieve when it is above the threshold.
- `max_prob`: per draft token, the highest probability of its next-token distribution; the answer's
  score is the lowest of them (one unsure step makes the answer unsure); retrieve when below.
- `perplexity`: exp(-mean log-probability of the draft's tokens); retrieve when above.
- `p_true`: the LLM is shown the question and its closed-book answer and asked whether the answer is
  true (Kadavath et al., 2022); P(True) = p("True") / (p("True") + p("False")) of the next token, each
  summed over its surface forms' first tokens; retrieve when below. One extra forward per question.

The draft is DRAGIN's (`drafts.draft_token_signals`, cached): one greedy closed-book generation that is
also the closed-book answer, so a parametric decision costs nothing more. An empty draft has nothing to
judge and nothing to answer with, so the draft gates retrieve (its score is +-inf, on the retrieve side).
"""

from __future__ import annotations

import abc
from typing import ClassVar

import numpy as np

from confrag.gates.base import Decision, Gate, GateSignals
from confrag.infra import checks


class UncertaintyGate(Gate):
    """Retrieve when a per-question uncertainty score passes `threshold` (on the side `retrieves_below`
    names). Subclasses set the score, its allowed threshold range and the signal it reads."""

    retrieves_below: ClassVar[bool]
    threshold_range: ClassVar[tuple[float | None, float | None]] = (None, None)

    def __init__(self, threshold: float) -> None:
        checks.number(threshold, "threshold", *self.threshold_range)
        super().__init__(threshold=threshold)
        self.threshold = float(threshold)

    @abc.abstractmethod
    def threshold_scores(self, signals: GateSignals) -> np.ndarray: ...

    def _decide(self, signals: GateSignals) -> list[Decision]:
        scores = self.threshold_scores(signals)
        retrieve = scores < self.threshold if self.retrieves_below else scores > self.threshold
        return [Decision.RETRIEVE if r else Decision.PARAMETRIC for r in retrieve]


class DraftUncertaintyGate(UncertaintyGate):
    """A score per closed-book draft from its per-token values."""

    needs = frozenset({"draft"})
    decision_passes = 1  # the draft is the closed-book answer
    decision_is_closed_book = True

    @abc.abstractmethod
    def draft_score(self, entropy: np.ndarray, logprob: np.ndarray, max_prob: np.ndarray) -> float:
        """The score of one non-empty draft from its tokens' entropies, log-probabilities, max probabilities."""

    def threshold_scores(self, signals: GateSignals) -> np.ndarray:
        draft = signals.draft
        empty = -np.inf if self.retrieves_below else np.inf  # an empty draft retrieves
        return np.array(
            [
                self.draft_score(e, lp, mp) if len(e) else empty
                for e, lp, mp in zip(draft.entropy, draft.logprob, draft.max_prob)
            ],
            dtype=np.float64,
        )


class EntropyGate(DraftUncertaintyGate):
    name = "entropy"
    retrieves_below = False
    threshold_range = (0.0, None)

    def draft_score(self, entropy: np.ndarray, logprob: np.ndarray, max_prob: np.ndarray) -> float:
        return float(np.mean(entropy))


class MaxProbGate(DraftUncertaintyGate):
    name = "max_prob"
    retrieves_below = True
    threshold_range = (0.0, 1.0)

    def draft_score(self, entropy: np.ndarray, logprob: np.ndarray, max_prob: np.ndarray) -> float:
        return float(np.min(max_prob))


class PerplexityGate(DraftUncertaintyGate):
    name = "perplexity"
    retrieves_below = False
    threshold_range = (1.0, None)

    def draft_score(self, entropy: np.ndarray, logprob: np.ndarray, max_prob: np.ndarray) -> float:
        return float(np.exp(-np.mean(logprob)))


class PTrueGate(UncertaintyGate):
    name = "p_true"
    needs = frozenset({"p_true"})
    retrieves_below = True
    threshold_range = (0.0, 1.0)
    # The closed-book answer, then the forward that reads its verdict: a parametric decision is answered.
    decision_passes = 2
    decision_is_closed_book = True

    def threshold_scores(self, signals: GateSignals) -> np.ndarray:
        return np.asarray(signals.p_true, dtype=np.float64)
