"""Where NQ_Rerank's Conf(Q + C) and Conf(reference) come from (`preferences.confidence`), one table entry each:

- `probe` (the paper): the probe on the LLM's Layer/2 state of each prompt (`preferences.confidence_shifts`);
- `relevance`: the perfect-relevance control. Conf(Q + C) = 1 on the passages of the question's own paragraph, 0
  elsewhere, every reference at 0.5: labels that know which passage is relevant and nothing else. Through `sign` and
  `rank` at K = 5 and K = 1 it shows what each label rule does with perfect labels when a question has about one
  relevant passage, so a loss of the aligned reranker can be told apart from the probe's error. A question whose own
  paragraph was not retrieved has Conf 0 everywhere (sign: no positive, dropped; rank: ties kept in retrieval order).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from confrag.infra.sharded import ShardedCache
from confrag.llm.prompted import PromptedLLM
from confrag.reranker.preferences import REFERENCES, ConfidenceShifts, confidence_shifts
from confrag.retrieval.candidates import Candidates

RELEVANCE_REFERENCE = 0.5


@dataclass(frozen=True)
class ConfidenceInputs:
    """What a source may read: the LLM with its templates, the probe, the engine, the cache."""

    prompted: PromptedLLM
    probe: Any
    engine: Any
    cache_dir: Any
    progress: bool


def probe_shifts(candidates: Sequence[Candidates], inputs: ConfidenceInputs) -> ConfidenceShifts:
    return confidence_shifts(
        inputs.prompted,
        inputs.probe,
        candidates,
        engine=inputs.engine,
        cache=ShardedCache(inputs.cache_dir, progress=inputs.progress),
    )


def relevance_shifts(candidates: Sequence[Candidates], inputs: ConfidenceInputs | None = None) -> ConfidenceShifts:
    reference = np.full(len(candidates), RELEVANCE_REFERENCE, dtype=np.float32)
    return ConfidenceShifts(
        {kind: reference.copy() for kind in REFERENCES},
        [np.asarray(c.from_gold, dtype=np.float32) for c in candidates],
    )


SOURCES: dict[str, Callable[[Sequence[Candidates], ConfidenceInputs], ConfidenceShifts]] = {
    "probe": probe_shifts,
    "relevance": relevance_shifts,
}
# The sources that read each question's own (gold) paragraph: a question set without any cannot use them.
GOLD_SOURCES = frozenset({"relevance"})
