"""Cross-fitted rerankers: one reranker per fold, each answering only the questions of its own fold.

With `preferences.cross_fit = k`, the questions no probe and no base reranker uses are split into k folds
(`confrag.data.splits.cross_fit_plan`); fold f's aligned rerankers train on the preference rows of the
other folds. A `FoldedReranker` puts the k of them behind the one `score` a Table 1 / Table 2 row calls,
routing each (question, passage) pair to the reranker of the question's fold, so every question of the
pool is evaluated once, by rerankers that never saw it (the evaluation asserts it:
`confrag.stages.evaluation.check_held_out`). Questions outside every fold (HotpotQA, `eval.questions_path`) were
seen by no fold; they go to fold 0's reranker.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from confrag.reranker.module import RerankerModule, fold_export


class FoldedReranker:
    """k rerankers behind one `score(queries, passages)`: each pair scored by its question's fold's reranker."""

    def __init__(self, folds: Sequence[RerankerModule], fold_of: Callable[[str], int | None]) -> None:
        if len(folds) < 2:
            raise ValueError(f"a cross-fitted reranker needs one reranker per fold, at least 2 (got {len(folds)})")
        self.folds = list(folds)
        self.fold_of = fold_of

    def _fold(self, query: str) -> int:
        fold = self.fold_of(query)
        return 0 if fold is None else fold

    def scorer_for(self, query: str) -> RerankerModule:
        """The reranker that scores `query`: its fold's (the base's own module where that fold's dev guard kept
        the base's weights, so that its scores can be shared with the base row's)."""
        return self.folds[self._fold(query)]

    def score(self, queries: Sequence[str], passages: Sequence[str], batch_size: int = 32) -> np.ndarray:
        if len(queries) != len(passages):
            raise ValueError(f"{len(queries)} queries for {len(passages)} passages")
        by_fold: dict[int, list[int]] = defaultdict(list)
        for i, query in enumerate(queries):
            by_fold[self._fold(query)].append(i)
        scores = np.zeros(len(queries), dtype=np.float32)
        for fold, index in by_fold.items():
            scores[index] = self.folds[fold].score(
                [queries[i] for i in index], [passages[i] for i in index], batch_size=batch_size
            )
        return scores

    def to(self, device: str) -> FoldedReranker:
        for module in self.folds:
            module.to(device)
        return self

    def export(self, directory: str | Path) -> Path:
        """Each fold's reranker to `<directory>/fold<f>/` (a plain `save_pretrained` folder each)."""
        directory = Path(directory)
        for f, module in enumerate(self.folds):
            module.export(fold_export(directory, f))
        return directory
