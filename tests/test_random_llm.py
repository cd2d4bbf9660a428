"""`source: random`: Llama-3-8B's layer shapes with seeded random weights and SmolLM2's tokenizer, loaded on the CPU
with one layer (the smoke test the config comment describes); the 8B-shaped experiment composes; clear refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

import confrag.llm.random_weights as random_weights
from confrag.llm.config import LLMNotAvailableError
from confrag.llm.generation import generate_greedy
from confrag.llm.hidden_states import HiddenStateEngine, naive_hidden_states
from confrag.llm.loading import load_llm
from confrag.llm.prompts import encode_prompts
from test_configs import ROOT, compose_cfg


def random_cfg(**changes):
    cfg = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "llm" / "llama3_8b_shape.yaml"))
    cfg.update(cache_dir=None, device="cpu")
    random = {**cfg["random"], **changes.pop("random", {})}
    return {**cfg, **changes, "random": random}


@pytest.mark.heavy
def test_one_llama3_layer_on_the_cpu(templates, nq_rows):
    llm = load_llm(random_cfg(dtype="bfloat16", random={"num_hidden_layers": 1}))
    config, model = llm.model.config, llm.model
    assert (config.hidden_size, config.intermediate_size, config.num_attention_heads, config.num_key_value_heads) == (
        4096,
        14336,
        32,
        8,
    )
    assert config.rope_parameters["rope_theta"] == 500000.0 and config.rms_norm_eps == 1e-5
    assert not config.tie_word_embeddings and config.num_hidden_layers == 1 and llm.num_layers == 1
    assert config.vocab_size == len(llm.tokenizer) == 49152  # SmolLM2's vocabulary: its token ids are valid rows
    assert next(model.parameters()).dtype == torch.bfloat16 and llm.device.type == "cpu"
    assert llm.identity["source"] == "random" and llm.identity["ref"].startswith("random:llama3_8b@")
    prompt = templates.qa_prompt(llm.tokenizer, nq_rows[0].question)
    assert "<|im_start|>" in prompt  # SmolLM2's chat template
    (answer,) = generate_greedy(model, llm.tokenizer, [prompt], max_new_tokens=2, progress=False)
    assert isinstance(answer, str)
    state = HiddenStateEngine(model, llm.tokenizer, progress=False).extract([prompt], [1])[0, 0]
    reference = naive_hidden_states(model, encode_prompts(llm.tokenizer, [prompt])[0], [1])[0]
    assert np.isfinite(state).all() and np.abs(state - reference).max() <= 2e-2 * np.abs(reference).max()  # bf16


def test_the_seed_fixes_the_weights_and_the_identity_names_them():
    small = {
        "num_hidden_layers": 1,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }
    first = load_llm(random_cfg(dtype="float32", random=small))
    again = load_llm(random_cfg(dtype="float32", random=small))
    other = load_llm(random_cfg(dtype="float32", seed=1, random=small))
    assert first.identity == again.identity and first.identity != other.identity
    assert all(torch.equal(p, q) for p, q in zip(first.model.parameters(), again.model.parameters()))
    assert not torch.equal(first.model.lm_head.weight, other.model.lm_head.weight)


def test_too_large_for_the_memory_is_refused_before_building(monkeypatch):
    monkeypatch.setattr(random_weights, "available_memory", lambda device: (4 << 30, "available host memory"))
    with pytest.raises(MemoryError) as info:
        load_llm(random_cfg(dtype="float32"))
    message = str(info.value)
    assert "32 layers of shape llama3_8b in float32 need 27.5 GiB" in message
    assert "llm.random.num_hidden_layers" in message and "llm.device=cuda" in message


def test_bad_random_settings_are_named():
    with pytest.raises(ValueError, match=r"random.shape='llama2' is not one of \('llama3_8b', 'qwen2_5_7b'\)"):
        load_llm(random_cfg(random={"shape": "llama2"}))
    with pytest.raises(ValueError, match=r"random: key\(s\) \['vocab_size'\] cannot be set .* tokenizer's"):
        load_llm(random_cfg(random={"vocab_size": 128256}))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without CUDA")
def test_cuda_without_a_gpu_says_how_to_smoke_test_on_the_cpu():
    cfg = random_cfg()
    cfg["device"] = "cuda"
    with pytest.raises(LLMNotAvailableError, match="llm.random.num_hidden_layers=2"):
        load_llm(cfg)


def test_the_8b_shaped_cbdr_experiment_composes(tmp_path):
    cfg = OmegaConf.to_container(compose_cfg(["+experiment=cbdr_llama3_shape"], tmp_path), resolve=True)
    assert (
        cfg["task_name"] == "cbdr" and cfg["llm"]["source"] == "random" and cfg["llm"]["random"]["shape"] == "llama3_8b"
    )
    assert cfg["llm"]["dtype"] == "bfloat16" and cfg["llm"]["device"] == "cuda"
    assert cfg["probe"]["data"]["llm"] == cfg["llm"] and cfg["model"]["backbone"] == "minilm"
    assert cfg["trainer"]["accelerator"] == "gpu" and cfg["probe"]["trainer"]["accelerator"] == "gpu"
    # cbdr_llama3's GPU sizes: chosen from free device memory (docs/gpu.md)
    assert cfg["rag"]["batch_size"] == "auto" and cfg["probe"]["data"]["answers"]["batch_size"] == "auto"
    qwen = OmegaConf.to_container(
        compose_cfg(["+experiment=cbdr_llama3_shape", "llm=qwen2_5_7b_shape"], tmp_path), resolve=True
    )
    assert qwen["llm"]["random"]["shape"] == "qwen2_5_7b" and qwen["probe"]["data"]["llm"] == qwen["llm"]
