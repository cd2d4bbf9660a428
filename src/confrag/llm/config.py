"""What `conf/llm/*.yaml` holds (`LLMConfig`), the sources and dtypes it may name, and the settings every
`from_pretrained` of the target LLM shares."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedModel

SOURCES = ("hf", "local", "gguf", "tiny", "random")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class LLMNotAvailableError(RuntimeError):
    """The requested model cannot be loaded from local files."""


@dataclass
class LLMConfig:
    """What `conf/llm/*.yaml` holds (see there for the meaning of each field)."""

    name: str
    source: str
    repo_id: str | None = None
    revision: str | None = None
    local_dir: str | None = None
    gguf_package: str | None = None
    gguf_file: str | None = None
    gguf_path: str | None = None
    dtype: str = "float32"
    device: str = "cpu"  # cpu, cuda[:N], auto (device_map), rank (cuda:LOCAL_RANK of a torchrun rank, else cpu)
    attn_implementation: str | None = "sdpa"
    tiny: dict[str, Any] = field(default_factory=dict)
    random: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    chat_template: str | None = None
    cache_dir: str | None = None

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"llm.source={self.source!r} is not one of {SOURCES}")
        if self.dtype not in DTYPES:
            raise ValueError(f"llm.dtype={self.dtype!r} is not one of {tuple(DTYPES)}")


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
