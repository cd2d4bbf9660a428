"""Listwise teachers: a target distribution over each question's whole candidate list, one table entry each.

A teacher turns a question's candidates (and the LLM's likelihood ℓ of the gold answer under each, where it
reads it) into target logits over the list; the aligned student learns KL(softmax(target) ‖ softmax(score / τ))
(`confrag.reranker.loss.listwise_kl`). A logit of -inf gives a candidate zero target probability. A question the
teacher cannot label (no positive) gets None and is left out of training, counted by the caller.

- `likelihood`: ℓ / τ_T, REPLUG LSR's target (softmax of the LM's score of the gold continuation under each
  document), RA-DIT's retriever step, Atlas's perplexity distillation. Graded over every candidate.
- `relevance`: the perfect-relevance control: uniform over the passages of the question's own paragraph, zero
  elsewhere. Trained exactly like `likelihood` (same steps, anchor, optimiser), it shows what the student does with
  a target that knows relevance and nothing about the LLM.
- `answer_bearing`: uniform over the candidates whose text holds a gold answer (distant supervision, DPR's
  positives): a multi-positive target that, unlike `relevance`, rewards any passage with the answer string.
- `utility`: uniform over the candidates the LLM answered right under (its greedy answer holds a gold answer):
  the utility labels used fully, multi-positive. An answer-bearing candidate the LLM failed under is left out of
  the list rather than pushed down as a negative (the passage holds the answer; the failure is the LLM's), and so
  is a candidate never answered (below the depth the labels were generated to).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from confrag.infra.finite import require_finite
from confrag.reranker.listwise_data import ListTarget
from confrag.retrieval.candidates import Candidates


@dataclass(frozen=True)
class TeacherInputs:
    """What a teacher may read for one question."""

    candidates: Candidates
    likelihood: np.ndarray  # ℓ per candidate, aligned with candidates.passages
    # The LLM's greedy answer under each candidate alone: 1 right, 0 wrong, -1 not answered (`utility` reads it).
    utility: np.ndarray | None = None


def _uniform_over(flags: list[bool]) -> np.ndarray | None:
    flags = np.asarray(flags, dtype=bool)
    if not flags.any():
        return None
    return np.where(flags, 0.0, -np.inf).astype(np.float32)


def likelihood_target(inputs: TeacherInputs, temperature: float) -> np.ndarray | None:
    ell = np.asarray(inputs.likelihood, dtype=np.float32)
    if ell.shape != (len(inputs.candidates.passages),):
        raise ValueError(
            f"likelihood teacher: question {inputs.candidates.qid} has {len(inputs.candidates.passages)} candidates "
            f"but {ell.shape} likelihoods"
        )
    require_finite(ell, stage="likelihood teacher", artifact=f"ℓ of question {inputs.candidates.qid}'s candidates")
    return ell / np.float32(temperature)


def relevance_target(inputs: TeacherInputs, temperature: float) -> np.ndarray | None:
    return _uniform_over(inputs.candidates.from_gold)


def answer_bearing_target(inputs: TeacherInputs, temperature: float) -> np.ndarray | None:
    return _uniform_over(inputs.candidates.has_answer)


def utility_target(inputs: TeacherInputs, temperature: float) -> ListTarget | None:
    c = inputs.candidates
    labels = inputs.utility
    if labels is None:
        raise ValueError(f"utility teacher: question {c.qid} has no answer labels (TeacherInputs.utility)")
    labels = np.asarray(labels)
    if labels.shape != (len(c.passages),) or not np.isin(labels, (-1, 0, 1)).all():
        raise ValueError(
            f"utility teacher: question {c.qid} needs one label in {{-1, 0, 1}} per candidate ({len(c.passages)}); "
            f"got {labels.tolist()}"
        )
    right = labels == 1
    if not right.any():
        return None
    wrong_without_answer = (labels == 0) & ~np.asarray(c.has_answer, dtype=bool)
    return ListTarget(np.where(right, 0.0, -np.inf).astype(np.float32), right | wrong_without_answer)


# name -> target logits of one question (None: no positive); τ_T divides ℓ and is ignored by the others.
LISTWISE_TEACHERS: dict[str, Callable[[TeacherInputs, float], np.ndarray | ListTarget | None]] = {
    "likelihood": likelihood_target,
    "relevance": relevance_target,
    "answer_bearing": answer_bearing_target,
    "utility": utility_target,
}


def teacher_targets(
    name: str, inputs: list[TeacherInputs], temperature: float
) -> tuple[list[np.ndarray | ListTarget | None], int]:
    """Each question's target logits (None where the teacher has no positive) and how many got None."""
    if name not in LISTWISE_TEACHERS:
        raise ValueError(f"teacher must be one of {sorted(LISTWISE_TEACHERS)}; got {name!r}")
    if not temperature > 0:
        raise ValueError(f"teacher temperature must be > 0; got {temperature!r}")
    targets = [LISTWISE_TEACHERS[name](x, float(temperature)) for x in inputs]
    return targets, sum(t is None for t in targets)


def likelihood_rows(candidate_sets: list[Candidates], likelihood: list[np.ndarray]) -> list[dict]:
    """The likelihood teacher's data as FlagEmbedding rows: per question, `pos` the candidate with the highest ℓ,
    `neg` the others, `pos_scores` / `neg_scores` their ℓ (FlagEmbedding's distillation fields), so the whole graded
    list travels in the format its trainers and this project's row readers take."""
    from confrag.reranker.rows import validate_rows
    from confrag.retrieval.corpus import document_text

    rows = []
    for c, ell in zip(candidate_sets, likelihood, strict=True):
        ell = np.asarray(ell, dtype=np.float64)
        require_finite(ell, stage="likelihood rows", artifact=f"ℓ of question {c.qid}'s candidates")
        if len(ell) != len(c.passages) or len(ell) < 2:
            raise ValueError(f"likelihood rows: question {c.qid} has {len(c.passages)} candidates, {len(ell)} ℓ (≥ 2)")
        top = int(np.argmax(ell))
        texts = [document_text(p) for p in c.passages]
        rest = [j for j in range(len(texts)) if j != top]
        rows.append(
            {
                "query": c.question,
                "pos": [texts[top]],
                "neg": [texts[j] for j in rest],
                "pos_scores": [float(ell[top])],
                "neg_scores": [float(ell[j]) for j in rest],
            }
        )
    return validate_rows(rows, "likelihood rows")
