"""Hidden-state extraction: the naive per-prompt full forward (the papers' Algorithm 1) against the engine.

Same 48 real RAG prompts (SmolLM2-135M-Instruct, gold paragraphs of the shared NQ data), layer 15
(Layer/2), side by side in one run. The last two lines are `max_rel_err:` and `speedup_vs_naive:`.

    python benchmarks/extraction.py [--prompts 48] [--layer 15] [--batch-size 16] [--repeats 2]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf

from confrag.data.nq import default_questions_path, load_questions_jsonl
from confrag.llm.hidden_states import HiddenStateEngine, common_prefix_length, naive_hidden_states
from confrag.llm.loading import load_llm
from confrag.llm.prompts import PromptTemplates, encode_prompts
from confrag.llm.shapes import DecoderCost, engine_flops, stack_flops

ROOT = Path(__file__).resolve().parents[1]


def matmul_flops_per_second(size: int = 1024, repeats: int = 20) -> float:
    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.mm(a, b)
    start = time.perf_counter()
    for _ in range(repeats):
        torch.mm(a, b)
    return 2 * size**3 * repeats / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=48)
    parser.add_argument("--layer", type=int, default=15)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    llm = load_llm(OmegaConf.to_container(OmegaConf.load(ROOT / "conf/llm/smollm2_135m.yaml")) | {"cache_dir": None})
    templates = PromptTemplates(**OmegaConf.to_container(OmegaConf.load(ROOT / "conf/prompts/paper.yaml")))
    rows = load_questions_jsonl(default_questions_path(), limit=args.prompts)
    prompts = [templates.rag_prompt(llm.tokenizer, row.question, row.contexts[:1]) for row in rows]
    ids = encode_prompts(llm.tokenizer, prompts)
    tokens = sum(len(seq) for seq in ids)
    cost = DecoderCost.of(llm.model.config)  # FLOPs of the matrix multiplies; attention scores apart on both sides
    engine = HiddenStateEngine(llm.model, llm.tokenizer, batch_size=args.batch_size, progress=False)

    naive_hidden_states(llm.model, ids[0], [args.layer])  # warm-up, both paths
    engine.extract(prompts[:2], [args.layer])

    naive_times, engine_times = [], []
    for _ in range(args.repeats):  # interleaved, best of N: the machine's other load hits both paths alike
        start = time.perf_counter()
        reference = np.stack([naive_hidden_states(llm.model, seq, [args.layer])[0] for seq in ids])
        naive_times.append(time.perf_counter() - start)
        start = time.perf_counter()
        got = engine.extract(prompts, [args.layer])[0]
        engine_times.append(time.perf_counter() - start)
    naive_s, engine_s = min(naive_times), min(engine_times)

    rate = matmul_flops_per_second()
    naive_rate = stack_flops(cost, tokens, tokens) / naive_s
    engine_rate = (
        engine_flops(cost, [len(seq) for seq in ids], common_prefix_length(ids), args.layer, attention=False) / engine_s
    )
    err = float((np.abs(got - reference).max(-1) / np.abs(reference).max(-1)).max())
    print(
        f"naive runs (s): {[round(t, 2) for t in naive_times]}  engine runs (s): {[round(t, 2) for t in engine_times]}"
    )
    print(
        f"prompts: {len(prompts)}  prompt tokens: {tokens}  shared prefix: {common_prefix_length(ids)} tokens  "
        f"torch threads: {torch.get_num_threads()}"
    )
    print(f"fp32 matmul rate (1024^3 mm): {rate / 1e9:.1f} GFLOP/s")
    print(
        f"naive  (per prompt, all layers + LM head): {naive_s:.2f} s  {tokens / naive_s:8.0f} tokens/s  "
        f"{naive_rate / 1e9:.1f} GFLOP/s = {naive_rate / rate:.2f} of matmul rate"
    )
    print(
        f"engine (length-grouped batches, layers 1..{args.layer - 1} + last-token layer {args.layer}, "
        f"shared prefix once): {engine_s:.2f} s  {tokens / engine_s:8.0f} tokens/s  "
        f"{engine_rate / 1e9:.1f} GFLOP/s = {engine_rate / rate:.2f} of matmul rate"
    )
    print(f"max_rel_err: {err:.3e}")
    print(f"speedup_vs_naive: {naive_s / engine_s:.2f}")


if __name__ == "__main__":
    main()
