"""SKR-kNN (Wang et al., 2023): a question needs retrieval when its nearest training questions did.

Training questions carry SKR's self-knowledge label, "retrieval helped" = the RAG answer is right and
the closed-book answer wrong (both right, both wrong and right-then-wrong all count as "known": retrieval
did not help). A new question's k nearest training questions by cosine similarity of their (MiniLM)
embeddings vote; retrieve when the fraction that needed retrieval is >= `threshold`. With the default
0.5 and an even k, a tie therefore retrieves: when the neighbours are split, the safe side is to look up.
Neighbours with equal similarity are taken in training order (deterministic).
"""

from __future__ import annotations

import numpy as np

from confrag.gates.base import Decision, Gate, GateSignals, GateTrainingData
from confrag.infra import checks
from confrag.retrieval.ranking import top_n_hits


def unit_rows(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return x / np.where(norms > 0, norms, 1.0)


def knn_vote(query: np.ndarray, history: np.ndarray, labels: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(fraction of positive labels among the k most similar history rows, best similarity) per query."""
    query, history = np.asarray(query), np.asarray(history)
    if query.ndim != 2 or history.ndim != 2 or query.shape[1] != history.shape[1]:
        raise ValueError(
            f"question embeddings {query.shape} and training-question embeddings {history.shape} "
            "must be 2-D with the same width (the same encoder)"
        )
    similarities = unit_rows(query) @ unit_rows(history).T
    labels = np.asarray(labels, dtype=np.float64)
    fractions, best = np.empty(len(query)), np.empty(len(query))
    for row, scores in enumerate(similarities):
        hits = top_n_hits(scores, k)
        fractions[row] = labels[[i for i, _ in hits]].mean()
        best[row] = hits[0][1]
    return fractions, best


class SKRKnnGate(Gate):
    name = "skr_knn"
    needs = frozenset({"question_embedding"})
    training_needs = frozenset({"outcomes", "question_embedding"})

    def __init__(self, k: int, threshold: float) -> None:
        checks.positive_int(k, "k")
        checks.number(threshold, "threshold", 0.0, 1.0)
        super().__init__(k=k, threshold=threshold)
        self.k = int(k)
        self.threshold = float(threshold)
        self._history: np.ndarray | None = None
        self._labels: np.ndarray | None = None

    def _fit(self, train: GateTrainingData) -> None:
        self._history = np.asarray(train.signals.question_embedding, dtype=np.float64)
        self._labels = train.retrieval_helped

    retrieves_below = False

    def threshold_scores(self, signals: GateSignals) -> np.ndarray:
        return np.asarray(self.scores(signals), dtype=np.float64)

    def scores(self, signals: GateSignals) -> np.ndarray:
        """Fraction of the k nearest training questions for which retrieval helped."""
        fractions, _ = knn_vote(signals.question_embedding, self._history, self._labels, self.k)
        return fractions

    def _decide(self, signals: GateSignals) -> list[Decision]:
        return [Decision.RETRIEVE if f >= self.threshold else Decision.PARAMETRIC for f in self.scores(signals)]
