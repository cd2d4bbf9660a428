"""The teachers an aligned reranker learns from, one registry entry each (`ALIGNMENT_TEACHERS`, the `alignment.teacher`
of a run): the paper's rows, or a target distribution over each question's candidate list.

`inc` is the paper's: NQ_Rerank's pos / neg rows from the probe's confidence shift under a label rule
(`preferences.selection`, `compare`), trained with group InfoNCE (`confrag.reranker.module.RerankerModule`). Every
other teacher turns a question's candidates (and what it reads beside them: the LLM's likelihood ℓ of the gold answer
under each, the LLM's greedy answer under each, the base's scores) into target logits over the list; the aligned
student learns KL(softmax(target) ‖ softmax(score / τ)) + λ·KL(softmax(base / τ) ‖ softmax(score / τ))
(`confrag.reranker.loss.listwise_kl`, `confrag.reranker.listwise_student`). A logit of -inf gives a candidate zero
target probability. A question the teacher cannot label (no positive) gets None and is left out of training, counted
by the caller.

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
- `base`: the base's own scores / τ_T: the matched-steps control of every listwise row (what the same training does
  with a teacher that knows nothing beyond the base).

A new teacher is one entry of `ALIGNMENT_TEACHERS`: its target function and what it reads.
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
    likelihood: np.ndarray | None  # ℓ per candidate, aligned with candidates.passages (`likelihood` reads it)
    # The LLM's greedy answer under each candidate alone: 1 right, 0 wrong, -1 not answered (`utility` reads it).
    utility: np.ndarray | None = None
    base: np.ndarray | None = None  # the base's score of each candidate (`base` reads it)


def _uniform_over(flags: list[bool]) -> np.ndarray | None:
    flags = np.asarray(flags, dtype=bool)
    if not flags.any():
        return None
    return np.where(flags, 0.0, -np.inf).astype(np.float32)


def _graded(values: np.ndarray | None, what: str, inputs: TeacherInputs, temperature: float) -> np.ndarray:
    c = inputs.candidates
    if values is None:
        raise ValueError(f"{what} teacher: question {c.qid} has no {what} scores (TeacherInputs.{what})")
    values = np.asarray(values, dtype=np.float32)
    if values.shape != (len(c.passages),):
        raise ValueError(f"{what} teacher: question {c.qid} has {len(c.passages)} candidates but {values.shape} scores")
    require_finite(values, stage=f"{what} teacher", artifact=f"the {what} scores of question {c.qid}'s candidates")
    return values / np.float32(temperature)


def likelihood_target(inputs: TeacherInputs, temperature: float) -> np.ndarray | None:
    if inputs.likelihood is None:
        raise ValueError(f"likelihood teacher: question {inputs.candidates.qid} has no ℓ (TeacherInputs.likelihood)")
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


def base_target(inputs: TeacherInputs, temperature: float) -> np.ndarray | None:
    return _graded(inputs.base, "base", inputs, temperature)


Target = Callable[[TeacherInputs, float], np.ndarray | ListTarget | None]

# What a teacher may read beside the candidates (`Teacher.reads`): ℓ, the LLM's answer under each candidate, the
# base's scores. The stage computes only what its teachers read.
LIKELIHOOD, ANSWERS, BASE_SCORES = "likelihood", "answers", "base"


@dataclass(frozen=True)
class Teacher:
    """One teacher: what it is (the reports' words), its target over a question's list (None: the paper's rows,
    trained pairwise with group InfoNCE, not a listwise target), what it reads beside the candidates, and the
    students it can teach (None: every listwise student)."""

    description: str
    target: Target | None
    reads: frozenset[str] = frozenset()
    students: tuple[str, ...] | None = None

    @property
    def listwise(self) -> bool:
        return self.target is not None

    @property
    def graded(self) -> bool:
        """Whether its target is a graded score divided by τ_T (ℓ, the base's); the others ignore τ_T."""
        return bool(self.reads & {LIKELIHOOD, BASE_SCORES})


# name -> the teacher; τ_T divides the graded scores (ℓ, the base's) and is ignored by the others.
ALIGNMENT_TEACHERS: dict[str, Teacher] = {
    "inc": Teacher(
        "the paper's rows: the probe's confidence shift Inc under the label rules, group InfoNCE",
        None,
        students=("cross_encoder",),  # the model node's reranker, fine-tuned whole
    ),
    "likelihood": Teacher(
        "the LLM's likelihood of the gold answer under each candidate (REPLUG LSR)",
        likelihood_target,
        frozenset({LIKELIHOOD}),
    ),
    "utility": Teacher(
        "the candidates the LLM answers right under (its greedy answer, multi-positive)",
        utility_target,
        frozenset({ANSWERS}),
    ),
    "relevance": Teacher(
        "the passages of the question's own paragraph (the perfect-relevance control)", relevance_target
    ),
    "answer_bearing": Teacher("the candidates that hold a gold answer string", answer_bearing_target),
    "base": Teacher("the base's own scores (the matched-steps control)", base_target, frozenset({BASE_SCORES})),
}
LISTWISE = tuple(name for name, t in ALIGNMENT_TEACHERS.items() if t.listwise)


def teacher_targets(
    name: str, inputs: list[TeacherInputs], temperature: float
) -> tuple[list[np.ndarray | ListTarget | None], int]:
    """Each question's target logits (None where the teacher has no positive) and how many got None."""
    if name not in LISTWISE:
        raise ValueError(f"teacher must be one of {sorted(LISTWISE)} (a listwise teacher); got {name!r}")
    if not temperature > 0:
        raise ValueError(f"teacher temperature must be > 0; got {temperature!r}")
    target = ALIGNMENT_TEACHERS[name].target
    targets = [target(x, float(temperature)) for x in inputs]
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
