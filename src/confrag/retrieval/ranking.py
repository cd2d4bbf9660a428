"""Top-n selection shared by the retrievers, with a deterministic order among equal scores."""

from __future__ import annotations

import numpy as np

from confrag.infra import checks

Hits = list[tuple[int, float]]


def check_top_n(top_n: int) -> None:
    checks.positive_int(top_n, "top_n")


def top_n_hits(scores: np.ndarray, top_n: int) -> Hits:
    """(index, score) of the `top_n` highest scores, best first; ties go to the lower index, so the
    result does not depend on argpartition's internals or on the platform (candidates are cached)."""
    count = min(top_n, scores.shape[0])
    if count == 0:
        return []
    if count < scores.shape[0]:
        # argpartition alone could cut a tie at the boundary arbitrarily: keep every score tied with the
        # n-th best, then let the lexsort below decide by index.
        threshold = np.partition(scores, -count)[-count]
        pool = np.flatnonzero(scores >= threshold)
    else:
        pool = np.arange(scores.shape[0])
    order = pool[np.lexsort((pool, -scores[pool]))][:count]
    return [(int(i), float(scores[i])) for i in order]
