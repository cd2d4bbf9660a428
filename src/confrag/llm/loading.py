"""Load the target LLM by Hugging Face id, local directory, GGUF file, as a tiny random model, or as a
random-weight model of a published shape (`source: random`, e.g. Llama-3-8B's layers: GPU speed and
memory runs without a download).

Every loaded model carries an `identity`: the exact facts that change its hidden states (weights
reference, dtype). Artifact keys are built from it, so a cache never mixes two models.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from confrag.infra.distributed import rank_device
from confrag.llm.config import LLMConfig
from confrag.llm.sources import SOURCE_READERS

log = logging.getLogger(__name__)


@dataclass
class LoadedLLM:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    identity: dict[str, Any]

    @property
    def num_layers(self) -> int:
        return int(self.model.config.num_hidden_layers)

    @property
    def mid_layer(self) -> int:
        """The paper's Layer/2 in `hidden_states` indexing (0 = embeddings)."""
        return self.num_layers // 2

    @property
    def context(self) -> int:
        """The context length prompts are checked against (`max_position_embeddings`, as DeferredLLM's)."""
        return int(self.model.config.max_position_embeddings)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device


def load_llm(cfg: LLMConfig | dict[str, Any]) -> LoadedLLM:
    if not isinstance(cfg, LLMConfig):
        cfg = LLMConfig(**dict(cfg))
    if cfg.device == "rank":  # one device per process of a torchrun / SLURM launch
        cfg = dataclasses.replace(cfg, device=rank_device())
    model, tokenizer, ref = SOURCE_READERS[cfg.source].load(cfg)
    if cfg.chat_template:
        tokenizer.chat_template = cfg.chat_template
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.eval()
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    identity = {"name": cfg.name, "source": cfg.source, "ref": ref, "dtype": cfg.dtype}
    log.info("Loaded LLM %s (%d layers, dtype %s)", cfg.name, model.config.num_hidden_layers, cfg.dtype)
    return LoadedLLM(model=model, tokenizer=tokenizer, identity=identity)


def model_num_layers(cfg: LLMConfig | dict[str, Any]) -> int:
    """The model's number of decoder layers (`num_hidden_layers`), read from its configuration without
    loading weights or converting anything: the HF cache's or the local folder's config.json, for a GGUF
    file its converted folder's config.json or else the file's metadata (`<arch>.block_count`), or the
    tiny or random model's shape. Layer settings can so be checked before any generation."""
    if not isinstance(cfg, LLMConfig):
        cfg = LLMConfig(**dict(cfg))
    return SOURCE_READERS[cfg.source].num_layers(cfg)


def prompt_tokenizer(cfg: LLMConfig | dict[str, Any]) -> tuple[PreTrainedTokenizerBase, int]:
    """The tokenizer `load_llm` gives the model (its chat template included) and the model's context length
    (`max_position_embeddings`), without loading any weights: prompt lengths can so be checked before the
    LLM loads. A GGUF model is converted first (as `load_llm` would)."""
    if not isinstance(cfg, LLMConfig):
        cfg = LLMConfig(**dict(cfg))
    tokenizer, limit = SOURCE_READERS[cfg.source].tokenizer(cfg)
    if cfg.chat_template:
        tokenizer.chat_template = cfg.chat_template
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer, int(limit)


def llm_identity(cfg: LLMConfig | dict[str, Any]) -> dict[str, Any] | None:
    """The identity `load_llm` gives the model, from its files and settings alone (no weights loaded);
    None for `source: random`, whose identity samples the weights themselves."""
    if not isinstance(cfg, LLMConfig):
        cfg = LLMConfig(**dict(cfg))
    ref = SOURCE_READERS[cfg.source].ref(cfg)
    if ref is None:
        return None
    return {"name": cfg.name, "source": cfg.source, "ref": ref, "dtype": cfg.dtype}


class DeferredLLM:
    """What `load_llm` gives (identity, tokenizer, layer count, context length), with the weights loaded
    only when `.model` is first used: a stage whose results are all in the cache never loads them, and a
    stage that could not store what it would compute (a read-only cache) is refused before they load.
    The identity is computed from files and settings, and checked again once the weights are loaded."""

    def __init__(self, cfg: LLMConfig | dict[str, Any]) -> None:
        self.cfg = cfg if isinstance(cfg, LLMConfig) else LLMConfig(**dict(cfg))
        self.tokenizer, self.context = prompt_tokenizer(self.cfg)
        self._loaded: LoadedLLM | None = None
        identity = llm_identity(self.cfg)
        if identity is None:  # a random model's identity needs its weights
            identity = self.loaded.identity
        self.identity = identity
        self.num_layers = model_num_layers(self.cfg)

    @property
    def loaded(self) -> LoadedLLM:
        if self._loaded is None:
            loaded = load_llm(self.cfg)
            if getattr(self, "identity", loaded.identity) != loaded.identity:
                raise RuntimeError(
                    f"LLM '{self.cfg.name}': loaded as {loaded.identity}, announced as {self.identity} before "
                    f"loading; the caches keyed by it would mix models"
                )
            loaded.tokenizer = self.tokenizer  # one tokenizer object for prompts and generation
            loaded.model.generation_config.pad_token_id = self.tokenizer.pad_token_id
            self._loaded = loaded
        return self._loaded

    @property
    def model(self) -> PreTrainedModel:
        return self.loaded.model

    @property
    def mid_layer(self) -> int:
        return self.num_layers // 2

    @property
    def device(self) -> torch.device:
        return self.loaded.device
