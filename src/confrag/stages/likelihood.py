"""The ℓ stage: the LLM's likelihood of the gold answer under each candidate of a question set, for any `llm` node.

ℓ(q, c) is the mean per-token log-probability of a gold answer (the best of the first `max_answers`) right after the
RAG prompt holding c alone (`confrag.llm.likelihood`: teacher-forced, no decoding, batched by length, the shared
prompt prefix computed once, CPU batches on every core with fixed intra-op threads so the bytes do not depend on the
core count). It is one cached, sharded, resumable artifact per question set (`<cache>/likelihood/<key>/`,
`confrag.reranker.likelihood_teacher`): the key holds the LLM's identity (its weights and `llm.dtype`), the device
type off the CPU (`llm.device=cuda`), the prompts' identity, the questions, the candidates' texts, the gold answers
and the engine's extraction settings, so another LLM, dtype, device, prompt or candidate list computes anew and an
interrupted stage resumes at its first missing shard. The same forward can keep the prompts' states at `layers`
(the Layer/2 state the probe reads is the state at the last prompt token, which the answer after it does not change).

The rerank task runs it on the preference questions' candidates when the alignment's teachers read ℓ or the fusion
row is asked for (`confrag.stages.alignment`), the cbdr task on the evaluation questions' candidates for the fusion
row of Table 2.
"""

from __future__ import annotations

from collections.abc import Sequence

from confrag.infra.run_context import RunContext
from confrag.llm.hidden_states import HiddenStateEngine
from confrag.llm.prompted import PromptedLLM
from confrag.reranker.likelihood_teacher import CandidateLikelihoods, candidate_likelihoods
from confrag.retrieval.candidates import Candidates


def likelihood_stage(
    prompted: PromptedLLM,
    candidates: Sequence[Candidates],
    ctx: RunContext,
    batch_size: int | str,
    max_answers: int | None,
    layers: Sequence[int] = (),
) -> CandidateLikelihoods:
    """ℓ of every candidate of `candidates` (and their states at `layers`), through the run's cache; `batch_size`
    is the engine's (rows a batch, or "auto" from free device memory)."""
    llm = prompted.llm
    engine = HiddenStateEngine(llm.model, llm.tokenizer, batch_size=batch_size, progress=ctx.progress)
    return candidate_likelihoods(
        prompted,
        candidates,
        engine=engine,
        cache_dir=ctx.cache_dir,
        layers=layers,
        max_answers=max_answers,
        progress=ctx.progress,
    )
