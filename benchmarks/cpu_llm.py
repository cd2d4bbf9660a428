"""The embedded LLM at the CPU's limit: fp32 and bf16, one worker and every core, side by side in one run.

On SmolLM2-135M-Instruct and the same real NQ prompts for every path, this prints

- the measured matmul peak of the cores it is given, fp32 and bf16, on one thread and on all of them;
- for the hidden-state engine (Layer/2 states of RAG prompts), the likelihood forward (ℓ of the gold answers after
  the RAG prompt, `confrag.llm.likelihood`) and greedy answers (24 new tokens): seconds, prompts/s, useful GFLOP/s
  and its share of the peak of its dtype and core count, for fp32 on one worker (the path shipped before: one
  intra-op thread), fp32 on every core and bf16 on every core (workers = cores, each on one intra-op thread);
- the ratios: every core against one worker (`cores_speedup`), bf16 against fp32 on the same cores
  (`bf16_vs_fp32`), and the new default path against the previous one (`speedup_vs_fp32`: fp32 one worker ->
  the faster dtype whose answers agree, every core);
- what bf16 changes on these prompts: greedy answers identical to fp32's, has_answer labels identical, the largest
  relative error of a Layer/2 state (the full measurement on 500 + 300 prompts: benchmarks/bf16_agreement.py).

Paths run interleaved, best of `--repeats`, so the machine's other load hits them alike.

    python benchmarks/cpu_llm.py [--prompts 48] [--repeats 2] [--new-tokens 24]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf

from confrag.data.nq import default_questions_path, load_questions_jsonl
from confrag.data.qa_metrics import has_answer
from confrag.llm.generation import GreedyOptions, generate_greedy
from confrag.llm.hidden_states import HiddenStateEngine, common_prefix_length
from confrag.llm.likelihood import AnswerLikelihood, answer_token_ids
from confrag.llm.loading import load_llm
from confrag.llm.prompts import PromptTemplates, encode_prompts
from confrag.llm.shapes import DecoderCost, engine_flops, stack_flops
from confrag.llm.workers import available_cores

ROOT = Path(__file__).resolve().parents[1]


def matmul_peak(dtype: torch.dtype, threads: int, size: int = 1024, repeats: int = 12) -> float:
    """FLOP/s of a square matrix product on `threads` intra-op threads (the best of two timings)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
    torch.mm(a, b)
    best = 0.0
    for _ in range(2):
        start = time.perf_counter()
        for _ in range(repeats):
            torch.mm(a, b)
        best = max(best, 2 * size**3 * repeats / (time.perf_counter() - start))
    torch.set_num_threads(before)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=24)
    args = parser.parse_args()
    cores = available_cores()
    peaks = {
        (name, n): matmul_peak(dtype, n)
        for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16))
        for n in sorted({1, cores})
    }
    cfg = OmegaConf.to_container(OmegaConf.load(ROOT / "conf/llm/smollm2_135m.yaml")) | {"cache_dir": None}
    llms = {dtype: load_llm(cfg | {"dtype": dtype}) for dtype in ("float32", "bfloat16")}
    tok = llms["float32"].tokenizer
    templates = PromptTemplates(**OmegaConf.to_container(OmegaConf.load(ROOT / "conf/prompts/paper.yaml")))
    rows = load_questions_jsonl(default_questions_path(), limit=args.prompts)
    prompts = [templates.rag_prompt(tok, r.question, r.contexts[:1]) for r in rows]
    answers = [r.answers[:3] for r in rows]
    ids = encode_prompts(tok, prompts)
    config = llms["float32"].model.config
    cost = DecoderCost.of(config)  # matmul FLOPs (attention scores apart), as benchmarks/extraction.py counts
    layer = config.num_hidden_layers // 2
    lengths = [len(seq) for seq in ids]
    prefix = common_prefix_length(ids)
    answer_ids = [answer_token_ids(tok, list(dict.fromkeys(gold))) for gold in answers]
    work = {
        "engine": engine_flops(cost, lengths, prefix, layer, attention=False),
        # the shared prefix once, then each (prompt, answer) pair's own tokens; the LM head on the answer tokens
        "likelihood": stack_flops(cost, prefix, 0)
        + sum(stack_flops(cost, n - prefix + len(a), len(a)) for n, gold in zip(lengths, answer_ids) for a in gold),
        # prefill of every prompt, then one token per step (the KV reads left out: small at these lengths)
        "generation": stack_flops(cost, sum(lengths), len(ids))
        + stack_flops(cost, len(ids) * (args.new_tokens - 1), len(ids) * (args.new_tokens - 1)),
    }
    paths = {"fp32, 1 worker": ("float32", 1), f"fp32, {cores} workers": ("float32", cores)}
    paths[f"bf16, {cores} workers"] = ("bfloat16", cores)

    def run(kind: str, dtype: str, workers: int):
        llm = llms[dtype]
        engine = HiddenStateEngine(llm.model, llm.tokenizer, progress=False, workers=workers)
        if kind == "engine":
            return engine.extract(prompts, [layer])[0]
        if kind == "likelihood":
            return AnswerLikelihood(engine).score(prompts, answers).likelihood
        options = GreedyOptions(workers=workers)
        return generate_greedy(llm.model, llm.tokenizer, prompts, args.new_tokens, 16, progress=False, options=options)

    times: dict[tuple[str, str], list[float]] = {}
    outputs: dict[tuple[str, str], object] = {}
    for kind in work:
        if kind != "generation":
            for dtype, workers in paths.values():  # warm-up
                run(kind, dtype, workers)
        for _ in range(args.repeats):
            for name, (dtype, workers) in paths.items():
                start = time.perf_counter()
                outputs[kind, name] = run(kind, dtype, workers)
                times.setdefault((kind, name), []).append(time.perf_counter() - start)

    print(f"cores given: {cores}; prompts: {len(prompts)} real NQ RAG prompts, {sum(lengths)} tokens")
    for (name, n), rate in peaks.items():
        print(f"matmul peak {name:8s} {n} thread(s): {rate / 1e9:7.1f} GFLOP/s")
    print()
    print(f"{'path':28s} {'kind':11s} {'s':>7s} {'prompts/s':>10s} {'GFLOP/s':>8s} {'of peak':>8s}")
    best = {key: min(value) for key, value in times.items()}
    for kind in work:
        for name, (dtype, workers) in paths.items():
            seconds = best[kind, name]
            rate = work[kind] / seconds
            peak = peaks[(dtype, 1 if workers == 1 else cores)]
            print(
                f"{name:28s} {kind:11s} {seconds:7.2f} {len(prompts) / seconds:10.1f} {rate / 1e9:8.1f} "
                f"{rate / peak:8.2f}"
            )
    fp32_1, fp32_n, bf16_n = paths
    states32, states16 = outputs["engine", fp32_n], outputs["engine", bf16_n]
    state_err = float((np.abs(states16 - states32).max(-1) / np.abs(states32).max(-1)).max())
    same_answers = np.mean([a == b for a, b in zip(outputs["generation", fp32_n], outputs["generation", bf16_n])])
    labels = [
        [has_answer(a, r.answers) for a, r in zip(outputs["generation", name], rows)] for name in (fp32_n, bf16_n)
    ]
    same_labels = np.mean([a == b for a, b in zip(*labels)])
    ell_diff = float(np.abs(outputs["likelihood", bf16_n] - outputs["likelihood", fp32_n]).max())
    exact = outputs["engine", fp32_1].tobytes() == states32.tobytes()
    print()
    print(f"states on 1 and {cores} workers: {'the same bytes' if exact else 'DIFFERENT BYTES'}")
    print(
        f"bf16 vs fp32: answers identical {same_answers:.3f}, has_answer labels identical {same_labels:.3f}, "
        f"largest relative state error {state_err:.2e}, largest |Δℓ| {ell_diff:.3f} nats"
    )
    # The default dtype stays fp32 unless bf16 is faster here and its answers agree (docs/results.md).
    for kind in ("engine", "likelihood", "generation"):
        cores_x = best[kind, fp32_1] / best[kind, fp32_n]
        bf16_x = best[kind, fp32_n] / best[kind, bf16_n]
        new = min(best[kind, fp32_n], best[kind, bf16_n])
        print(
            f"{kind}: cores_speedup {cores_x:.2f}  bf16_vs_fp32 {bf16_x:.2f}  "
            f"speedup_vs_fp32 {best[kind, fp32_1] / new:.2f} (fastest path vs fp32 on 1 worker)"
        )


if __name__ == "__main__":
    main()
