"""The LLM's own likelihood of the gold answer under each retrieved candidate: a graded teacher over the whole list.

ℓ(q, c) = max over q's gold answers of the mean per-token log-probability of the answer after the RAG prompt
holding c alone (`confrag.llm.likelihood`), the target of REPLUG's LM-supervised retrieval, RA-DIT's retriever
step and Atlas's perplexity distillation. One teacher-forced forward per (candidate, answer), no decoding; the
same forward keeps the prompt's states at the requested layers (Conf(Q + C) for the probe's rows).

Cached like the candidates' states: one sharded, resumable artifact (`<cache>/likelihood/<key>/`) whose key
hashes the LLM identity (dtype included), the device type off the CPU (a GPU's kernels round otherwise; the CPU
adds nothing, so the keys computed before it was recorded stay), the prompt templates, the questions, the
candidates' texts, the gold answers used, the layers and the engine's extraction settings. A shard holds, per
candidate, ℓ in column 0 and the states of the layers after it (layer by layer), shape (1, items, 1 + layers x
hidden).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from confrag.infra.digests import fingerprint
from confrag.infra.finite import require_finite
from confrag.infra.sharded import ShardedArtifact
from confrag.llm.hidden_states import HiddenStateEngine
from confrag.llm.likelihood import AnswerLikelihood
from confrag.llm.prompted import PromptedLLM
from confrag.retrieval.candidates import Candidates

KIND = "likelihood"
# Bump when how ℓ is computed changes (the answer's tokenization, the mean, the max over answers).
VERSION = "mean_token_logprob.max_answers.v1"


@dataclass(frozen=True)
class CandidateLikelihoods:
    """ℓ of every candidate, question by question (`per_question[i]` aligned with candidate_sets[i].passages), and
    the states at `layers` ((layers, candidates, d), question by question; empty without layers)."""

    per_question: list[np.ndarray]
    states: np.ndarray
    layers: tuple[int, ...]
    key: str


def gold_answers(candidates: Candidates, max_answers: int | None) -> list[str]:
    """The gold answers ℓ maximises over: distinct, in the file's order, at most `max_answers` (None: all)."""
    distinct = list(dict.fromkeys(a for a in candidates.answers if a.strip()))
    return distinct if max_answers is None else distinct[:max_answers]


def device_key(engine: HiddenStateEngine) -> dict[str, str]:
    """The device type of the engine's model when it is not the CPU; {} on the CPU."""
    device = engine.device
    return {} if device.type == "cpu" else {"device": device.type}


def candidate_likelihoods(
    prompted: PromptedLLM,
    candidate_sets: Sequence[Candidates],
    *,
    engine: HiddenStateEngine,
    cache_dir: str | Path,
    layers: Sequence[int] = (),
    max_answers: int | None = 3,
    shard_size: int = 256,
    progress: bool = True,
) -> CandidateLikelihoods:
    """ℓ (and states) of the RAG prompt holding each candidate alone, through the cache (`engine` runs the LLM where
    a shard is missing; its model's device and its extraction settings are in the key)."""
    layers = tuple(int(x) for x in layers)
    pairs = [(c, p) for c in candidate_sets for p in c.passages]
    answers = [gold_answers(c, max_answers) for c, _ in pairs]
    empty = sorted({c.qid for (c, _), gold in zip(pairs, answers) if not gold})
    if empty:
        raise ValueError(f"likelihood teacher: question(s) {empty[:5]} have no gold answer (ℓ needs one)")
    prompts = [prompted.rag_prompt(c.question, [p]) for c, p in pairs]
    spec = {
        "llm": prompted.llm.identity,
        "prompts": prompted.prompts_identity,
        "rows": fingerprint([[c.qid, c.question] for c in candidate_sets]),
        "contexts": fingerprint([[p.title, p.text] for _, p in pairs]),
        "answers": fingerprint(answers),
        "layers": list(layers),
        "version": VERSION,
        **engine.key,
        **device_key(engine),
    }
    artifact = ShardedArtifact(cache_dir, KIND, spec, len(pairs), shard_size, fmt="npy")

    def compute(start: int, stop: int) -> np.ndarray:
        found = AnswerLikelihood(engine).score(prompts[start:stop], answers[start:stop], layers)
        flat = found.states.transpose(1, 0, 2).reshape(stop - start, -1)  # (items, layers x d)
        return np.concatenate([found.likelihood[:, None], flat], axis=1)[None]

    artifact.compute(compute, desc="answer likelihood", progress=progress)
    table = np.concatenate([np.asarray(s)[0] for s in artifact.shards()], axis=0) if pairs else np.zeros((0, 1))
    ell = table[:, 0].astype(np.float32)
    require_finite(ell, stage="likelihood teacher", artifact=f"ℓ of {artifact.dir}", rows=[c.qid for c, _ in pairs])
    states = table[:, 1:].reshape(len(pairs), len(layers), -1).transpose(1, 0, 2) if layers else np.zeros((0, 0, 0))
    bounds = np.cumsum([0] + [len(c.passages) for c in candidate_sets])
    return CandidateLikelihoods(
        [ell[a:b] for a, b in zip(bounds[:-1], bounds[1:])], np.ascontiguousarray(states), layers, artifact.key
    )
