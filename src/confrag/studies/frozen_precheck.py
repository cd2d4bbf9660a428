"""Before training a student: can frozen features predict ℓ's choice among the base's top candidates?

For each question, among the base's top `k` (3) candidates, the label is "this candidate is ℓ's top-1 among them".
The features are what a student with frozen passage vectors can see: q ⊙ p and |q − p| (the base's MiniLM
vectors), the base score, its gap to the question's best and its rank, the BM25 score and rank, the passage's
length. A model fitted on them (a standardised logistic regression and a gradient-boosted one), cross-fitted over
the study's folds, is scored held out (AUROC, with a bootstrap interval over questions) beside the same model on
the base's score, gap and rank alone: the control. If the frozen features add nothing over the control, ℓ's
preference is not in them, and a student that reads the passage in the light of the question (a cross-encoder) is
the test. The share of questions whose top-1 by the model is ℓ's, against the base's own top-1, says the same in
the unit a reranker is judged by.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from sklearn.ensemble import HistGradientBoostingClassifier
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import roc_auc_score
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from confrag.reranker.listwise_data import ListwiseData
from confrag.retrieval.candidates import Candidates

CONTROL_COLUMNS = 3  # base score, gap to the question's best, base rank: the first columns of every row


@dataclass(frozen=True)
class Shortlist:
    """Every question's base top-k candidates as rows of features: `features` (rows, d), `label` (rows,) 1 for ℓ's
    choice among the k, `question` (rows,) the question's position in the study, `rank` (rows,) the base's rank."""

    features: np.ndarray
    label: np.ndarray
    question: np.ndarray
    rank: np.ndarray


def shortlist(data: ListwiseData, sets: Sequence[Candidates], ell: Sequence[np.ndarray], at: list[int], k: int = 3):
    """The base's top `k` of each question at `at`, as feature rows (control columns first)."""
    rows, labels, owner, ranks = [], [], [], []
    for i in at:
        n = len(sets[i].passages)
        base = data.base_scores[i][:n]
        top = np.argsort(-base, kind="stable")[:k]
        choice = top[int(np.argmax(np.asarray(ell[i])[top]))]
        q = data.query_vectors[i]
        for rank, j in enumerate(top):
            p = data.passage_vectors[i, j]
            words = len(sets[i].passages[j].text.split())
            control = [base[j], base[j] - base[top[0]], rank]
            rows.append(np.concatenate([control, q * p, np.abs(q - p), [sets[i].scores[j], j, words]]))
            labels.append(int(j == choice))
            owner.append(i)
            ranks.append(rank)
    return Shortlist(np.asarray(rows, dtype=np.float64), np.asarray(labels), np.asarray(owner), np.asarray(ranks))


MODELS = {
    "logistic": lambda: make_pipeline(StandardScaler(), LogisticRegression(C=1.0, max_iter=5000)),
    "boosted": lambda: HistGradientBoostingClassifier(max_iter=200, learning_rate=0.05, random_state=0),
}


@dataclass(frozen=True)
class PrecheckRow:
    model: str
    features: str  # "frozen" (every column) or "control" (the base's score, gap and rank)
    auroc: float
    auroc_ci: tuple[float, float]
    top1_is_ells: float  # share of questions whose top-1 by the model is ℓ's choice among the k


def _held_out(model: str, sl: Shortlist, folds: Sequence[Sequence[int]], columns: slice) -> np.ndarray:
    """Each row's probability from the model fitted on the other folds' questions."""
    out = np.full(len(sl.label), np.nan)
    for fold in folds:
        held = np.isin(sl.question, list(fold))
        fitted = MODELS[model]().fit(sl.features[~held][:, columns], sl.label[~held])
        out[held] = fitted.predict_proba(sl.features[held][:, columns])[:, 1]
    return out


def _top1_share(sl: Shortlist, scores: np.ndarray) -> float:
    hits = []
    for q in np.unique(sl.question):
        rows = np.flatnonzero(sl.question == q)
        hits.append(sl.label[rows[int(np.argmax(scores[rows]))]] == 1)
    return float(np.mean(hits))


def _bootstrap_auroc(sl: Shortlist, scores: np.ndarray, resamples: int, seed: int) -> tuple[float, float]:
    questions = np.unique(sl.question)
    by_question = {q: np.flatnonzero(sl.question == q) for q in questions}
    rng = np.random.default_rng(seed)
    values = []
    for _ in range(resamples):
        rows = np.concatenate([by_question[q] for q in rng.choice(questions, len(questions))])
        if 0 < sl.label[rows].sum() < len(rows):
            values.append(roc_auc_score(sl.label[rows], scores[rows]))
    return float(np.percentile(values, 2.5)), float(np.percentile(values, 97.5))


def frozen_precheck(
    sl: Shortlist, folds: Sequence[Sequence[int]], resamples: int = 1000, seed: int = 0, models=tuple(MODELS)
) -> list[PrecheckRow]:
    """Each of `models` on the frozen features and on the control columns, held out; plus the base's own top-1
    (`base`, its rank alone) as the row every other is read against."""
    rows = [
        PrecheckRow(
            "base", "control", float(roc_auc_score(sl.label, -sl.rank)),
            _bootstrap_auroc(sl, -sl.rank.astype(float), resamples, seed), _top1_share(sl, -sl.rank.astype(float)),
        )
    ]  # fmt: skip
    for model in models:
        for name, columns in (("control", slice(0, CONTROL_COLUMNS)), ("frozen", slice(None))):
            scores = _held_out(model, sl, folds, columns)
            rows.append(
                PrecheckRow(
                    model, name, float(roc_auc_score(sl.label, scores)),
                    _bootstrap_auroc(sl, scores, resamples, seed), _top1_share(sl, scores),
                )
            )  # fmt: skip
    return rows
