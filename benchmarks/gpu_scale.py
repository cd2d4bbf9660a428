"""GPU scale: hidden states and greedy answers at Llama-3-8B / Qwen2.5-7B size, the engine against the baselines.

Random-weight models of the exact Llama-3-8B and Qwen2.5-7B shapes (`confrag.llm.shapes.PUBLISHED_SHAPES`:
their published config numbers, full vocabularies, untied heads, Qwen's q/k/v bias; nothing is downloaded),
bf16 on CUDA, and the GPU targets' workload (docs/gpu.md): 2,048 RAG-like prompts of random token ids, a 40-token prefix
shared by all, then 120-260 tokens of their own (~469k tokens), hidden states at Layer/2. Side by side:

- engine: `HiddenStateEngine.extract_ids` (batch sizes "auto" by default: from free device memory), eager,
  then on CUDA with its norm/MLP blocks compiled (`compile=True`; `--no-engine-compile` skips it); the
  ratios are those of the compiled engine when it ran (`engine_eager_share_of_peak` keeps the eager one);
- batched full forward, what a user writes first: batches of `--baseline-batch` prompts in data order,
  right padding, `model(..., output_hidden_states=True)`, the state at each row's last real token;
- per-prompt full forward (the papers' Algorithm 1) on the first `--per-prompt` prompts, extrapolated to
  all by their share of the tokens;
- the ℓ stage (`confrag.llm.likelihood.AnswerLikelihood`, what the likelihood teacher's stage runs): every prompt
  followed by a gold answer of `--answer-min`..`--answer-max` random tokens, teacher-forced, the mean log-probability
  of the answer's tokens; prompts + answers per second and the share of the peak, and ℓ of the first pairs against
  one full forward each;
- greedy generation of `--new-tokens` tokens for `--gen-prompts` prompts: plain `model.generate` (left
  padding, dynamic cache, batches of `--gen-batch`: the repo's generation before the GPU levers) and the
  fast path (`generate_greedy_ids` with the shared prefix's keys/values reused and, on CUDA, a static
  cache over a few length buckets with the decoding step compiled; warm-up, i.e. compilation, timed apart).

Definitions (what the printed ratios mean):

- peak: the best bf16 (fp32 on CPU) rate of large square matrix multiplies measured in the same run;
  bandwidth: the rate of a large device-to-device copy (bytes read + bytes written), same run.
- useful FLOPs of the engine: the layers it actually runs, padding not counted (`shapes.engine_flops`):
  the shared prefix once through layers 1..L/2; each prompt's own tokens through layers 1..L/2-1 plus the
  key/value projections of layer L/2; the rest of layer L/2 at the last token only. Projections and MLP
  count 2 FLOPs per weight per token; attention scores and their weighted sum count 4 * heads * head_dim
  per causal (query, key) pair. No LM head. Useful TFLOP/s = useful FLOPs / wall time; share = that / peak.
- useful FLOPs of the ℓ stage: each prompt's own tokens and its answer's through the whole stack, the shared
  prefix once, the LM head at the answer positions only (`shapes.likelihood_flops`); share = that / time / peak.
- generation bound of a path with R prompts per batch: prefill FLOPs at the peak + decoding steps x weight
  bytes / bandwidth. Prefill FLOPs: every prompt token through the whole stack with the shared prefix
  counted once, plus the LM head at each prompt's last token (`shapes.prefill_flops`); decoding steps:
  ceil(prompts / R) x (new tokens - 1), each reading every weight once (`DecoderCost.weight_bytes`: all but
  the input embedding table). Key/value reads, sampling and launch overheads are left out, so the bound
  is optimistic and no real run reaches it. Share = bound / measured time.
- peak memory: `torch.cuda.max_memory_allocated` during the phase (weights included); on CPU the
  process's maximum resident size, once at the end.

On CPU (no CUDA, or `--tiny`) the models are tiny ones of the same families (`shapes.tiny_overrides`),
fp32, 256 prompts, no static cache: the script and its arithmetic run, the numbers say nothing of a GPU.
The last lines are the ratios, one `<shape> <name>: <value>` per line.

    python benchmarks/gpu_scale.py                       # on one CUDA GPU: both shapes (measured: 6 min on an H100)
    python benchmarks/gpu_scale.py --shapes llama3_8b    # one shape
    python benchmarks/gpu_scale.py --tiny                # tiny shapes (the default without CUDA)
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import resource
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from confrag.llm.batching import AUTO, check_batch_size
from confrag.llm.generation import (
    DEFAULT_CACHE_BUCKETS,
    PLAIN,
    GreedyOptions,
    cache_length,
    generate_greedy_ids,
    generation_batch_rows,
    release_static_caches,
)
from confrag.llm.hidden_states import HiddenStateEngine, common_prefix_length, naive_hidden_states
from confrag.llm.likelihood import AnswerLikelihood
from confrag.llm.shapes import (
    PUBLISHED_SHAPES,
    DecoderCost,
    dtype_bytes,
    engine_flops,
    likelihood_flops,
    prefill_flops,
    random_decoder,
    shape_config,
    tiny_overrides,
)

# --- measurements of the device --------------------------------------------------------------------


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, fn: Callable[[], Any]) -> tuple[float, Any]:
    synchronize(device)
    start = time.perf_counter()
    result = fn()
    synchronize(device)
    return time.perf_counter() - start, result


def best_of(repeats: int, device: torch.device, fn: Callable[[], Any]) -> tuple[float, Any]:
    """The fastest of `repeats` timed runs (other jobs on a shared machine slow some runs down)."""
    runs = [timed(device, fn) for _ in range(max(1, repeats))]
    return min(runs, key=lambda run: run[0])


def params_text(count: int) -> str:
    return f"{count / 1e9:.2f} B" if count >= 1e8 else f"{count / 1e6:.2f} M"


def flops_text(value: float) -> str:
    return f"{value / 1e12:.1f} TFLOP" if value >= 1e11 else f"{value / 1e9:.2f} GFLOP"


def matmul_peak(device: torch.device, dtype: torch.dtype) -> tuple[float, int]:
    """(best FLOP/s, at size) of square matrix multiplies, each size run for about half a second."""
    sizes = (4096, 8192, 16384) if device.type == "cuda" else (512, 1024)
    best, best_size = 0.0, 0
    for n in sizes:
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        for _ in range(3):
            torch.mm(a, b)
        one, _ = timed(device, lambda: torch.mm(a, b))
        repeats = max(3, min(200, int(0.5 / max(one, 1e-6))))
        seconds, _ = timed(device, lambda: [torch.mm(a, b) for _ in range(repeats)])
        rate = 2 * n**3 * repeats / seconds
        if rate > best:
            best, best_size = rate, n
        del a, b
    return best, best_size


def copy_bandwidth(device: torch.device) -> float:
    """Bytes/s of a large copy on the device, counting the bytes read and the bytes written."""
    size = (1 << 30) if device.type == "cuda" else (1 << 27)
    src = torch.empty(size, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    for _ in range(2):
        dst.copy_(src)
    repeats = 20 if device.type == "cuda" else 5
    seconds, _ = timed(device, lambda: [dst.copy_(src) for _ in range(repeats)])
    del src, dst
    return 2 * size * repeats / seconds


class PeakMemory:
    """Peak allocated bytes of the phase run inside (CUDA); None elsewhere."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.bytes = device, None

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            self.bytes = torch.cuda.max_memory_allocated(self.device)

    def __str__(self) -> str:
        return "n/a on CPU" if self.bytes is None else f"{self.bytes / 2**30:.1f} GiB"


# --- workload and baselines ------------------------------------------------------------------------


def rag_like_workload(count: int, prefix: int, own_min: int, own_max: int, vocab: int, seed: int) -> list[list[int]]:
    """Random token ids: one shared prefix, then own_min..own_max tokens per prompt (uniform)."""
    rng = np.random.default_rng(seed)
    low, high = 3, min(vocab, 128000)  # clear of the special tokens at the ends of the vocabularies
    shared = rng.integers(low, high, prefix).tolist()
    return [shared + rng.integers(low, high, int(rng.integers(own_min, own_max + 1))).tolist() for _ in range(count)]


@torch.inference_mode()
def batched_full_forward(model, ids: list[list[int]], layer: int, batch: int, pad_id: int) -> np.ndarray:
    """Batches in data order, right padding, all hidden states returned, the layer's state at the last real token."""
    device = next(model.parameters()).device
    out = np.zeros((len(ids), model.config.hidden_size), dtype=np.float32)
    for start in range(0, len(ids), batch):
        chunk = ids[start : start + batch]
        width = max(len(seq) for seq in chunk)
        input_ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        mask = torch.zeros_like(input_ids)
        for row, seq in enumerate(chunk):
            input_ids[row, : len(seq)] = torch.tensor(seq)
            mask[row, : len(seq)] = 1
        hidden = model(
            input_ids=input_ids.to(device), attention_mask=mask.to(device), output_hidden_states=True
        ).hidden_states[layer]
        last = torch.tensor([len(seq) - 1 for seq in chunk], device=device)
        out[start : start + len(chunk)] = hidden[torch.arange(len(chunk), device=device), last].float().cpu().numpy()
    return out


@torch.inference_mode()
def forward_likelihood(model, prompt: list[int], answer: list[int]) -> float:
    """ℓ of one (prompt, answer) pair from one full forward of both: the reference of the ℓ stage."""
    device = next(model.parameters()).device
    logits = model(input_ids=torch.tensor([prompt + answer], device=device)).logits[0].float()
    logp = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    return float(logp[torch.arange(len(answer), device=device), torch.tensor(answer, device=device)].mean())


def likelihood_phase(model, ids: list[list[int]], args, cost: DecoderCost, device, peak: float, pad_id: int) -> dict:
    """The ℓ stage on the workload, each prompt with one random answer; its rate, share of the peak and error."""
    rng = np.random.default_rng(args.seed + 1)
    answers = [rng.integers(3, min(cost.vocab, 128000), int(rng.integers(args.answer_min, args.answer_max + 1)))
               for _ in ids]  # fmt: skip
    answer_ids = [[a.tolist()] for a in answers]
    lengths, prefix = [len(seq) for seq in ids], common_prefix_length(ids)
    engine = HiddenStateEngine(
        model, _PadOnly(pad_id), batch_size=args.engine_batch, max_batch_tokens=args.engine_tokens, progress=False
    )
    scorer = AnswerLikelihood(engine)
    timed(device, lambda: scorer.score_ids(ids[:16], answer_ids[:16]))  # warm-up
    with PeakMemory(device) as memory:
        seconds, found = best_of(args.repeats, device, lambda: scorer.score_ids(ids, answer_ids))
    useful = likelihood_flops(cost, lengths, [len(a) for a in answers], prefix)
    checked = min(4, len(ids))
    error = max(abs(float(found.likelihood[i]) - forward_likelihood(model, ids[i], answer_ids[i][0]))
                for i in range(checked))  # fmt: skip
    print(
        f"ℓ stage (AnswerLikelihood.score_ids, answers of {args.answer_min}-{args.answer_max} tokens): "
        f"{seconds:.2f} s  {len(ids) / seconds:,.1f} prompts + answers/s  useful {flops_text(useful)} -> "
        f"{flops_text(useful / seconds)}/s = {useful / seconds / peak:.1%} of peak  peak memory {memory}; "
        f"ℓ of the first {checked} against one full forward each: largest absolute error {error:.2e}"
    )
    return dict(
        likelihood_seconds=seconds,
        likelihood_pairs_per_s=len(ids) / seconds,
        likelihood_useful_tflops=useful / seconds / 1e12,
        likelihood_peak_memory=memory.bytes,
        likelihood_vs_forward_abs_error=error,
        likelihood_share_of_peak=useful / seconds / peak,
    )


def relative_error(got: np.ndarray, reference: np.ndarray) -> float:
    """Largest relative L2 error of a row."""
    error = np.linalg.norm(got - reference, axis=-1) / np.maximum(np.linalg.norm(reference, axis=-1), 1e-12)
    return float(error.max())


class _PadOnly:
    """The engine reads only the pad id from its tokenizer; the workload is token ids already."""

    def __init__(self, pad_id: int) -> None:
        self.pad_token_id = self.eos_token_id = pad_id


# --- one shape -------------------------------------------------------------------------------------


def run_shape(name: str, args, device: torch.device, dtype: torch.dtype, peak: float, bandwidth: float) -> dict:
    overrides = tiny_overrides(name) if args.tiny else {}
    config = shape_config(name, **overrides)
    cost = DecoderCost.of(config)
    load_s, model = timed(device, lambda: random_decoder(config, dtype, device, seed=args.seed))
    pad_id = int(config.eos_token_id)
    layer = args.layer if args.layer is not None else cost.layers // 2
    ids = rag_like_workload(args.prompts, args.prefix, args.own_min, args.own_max, cost.vocab, args.seed)
    lengths = [len(seq) for seq in ids]
    tokens, prefix = sum(lengths), common_prefix_length(ids)
    result: dict[str, Any] = {"shape": name, "params": cost.params, "tokens": tokens, "layer": layer}
    print(
        f"\n== {name}{' (tiny)' if args.tiny else ''}: hidden {cost.hidden}, MLP {cost.intermediate}, "
        f"{cost.layers} layers, "
        f"{cost.heads}/{cost.kv_heads} heads, vocab {cost.vocab}, qkv bias {cost.qkv_bias}, tied {cost.tied}; "
        f"{params_text(cost.params)} parameters in {str(dtype).removeprefix('torch.')}, built in {load_s:.1f} s"
    )
    print(
        f"workload: {len(ids)} prompts, shared prefix {prefix} tokens, own {args.own_min}-{args.own_max} tokens, "
        f"{tokens:,} tokens; hidden states at layer {layer} (Layer/2 = {cost.layers // 2})"
    )

    # Engine: as configured, then (CUDA, --engine-compile) with its norm/MLP blocks compiled.
    useful = engine_flops(cost, lengths, prefix, layer)

    def run_engine(compiled: bool) -> tuple[float, np.ndarray, PeakMemory, int, int]:
        engine = HiddenStateEngine(
            model,
            _PadOnly(pad_id),
            batch_size=args.engine_batch,
            max_batch_tokens=args.engine_tokens,
            compile=compiled,
            progress=False,
        )
        rows, batch_tokens = engine.batch_limits(layer, max(lengths))
        warm_s, _ = timed(device, lambda: engine.extract_ids(ids[: min(len(ids), 64)], [layer]))  # warm-up (compiles)
        with PeakMemory(device) as memory:
            seconds, states = best_of(args.repeats, device, lambda: engine.extract_ids(ids, [layer]))
        batches = len(engine.length_batches([n - prefix for n in lengths], rows, batch_tokens))
        from_free = (
            " from free memory" if AUTO in (args.engine_batch, args.engine_tokens) and device.type == "cuda" else ""
        )
        print(
            f"engine{' with compiled norm/MLP blocks' if compiled else ''} (extract_ids; batch limits {rows} rows / "
            f"{batch_tokens} tokens{from_free}"
            f", {batches} batches; warm-up {warm_s:.1f} s): {seconds:.2f} s  {tokens / seconds:,.0f} tokens/s  "
            f"useful {flops_text(useful)} -> {flops_text(useful / seconds)}/s = {useful / seconds / peak:.1%} of peak  "
            f"peak memory {memory}"
        )
        result.setdefault("engine_runs", []).append(
            dict(
                compiled=compiled,
                seconds=seconds,
                rows=rows,
                batch_tokens=batch_tokens,
                batches=batches,
                warmup=warm_s,
                peak_memory=memory.bytes,
            )
        )
        return seconds, states[0], memory, rows, batch_tokens

    engine_s, states, engine_mem, rows, batch_tokens = run_engine(False)
    uncompiled_s, compiled_ran = engine_s, args.engine_compile and device.type == "cuda"
    if compiled_ran:
        engine_s, compiled_states, engine_mem, rows, batch_tokens = run_engine(True)
        print(
            "compiled vs eager engine: largest relative L2 error of a state "
            f"{relative_error(compiled_states, states):.2e}"
        )
        states = compiled_states
    engine_share = useful / engine_s / peak
    likelihood = likelihood_phase(model, ids, args, cost, device, peak, pad_id)

    # Batched full forward.
    batched_full_forward(model, ids[: args.baseline_batch], layer, args.baseline_batch, pad_id)  # warm-up
    with PeakMemory(device) as forward_mem:
        forward_s, reference = best_of(
            args.repeats, device, lambda: batched_full_forward(model, ids, layer, args.baseline_batch, pad_id)
        )
    print(
        f"batched full forward (batches of {args.baseline_batch} in data order, right padding, output_hidden_states): "
        f"{forward_s:.2f} s  {tokens / forward_s:,.0f} tokens/s  peak memory {forward_mem}"
    )
    error = relative_error(states, reference)
    print(
        f"engine vs batched full forward: largest relative L2 error of a state {error:.2e} "
        f"({str(dtype).removeprefix('torch.')})"
    )

    # Per-prompt full forward on a subset.
    subset = ids[: args.per_prompt]
    naive_hidden_states(model, subset[0], [layer])  # warm-up
    subset_s, _ = best_of(args.repeats, device, lambda: [naive_hidden_states(model, seq, [layer]) for seq in subset])
    per_prompt_s = subset_s * tokens / sum(len(seq) for seq in subset)
    print(
        f"per-prompt full forward ({len(subset)} prompts in {subset_s:.2f} s, extrapolated by tokens): "
        f"{per_prompt_s:.1f} s  {tokens / per_prompt_s:,.0f} tokens/s"
    )

    # Greedy generation.
    gen_ids = ids[: args.gen_prompts]
    gen_lengths = [len(seq) for seq in gen_ids]
    gen_prefix = common_prefix_length(gen_ids)
    fast = GreedyOptions(static_cache=args.static_cache, compile=args.compile, cache_buckets=args.cache_buckets)

    def bound(rows_per_batch: int) -> float:
        steps = math.ceil(len(gen_ids) / rows_per_batch) * (args.new_tokens - 1)
        return (
            prefill_flops(cost, gen_lengths, gen_prefix) / peak
            + steps * cost.weight_bytes(dtype_bytes(dtype)) / bandwidth
        )

    generate_greedy_ids(model, gen_ids[:2], pad_id, 2, 2, progress=False, options=PLAIN)  # warm-up
    with PeakMemory(device) as plain_mem:
        plain_s, plain_out = best_of(
            args.repeats,
            device,
            lambda: generate_greedy_ids(
                model, gen_ids, pad_id, args.new_tokens, args.gen_batch, progress=False, options=PLAIN
            ),
        )
    plain_share = bound(args.gen_batch) / plain_s
    print(
        f"generate, plain (model.generate, batches of {args.gen_batch}, left padding, dynamic cache): {plain_s:.2f} s  "
        f"{len(gen_ids) / plain_s:.1f} prompts/s  bound {bound(args.gen_batch):.2f} s = {plain_share:.1%}  "
        f"peak memory {plain_mem}"
    )

    fast_rows = generation_batch_rows(model, gen_ids, args.new_tokens, args.fast_gen_batch, fast, gen_prefix)
    # Warm-up: one full batch of each static-cache bucket the timed run meets (each compiles once).
    order = sorted(range(len(gen_ids)), key=lambda i: gen_lengths[i])
    warm_batches: dict[int, list[int]] = {}
    for start in range(0, len(order), fast_rows):
        batch = order[start : start + fast_rows]
        bucket = cache_length(max(gen_lengths[i] for i in batch) + args.new_tokens, args.cache_buckets)
        warm_batches.setdefault(bucket if args.static_cache else 0, batch + [batch[-1]] * (fast_rows - len(batch)))
    warm_s = 0.0
    for batch in warm_batches.values():
        seconds, _ = timed(
            device,
            lambda: generate_greedy_ids(
                model, [gen_ids[i] for i in batch], pad_id, args.new_tokens, fast_rows, progress=False, options=fast
            ),
        )
        warm_s += seconds
    with PeakMemory(device) as fast_mem:
        fast_s, fast_out = best_of(
            args.repeats,
            device,
            lambda: generate_greedy_ids(
                model, gen_ids, pad_id, args.new_tokens, fast_rows, progress=False, options=fast
            ),
        )
    fast_share = bound(fast_rows) / fast_s
    same = sum(a == b for a, b in zip(plain_out, fast_out))
    levers = (
        ["shared prefix"]
        + ([f"static cache, buckets {list(args.cache_buckets[:4])}..."] if args.static_cache else [])
        + (["compiled decoding step"] if args.static_cache and args.compile and device.type == "cuda" else [])
    )
    print(
        f"generate, fast ({', '.join(levers)}; batches of {fast_rows}): warm-up {warm_s:.1f} s "
        f"({len(warm_batches)} bucket(s)), then {fast_s:.2f} s  {len(gen_ids) / fast_s:.1f} prompts/s  "
        f"bound {bound(fast_rows):.2f} s = {fast_share:.1%}  peak memory {fast_mem}"
    )
    print(
        f"generated tokens equal to the plain path's: {same}/{len(gen_ids)} prompts "
        f"({'fp32: expected all' if dtype == torch.float32 else 'bf16 rounding can flip near-ties'})"
    )

    release_static_caches(model)
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    result.update(
        engine_seconds=engine_s,
        engine_tokens_per_s=tokens / engine_s,
        engine_useful_tflops=useful / engine_s / 1e12,
        engine_rows=rows,
        engine_batch_tokens=batch_tokens,
        engine_peak_memory=engine_mem.bytes,
        forward_seconds=forward_s,
        forward_peak_memory=forward_mem.bytes,
        per_prompt_seconds=per_prompt_s,
        engine_vs_forward_rel_error=error,
        plain_generate_seconds=plain_s,
        fast_generate_seconds=fast_s,
        fast_generate_warmup_seconds=warm_s,
        fast_generate_rows=fast_rows,
        fast_generate_peak_memory=fast_mem.bytes,
        same_tokens=same,
        gen_prompts=len(gen_ids),
        **{k: v for k, v in likelihood.items() if k != "likelihood_share_of_peak"},
        ratios={
            "engine_share_of_peak": engine_share,
            **({"engine_eager_share_of_peak": useful / uncompiled_s / peak} if compiled_ran else {}),
            "engine_speedup_vs_batched_forward": forward_s / engine_s,
            "engine_speedup_vs_per_prompt": per_prompt_s / engine_s,
            "generation_share_of_bound": fast_share,
            "plain_generation_share_of_bound": plain_share,
            "generation_speedup_vs_plain_generate": plain_s / fast_s,
            "likelihood_share_of_peak": likelihood["likelihood_share_of_peak"],
        },
    )
    return result


def batch_arg(value: str) -> int | str:
    try:
        return check_batch_size(value if value == AUTO else int(value), "batch size")
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"batch size must be an integer >= 1 or {AUTO!r}; got {value!r}") from err


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--shapes", default=",".join(PUBLISHED_SHAPES), help="comma-separated, of " + ", ".join(PUBLISHED_SHAPES)
    )
    parser.add_argument("--tiny", action="store_true", help="tiny models of the same families (default without CUDA)")
    parser.add_argument("--prompts", type=int, default=None, help="default 2048 (tiny: 256)")
    parser.add_argument("--prefix", type=int, default=40)
    parser.add_argument("--own-min", type=int, default=120)
    parser.add_argument("--own-max", type=int, default=260)
    parser.add_argument("--layer", type=int, default=None, help="default Layer/2")
    parser.add_argument("--engine-batch", type=batch_arg, default=AUTO, help="engine rows per batch (int or auto)")
    parser.add_argument(
        "--engine-tokens", type=batch_arg, default=AUTO, help="engine padded tokens per batch (int or auto)"
    )
    parser.add_argument(
        "--baseline-batch", type=int, default=None, help="batched full forward rows (default 64; tiny 16)"
    )
    parser.add_argument("--per-prompt", type=int, default=None, help="prompts run one by one (default 64; tiny 16)")
    parser.add_argument("--gen-prompts", type=int, default=None, help="prompts answered (default 512; tiny 32)")
    parser.add_argument("--gen-batch", type=int, default=None, help="plain generate rows (default 64; tiny 8)")
    parser.add_argument(
        "--engine-compile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time the engine with compiled norm/MLP blocks (CUDA only; the ratios are then its own)",
    )
    parser.add_argument("--fast-gen-batch", type=batch_arg, default=AUTO, help="fast generation rows (int or auto)")
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--answer-min", type=int, default=2, help="the ℓ stage's answers: fewest tokens")
    parser.add_argument("--answer-max", type=int, default=8, help="the ℓ stage's answers: most tokens")
    parser.add_argument(
        "--static-cache",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="static cache for the fast path (default: on with CUDA)",
    )
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="compile the static cache's decoding step (CUDA only)",
    )
    parser.add_argument(
        "--cache-buckets", type=lambda s: tuple(int(x) for x in s.split(",")), default=DEFAULT_CACHE_BUCKETS
    )
    parser.add_argument(
        "--repeats", type=int, default=None, help="timed runs per phase, the fastest kept (default 1; CPU 2)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)

    cuda = torch.cuda.is_available()
    args.tiny = args.tiny or not cuda
    device = torch.device("cuda" if cuda and not args.tiny else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tiny = args.tiny
    defaults = dict(
        prompts=(256, 2048),
        baseline_batch=(16, 64),
        per_prompt=(16, 64),
        gen_prompts=(32, 512),
        gen_batch=(8, 64),
        repeats=(2, 1),
    )
    for key, (small, large) in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, small if tiny else large)
    if args.static_cache is None:
        args.static_cache = device.type == "cuda"
    shapes = [s for s in args.shapes.split(",") if s]
    unknown = [s for s in shapes if s not in PUBLISHED_SHAPES]
    if unknown:
        parser.error(f"--shapes: {unknown} not among {list(PUBLISHED_SHAPES)}")
    if args.own_min < 1 or args.own_max < args.own_min or args.prefix < 0:
        parser.error("need 1 <= --own-min <= --own-max and --prefix >= 0")
    if args.answer_min < 1 or args.answer_max < args.answer_min:
        parser.error("need 1 <= --answer-min <= --answer-max")
    GreedyOptions(cache_buckets=args.cache_buckets)  # refuses bad buckets before anything runs

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"device: {name}; torch {torch.__version__}")
    peak, size = matmul_peak(device, dtype)
    bandwidth = copy_bandwidth(device)
    print(
        f"{str(dtype).removeprefix('torch.')} matmul peak: {flops_text(peak)}/s (best of square sizes, at {size}); "
        f"copy bandwidth: {bandwidth / 1e9:.1f} GB/s"
    )
    results = [run_shape(shape, args, device, dtype, peak, bandwidth) for shape in shapes]
    if device.type == "cpu":
        print(f"process max resident memory: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")
    if args.json:
        args.json.write_text(
            json.dumps({"device": name, "peak_flops": peak, "bandwidth": bandwidth, "results": results}, indent=2)
        )
    print()
    for result in results:
        for key, value in result["ratios"].items():
            print(f"{result['shape']} {key}: {value:.3f}")
    return results


if __name__ == "__main__":
    main()
