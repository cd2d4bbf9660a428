"""The two bounds (always / never retrieve) and CBDR's confidence threshold."""

from __future__ import annotations

import numpy as np

from confrag.cbdr.gate import check_beta, should_retrieve
from confrag.gates.base import Decision, Gate, GateSignals


class AlwaysGate(Gate):
    """Standard RAG: every question retrieves."""

    name = "always"

    def __init__(self) -> None:
        super().__init__()

    def _decide(self, signals: GateSignals) -> list[Decision]:
        return [Decision.RETRIEVE] * len(signals)


class NeverGate(Gate):
    """Closed-book: every question is answered from parametric knowledge."""

    name = "never"

    def __init__(self) -> None:
        super().__init__()

    def _decide(self, signals: GateSignals) -> list[Decision]:
        return [Decision.PARAMETRIC] * len(signals)


class CBDRGate(Gate):
    """CBDR (paper §3.3): retrieve iff Conf(H(Q)) < β. β = 0 means "CBDR off", i.e. always retrieve
    (the convention of the paper's Table 3, where β = 0 is the retrieval rate 100 % row).

    The QA-prompt forward that yields H(Q) is the prefill of the closed-book answer, so a parametric
    decision costs one LLM call and a retrieval two. This gate decides from precomputed signals (the
    comparison of gates); `confrag.cbdr.ConfidenceGate` is the same rule run live on a question."""

    name = "cbdr"
    needs = frozenset({"confidence"})
    decision_passes = 1
    decision_is_closed_book = True

    def __init__(self, beta: float) -> None:
        # The rule and its check are CBDR's own (confrag.cbdr), so this gate and the β sweep agree.
        self.beta = check_beta(beta)
        super().__init__(beta=beta)

    retrieves_below = True

    def threshold_scores(self, signals: GateSignals) -> np.ndarray:
        return np.asarray(signals.confidence, dtype=np.float64)

    def _decide(self, signals: GateSignals) -> list[Decision]:
        retrieve = should_retrieve(signals.confidence, self.beta)
        return [Decision.RETRIEVE if r else Decision.PARAMETRIC for r in retrieve]
