"""A confidence direction in hidden-state space (representation engineering), and how to read it.

Kept apart from the gates that use it: `GateTrainingData` (gates.base) carries one, CtrlA (gates.ctrla)
fits and reads it; neither module then needs the other.

The direction at each layer is the first principal direction of the hidden-state differences between
paired "confident" and "unconfident" prompts. The SVD is taken without centering: the pairs'
differences share a sign, and centering would remove exactly the common direction. Its sign is fixed
so that confident prompts project higher.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ConfidenceDirection:
    layers: tuple[int, ...]
    directions: np.ndarray  # (len(layers), d), unit rows
    centers: np.ndarray  # (len(layers), d)

    def project(self, hidden_states: np.ndarray, hidden_layers: Sequence[int]) -> np.ndarray:
        """(n,) scores of states (len(hidden_layers), n, d); every direction layer must be present."""
        hidden_layers = [int(layer) for layer in hidden_layers]
        missing = [layer for layer in self.layers if layer not in hidden_layers]
        if missing:
            raise ValueError(
                f"the confidence direction is at layers {list(self.layers)}; signals.hidden_states "
                f"lack layer(s) {missing} (they hold {hidden_layers})"
            )
        states = np.stack(
            [np.asarray(hidden_states[hidden_layers.index(layer)], dtype=np.float64) for layer in self.layers]
        )
        return np.einsum("lnd,ld->n", states - self.centers[:, None, :], self.directions) / len(self.layers)


def direction_from_states(confident: np.ndarray, unconfident: np.ndarray, layers: Sequence[int]) -> ConfidenceDirection:
    """Direction from paired states of shape (len(layers), n_pairs, d)."""
    confident = np.asarray(confident, dtype=np.float64)
    unconfident = np.asarray(unconfident, dtype=np.float64)
    if confident.shape != unconfident.shape or confident.ndim != 3 or confident.shape[0] != len(layers):
        raise ValueError(
            f"confident and unconfident states must both have shape (len(layers)={len(layers)}, "
            f"pairs, d); got {confident.shape} and {unconfident.shape}"
        )
    if confident.shape[1] < 1:
        raise ValueError("at least one contrastive prompt pair is needed")
    directions = []
    for diff in confident - unconfident:
        _, _, vt = np.linalg.svd(diff, full_matrices=False)
        direction = vt[0]
        if diff.mean(axis=0) @ direction < 0:
            direction = -direction
        directions.append(direction)
    centers = (confident + unconfident).mean(axis=1) / 2
    return ConfidenceDirection(layers=tuple(int(x) for x in layers), directions=np.stack(directions), centers=centers)
