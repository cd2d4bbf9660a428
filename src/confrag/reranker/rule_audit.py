"""Why a label rule keeps few NQ_Rerank questions, told to the user while the stage runs."""

from __future__ import annotations

from confrag.reranker.label_rules import LabelRule


def sparse_rule_message(
    rule: LabelRule, drops: dict[str, int], questions: int, share_positive: float | None = None, reference: str = ""
) -> str | None:
    """What to tell the user when a rule drops most questions (None when it keeps at least half). For a rule that
    thresholds Inc, the usual cause is the reference: measured with a probe trained only on retrieved candidates'
    states, Inc > 0 for 97.9 % of candidates because the empty-context reference lies outside its training
    states. `share_positive`: the share of candidates with Inc > 0 against `reference` (the dataset report's)."""
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
