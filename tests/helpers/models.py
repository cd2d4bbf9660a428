"""The tiny random models' shape, shared by the fixtures (`conftest.py`), the tests that load their own
copy and the worker scripts run in subprocesses."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

# Four layers (Layer/2 = 2), GQA with two key-value heads: small enough for CPU, shaped like the real ones.
TINY_SHAPE = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2
)


def cpu_llm(**fields: Any) -> dict[str, Any]:
    """An `llm` node with what every shipped CPU node sets and LLMConfig leaves to it (dtype, device, attention: read
    from conf/llm/tiny_llama.yaml), `fields` on top (`name`, `source` and what the source needs)."""
    node = OmegaConf.load(Path(__file__).resolve().parents[2] / "conf" / "llm" / "tiny_llama.yaml")
    return {**{k: node[k] for k in ("dtype", "device", "attn_implementation")}, **fields}


def tiny_llm_config(arch: str = "llama", **fields: Any) -> dict[str, Any]:
    """The `llm` config of the tiny random `arch` model (conftest's `tiny_llama` / `tiny_qwen2`), with `fields`."""
    return cpu_llm(name=f"tiny_{arch}", source="tiny", **fields, tiny=tiny_spec(arch))


def tiny_spec(arch: str = "llama") -> dict[str, Any]:
    """`llm.tiny` of the tiny `arch` model. `CONFRAG_TINY_TOKENIZER_DIR` (a saved SmolLM2 tokenizer) stands in
    for the GGUF on a machine that lacks it: the lent GPU, which receives 64 MiB of files."""
    return dict(arch=arch, **TINY_SHAPE, **tokenizer_spec())


def tokenizer_spec() -> dict[str, Any]:
    """The `llm.tiny` keys that choose the tokenizer of the tiny and random-weight models (see `tiny_spec`)."""
    folder = os.environ.get("CONFRAG_TINY_TOKENIZER_DIR")
    return {"tokenizer_dir": folder} if folder else {}
