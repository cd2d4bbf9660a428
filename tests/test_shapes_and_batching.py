"""Published shapes and their cost arithmetic (checked against transformers' own models, built on the meta device:
no memory, no download), and the engine's batch sizes from free memory."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

import confrag.llm.batching as batching
from confrag.llm.hidden_states import HiddenStateEngine, naive_hidden_states
from confrag.llm.prompts import encode_prompts
from confrag.llm.shapes import (
    PUBLISHED_SHAPES,
    DecoderCost,
    causal_pairs,
    engine_flops,
    prefill_flops,
    shape_config,
    stack_flops,
    tiny_overrides,
)


def meta_model(config, dtype=torch.bfloat16):
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


@pytest.mark.parametrize("shape", list(PUBLISHED_SHAPES))
@pytest.mark.parametrize("tiny", [False, True])
def test_cost_arithmetic_counts_the_models_parameters(shape, tiny):
    config = shape_config(shape, **(tiny_overrides(shape) if tiny else {}))
    model = meta_model(config)
    cost = DecoderCost.of(config)
    assert cost.params == sum(p.numel() for p in model.parameters())
    layer = model.model.layers[0]
    assert cost.layer_params == sum(p.numel() for p in layer.parameters())
    assert (layer.self_attn.q_proj.bias is not None) == (shape == "qwen2_5_7b") == cost.qkv_bias
    assert not config.tie_word_embeddings and model.lm_head.weight.shape == (cost.vocab, cost.hidden)


def test_published_numbers():
    llama, qwen = DecoderCost.of(shape_config("llama3_8b")), DecoderCost.of(shape_config("qwen2_5_7b"))
    assert (llama.hidden, llama.intermediate, llama.layers, llama.heads, llama.kv_heads, llama.vocab) == (
        4096,
        14336,
        32,
        32,
        8,
        128256,
    )
    assert (qwen.hidden, qwen.intermediate, qwen.layers, qwen.heads, qwen.kv_heads, qwen.vocab) == (
        3584,
        18944,
        28,
        28,
        4,
        152064,
    )
    assert round(llama.params / 1e9, 2) == 8.03 and round(qwen.params / 1e9, 2) == 7.62  # the models' known sizes
    assert shape_config("llama3_8b").rope_parameters["rope_theta"] == 500000.0
    assert shape_config("qwen2_5_7b").rms_norm_eps == 1e-6 and shape_config("qwen2_5_7b").sliding_window is None
    with pytest.raises(ValueError, match=r"shape='gpt5' is not one of \('llama3_8b', 'qwen2_5_7b'\)"):
        shape_config("gpt5")
    with pytest.raises(ValueError, match=r"\['layers'\] are not keys of shape 'llama3_8b'"):
        shape_config("llama3_8b", layers=2)


def test_flop_counts_add_up():
    cost = DecoderCost.of(shape_config("llama3_8b"))
    assert causal_pairs(3) == 6 and causal_pairs(2, prefix=5) == 13
    # Layer/2 of one 10-token prompt without a prefix: 15 full layers + K/V of layer 16 + its rest for one token.
    one = engine_flops(cost, [10], 0, 16)
    expected = (
        15 * (cost.layer_flops(10) + cost.attention_flops(55))
        + 2 * 10 * cost.kv_matmul_params
        + 2 * cost.other_matmul_params
        + cost.attention_flops(10)
    )
    assert one == pytest.approx(expected)
    # The CPU benchmarks' measure: the matrix multiplies alone (attention scores apart), and a full forward's.
    matmuls = 15 * cost.layer_flops(10) + 2 * 10 * cost.kv_matmul_params + 2 * cost.other_matmul_params
    assert engine_flops(cost, [10], 0, 16, attention=False) == pytest.approx(matmuls)
    assert stack_flops(cost, 10, 1) == pytest.approx(32 * cost.layer_flops(10) + cost.lm_head_flops(1))
    # A shared prefix is counted once, not per prompt.
    assert engine_flops(cost, [50, 50], 40, 16) < 2 * engine_flops(cost, [50], 0, 16)
    assert prefill_flops(cost, [10]) == pytest.approx(
        32 * (cost.layer_flops(10) + cost.attention_flops(55)) + cost.lm_head_flops(1)
    )
    assert cost.weight_bytes(2) == 2 * (cost.params - cost.vocab * cost.hidden)


def test_extraction_budget_grows_with_free_memory_and_is_capped(monkeypatch):
    model = meta_model(shape_config("llama3_8b"))
    monkeypatch.setattr(batching, "free_device_memory", lambda device: 10 << 30)
    rows, small = batching.extraction_budget(model, depth=16, max_length=300)
    monkeypatch.setattr(batching, "free_device_memory", lambda device: 60 << 30)
    _, large = batching.extraction_budget(model, depth=16, max_length=300)
    assert rows == batching.MAX_EXTRACT_ROWS and 300 <= small < large == batching.MAX_EXTRACT_TOKENS
    per_token = batching.extraction_bytes_per_token(DecoderCost.of(model.config), 16, 300, 2)
    assert small == int((10 << 30) * batching.MEMORY_FRACTION // per_token)
    monkeypatch.setattr(batching, "free_device_memory", lambda device: 64 << 20)
    with pytest.raises(MemoryError, match="fewer than the longest prompt"):
        batching.extraction_budget(model, depth=16, max_length=300)


def test_engine_auto_batches_are_the_cpu_defaults_here_and_stay_exact(tiny_llama, templates, nq_rows, monkeypatch):
    prompts = [templates.rag_prompt(tiny_llama.tokenizer, r.question, r.contexts[:1]) for r in nq_rows[:6]]
    engine = HiddenStateEngine(tiny_llama.model, tiny_llama.tokenizer, batch_size="auto", progress=False)
    assert engine.batch_limits(2, 500) == (batching.CPU_EXTRACT_BATCH, batching.CPU_EXTRACT_TOKENS)
    reference = np.stack(
        [naive_hidden_states(tiny_llama.model, ids, [2]) for ids in encode_prompts(tiny_llama.tokenizer, prompts)],
        axis=1,
    )
    # As on a GPU with plenty of memory: every prompt in one batch (the padding tolerance still splits by length).
    monkeypatch.setattr(batching, "free_device_memory", lambda device: 64 << 30)
    rows, tokens = engine.batch_limits(2, 500)
    assert rows == batching.MAX_EXTRACT_ROWS and tokens == batching.MAX_EXTRACT_TOKENS
    got = engine.extract(prompts, [2])
    assert float((np.abs(got - reference).max(-1) / np.abs(reference).max(-1)).max()) <= 1e-5
    with pytest.raises(ValueError, match="max_batch_tokens must be an integer >= 1 or 'auto'"):
        HiddenStateEngine(tiny_llama.model, tiny_llama.tokenizer, max_batch_tokens="lots")


def test_engine_compile_is_a_cuda_lever_and_leaves_the_cpu_path_as_it_was(tiny_llama, templates, nq_rows):
    prompts = [templates.qa_prompt(tiny_llama.tokenizer, r.question) for r in nq_rows[:4]]
    eager = HiddenStateEngine(tiny_llama.model, tiny_llama.tokenizer, progress=False).extract(prompts, [1, 2])
    engine = HiddenStateEngine(tiny_llama.model, tiny_llama.tokenizer, compile=True, progress=False)
    assert np.array_equal(engine.extract(prompts, [1, 2]), eager)
    assert all(layer.mlp._compiled_call_impl is None for layer in tiny_llama.model.base_model.layers)
    with pytest.raises(ValueError, match="compile must be true or false"):
        HiddenStateEngine(tiny_llama.model, tiny_llama.tokenizer, compile="yes")
