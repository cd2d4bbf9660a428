"""The GPU levers on a CUDA device: the compiled static-cache decoding step gives the plain path's tokens and
compiles once per bucket, not once per batch; "auto" batch sizes from free memory keep the engine exact; a
random-weight model of Llama-3-8B's shape loads in bf16 and answers through the compiled path; the scale
benchmark runs on the real shapes (small workload).

Marked `gpu`: skipped without a CUDA device. `pytest -m gpu tests/test_gpu_levers.py -s` prints the numbers."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from confrag.llm.batching import CPU_EXTRACT_TOKENS, CPU_GENERATE_BATCH
from confrag.llm.generation import (
    PLAIN,
    GreedyOptions,
    generate_greedy_ids,
    generation_batch_rows,
    release_static_caches,
)
from confrag.llm.hidden_states import HiddenStateEngine, naive_hidden_states
from confrag.llm.loading import load_llm
from confrag.llm.prompts import encode_prompts
from test_gpu_scale import benchmark_module

from helpers.models import cpu_llm, tiny_spec, tokenizer_spec

pytestmark = pytest.mark.gpu


def tiny_on_cuda(arch: str):
    return load_llm(cpu_llm(name=f"tiny_{arch}", source="tiny", device="cuda", tiny=tiny_spec(arch)))


def rag_ids(llm, templates, nq_rows, count=24):
    prompts = [templates.rag_prompt(llm.tokenizer, r.question, r.contexts[:1]) for r in nq_rows[:count]]
    return encode_prompts(llm.tokenizer, prompts)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_compiled_static_cache_gives_the_plain_tokens_and_compiles_once_per_bucket(arch, templates, nq_rows):
    import torch._dynamo.utils as dynamo_utils

    llm = tiny_on_cuda(arch)
    ids, pad = rag_ids(llm, templates, nq_rows), llm.tokenizer.pad_token_id
    plain = generate_greedy_ids(llm.model, ids, pad, 12, 8, progress=False, options=PLAIN)
    options = GreedyOptions(static_cache=True, cache_buckets=(1024,))  # one bucket: every batch has one shape
    start = time.perf_counter()
    first = generate_greedy_ids(llm.model, ids, pad, 12, 8, progress=False, options=options)
    warm = time.perf_counter() - start
    compiled = dict(dynamo_utils.counters["stats"])
    start = time.perf_counter()
    second = generate_greedy_ids(llm.model, ids, pad, 12, 8, progress=False, options=options)
    steady = time.perf_counter() - start
    print(
        f"\n{arch}: compiled static path {warm:.1f} s with compilation, {steady:.2f} s after; "
        f"dynamo stats {compiled} -> {dict(dynamo_utils.counters['stats'])}"
    )
    assert first == second == plain  # fp32: the compiled step computes the plain path's tokens
    assert dynamo_utils.counters["stats"].get("unique_graphs", 0) == compiled.get("unique_graphs", 0)  # no recompile
    release_static_caches(llm.model)


def test_auto_batches_use_free_memory_and_stay_exact(templates, nq_rows):
    llm = tiny_on_cuda("llama")
    ids = rag_ids(llm, templates, nq_rows, 32)
    engine = HiddenStateEngine(llm.model, llm.tokenizer, batch_size="auto", progress=False)
    rows, tokens = engine.batch_limits(2, max(len(s) for s in ids))
    assert tokens > CPU_EXTRACT_TOKENS
    assert generation_batch_rows(llm.model, ids, 12, "auto", GreedyOptions()) > CPU_GENERATE_BATCH
    got = engine.extract_ids(ids, [2])[0]
    reference = np.stack([naive_hidden_states(llm.model, seq, [2])[0] for seq in ids])
    error = float((np.abs(got - reference).max(-1) / np.abs(reference).max(-1)).max())
    print(f"\nauto on cuda: {rows} rows / {tokens} tokens per batch; fp32 relative error {error:.2e}")
    assert error <= 1e-5


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_compiled_engine_blocks_stay_exact_and_compile_once(arch, templates, nq_rows):
    import torch._dynamo.utils as dynamo_utils

    llm = tiny_on_cuda(arch)
    ids = rag_ids(llm, templates, nq_rows, 32)
    layers = [1, 2, 4]
    reference = np.stack([naive_hidden_states(llm.model, seq, layers) for seq in ids], axis=1)
    engine = HiddenStateEngine(llm.model, llm.tokenizer, batch_size=5, compile=True, progress=False)
    before = dynamo_utils.counters["stats"].get("unique_graphs", 0)
    got = engine.extract_ids(ids, layers)
    graphs = dynamo_utils.counters["stats"].get("unique_graphs", 0) - before
    error = float((np.abs(got - reference).max(-1) / np.abs(reference).max(-1)).max())
    rows = [len(batch) for batch in engine.length_batches([len(s) for s in ids], 5, 4096)]
    print(
        f"\n{arch}: compiled norm/MLP blocks, {graphs} graph(s) for {len(rows)} batches of {rows} rows"
        f" x 4 layers; fp32 relative error {error:.2e}"
    )
    assert error <= 1e-5 and not engine._compile_failed
    # Per block kind (norm, MLP) and input rank (all tokens, last token), not per layer or batch shape; a
    # one-row batch adds one graph each (dynamic shapes specialize a size-1 dimension). H100: 8 for rows
    # [3, 3, 5, 5, 5, 5, 4, 1, 1] of 9 batches x 4 layers.
    assert 1 <= graphs <= 2 * 2 * (1 + (1 in rows))
    assert all(layer.mlp._compiled_call_impl is None for layer in llm.model.base_model.layers)  # restored


def test_llama3_shape_loads_in_bf16_and_answers_through_the_compiled_path(templates, nq_rows):
    llm = load_llm(
        cpu_llm(
            name="llama3_8b_shape",
            source="random",
            dtype="bfloat16",
            device="cuda",
            random=dict(shape="llama3_8b", num_hidden_layers=4),
            tiny=tokenizer_spec(),
        )
    )
    assert next(llm.model.parameters()).dtype == torch.bfloat16 and llm.device.type == "cuda"
    ids, pad = rag_ids(llm, templates, nq_rows, 16), llm.tokenizer.pad_token_id
    fast = generate_greedy_ids(llm.model, ids, pad, 8, 8, progress=False, options=GreedyOptions(static_cache=True))
    assert all(len(tokens) == 8 for tokens in fast)
    again = load_llm(
        cpu_llm(
            name="llama3_8b_shape",
            source="random",
            dtype="bfloat16",
            device="cuda",
            random=dict(shape="llama3_8b", num_hidden_layers=4),
            tiny=tokenizer_spec(),
        )
    )
    assert again.identity == llm.identity  # same seed, same device: same weights, same cache keys
    release_static_caches(llm.model)


def test_scale_benchmark_on_the_real_shapes(capsys):
    results = benchmark_module().main(
        ["--prompts", "128", "--per-prompt", "4", "--gen-prompts", "64", "--gen-batch", "32"]
    )
    print(capsys.readouterr().out)
    for result in results:
        assert all(np.isfinite(v) and v > 0 for v in result["ratios"].values())
        assert result["engine_vs_forward_rel_error"] < 5e-2  # bf16
