"""Conf(H(Q)) for many questions at once, for the β sweep: the probe on the QA-prompt states of the
hidden-state engine, which are cached so that a second sweep (another β grid, another reranker) reads
them instead of running the LLM again."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from confrag.cbdr.gate import check_probe
from confrag.infra.digests import fingerprint
from confrag.infra.sharded import ShardedArtifact
from confrag.llm.hidden_states import HiddenStateEngine
from confrag.llm.prompted import PromptedLLM
from confrag.probe.module import SavedProbe


def question_confidences(
    prompted: PromptedLLM,
    probe: SavedProbe,
    questions: Sequence[str],
    cache_dir: str | Path | None = None,
    batch_size: int = 16,
    shard_size: int = 256,
    progress: bool = True,
) -> np.ndarray:
    """Conf(H(Q)) = P(correct) of `probe` for each question, from the QA prompt's state at the probe's layer."""
    check_probe(prompted, probe)
    llm = prompted.llm
    prompts = [prompted.qa_prompt(q) for q in questions]
    engine = HiddenStateEngine(llm.model, llm.tokenizer, batch_size=batch_size, progress=progress)
    layer = probe.layer
    if cache_dir is None:
        states = engine.extract(prompts, [layer])[0]
    else:
        spec = {
            "llm": llm.identity,
            "prompts": prompted.prompts_identity,
            "questions": fingerprint(list(questions)),
            "layers": [layer],
            "kind": "qa",
            "store": "float32",
        }
        artifact = ShardedArtifact(cache_dir, "qa_states", spec, len(prompts), shard_size, fmt="npy")
        artifact.compute(lambda a, b: engine.extract(prompts[a:b], [layer], desc="QA states"), progress=progress)
        states = (
            np.concatenate([np.asarray(shard[0]) for shard in artifact.shards()])
            if prompts
            else np.zeros((0, llm.model.config.hidden_size), dtype=np.float32)
        )
    return probe.confidence(states) if len(states) else np.zeros(0, dtype=np.float32)
