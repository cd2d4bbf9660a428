"""The label rules of NQ_Rerank: how one question's candidates become `pos` and `neg` (`preferences.selection`,
`preferences.compare`). `RULES` is their catalogue: each rule's id, what it does (its `description`, the one place
it is written: the docs and the config point here) and what it needs. A new rule is one `RULES` entry."""

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
            "the paper's: the top-K candidates with Inc > 0 are pos (largest first), the top-K with Inc < 0 neg (most "
            "negative first); a question lacking either is dropped and counted",
            lambda inc, conf, correct, k: select_by_sign(inc, k),
            uses_reference=True,
        ),
        LabelRule(
            "rank",
            "the K highest Conf(Q + C) of the question are pos, the K lowest neg (at most half of the candidates "
            "each): no threshold, so the reference cancels out",
            lambda inc, conf, correct, k: select_by_rank(conf, k),
        ),
        LabelRule(
            "utility",
            "the LLM's own greedy answer under each candidate, what the probe stands in for: the first K under which "
            "it answers right (has_answer) are pos, the first K under which it does not neg, in retrieval order",
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


def sparse_rule_message(
    rule: LabelRule, drops: dict[str, int], questions: int, share_positive: float | None = None, reference: str = ""
) -> str | None:
    """What to tell the user while NQ_Rerank runs when `rule` drops most questions (None when it keeps at least
    half). For a rule that thresholds Inc the usual cause is the reference: a probe never trained on the
    reference's prompt (e.g. `train_states=candidates`) scores it out of distribution, and Inc comes out positive
    for nearly every candidate. `share_positive`: the share of candidates with Inc > 0 against `reference` (the
    dataset report's)."""
    lost = sum(drops.values())
    if not questions or lost <= questions / 2:
        return None
    message = f"NQ_Rerank rule {rule.id} keeps {questions - lost} of {questions} questions (dropped: {drops})"
    if rule.uses_reference and share_positive is not None and reference:
        message += (
            f"; Inc against the {reference} reference is positive for {100 * share_positive:.1f} % of candidates (a "
            "probe never trained on the reference's prompt, e.g. train_states=candidates, scores it out of "
            "distribution): preferences.selection=rank needs no reference"
        )
    return message
