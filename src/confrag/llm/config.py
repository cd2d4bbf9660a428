"""What `conf/llm/*.yaml` holds (`LLMConfig`), the sources and dtypes it may name, and the settings every
`from_pretrained` of the target LLM shares."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedModel

from confrag.infra import checks
from confrag.llm.shapes import PUBLISHED_SHAPES

SOURCES = ("hf", "local", "gguf", "tiny", "random")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TINY_ARCHS = ("llama", "qwen2")
# A random-weight model's vocabulary and special tokens are its tokenizer's (SmolLM2's), never the shape's.
RANDOM_TOKENIZER_KEYS = ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")


def random_overridable(shape: str) -> list[str]:
    """The shape keys `random` may override for a published `shape`."""
    return sorted(set(PUBLISHED_SHAPES[shape]) - {"model_type", *RANDOM_TOKENIZER_KEYS})


class LLMNotAvailableError(RuntimeError):
    """The requested model cannot be loaded from local files."""


@dataclass
class LLMConfig:
    """What `conf/llm/*.yaml` holds (see there for the meaning of each field). Each default is written once
    (tests/test_settings_defaults.py): what every node sets (the dtype, device and attention) has none here; what a
    source does not use has its "unused" here (None, {}, seed 0), and a node writes it only to set another value."""

    name: str
    source: str
    dtype: str
    device: str  # cpu, cuda[:N], auto (device_map), rank (cuda:LOCAL_RANK of a torchrun rank, else cpu)
    attn_implementation: str | None
    repo_id: str | None = None
    revision: str | None = None
    local_dir: str | None = None
    gguf_package: str | None = None
    gguf_file: str | None = None
    gguf_path: str | None = None
    tiny: dict[str, Any] = field(default_factory=dict)
    random: dict[str, Any] = field(default_factory=dict)
    seed: int = 0  # the random weights' of `tiny` and `random`
    chat_template: str | None = None
    cache_dir: str | None = None  # converted models; None: <confrag cache>/models

    def __post_init__(self) -> None:
        """Everything a source needs that can be checked without its files, every problem at once, each naming
        the field (the config boundary, `recipes.llm_node`, adds the node: `llm.repo_id is required ...`)."""
        problems: list[str] = []
        if self.source not in SOURCES:
            problems.append(f"source={self.source!r} is not one of {SOURCES}")
        if self.dtype not in DTYPES:
            problems.append(f"dtype={self.dtype!r} is not one of {tuple(DTYPES)}")
        if self.source == "hf" and not self.repo_id:
            problems.append(f"repo_id is required when source=hf (config {self.name})")
        if self.source == "local" and not self.local_dir:
            problems.append(f"local_dir is required when source=local (config {self.name})")
        if self.source == "gguf" and not (self.gguf_path or (self.gguf_package and self.gguf_file)):
            problems.append(
                f"gguf_path, or gguf_package with gguf_file, is required when source=gguf (config {self.name})"
            )
        if self.source == "tiny" and self.tiny.get("arch", "llama") not in TINY_ARCHS:
            problems.append(f"tiny.arch={self.tiny.get('arch')!r} is not one of {TINY_ARCHS}")
        if self.source == "random":
            shape = self.random.get("shape")
            if shape not in PUBLISHED_SHAPES:
                problems.append(f"random.shape={shape!r} is not one of {tuple(PUBLISHED_SHAPES)}")
            else:
                allowed = random_overridable(shape)
                bad = sorted(set(self.random) - {"shape", *allowed})
                if bad:
                    problems.append(
                        f"random: key(s) {bad} cannot be set for shape {shape}; allowed: "
                        f"['shape', {', '.join(map(repr, allowed))}] (the vocabulary and special tokens are the "
                        f"tokenizer's)"
                    )
        checks.refuse(problems)


def from_pretrained_kwargs(cfg: LLMConfig) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"dtype": DTYPES[cfg.dtype]}
    if cfg.attn_implementation:
        kwargs["attn_implementation"] = cfg.attn_implementation
    if cfg.device == "auto":
        kwargs["device_map"] = "auto"
    return kwargs


def place(model: PreTrainedModel, cfg: LLMConfig) -> PreTrainedModel:
    if cfg.device not in ("auto",):
        model = model.to(cfg.device)
    return model
