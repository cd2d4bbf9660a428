"""Group InfoNCE (papers, eq. 6-7) and an optional distillation term from the teacher's Inc scores.

Scores come in groups of G per query, the positive at index 0 and G−1 negatives after it:

    L = −log( exp(s⁺/τ) / (exp(s⁺/τ) + Σ_i exp(s⁻_i/τ)) ) = cross_entropy(s/τ, target 0),

averaged over the batch. This is what FlagEmbedding's reranker trainer computes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _check_temperature(temperature: float, key: str) -> float:
    if not temperature > 0:  # also refuses NaN
        raise ValueError(f"{key} must be > 0 (got {temperature!r}): the scores are divided by it")
    return float(temperature)


def _check_groups(scores: torch.Tensor) -> None:
    if scores.dim() != 2 or scores.shape[1] < 2:
        raise ValueError(
            f"scores must have shape (batch, group) with group >= 2 (data.group_size); got {tuple(scores.shape)}"
        )


def group_infonce(scores: torch.Tensor, temperature: float) -> torch.Tensor:
    """Mean cross-entropy of scores / τ with the positive at index 0 of each group."""
    tau = _check_temperature(temperature, "temperature")
    _check_groups(scores)
    target = torch.zeros(scores.shape[0], dtype=torch.long, device=scores.device)
    return F.cross_entropy(scores.float() / tau, target)


def distillation_kl(
    scores: torch.Tensor, teacher_scores: torch.Tensor, temperature: float, teacher_temperature: float | None = None
) -> torch.Tensor:
    """KL(teacher ‖ student) over each group, averaged over the batch.

    The teacher's distribution is softmax(Inc / τ_t), the student's softmax(scores / τ). Inc values are
    differences of probabilities (|Inc| ≤ 1, typically a few hundredths), so with τ_t = τ = 1 the
    teacher is almost uniform and the term pulls the student towards indifference; a small
    `teacher_temperature` (model.distill_tau) sharpens it. The teacher gets no gradient."""
    tau = _check_temperature(temperature, "temperature")
    tau_t = _check_temperature(
        temperature if teacher_temperature is None else teacher_temperature, "teacher_temperature"
    )
    _check_groups(scores)
    if teacher_scores.shape != scores.shape:
        raise ValueError(
            f"teacher scores have shape {tuple(teacher_scores.shape)}, student scores {tuple(scores.shape)}"
        )
    student = F.log_softmax(scores.float() / tau, dim=-1)
    teacher = F.log_softmax(teacher_scores.detach().float().to(scores.device) / tau_t, dim=-1)
    return F.kl_div(student, teacher, reduction="batchmean", log_target=True)


def listwise_kl(
    scores: torch.Tensor, target_logits: torch.Tensor, mask: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """KL(softmax(target_logits) ‖ softmax(scores / τ)) over each row's valid candidates, averaged over rows: the
    listwise distillation of REPLUG's LM-supervised retrieval, RA-DIT's retriever step and Atlas's perplexity
    distillation.

    Rows are questions, columns their candidates, padded: `mask` is False on padding. The target may put zero
    probability on candidates (a logit of -inf: e.g. a multi-positive target spread over the relevant passages
    only); those terms are 0 in the KL, written out because `F.kl_div` gives 0 · (-inf) = NaN there. The target
    gets no gradient; its temperature is the caller's (the logits come already divided by it)."""
    tau = _check_temperature(temperature, "temperature")
    if scores.dim() != 2 or scores.shape != target_logits.shape or scores.shape != mask.shape:
        raise ValueError(
            f"scores, target_logits and mask must share one (questions, candidates) shape; got "
            f"{tuple(scores.shape)}, {tuple(target_logits.shape)}, {tuple(mask.shape)}"
        )
    mask = mask.to(torch.bool)
    target = target_logits.detach().float().masked_fill(~mask, float("-inf"))
    if not torch.isfinite(target).any(dim=1).all():
        raise ValueError("a row of the listwise target has no candidate with a finite logit (nothing to learn)")
    student = F.log_softmax((scores.float() / tau).masked_fill(~mask, float("-inf")), dim=1)
    teacher = F.log_softmax(target, dim=1)
    p = teacher.exp()
    # Zero-probability terms are 0; zeroing both logs first keeps -inf - -inf (NaN) out of forward and backward.
    void = p == 0
    terms = p * (teacher.masked_fill(void, 0.0) - student.masked_fill(void, 0.0))
    return terms.sum(dim=1).mean()
