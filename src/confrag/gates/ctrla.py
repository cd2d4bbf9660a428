"""CtrlA's confidence direction (Liu et al., 2024), read once per question.

The direction at each chosen layer is the first principal direction of the hidden-state differences
between paired "confident" and "unconfident" prompts (representation engineering). The SVD is taken
without centering: the pairs' differences share a sign, and centering would remove exactly the common
direction (RepE reaches the same axis by flipping pair order at random before a centred PCA). Its sign
is fixed so that confident prompts project higher.

A question's score is the mean over layers of (H_l(Q) - c_l) . d_l, with c_l the mean of all contrastive
states at layer l, so 0 sits between the two prompt groups. Retrieve when the score < threshold.
CtrlA monitors the direction while generating and also uses an honesty direction; here it gates once,
before answering, on the QA prompt's last token (the state the CBDR probe reads).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from transformers import PreTrainedTokenizerBase

from confrag.gates.base import Decision, Gate, GateSignals, GateTrainingData
from confrag.gates.directions import ConfidenceDirection, direction_from_states
from confrag.infra import checks


def check_template(key: str, template: str) -> str:
    if not isinstance(template, str) or "{question}" not in template:
        raise ValueError(f"{key} must be a string containing {{question}}; got {template!r}")
    return template


def contrastive_prompts(
    tokenizer: PreTrainedTokenizerBase,
    questions: Sequence[str],
    confident_template: str,
    unconfident_template: str,
) -> tuple[list[str], list[str]]:
    """Paired chat prompts (confident, unconfident) per question, through the model's chat template."""
    check_template("confident_template", confident_template)
    check_template("unconfident_template", unconfident_template)
    if tokenizer.chat_template is None:
        raise ValueError("the tokenizer has no chat template; set llm.chat_template")

    def render(template: str, question: str) -> str:
        messages = [{"role": "user", "content": template.format(question=question)}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    return [render(confident_template, q) for q in questions], [render(unconfident_template, q) for q in questions]


class CtrlAGate(Gate):
    name = "ctrla"
    needs = frozenset({"hidden_states"})
    training_needs = frozenset({"confidence_direction"})
    decision_passes = 1  # the QA-prompt prefill, continued as the closed-book answer
    decision_is_closed_book = True

    def __init__(
        self,
        threshold: float,
        layers: Sequence[int] | None,
        confident_template: str,
        unconfident_template: str,
    ) -> None:
        # The templates are what the direction is computed from (contrastive_prompts): part of
        # the gate's identity even though decide() only reads the finished direction.
        checks.number(threshold, "threshold")
        check_template("confident_template", confident_template)
        check_template("unconfident_template", unconfident_template)
        if layers is not None:
            layers = [int(checks.integer(layer, "layers[]", 0)) for layer in layers]
            if not layers:
                raise ValueError("layers must be null (the direction's layers) or a non-empty list of layers")
        super().__init__(
            threshold=threshold,
            layers=layers,
            confident_template=confident_template,
            unconfident_template=unconfident_template,
        )
        self.confident_template, self.unconfident_template = confident_template, unconfident_template
        self.threshold = float(threshold)
        self.layers = layers
        self.direction: ConfidenceDirection | None = None

    def _fit(self, train: GateTrainingData) -> None:
        direction = train.confidence_direction
        if self.layers is not None and sorted(direction.layers) != sorted(self.layers):
            raise ValueError(
                f"layers={self.layers} but the confidence direction was computed at layers "
                f"{list(direction.layers)}; recompute it at those layers"
            )
        self.direction = direction

    def state_layers(self, default_layer: int) -> tuple[int, ...]:
        """The gate's layers, or `default_layer` (Layer/2, the state the CBDR probe reads) when it leaves them
        to the direction."""
        return tuple(sorted(self.layers)) if self.layers else (default_layer,)

    def extras_key(self, default_layer: int) -> tuple:
        return self.state_layers(default_layer), self.confident_template, self.unconfident_template

    def training_extras(self, maker: Any, rows: Sequence[Any]) -> dict[str, Any]:
        """The confidence direction from the training questions' paired prompts (their states through
        `maker.states`, cached)."""
        confident, unconfident = contrastive_prompts(
            maker.llm.tokenizer, [r.question for r in rows], self.confident_template, self.unconfident_template
        )
        confident_states, layers = maker.states(confident, self.state_layers(maker.llm.mid_layer))
        unconfident_states, _ = maker.states(unconfident, layers)
        return {"confidence_direction": direction_from_states(confident_states, unconfident_states, layers)}

    retrieves_below = True

    def scores(self, signals: GateSignals) -> np.ndarray:
        return self.direction.project(signals.hidden_states, signals.hidden_layers)

    def threshold_scores(self, signals: GateSignals) -> np.ndarray:
        return np.asarray(self.scores(signals), dtype=np.float64)

    def _decide(self, signals: GateSignals) -> list[Decision]:
        return [Decision.RETRIEVE if s < self.threshold else Decision.PARAMETRIC for s in self.scores(signals)]
