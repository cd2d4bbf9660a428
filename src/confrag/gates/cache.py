"""The LLM-bound gate signals, kept in the content-keyed cache: drafts (DRAGIN and the uncertainty
gates), internal passages (BRIDGE), last-token hidden states (CtrlA) and P(True)'s verdict
probabilities. Each is a resumable `ShardedArtifact` keyed by the LLM, the prompts (or the prompt
templates and questions) and the generation settings, so a rerun, another gate list or another
threshold grid computes none of them again. Batch sizes are left out of the keys, as for the answer
cache: they only move float rounding. `cache_dir=None` computes without the cache (what timing the
parts needs)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from confrag.gates.base import DraftSignals
from confrag.gates.drafts import draft_token_signals
from confrag.gates.p_true import p_true_from_verdicts, p_true_prompts, verdict_probabilities, verdict_token_ids
from confrag.gates.signals import INTERNAL_KNOWLEDGE_TEMPLATE, internal_passages
from confrag.infra.digests import fingerprint
from confrag.infra.sharded import ShardedArtifact
from confrag.llm.hidden_states import HiddenStateEngine, validate_layers
from confrag.llm.loading import LoadedLLM

SHARD = 64  # questions per shard: the unit of resumption


def cached_drafts(
    llm: LoadedLLM,
    prompts: Sequence[str],
    cache_dir: str | Path | None,
    max_new_tokens: int,
    batch_size: int,
    progress: bool = False,
) -> DraftSignals:
    """`draft_token_signals` of the closed-book prompts."""

    def compute(start: int, stop: int) -> list[dict]:
        draft = draft_token_signals(llm, prompts[start:stop], max_new_tokens=max_new_tokens, batch_size=batch_size)
        return [
            {
                "text": t,
                "tokens": tok,
                "entropy": e.tolist(),
                "attention": a.tolist(),
                "logprob": lp.tolist(),
                "max_prob": mp.tolist(),
            }
            for t, tok, e, a, lp, mp in zip(
                draft.texts, draft.tokens, draft.entropy, draft.attention, draft.logprob, draft.max_prob
            )
        ]

    if cache_dir is None:
        records = compute(0, len(prompts))
    else:
        spec = {
            "llm": llm.identity,
            "prompts": fingerprint(list(prompts)),
            "max_new_tokens": max_new_tokens,
            "generator": "draft_token_signals.v2",  # v2: with each token's log-probability and max probability
        }
        artifact = ShardedArtifact(cache_dir, "gate_drafts", spec, len(prompts), SHARD, fmt="json")
        records = artifact.compute(compute, desc="drafts", progress=progress).records()
    return DraftSignals(
        texts=[r["text"] for r in records],
        tokens=[list(r["tokens"]) for r in records],
        entropy=[np.asarray(r["entropy"], dtype=np.float64) for r in records],
        attention=[np.asarray(r["attention"], dtype=np.float64) for r in records],
        logprob=[np.asarray(r["logprob"], dtype=np.float64) for r in records],
        max_prob=[np.asarray(r["max_prob"], dtype=np.float64) for r in records],
    )


def cached_p_true(
    llm: LoadedLLM,
    questions: Sequence[str],
    answers: Sequence[str],
    cache_dir: str | Path | None,
    batch_size: int,
    progress: bool = False,
) -> np.ndarray:
    """P(True) of each closed-book answer (`p_true_prompts`, `verdict_probabilities`); the cache keeps the
    two verdicts' probabilities, P(True) is their ratio."""
    verdict_token_ids(llm.tokenizer)  # refused before anything runs if the LLM cannot give P(True)
    prompts = p_true_prompts(llm.tokenizer, questions, answers)

    def compute(start: int, stop: int) -> list[list[float]]:  # per prompt: [p(True), p(False)]
        return verdict_probabilities(llm, prompts[start:stop], batch_size=batch_size).tolist()

    if cache_dir is None or not prompts:
        records = compute(0, len(prompts))
    else:
        spec = {"llm": llm.identity, "prompts": fingerprint(list(prompts)), "generator": "verdict_probabilities.v1"}
        artifact = ShardedArtifact(cache_dir, "gate_p_true", spec, len(prompts), 256, fmt="json")
        records = artifact.compute(compute, desc="P(True)", progress=progress).records()
    verdicts = np.asarray(records, dtype=np.float64).reshape(len(prompts), 2)
    if not np.all(np.isfinite(verdicts)) or np.any(verdicts < 0):
        bad = int(np.flatnonzero(~(np.isfinite(verdicts) & (verdicts >= 0)).all(axis=1))[0])
        raise ValueError(f"P(True) cache: verdict probabilities of question {bad} are {verdicts[bad].tolist()}")
    return p_true_from_verdicts(verdicts)


def cached_internal_passages(
    llm: LoadedLLM,
    questions: Sequence[str],
    cache_dir: str | Path | None,
    max_new_tokens: int,
    batch_size: int,
    progress: bool = False,
) -> list[str]:
    """BRIDGE's K_int per question (`internal_passages`)."""

    def compute(start: int, stop: int) -> list[str]:
        return internal_passages(llm, questions[start:stop], max_new_tokens=max_new_tokens, batch_size=batch_size)

    if cache_dir is None:
        return compute(0, len(questions))
    spec = {
        "llm": llm.identity,
        "chat_template": llm.tokenizer.chat_template,
        "template": INTERNAL_KNOWLEDGE_TEMPLATE,
        "questions": fingerprint(list(questions)),
        "max_new_tokens": max_new_tokens,
        "generator": "generate_greedy.v1",
    }
    artifact = ShardedArtifact(cache_dir, "gate_internal_passages", spec, len(questions), SHARD, fmt="json")
    return list(artifact.compute(compute, desc="internal passages", progress=progress).records())


def cached_states(
    llm: LoadedLLM,
    prompts: Sequence[str],
    layers: Sequence[int],
    cache_dir: str | Path | None,
    batch_size: int,
    progress: bool = False,
) -> tuple[np.ndarray, tuple[int, ...]]:
    """Last-prompt-token hidden states (len(layers), n, d) at `layers` (ascending), and those layers."""
    layers = tuple(validate_layers(layers, llm.num_layers))
    engine = HiddenStateEngine(llm.model, llm.tokenizer, batch_size=batch_size, progress=False)

    def compute(start: int, stop: int) -> np.ndarray:
        return engine.extract(prompts[start:stop], layers, desc="gate states")

    if cache_dir is None or not prompts:
        return compute(0, len(prompts)), layers
    spec = {"llm": llm.identity, "prompts": fingerprint(list(prompts)), "layers": list(layers), "store": "float32"}
    artifact = ShardedArtifact(cache_dir, "gate_states", spec, len(prompts), 256, fmt="npy")
    artifact.compute(compute, desc="gate states", progress=progress)
    return np.concatenate([np.asarray(shard) for shard in artifact.shards()], axis=1), layers
