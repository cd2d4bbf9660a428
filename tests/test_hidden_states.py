"""The engine's vectors equal the naive full forward, for every padding side and batch composition."""

from __future__ import annotations

import numpy as np
import pytest

from confrag.llm.hidden_states import HiddenStateEngine, common_prefix_length, naive_hidden_states, validate_layers
from confrag.llm.prompts import encode_prompts

TOLERANCE = 1e-5


def relative_error(got: np.ndarray, ref: np.ndarray) -> float:
    return float((np.abs(got - ref).max(-1) / np.abs(ref).max(-1)).max())


def naive(llm, prompts, layers):
    ids = encode_prompts(llm.tokenizer, prompts)
    return np.stack([naive_hidden_states(llm.model, seq, layers) for seq in ids], axis=1)


def rag_prompts(llm, templates, rows):
    # Contexts of different lengths so that batches need padding; all share the system + instruction prefix.
    return [templates.rag_prompt(llm.tokenizer, row.question, row.contexts[:1]) for row in rows]


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_qwen2"])
@pytest.mark.parametrize("padding_side", ["left", "right"])
@pytest.mark.parametrize("share_prefix", [True, False])
def test_tiny_models_match_naive_forward(request, templates, nq_rows, arch, padding_side, share_prefix):
    llm = request.getfixturevalue(arch)
    prompts = rag_prompts(llm, templates, nq_rows[:7]) + [templates.qa_prompt(llm.tokenizer, nq_rows[7].question)]
    layers = [0, 1, llm.mid_layer, llm.num_layers - 1, llm.num_layers]
    reference = naive(llm, prompts, layers)
    for batch_size in (1, 3, 8):
        engine = HiddenStateEngine(
            llm.model,
            llm.tokenizer,
            batch_size=batch_size,
            padding_side=padding_side,
            share_prefix=share_prefix,
            progress=False,
        )
        got = engine.extract(prompts, layers)
        assert got.shape == (len(layers), len(prompts), llm.model.config.hidden_size)
        assert relative_error(got, reference) <= TOLERANCE


@pytest.mark.heavy
def test_smollm2_real_rag_prompts_match_naive_forward(smollm2, templates, nq_rows):
    prompts = rag_prompts(smollm2, templates, nq_rows[:6])
    layers = [0, 6, 15, 21, 30]
    reference = naive(smollm2, prompts, layers)
    for padding_side in ("left", "right"):
        engine = HiddenStateEngine(
            smollm2.model, smollm2.tokenizer, batch_size=4, padding_side=padding_side, progress=False
        )
        assert relative_error(engine.extract(prompts, layers), reference) <= TOLERANCE


def test_shared_prefix_is_found_and_used(smollm2, templates, nq_rows):
    ids = encode_prompts(smollm2.tokenizer, rag_prompts(smollm2, templates, nq_rows[:8]))
    prefix = common_prefix_length(ids)
    assert prefix >= 40  # system prompt + RAG instruction
    engine = HiddenStateEngine(smollm2.model, smollm2.tokenizer, progress=False)
    assert engine._shared_prefix_length(ids) == prefix


def test_only_layers_up_to_the_deepest_requested_run(tiny_llama, templates, nq_rows):
    calls = []
    hooks = [
        layer.register_forward_hook(lambda m, i, o, k=k: calls.append(k))
        for k, layer in enumerate(tiny_llama.model.base_model.layers)
    ]
    try:
        engine = HiddenStateEngine(
            tiny_llama.model, tiny_llama.tokenizer, batch_size=8, share_prefix=False, progress=False
        )
        engine.extract([templates.qa_prompt(tiny_llama.tokenizer, r.question) for r in nq_rows[:4]], [1, 2])
    finally:
        for hook in hooks:
            hook.remove()
    # hidden_states[2] is the output of decoder layer 1: layer 0 runs whole, layer 1 only for the last
    # token (through its submodules, not its forward), layers 2 and 3 not at all.
    assert sorted(set(calls)) == [0]
    assert len(tiny_llama.model.base_model.layers) == 4  # the stack is restored


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_qwen2"])
@pytest.mark.parametrize("layers", [[1], [2], [0, 3], [4]])
def test_last_token_tail_matches_full_path(request, templates, nq_rows, arch, layers):
    llm = request.getfixturevalue(arch)
    prompts = rag_prompts(llm, templates, nq_rows[:5])
    reference = naive(llm, prompts, layers)
    for tail in (True, False):
        engine = HiddenStateEngine(llm.model, llm.tokenizer, batch_size=2, last_token_tail=tail, progress=False)
        assert relative_error(engine.extract(prompts, layers), reference) <= TOLERANCE


def test_layer_outside_range_lists_valid_range(tiny_llama):
    with pytest.raises(ValueError, match=r"valid layers are 0\.\.4"):
        validate_layers([5], 4)
    engine = HiddenStateEngine(tiny_llama.model, tiny_llama.tokenizer, progress=False)
    with pytest.raises(ValueError, match=r"0\.\.4"):
        engine.extract(["hello"], [-1])


def test_bad_engine_settings_are_refused(tiny_llama):
    with pytest.raises(ValueError, match="padding_side"):
        HiddenStateEngine(tiny_llama.model, tiny_llama.tokenizer, padding_side="middle")
    with pytest.raises(ValueError, match="batch_size"):
        HiddenStateEngine(tiny_llama.model, tiny_llama.tokenizer, batch_size=0)


def test_a_family_outside_the_fast_path_runs_the_full_layer_and_says_so_once(
    tiny_llama, templates, nq_rows, monkeypatch, caplog
):
    """A new LLM family (here the tiny Llama under another `model_type`) gets exact states through the full layer
    and one log line naming why; one entry of TAIL_MODEL_TYPES puts it on the fast path."""
    import confrag.llm.last_token as last_token

    monkeypatch.setattr(tiny_llama.model.config, "model_type", "mistral")
    monkeypatch.setattr(last_token, "_told", set())
    prompts = rag_prompts(tiny_llama, templates, nq_rows[:3])
    reference = naive(tiny_llama, prompts, [2])
    engine = HiddenStateEngine(tiny_llama.model, tiny_llama.tokenizer, batch_size=2, progress=False)
    with caplog.at_level("INFO", logger="confrag.llm.last_token"):
        for _ in range(2):
            assert relative_error(engine.extract(prompts, [2]), reference) <= TOLERANCE
    told = [r.getMessage() for r in caplog.records if r.name == "confrag.llm.last_token"]
    assert len(told) == 1 and "mistral: the deepest requested layer runs over every prompt token" in told[0]
    assert "'mistral' is not in TAIL_MODEL_TYPES" in told[0]
    layer = tiny_llama.model.base_model.layers[1]
    assert not last_token.plain_decoder_layer(tiny_llama.model, layer)
    monkeypatch.setattr(last_token, "TAIL_MODEL_TYPES", (*last_token.TAIL_MODEL_TYPES, "mistral"))
    assert last_token.plain_decoder_layer(tiny_llama.model, layer)
    assert relative_error(engine.extract(prompts, [2]), reference) <= TOLERANCE
