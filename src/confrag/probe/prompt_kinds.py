"""The prompt kinds of NQ_Confidence (`qa`, `rag_gold`, `rag_other`, one `rag_cand<j>` per retrieved candidate,
the flat `rag_pairs`), which kinds each `data.train_states` option uses, and a training example: a state of
one kind with its label."""

from __future__ import annotations

from dataclasses import dataclass

KINDS = ("qa", "rag_gold", "rag_other")
CANDIDATE_KIND = "rag_cand"
# One state per (question, retrieved candidate) pair, every candidate of every question (`candidates`).
PAIRS_KIND = "rag_pairs"
TRAIN_STATES = {
    "qa": ("qa",),
    "qa+rag": ("qa", "rag_gold", "rag_other"),
    "qa+candidates": ("qa",),
    "qa+rag+candidates": ("qa", "rag_gold", "rag_other"),
    # The post-retrieval probe as the reference trains it: candidate states only, each labelled by the LLM's
    # answer under that candidate, the question's whole candidate list (duplicates removed), no fixed ranks.
    "candidates": (),
}


def uses_candidates(train_states: str) -> bool:
    return train_states.endswith("candidates")


def pairs_only(train_states: str) -> bool:
    """Whether the option trains on the flat (question, candidate) pairs alone (`candidates`)."""
    return train_states == "candidates"


def kinds_of(train_states: str, num_candidates: int) -> tuple[str, ...]:
    """The prompt kinds of a `train_states` option; `+candidates` adds one kind per retrieved candidate."""
    if train_states not in TRAIN_STATES:
        raise ValueError(f"train_states={train_states!r} is not one of {tuple(TRAIN_STATES)}")
    extra = tuple(f"{CANDIDATE_KIND}{j}" for j in range(num_candidates)) if uses_candidates(train_states) else ()
    return TRAIN_STATES[train_states] + extra


def kind_order(kind: str) -> tuple[int, int]:
    """Sort key of a prompt kind: the fixed kinds first, then the candidates by rank."""
    if kind == PAIRS_KIND:
        return len(KINDS) + 1, 0
    if kind.startswith(CANDIDATE_KIND):
        return len(KINDS), int(kind[len(CANDIDATE_KIND) :])
    return KINDS.index(kind), 0


@dataclass(frozen=True)
class Example:
    kind: str
    index: int  # row in the kind's activation store: the question's row in `ConfidenceData.rows`, or the pair's
    label: int
