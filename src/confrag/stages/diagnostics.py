"""Diagnostic rankers for Table 2: every link from probe to answer, measured on the evaluation questions.

- **probe as reranker**: each candidate ordered by Conf(Q + C) itself, no training; it measures whether the
  probe's post-retrieval confidence carries context preference at all, before any label is built from it;
- **utility oracle**: the candidates under which the LLM answered correctly first (from its greedy answer
  with each candidate alone, the Top-1 prompt, cached), then the rest in retrieval order: an upper bound on
  what any reranker of these candidates can reach at Top-1, marked as such.

Both read the same per-candidate data that also gives the probe's AUROC on held-out candidate states
(actual-answer labels), the number that says whether the probe transfers to retrieved contexts.

- **fusion** (`alignment.fusion_weight`): z(base) + w · z(ℓ) over a question's passages, ℓ the LLM's likelihood of
  the gold answer under each (`stages.likelihood`): the base's near-ties broken by ℓ. It reads the gold answer, so it
  is a bound on what a student of ℓ could add, in Tables 1 and 2, never a reranker a config may choose.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from sklearn.metrics import roc_auc_score

from confrag.infra.run_context import RunContext
from confrag.infra.sharded import ShardedCache
from confrag.llm.hidden_states import HiddenStateEngine
from confrag.llm.prompted import PromptedLLM
from confrag.probe.module import SavedProbe
from confrag.rag import AnswerStore
from confrag.reranker.preferences import confidence_shifts
from confrag.reranker.systems import ORACLE, PROBE
from confrag.retrieval import Candidates, document_text
from confrag.stages.nq_rerank import candidate_utility


def lookup_scorer(candidates: Sequence[Candidates], values: Sequence[np.ndarray]):
    """A Table 2 scorer over precomputed per-candidate values: (question, passage texts) -> their values."""
    table = {
        (c.question, document_text(p)): float(v) for c, vs in zip(candidates, values) for p, v in zip(c.passages, vs)
    }

    def score(question: str, passages: list[str]) -> np.ndarray:
        missing = [p[:60] for p in passages if (question, p) not in table]
        if missing:
            raise ValueError(f"no diagnostic value for question {question!r}, passages {missing[:2]}")
        return np.array([table[(question, p)] for p in passages], dtype=np.float64)

    return score


def zscore(x: np.ndarray) -> np.ndarray:
    return (x - x.mean()) / (x.std() + 1e-9)


def fusion_scorer(base, likelihood, weight: float):
    """The fusion row's scorer: z(base) + `weight` · z(ℓ) over the passages given, `base` and `likelihood` scorers
    (question, passages) -> values (ℓ from `lookup_scorer`)."""

    def score(question: str, passages: list[str]) -> np.ndarray:
        b = np.asarray(base(question, passages), dtype=np.float64)
        return zscore(b) + weight * zscore(np.asarray(likelihood(question, passages), dtype=np.float64))

    return score


@dataclass
class CandidateDiagnostics:
    candidates: list[Candidates]
    confidence: list[np.ndarray]  # Conf(Q + C) of every candidate
    correct: list[np.ndarray]  # the LLM's answer with that candidate alone holds a gold answer

    def scorers(self) -> dict[str, Any]:
        """The diagnostic rows' scorers by system id."""
        return {
            PROBE: lookup_scorer(self.candidates, self.confidence),
            ORACLE: lookup_scorer(self.candidates, [c.astype(np.float64) for c in self.correct]),
        }

    def summary(self) -> dict[str, Any]:
        """The probe's AUROC on these candidate states (labels: actual answers), where it ranks the question's
        own paragraph, and how often any candidate makes the LLM right."""
        conf = np.concatenate(self.confidence) if self.confidence else np.zeros(0)
        correct = np.concatenate(self.correct) if self.correct else np.zeros(0, bool)
        auroc = float(roc_auc_score(correct, conf)) if 0 < correct.sum() < correct.size else None
        gold_rank = []
        for c, values in zip(self.candidates, self.confidence):
            gold = [j for j, flag in enumerate(c.from_gold) if flag]
            if gold:
                order = list(np.argsort(-values, kind="stable"))
                gold_rank.append(1 + min(order.index(j) for j in gold))
        return {
            "questions": len(self.candidates),
            "candidates": int(conf.size),
            "correct_share": float(correct.mean()) if correct.size else 0.0,
            "questions_with_a_correct_candidate": float(np.mean([c.any() for c in self.correct]))
            if self.correct
            else 0.0,
            "probe_auroc_on_candidates": auroc,
            # Questions whose own paragraph the corpus names at all (none: a corpus of your own; the rest unknown).
            "questions_with_gold_known": sum(c.gold_source is not None for c in self.candidates),
            "questions_with_gold_retrieved": len(gold_rank),
            "probe_gold_first": float(np.mean([r == 1 for r in gold_rank])) if gold_rank else None,
            "probe_gold_mean_rank": float(np.mean(gold_rank)) if gold_rank else None,
            "chance_gold_first": float(
                np.mean([sum(c.from_gold) / len(c.passages) for c in self.candidates if any(c.from_gold)])
            )
            if gold_rank
            else None,
        }


def candidate_diagnostics(
    prompted: PromptedLLM,
    probe: SavedProbe,
    candidates: Sequence[Candidates],
    store: AnswerStore,
    extract_batch_size: int,
    ctx: RunContext,
    within: Sequence[Candidates] | None = None,
) -> CandidateDiagnostics:
    """Conf(Q + C) of every candidate (through the run's activation cache; read from NQ_Rerank's states when
    `within`, its candidate sets, holds these questions, as when cross-fitted) and the LLM's answer under each
    (through the answer cache)."""
    llm = prompted.llm
    engine = HiddenStateEngine(llm.model, llm.tokenizer, batch_size=extract_batch_size, progress=ctx.progress)
    cache = ShardedCache(ctx.cache_dir, progress=ctx.progress)
    shifts = confidence_shifts(prompted, probe, candidates, engine=engine, cache=cache, within=within)
    return CandidateDiagnostics(list(candidates), shifts.candidates, candidate_utility(store, candidates))
