"""Choosing an aligned reranker's weights by the answers they lead to (`preferences.select_on=dev_top1`).

The reranker is trained to put contexts that help the LLM first, so its weights are chosen on that: the share of
dev questions whose top-1 candidate, alone in the RAG prompt, made the LLM answer correctly. That answer is
already known for every candidate (the `utility` rule's answers, one per candidate, from the answer cache), so a
dev evaluation is a lookup, not generation. The weights before the first step (the base reranker) are a
candidate too: alignment that makes the answers worse on dev is not kept.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import lightning as L
import numpy as np
from lightning.pytorch.callbacks import Callback

from confrag.infra.digests import fingerprint

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DevTop1:
    """Dev questions: each one's candidate passages and whether the LLM answered correctly under each alone."""

    queries: tuple[str, ...]
    passages: tuple[tuple[str, ...], ...]
    correct: tuple[tuple[bool, ...], ...]

    def __post_init__(self) -> None:
        if not self.queries:
            raise ValueError("the dev set for choosing a reranker's weights is empty: raise preferences.dev_fraction")
        for q, ps, cs in zip(self.queries, self.passages, self.correct, strict=True):
            if len(ps) != len(cs) or not ps:
                raise ValueError(f"dev question {q[:60]!r}: {len(ps)} passages for {len(cs)} answers")

    def accuracy(self, score) -> float:
        """Top-1 accuracy of a `score(queries, passages) -> scores` over the dev questions."""
        flat_q = [q for q, ps in zip(self.queries, self.passages) for _ in ps]
        flat_p = [p for ps in self.passages for p in ps]
        scores = np.asarray(score(flat_q, flat_p), dtype=np.float64)
        bounds = np.cumsum([0] + [len(ps) for ps in self.passages])
        hits = [cs[int(np.argmax(scores[a:b]))] for cs, a, b in zip(self.correct, bounds[:-1], bounds[1:])]
        return float(np.mean(hits))

    def key(self) -> str:
        return fingerprint([self.queries, self.passages, self.correct])


class DevTop1Selection(Callback):
    """Evaluates dev Top-1 before training and `evaluations` times over training; at the end of fit the module
    holds the best weights (the earliest of equals), and `history` the (step, accuracy) pairs."""

    def __init__(self, dev: DevTop1, evaluations: int = 4, batch_size: int = 32) -> None:
        self.dev, self.evaluations, self.batch_size = dev, max(1, int(evaluations)), batch_size
        self.history: list[tuple[int, float]] = []
        self.best: tuple[float, int, dict] | None = None
        self._every = 1

    def _evaluate(self, trainer: L.Trainer, module) -> None:
        accuracy = self.dev.accuracy(lambda q, p: module.score(q, p, batch_size=self.batch_size))
        step = int(trainer.global_step)
        self.history.append((step, accuracy))
        log.info("dev Top-1 at step %d: %.3f", step, accuracy)
        if self.best is None or accuracy > self.best[0]:
            self.best = (accuracy, step, copy.deepcopy(module.state_dict()))

    def on_train_start(self, trainer: L.Trainer, module) -> None:
        total = int(trainer.estimated_stepping_batches)
        self._every = max(1, total // self.evaluations)
        self._evaluate(trainer, module)

    def on_train_batch_end(self, trainer: L.Trainer, module, outputs, batch, batch_idx: int) -> None:
        if trainer.global_step % self._every == 0 and trainer.global_step not in {s for s, _ in self.history}:
            self._evaluate(trainer, module)

    def on_train_end(self, trainer: L.Trainer, module) -> None:
        if trainer.global_step not in {s for s, _ in self.history}:
            self._evaluate(trainer, module)
        accuracy, step, state = self.best
        module.load_state_dict(state)
        log.info("weights of step %d kept (dev Top-1 %.3f of %s)", step, accuracy, self.history)

    @property
    def chosen(self) -> dict:
        accuracy, step, _ = self.best
        return {
            "selected_step": step,
            "dev_top1": accuracy,
            "dev_history": self.history,
            "dev_questions": len(self.dev.queries),
        }


def kept_start(info: dict) -> bool:
    """Whether the dev guard kept the weights training started from (step 0: the base's, for an aligned
    reranker), from a training's `confrag_training.json` record."""
    return info.get("selected_step") == 0


def dev_set(queries: Sequence[str], passages: Sequence[Sequence[str]], correct: Sequence[Sequence[bool]]) -> DevTop1:
    return DevTop1(
        tuple(queries), tuple(tuple(p) for p in passages), tuple(tuple(bool(c) for c in cs) for cs in correct)
    )
