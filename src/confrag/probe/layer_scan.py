"""Per-layer probe quality in one pass over the cache: cross-validated logistic-regression AUROC.

A cheap companion to the MLP sweep (`model.layer=...`): it reads every cached layer once and tells
where the confidence signal lives, so a sweep can be aimed.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import roc_auc_score
from sklearn.model_selection import StratifiedKFold
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from confrag.probe.nq_confidence import ConfidenceData

log = logging.getLogger(__name__)


def layer_scan(data: ConfidenceData, kinds: Sequence[str] | None = None, folds: int = 5, seed: int = 0) -> list[dict]:
    """Mean and std over folds of held-out AUROC for each cached layer, on all questions of `kinds`; none, with a
    warning saying why (`skip_reason`), when a class has fewer examples than folds."""
    kinds = list(kinds or data.stores)
    labels = np.concatenate([data.labels[k] for k in kinds])
    reason = skip_reason(labels, folds)
    if reason:
        log.warning("layer_scan skipped: %s", reason)
        return []
    splitter = StratifiedKFold(n_splits=folds, shuffle=True, random_state=seed)
    results = []
    for layer in data.layers:
        states = np.concatenate([data.stores[k].take(layer, range(len(data.labels[k]))) for k in kinds])
        scores = []
        for train, test in splitter.split(states, labels):
            classifier = make_pipeline(StandardScaler(), LogisticRegression(C=0.05, max_iter=2000))
            classifier.fit(states[train], labels[train])
            scores.append(roc_auc_score(labels[test], classifier.predict_proba(states[test])[:, 1]))
        results.append(
            {
                "layer": layer,
                "auroc_mean": float(np.mean(scores)),
                "auroc_std": float(np.std(scores)),
                "examples": int(len(labels)),
                "positives": int(labels.sum()),
            }
        )
    return results


def skip_reason(labels: np.ndarray, folds: int = 5) -> str | None:
    """Why the scan cannot run on `labels` (a class with fewer examples than folds), or None when it can."""
    positives = int(labels.sum())
    negatives = len(labels) - positives
    if min(positives, negatives) >= folds:
        return None
    return (
        f"{positives} positive and {negatives} negative examples; {folds}-fold cross-validation needs at least "
        f"{folds} of each class (raise data.num_questions, or set layer_scan=false)"
    )
