"""The probe as a ranker of retrieved contexts, measured where the probe is trained.

Downstream, the probe is used for one thing: Conf(Q + C) orders a question's retrieved candidates
(NQ_Rerank's labels, the probe-as-reranker row). A probe selected on AUROC over a balanced mix of QA and
RAG states can be no better at that than chance (docs/results.md), so the probe stage measures the use
itself: the dev questions' candidates, retrieved with the same top-N and duplicate removal as where the
probe is applied, are scored at every validation, and the checkpoint (and any hyper-parameter search) is
chosen by where the question's own paragraph lands (`gold_mrr`, `gold_first`). The own paragraph is the
one candidate known to help without asking the LLM, so no answers are generated for it: one state per
candidate, through the activation cache.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from confrag.infra.activation_store import ActivationStore
from confrag.infra.digests import fingerprint
from confrag.infra.sharded import ShardedArtifact, ShardedCache
from confrag.llm.hidden_states import HiddenStateEngine
from confrag.llm.prompted import PromptedLLM
from confrag.retrieval.candidates import Candidates

# The metric checkpoints and sweeps select on: smoother than gold_first on a few dozen dev questions.
SELECTION_METRIC = "gold_mrr"


def state_artifact(
    cache: ShardedCache,
    prompted: PromptedLLM,
    kind: str,
    rows_key: str,
    layer: int | Sequence[int],
    num_items: int,
    extra: dict | None = None,
) -> ShardedArtifact:
    """The cached states of one layer (or several) for `num_items` prompts of one kind over the questions
    `rows_key`, in `cache`, for `prompted`'s LLM and prompts."""
    spec = {
        "llm": prompted.llm.identity,
        "prompts": prompted.prompts_identity,
        "rows": rows_key,
        "kind": kind,
        **(extra or {}),
        "layers": [int(layer)] if isinstance(layer, (int, np.integer)) else [int(x) for x in layer],
        "store": "float32",
    }
    return cache.artifact("activations", spec, num_items, fmt="npy")


def candidate_states(
    prompted: PromptedLLM,
    candidate_sets: Sequence[Candidates],
    layer: int,
    *,
    engine: HiddenStateEngine | Callable[[], HiddenStateEngine],
    cache: ShardedCache,
    layers: Sequence[int] | None = None,
    extraction: dict | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """The layer-`layer` state of the RAG prompt holding each candidate alone, every question's candidates
    in order (one sharded, resumable artifact), and the bounds of each question's rows. `layers`: the layers
    extracted into the artifact (default: `layer` alone), so that a layer sweep extracts once. `engine` may be
    a factory, called only when a shard must be computed (then no weights load when the cache is complete);
    with a factory, `extraction` is its settings' `extraction_key` (the engine's own is used otherwise)."""
    make_engine = engine if not isinstance(engine, HiddenStateEngine) else (lambda: engine)
    layers = [int(layer)] if layers is None else [int(x) for x in layers]
    if layer not in layers:
        raise ValueError(f"layer {layer} is not among the extracted layers {layers}")
    rows_key = fingerprint([[c.qid, c.question] for c in candidate_sets])
    pairs = [(c.question, p) for c in candidate_sets for p in c.passages]
    prompts = [prompted.rag_prompt(q, [p]) for q, p in pairs]
    contexts_key = fingerprint([[p.title, p.text] for _, p in pairs])
    artifact = state_artifact(
        cache,
        prompted,
        "rag_candidates",
        rows_key,
        layers,
        len(pairs),
        {"contexts": contexts_key, **(engine.key if isinstance(engine, HiddenStateEngine) else extraction or {})},
    )
    artifact.compute(
        lambda a, b: make_engine().extract(prompts[a:b], layers, desc="states [candidates]"),
        desc="candidate states",
        progress=cache.progress,
    )
    states = ActivationStore(artifact, layers).take(layer, range(len(pairs))) if pairs else np.zeros((0, 0))
    bounds = np.cumsum([0] + [len(c.passages) for c in candidate_sets])
    return np.asarray(states, dtype=np.float32), bounds


@dataclass
class RankingSet:
    """Questions' candidates with their states at the probe's layer: what `ranking_metrics` scores."""

    name: str  # dev | test
    candidates: list[Candidates]
    states: np.ndarray  # (candidates of every question, d), question by question
    bounds: np.ndarray  # question i's rows are states[bounds[i]:bounds[i + 1]]

    def __post_init__(self) -> None:
        if len(self.bounds) != len(self.candidates) + 1 or int(self.bounds[-1]) != len(self.states):
            raise ValueError(
                f"ranking set {self.name!r}: {len(self.states)} states do not match the candidates of "
                f"{len(self.candidates)} questions"
            )

    @classmethod
    def of(cls, name: str, parts: Sequence[tuple[Sequence[Candidates], np.ndarray]]) -> RankingSet:
        """One set from (candidates, their states) parts, in order."""
        candidates = [c for found, _ in parts for c in found]
        states = [s for _, s in parts if len(s)]
        bounds = np.cumsum([0] + [len(c.passages) for c in candidates])
        return cls(name, candidates, np.concatenate(states) if states else np.zeros((0, 0), np.float32), bounds)

    @property
    def gold(self) -> list[list[bool]]:
        return [c.from_gold for c in self.candidates]

    def split(self, scores: np.ndarray) -> list[np.ndarray]:
        return [scores[a:b] for a, b in zip(self.bounds[:-1], self.bounds[1:])]

    def metrics(self, scores: np.ndarray) -> dict[str, Any]:
        return ranking_metrics(self.split(np.asarray(scores)), self.gold)


def gold_rank(scores: np.ndarray, gold: Sequence[bool]) -> int | None:
    """1-based rank of the best-placed gold candidate when ordered by score (ties keep retrieval order);
    None when no candidate is gold."""
    flags = list(gold)
    if not any(flags):
        return None
    order = np.argsort(-np.asarray(scores, dtype=np.float64), kind="stable")
    return 1 + min(int(np.flatnonzero(order == j)[0]) for j, flag in enumerate(flags) if flag)


def ranking_metrics(scores: Sequence[np.ndarray], gold: Sequence[Sequence[bool]]) -> dict[str, Any]:
    """Where the question's own paragraph lands when each question's candidates are ordered by score:
    `gold_first` (share of questions with it first), `gold_mrr`, `gold_mean_rank`, and `chance_gold_first`
    (a random order's gold_first), over the questions whose candidates hold it."""
    if len(scores) != len(gold):
        raise ValueError(f"{len(scores)} score lists for {len(gold)} questions")
    ranks, chance = [], []
    for values, flags in zip(scores, gold):
        if len(values) != len(flags):
            raise ValueError(f"a question has {len(values)} scores for {len(flags)} candidates")
        rank = gold_rank(values, flags)
        if rank is not None:
            ranks.append(rank)
            chance.append(sum(flags) / len(flags))
    if not ranks:
        return {"questions": 0, "gold_first": None, "gold_mrr": None, "gold_mean_rank": None, "chance_gold_first": None}
    ranks_array = np.asarray(ranks, dtype=np.float64)
    return {
        "questions": len(ranks),
        "gold_first": float(np.mean(ranks_array == 1)),
        "gold_mrr": float(np.mean(1.0 / ranks_array)),
        "gold_mean_rank": float(ranks_array.mean()),
        "chance_gold_first": float(np.mean(chance)),
    }
