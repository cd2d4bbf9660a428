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
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from confrag.infra.digests import folder_problem
from confrag.infra.distributed import rank_device
from confrag.llm.config import LLMConfig, LLMNotAvailableError
from confrag.llm.pretrained import (
    dir_fingerprint,
    ensure_converted,
    file_sha256,
    gguf_block_count,
    gguf_location,
    hf_missing_message,
    hf_ref,
    load_gguf,
    load_hf,
    load_local,
    local_dir,
    model_cache,
)
from confrag.llm.random_weights import (
    QWEN2_CHAT_TEMPLATE,
    TINY_ARCHS,
    load_random,
    load_tiny,
    tiny_ref,
    tiny_shape,
    tiny_tokenizer,
)
from confrag.llm.shapes import PUBLISHED_SHAPES

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
    loader = {"hf": load_hf, "local": load_local, "gguf": load_gguf, "tiny": load_tiny, "random": load_random}[
        cfg.source
    ]
    model, tokenizer, ref = loader(cfg)
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
    tiny model's shape. Layer settings can so be checked before any generation."""
    if not isinstance(cfg, LLMConfig):
        cfg = LLMConfig(**dict(cfg))
    if cfg.source == "tiny":
        arch = cfg.tiny.get("arch", "llama")
        if arch not in TINY_ARCHS:
            raise ValueError(f"llm.tiny.arch={arch!r} is not one of {TINY_ARCHS}")
        return int(cfg.tiny.get("num_hidden_layers", AutoConfig.for_model(arch).num_hidden_layers))
    if cfg.source == "gguf":
        path = gguf_location(cfg)
        converted = model_cache(cfg) / f"{path.stem}-{file_sha256(path)[:16]}"
        # A JSON read (its digest checked), where parsing the GGUF metadata takes seconds.
        if not folder_problem(converted, only=("config.json",)):
            return int(AutoConfig.from_pretrained(converted).num_hidden_layers)
        return gguf_block_count(path, cfg.name)
    if cfg.source == "local":
        if not cfg.local_dir:
            raise ValueError(f"llm.local_dir is required when llm.source=local (config {cfg.name})")
        path = Path(cfg.local_dir).expanduser()
        if not (path / "config.json").is_file():
            raise LLMNotAvailableError(f"LLM '{cfg.name}': directory {path} lacks config.json")
        return int(AutoConfig.from_pretrained(path).num_hidden_layers)
    if not cfg.repo_id:
        raise ValueError(f"llm.repo_id is required when llm.source=hf (config {cfg.name})")
    try:
        return int(AutoConfig.from_pretrained(cfg.repo_id, revision=cfg.revision).num_hidden_layers)
    except (OSError, ValueError) as err:
        raise LLMNotAvailableError(hf_missing_message(cfg, err)) from err


def prompt_tokenizer(cfg: LLMConfig | dict[str, Any]) -> tuple[PreTrainedTokenizerBase, int]:
    """The tokenizer `load_llm` gives the model (its chat template included) and the model's context length
    (`max_position_embeddings`), without loading any weights: prompt lengths can so be checked before the
    LLM loads. A GGUF model is converted first (as `load_llm` would)."""
    if not isinstance(cfg, LLMConfig):
        cfg = LLMConfig(**dict(cfg))
    if cfg.source == "tiny":
        arch = cfg.tiny.get("arch", "llama")
        if arch not in TINY_ARCHS:
            raise ValueError(f"llm.tiny.arch={arch!r} is not one of {TINY_ARCHS}")
        tokenizer = tiny_tokenizer(cfg)
        limit = AutoConfig.for_model(arch, **tiny_shape(cfg)).max_position_embeddings
        if arch == "qwen2":
            tokenizer.chat_template = QWEN2_CHAT_TEMPLATE
    elif cfg.source == "random":
        shape = cfg.random.get("shape")
        if shape not in PUBLISHED_SHAPES:
            raise ValueError(f"llm.random.shape={shape!r} is not one of {tuple(PUBLISHED_SHAPES)}")
        tokenizer = tiny_tokenizer(cfg)
        limit = cfg.random.get("max_position_embeddings") or PUBLISHED_SHAPES[shape]["max_position_embeddings"]
    else:
        if cfg.source == "gguf":
            path = gguf_location(cfg)
            where: Any = model_cache(cfg) / f"{path.stem}-{file_sha256(path)[:16]}"
            ensure_converted(path, where)
            kwargs = {}
        elif cfg.source == "local":
            where, kwargs = local_dir(cfg), {}
        else:
            if not cfg.repo_id:
                raise ValueError(f"llm.repo_id is required when llm.source=hf (config {cfg.name})")
            where, kwargs = cfg.repo_id, {"revision": cfg.revision}
        try:
            tokenizer = AutoTokenizer.from_pretrained(where, **kwargs)
            limit = AutoConfig.from_pretrained(where, **kwargs).max_position_embeddings
        except (OSError, ValueError) as err:
            if cfg.source == "hf":
                raise LLMNotAvailableError(hf_missing_message(cfg, err)) from err
            raise LLMNotAvailableError(f"LLM '{cfg.name}': no tokenizer or config in {where} ({err})") from err
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
    if cfg.source == "random":
        return None
    if cfg.source == "tiny":
        ref = tiny_ref(cfg)
    elif cfg.source == "gguf":
        path = gguf_location(cfg)
        ref = f"gguf:{path.name}@{file_sha256(path)[:16]}"
    elif cfg.source == "local":
        ref = f"local:{dir_fingerprint(local_dir(cfg))}"
    else:
        try:
            config = AutoConfig.from_pretrained(cfg.repo_id, revision=cfg.revision)
        except (OSError, ValueError) as err:
            raise LLMNotAvailableError(hf_missing_message(cfg, err)) from err
        ref = hf_ref(cfg, config)
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
