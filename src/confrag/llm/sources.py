"""Where the target LLM comes from: one registered class per `llm.source`, each answering the four questions the
project asks of a model (its weights, its layer count, its tokenizer with its context length, and the reference
its identity names), the last three without loading any weights. `confrag.llm.loading` asks the registry, so a new
source is one class here and one name in `confrag.llm.config.SOURCES` (a test holds the two equal).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

from transformers import AutoConfig, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from confrag.infra.digests import folder_problem
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
from confrag.llm.random_weights import QWEN2_CHAT_TEMPLATE, load_random, load_tiny, tiny_ref, tiny_shape, tiny_tokenizer
from confrag.llm.shapes import PUBLISHED_SHAPES


class LLMSource(ABC):
    """How one source is read. `load` gives (model, tokenizer, reference); the others read no weights."""

    @abstractmethod
    def load(self, cfg: LLMConfig) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, str]: ...

    @abstractmethod
    def num_layers(self, cfg: LLMConfig) -> int: ...

    @abstractmethod
    def tokenizer(self, cfg: LLMConfig) -> tuple[PreTrainedTokenizerBase, int]:
        """The tokenizer as the source gives it (the chat template and pad token are `load_llm`'s to set) and the
        model's context length (`max_position_embeddings`)."""

    @abstractmethod
    def ref(self, cfg: LLMConfig) -> str | None:
        """The identity's weights reference from files and settings; None where only the weights can name it."""


class _FolderSource(LLMSource):
    """A source whose config and tokenizer are read from a folder or a Hub id."""

    @abstractmethod
    def where(self, cfg: LLMConfig) -> tuple[Any, dict[str, Any]]:
        """The folder or Hub id `from_pretrained` reads, and its keyword arguments."""

    def unavailable(self, cfg: LLMConfig, where: Any, err: Exception) -> LLMNotAvailableError:
        return LLMNotAvailableError(f"LLM '{cfg.name}': no tokenizer or config in {where} ({err})")

    def tokenizer(self, cfg: LLMConfig) -> tuple[PreTrainedTokenizerBase, int]:
        where, kwargs = self.where(cfg)
        try:
            tokenizer = AutoTokenizer.from_pretrained(where, **kwargs)
            return tokenizer, int(AutoConfig.from_pretrained(where, **kwargs).max_position_embeddings)
        except (OSError, ValueError) as err:
            raise self.unavailable(cfg, where, err) from err


class HubSource(_FolderSource):
    """A Hugging Face id, read offline from the local HF cache."""

    def load(self, cfg):
        return load_hf(cfg)

    def where(self, cfg):
        return cfg.repo_id, {"revision": cfg.revision}

    def unavailable(self, cfg, where, err):
        return LLMNotAvailableError(hf_missing_message(cfg, err))

    def num_layers(self, cfg):
        try:
            return int(AutoConfig.from_pretrained(cfg.repo_id, revision=cfg.revision).num_hidden_layers)
        except (OSError, ValueError) as err:
            raise LLMNotAvailableError(hf_missing_message(cfg, err)) from err

    def ref(self, cfg):
        try:
            config = AutoConfig.from_pretrained(cfg.repo_id, revision=cfg.revision)
        except (OSError, ValueError) as err:
            raise LLMNotAvailableError(hf_missing_message(cfg, err)) from err
        return hf_ref(cfg, config)


class LocalSource(_FolderSource):
    """A folder holding a config, weights and a tokenizer (`save_pretrained`'s layout)."""

    def load(self, cfg):
        return load_local(cfg)

    def where(self, cfg):
        return local_dir(cfg), {}

    def num_layers(self, cfg):
        path = Path(cfg.local_dir).expanduser()
        if not (path / "config.json").is_file():
            raise LLMNotAvailableError(f"LLM '{cfg.name}': directory {path} lacks config.json")
        return int(AutoConfig.from_pretrained(path).num_hidden_layers)

    def ref(self, cfg):
        return f"local:{dir_fingerprint(local_dir(cfg))}"


class GgufSource(_FolderSource):
    """A GGUF file, converted once to a transformers folder in the model cache (keyed by the file's digest)."""

    def load(self, cfg):
        return load_gguf(cfg)

    def converted(self, cfg: LLMConfig) -> Path:
        path = gguf_location(cfg)
        return model_cache(cfg) / f"{path.stem}-{file_sha256(path)[:16]}"

    def where(self, cfg):
        converted = self.converted(cfg)
        ensure_converted(gguf_location(cfg), converted)
        return converted, {}

    def num_layers(self, cfg):
        converted = self.converted(cfg)
        # A JSON read (its digest checked), where parsing the GGUF metadata takes seconds.
        if not folder_problem(converted, only=("config.json",)):
            return int(AutoConfig.from_pretrained(converted).num_hidden_layers)
        return gguf_block_count(gguf_location(cfg), cfg.name)

    def ref(self, cfg):
        path = gguf_location(cfg)
        return f"gguf:{path.name}@{file_sha256(path)[:16]}"


class TinySource(LLMSource):
    """A tiny seeded random model of a real architecture (tests, smoke runs), with SmolLM2's tokenizer."""

    def load(self, cfg):
        return load_tiny(cfg)

    def num_layers(self, cfg):
        arch = cfg.tiny.get("arch", "llama")
        return int(cfg.tiny.get("num_hidden_layers", AutoConfig.for_model(arch).num_hidden_layers))

    def tokenizer(self, cfg):
        arch = cfg.tiny.get("arch", "llama")
        tokenizer = tiny_tokenizer(cfg)
        if arch == "qwen2":
            tokenizer.chat_template = QWEN2_CHAT_TEMPLATE
        return tokenizer, int(AutoConfig.for_model(arch, **tiny_shape(cfg)).max_position_embeddings)

    def ref(self, cfg):
        return tiny_ref(cfg)


class RandomShapeSource(LLMSource):
    """Random weights in a published model's layer shapes (GPU speed and memory runs without a download)."""

    def load(self, cfg):
        return load_random(cfg)

    def _shape_value(self, cfg: LLMConfig, key: str) -> int:
        return int(cfg.random.get(key) or PUBLISHED_SHAPES[cfg.random["shape"]][key])

    def num_layers(self, cfg):
        return self._shape_value(cfg, "num_hidden_layers")

    def tokenizer(self, cfg):
        return tiny_tokenizer(cfg), self._shape_value(cfg, "max_position_embeddings")

    def ref(self, cfg):
        return None  # drawn on the target device: the reference samples the weights themselves


SOURCE_READERS: dict[str, LLMSource] = {
    "hf": HubSource(),
    "local": LocalSource(),
    "gguf": GgufSource(),
    "tiny": TinySource(),
    "random": RandomShapeSource(),
}
