"""What an activation shard's bytes depend on: the same QA prompts (SmolLM2-135M-Instruct, the mid layer's
last-token states, the NQ sample) extracted under several process thread counts and batch sizes, each
compared byte for byte with the reference (1 thread, extract batch 16), with the engine's thread count
left to the process (`threads=None`, as before) and fixed (`threads=1`, the default now), and the time
each took. One line per case; docs/reliability.md#one-answer-however-many-workers-what-a-shards-bytes-depend-on.

    python benchmarks/shard_bytes.py [--prompts 64] [--llm smollm2_135m]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf

from confrag.data.nq import default_questions_path, load_questions_jsonl
from confrag.llm.hidden_states import HiddenStateEngine
from confrag.llm.loading import load_llm
from confrag.llm.prompts import PromptTemplates

ROOT = Path(__file__).resolve().parents[1]
# (process threads, extract batch size, engine threads): the engine's own setting None = the process's count.
CASES = [
    (1, 16, None),
    (2, 16, None),
    (1, 8, None),
    (2, 8, None),
    (1, 16, 1),
    (2, 16, 1),
    (2, 8, 1),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--llm", default="smollm2_135m")
    args = parser.parse_args()
    cfg = OmegaConf.load(ROOT / "conf" / "llm" / f"{args.llm}.yaml")
    cfg.cache_dir = None  # the default cache (CONFRAG_CACHE or <repo>/.cache), not the unresolved ${paths.model_dir}
    llm = load_llm(OmegaConf.to_container(cfg))
    templates = PromptTemplates(**OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "prompts" / "paper.yaml")))
    rows = load_questions_jsonl(default_questions_path(), limit=args.prompts)
    prompts = [templates.qa_prompt(llm.tokenizer, row.question) for row in rows]
    layer = llm.mid_layer
    print(f"{args.llm}, {len(prompts)} QA prompts, layer {layer}, torch {torch.__version__}")
    reference = None
    for process_threads, batch, engine_threads in CASES:
        torch.set_num_threads(process_threads)
        engine = HiddenStateEngine(llm.model, llm.tokenizer, batch_size=batch, progress=False, threads=engine_threads)
        engine.extract(prompts[:4], [layer])  # warm-up
        start = time.perf_counter()
        states = engine.extract(prompts, [layer])[0]
        seconds = time.perf_counter() - start
        if reference is None:
            reference = states
        differ = np.flatnonzero((states != reference).any(axis=1))
        print(
            f"process threads {process_threads}, batch {batch:>2}, engine threads {engine_threads!s:>4}: "
            f"bytes equal {states.tobytes() == reference.tobytes()!s:>5}, max abs diff "
            f"{float(np.abs(states - reference).max()):.1e}, rows differing {len(differ)}/{len(prompts)}, "
            f"{seconds:.2f} s",
            flush=True,
        )


if __name__ == "__main__":
    main()
