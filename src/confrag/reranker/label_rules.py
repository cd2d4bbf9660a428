"""The label rules of NQ_Rerank: how one question's candidates become `pos` and `neg` (`preferences.selection`,
`preferences.compare`; the rules are described in `confrag.reranker.preferences`). A new rule is one `RULES` entry."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np


def select_by_sign(inc: np.ndarray, top_k: int) -> tuple[list[int], list[int]]:
    """Indices of the top-K contexts with Inc > 0 (largest first) and with Inc < 0 (smallest first).
    Ties keep the retrieval order."""
    if top_k < 1:
        raise ValueError(f"top_k must be >= 1 (got {top_k})")
    order_pos = sorted((i for i in range(len(inc)) if inc[i] > 0), key=lambda i: -inc[i])
    order_neg = sorted((i for i in range(len(inc)) if inc[i] < 0), key=lambda i: inc[i])
    return order_pos[:top_k], order_neg[:top_k]


def select_by_rank(conf: np.ndarray, top_k: int) -> tuple[list[int], list[int]]:
    """Indices of the K highest Conf(Q + Ci) (highest first) and the K lowest (lowest first), at most half of
    the candidates each so that no context is on both sides. Ties keep the retrieval order."""
    if top_k < 1:
        raise ValueError(f"top_k must be >= 1 (got {top_k})")
    k = min(top_k, len(conf) // 2)
    order = sorted(range(len(conf)), key=lambda i: -conf[i])
    low = sorted(range(len(conf)), key=lambda i: conf[i])
    return order[:k], low[:k]


def select_by_utility(correct: Sequence[bool], top_k: int) -> tuple[list[int], list[int]]:
    """Indices of the first K candidates under which the LLM answered correctly, and the first K under
    which it did not (retrieval order)."""
    if top_k < 1:
        raise ValueError(f"top_k must be >= 1 (got {top_k})")
    return ([i for i, ok in enumerate(correct) if ok][:top_k], [i for i, ok in enumerate(correct) if not ok][:top_k])


@dataclass(frozen=True)
class LabelRule:
    """A rule turning one question's candidates into (pos, neg) indices; `needs_answers`: it reads the LLM's
    answer under every candidate (the answers are generated only when a rule, or `select_on`, needs them);
    `uses_reference`: it thresholds Inc, so the reference prompt's confidence decides its labels."""

    id: str
    description: str
    pick: Callable[[np.ndarray, np.ndarray, Sequence[bool] | None, int], tuple[list[int], list[int]]]
    needs_answers: bool = False
    uses_reference: bool = False


# The label rules by id (`preferences.selection`, `preferences.compare`); a new rule is one entry.
RULES: dict[str, LabelRule] = {
    rule.id: rule
    for rule in (
        LabelRule(
            "sign",
            "the paper: Inc > 0 pos, Inc < 0 neg",
            lambda inc, conf, correct, k: select_by_sign(inc, k),
            uses_reference=True,
        ),
        LabelRule("rank", "the K highest / lowest Conf(Q + C)", lambda inc, conf, correct, k: select_by_rank(conf, k)),
        LabelRule(
            "utility",
            "the LLM's actual answer under each candidate",
            lambda inc, conf, correct, k: select_by_utility(correct, k),
            needs_answers=True,
        ),
    )
}
SELECTIONS = tuple(RULES)


def check_selection(selection: str, utility: Sequence[np.ndarray] | None = None) -> str:
    if selection not in RULES:
        raise ValueError(f"selection={selection!r} is not one of {SELECTIONS}")
    if RULES[selection].needs_answers and utility is None:
        raise ValueError(f"selection={selection} needs the LLM's answer under every candidate (utility)")
    return selection


def select(
    selection: str, inc: np.ndarray, conf: np.ndarray, correct: Sequence[bool] | None, top_k: int
) -> tuple[list[int], list[int]]:
    """One question's (pos, neg) indices under a rule (see the module docstring)."""
    if selection not in RULES:
        raise ValueError(f"selection={selection!r} is not one of {SELECTIONS}")
    return RULES[selection].pick(inc, conf, correct, top_k)
