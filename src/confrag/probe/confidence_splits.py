"""NQ_Confidence's splits: questions split train/dev/test by question, stratified on the closed-book label,
and each split's examples class-balanced by down-sampling (the paper's 1000/300/500)."""

from __future__ import annotations

import numpy as np

from confrag.infra import checks
from confrag.probe.prompt_kinds import Example, kind_order

PAPER_SPLIT_SIZES = {"train": 1000, "dev": 300, "test": 500}
SPLITS = tuple(PAPER_SPLIT_SIZES)


def stratified_question_splits(labels: np.ndarray, seed: int, sizes: dict[str, int] = PAPER_SPLIT_SIZES) -> list[str]:
    """Assign every question to a split, per class in the proportions of `sizes`."""
    rng = np.random.default_rng(seed)
    labels = np.asarray(labels)
    total = sum(sizes.values())
    split_of = [""] * len(labels)
    for cls in (0, 1):
        members = rng.permutation(np.flatnonzero(labels == cls))
        bounds = np.cumsum([round(len(members) * sizes[s] / total) for s in SPLITS[:-1]])
        for split, chunk in zip(SPLITS, np.split(members, bounds)):
            for index in chunk:
                split_of[int(index)] = split
    return split_of


def check_splits(sizes: dict[str, int], key: str) -> dict[str, int]:
    """Positive sizes for exactly train, dev and test (`key` names the setting in the error)."""
    sizes = dict(sizes)
    if set(sizes) != set(SPLITS) or any(not checks.is_integer(v) or v < 1 for v in sizes.values()):
        raise ValueError(f"{key} must give positive integer sizes for exactly {SPLITS}; got {sizes}")
    return sizes


def balanced_examples(candidates: list[Example], cap: int, seed: int) -> list[Example]:
    """Equal numbers of positives and negatives (the smaller class, at most `cap` each), seeded."""
    rng = np.random.default_rng(seed)
    by_class = [[e for e in candidates if e.label == cls] for cls in (0, 1)]
    count = min(cap, *(len(group) for group in by_class))
    chosen = [group[i] for group in by_class for i in sorted(rng.choice(len(group), count, replace=False))]
    return sorted(chosen, key=lambda e: (kind_order(e.kind), e.index))
