"""Why a label rule keeps few NQ_Rerank questions, told to the user while the stage runs."""

from __future__ import annotations

import numpy as np

from confrag.reranker.preferences import ConfidenceShifts


def sparse_rule_message(
    rule: str, drops: dict[str, int], questions: int, shifts: ConfidenceShifts | None = None, reference: str = ""
) -> str | None:
    """What to tell the user when a rule drops most questions (None when it keeps at least half). With `sign`, the
    usual cause is the reference: measured with a probe trained only on retrieved candidates' states, Inc > 0 for
    97.9 % of candidates because the empty-context reference lies outside its training states."""
    lost = sum(drops.values())
    if not questions or lost <= questions / 2:
        return None
    message = f"NQ_Rerank rule {rule} keeps {questions - lost} of {questions} questions (dropped: {drops})"
    if rule == "sign" and shifts is not None and reference:
        inc = np.concatenate([shifts.candidates[i] - shifts.reference[reference][i] for i in range(questions)])
        message += (
            f"; Inc against the {reference} reference is positive for {100 * float((inc > 0).mean()):.1f} % of "
            "candidates (a probe never trained on the reference's prompt, e.g. train_states=candidates, scores it out "
            "of distribution): preferences.selection=rank needs no reference"
        )
    return message
