"""One rank of the heavy stages, for tests/test_multiprocess_stages.py (run alone or under torchrun):
NQ_Confidence (greedy answers + hidden states of the tiny llama) and RAG answers through the
AnswerStore, into a shared cache. Every call of the LLM is counted in COUNTER; the rank writes what it
ended with to OUT/rank<r>.npz and OUT/rank<r>.json.

    python tests/rank_worker.py ROOT OUT CACHE NQ_PATH COUNTER
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
from omegaconf import OmegaConf

import confrag.probe.nq_confidence as nq_confidence
import confrag.rag.answers as answers
from confrag.data.nq import load_questions_jsonl
from confrag.infra.distributed import rank_info
from confrag.infra.sharded import ShardedCache
from confrag.llm.loading import load_llm
from confrag.llm.prompted import PromptedLLM
from confrag.llm.prompts import PromptTemplates
from confrag.rag.answers import AnswerStore

from helpers.models import TINY_SHAPE, cpu_llm
from helpers.settings import data_settings

NUM_ROWS, SHARD_SIZE, RAG_ROWS, CHUNK = 16, 4, 12, 4
TINY = dict(arch="llama", **TINY_SHAPE)


def counting(stage: str, fn, counter: str):
    def wrapped(model, tokenizer, prompts, *args, **kwargs):
        line = f"{stage} {len(prompts)} {os.getpid()}\n"
        fd = os.open(counter, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
        return fn(model, tokenizer, prompts, *args, **kwargs)

    return wrapped


def main() -> None:
    root, out, cache, questions_path, counter = sys.argv[1:6]
    info = rank_info()
    nq_confidence.generate_greedy = counting("nq_confidence", nq_confidence.generate_greedy, counter)
    answers.generate_greedy = counting("answers", answers.generate_greedy, counter)
    llm = load_llm(cpu_llm(name="tiny_llama", source="tiny", device="rank", tiny=TINY))
    templates = PromptTemplates(**OmegaConf.to_container(OmegaConf.load(Path(root) / "conf/prompts/paper.yaml")))
    rows = load_questions_jsonl(questions_path, limit=NUM_ROWS)

    settings = data_settings(
        "qa+rag", extraction={"layers": [1, 2], "batch_size": 3}, answers={"max_new_tokens": 8, "batch_size": 4}
    )
    data = nq_confidence.build_confidence_data(
        PromptedLLM(llm, templates),
        rows,
        settings=settings,
        cache=ShardedCache(cache, SHARD_SIZE, progress=False),
        seed=0,
    )
    store = AnswerStore(
        PromptedLLM(llm, templates), cache, max_new_tokens=8, batch_size=4, chunk_size=CHUNK, progress=False
    )
    rag = store.answer([(row.question, row.contexts[:1]) for row in rows[:RAG_ROWS]])

    arrays = {
        f"{kind}/{layer}": store_.take(layer, range(len(rows)))
        for kind, store_ in data.stores.items()
        for layer in data.layers
    }
    np.savez(Path(out) / f"rank{info.rank}.npz", **arrays)
    record = {
        "rank": info.rank,
        "world_size": info.world_size,
        "device": str(llm.device),
        "responses": data.responses,
        "rag": rag,
        "states_computed": {kind: s.artifact.computed for kind, s in data.stores.items()},
    }
    (Path(out) / f"rank{info.rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
