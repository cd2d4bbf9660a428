"""DRAGIN's retrieval trigger, RIND (Su et al., 2024), as a single-round gate.

For each token t_i of the closed-book draft

    RIND(t_i) = H_i x a_max(i) x s_i

- H_i: entropy (nats) of the next-token distribution that produced t_i;
- a_max(i): the maximum attention t_i receives in the last layer from the draft tokens that read it,
  itself and every later one (per head, then averaged over heads, as DRAGIN's code computes it; the
  paper writes "later tokens", which would leave a one-token answer unable to trigger), divided by its
  mean over the draft's tokens so that 1 means "average attention" (DRAGIN normalizes within a
  sentence; our drafts are short answers, so the whole draft is the unit);
- s_i: 1 for content tokens, 0 for stopwords (scikit-learn's English list) and pure punctuation.

Retrieval happens when any token's RIND exceeds the threshold. Unlike DRAGIN, this is one round:
retrieve once with the question as the query and answer with the RAG prompt, instead of regenerating
from the triggering token with a query built from the draft. Token-level, not word-level: DRAGIN merges
sub-word pieces into words first; here each piece is scored on its own.

An empty draft has nothing to judge and nothing to answer with, so it retrieves.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from sklearn.feature_extraction.text import ENGLISH_STOP_WORDS

from confrag.gates.base import Decision, Gate, GateSignals
from confrag.infra import checks


def is_content_token(piece: str) -> bool:
    """DRAGIN's semantic indicator s_i: a token piece that is neither a stopword nor punctuation."""
    word = piece.strip().lower()
    return any(ch.isalnum() for ch in word) and word not in ENGLISH_STOP_WORDS


def rind_scores(tokens: Sequence[str], entropy: np.ndarray, attention: np.ndarray) -> np.ndarray:
    """RIND per draft token (see the module docstring)."""
    entropy = np.asarray(entropy, dtype=np.float64)
    attention = np.asarray(attention, dtype=np.float64)
    if len(tokens) == 0:
        return np.zeros(0)
    mean = attention.mean()
    normalized = attention / mean if mean > 0 else np.zeros_like(attention)
    content = np.array([is_content_token(t) for t in tokens], dtype=np.float64)
    return entropy * normalized * content


class DraginGate(Gate):
    name = "dragin"
    needs = frozenset({"draft"})
    decision_passes = 1  # the draft is the closed-book answer
    decision_is_closed_book = True

    def __init__(self, threshold: float) -> None:
        # conf/gate/dragin.yaml's 1.4: the hallucination_threshold of DRAGIN's released configs (Llama2-7b-chat).
        checks.number(threshold, "threshold", 0.0)
        super().__init__(threshold=threshold)
        self.threshold = float(threshold)

    def scores(self, signals: GateSignals) -> list[np.ndarray]:
        draft = signals.draft
        return [rind_scores(t, e, a) for t, e, a in zip(draft.tokens, draft.entropy, draft.attention)]

    retrieves_below = False

    def threshold_scores(self, signals: GateSignals) -> np.ndarray:
        # An empty draft always retrieves: no threshold moves it.
        return np.array([s.max() if len(s) else np.inf for s in self.scores(signals)])

    def _decide(self, signals: GateSignals) -> list[Decision]:
        return [
            Decision.RETRIEVE if len(s) == 0 or s.max() > self.threshold else Decision.PARAMETRIC
            for s in self.scores(signals)
        ]
