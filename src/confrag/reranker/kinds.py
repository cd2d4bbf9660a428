"""Reranker kinds (`model.kind`): how a backbone is loaded, how it scores a (query, passage) pair, and so how
pairs are tokenized, one registered class per kind (as FlagEmbedding has one model class per reranker kind).

- `cross_encoder`: any `AutoModelForSequenceClassification` with one logit (bge-reranker-v2-m3, or an encoder
  such as all-MiniLM-L6-v2 with a freshly drawn, seeded head), pairs tokenized FlagEmbedding-style.
- `qwen3_yes_no`: a Qwen3-Reranker causal LM scored as logit(yes) − logit(no) on its own prompt (`qwen3`).

A new kind is a subclass with its `id`, registered with `@register_kind`: the module, the data module and
the export ask the registry, never compare kind names.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import nn

from confrag.reranker import qwen3
from confrag.reranker.tokenization import EncodedPairs, encode_pairs

__all__ = [
    "RerankerKind",
    "CrossEncoderKind",
    "Qwen3YesNoKind",
    "KINDS",
    "register_kind",
    "reranker_kind",
    "load_cross_encoder",
    "head_module_names",
]

# Stored in the exported config: sentence-transformers' CrossEncoder would otherwise apply a sigmoid to a
# one-logit model, and its scores would differ from FlagReranker's and transformers' raw logits.
IDENTITY_ACTIVATION = "torch.nn.modules.linear.Identity"


class RerankerKind(ABC):
    """One way of turning a backbone into a pair scorer."""

    id: ClassVar[str]
    description: ClassVar[str]
    # How pairs are tokenized for this kind: (tokenizer, queries, passages, query_max_len, passage_max_len).
    encode: ClassVar[Callable[..., EncodedPairs]]

    @abstractmethod
    def load(self, path: str, tokenizer: Any, fresh_head: bool, seed: int, trust_remote_code: bool) -> nn.Module:
        """The scoring model, whose forward returns `.logits` with one score per pair."""

    def check(self, fresh_head: bool) -> None:
        """Refuse settings this kind cannot honour (before any weights load); every setting is fine by default."""
        return None

    def lora_settings(self, lora: dict[str, Any]) -> dict[str, Any]:
        """peft.LoraConfig fields for this kind's model, from the user's `model.lora`."""
        return dict(lora)

    def prepare_export(self, model: nn.Module) -> None:
        """Adjust the model's config before `save_pretrained`, so that other tools score as confrag does;
        nothing to adjust by default."""
        return None


KINDS: dict[str, RerankerKind] = {}


def register_kind(cls: type[RerankerKind]) -> type[RerankerKind]:
    if cls.id in KINDS:
        raise ValueError(f"reranker kind {cls.id!r} is registered twice")
    KINDS[cls.id] = cls()
    return cls


def reranker_kind(kind: str) -> RerankerKind:
    """The registered kind of `model.kind`; anything else is refused, naming the choices."""
    if kind not in KINDS:
        raise ValueError(f"model.kind must be one of {', '.join(KINDS)} (got {kind!r})")
    return KINDS[kind]


@register_kind
class CrossEncoderKind(RerankerKind):
    id = "cross_encoder"
    description = "AutoModelForSequenceClassification with one logit"
    encode = staticmethod(encode_pairs)

    def load(self, path: str, tokenizer: Any, fresh_head: bool, seed: int, trust_remote_code: bool) -> nn.Module:
        return load_cross_encoder(path, fresh_head=fresh_head, seed=seed, trust_remote_code=trust_remote_code)

    def prepare_export(self, model: nn.Module) -> None:
        model.config.sentence_transformers = {"activation_fn": IDENTITY_ACTIVATION}


@register_kind
class Qwen3YesNoKind(RerankerKind):
    id = "qwen3_yes_no"
    description = "Qwen3-Reranker causal LM, logit(yes) - logit(no)"
    encode = staticmethod(qwen3.encode_yes_no_pairs)

    def load(self, path: str, tokenizer: Any, fresh_head: bool, seed: int, trust_remote_code: bool) -> nn.Module:
        return qwen3.load_yes_no_scorer(path, tokenizer, trust_remote_code=trust_remote_code)

    def check(self, fresh_head: bool) -> None:
        if fresh_head:
            raise ValueError(
                "model.fresh_head must be false with model.kind=qwen3_yes_no (its score comes from the LM head's "
                f"yes/no rows, there is no head to redraw) (got {fresh_head!r})"
            )

    def lora_settings(self, lora: dict[str, Any]) -> dict[str, Any]:
        return qwen3.lora_settings(lora)


# --- the cross-encoder's backbone ------------------------------------------------------------------


def head_module_names(model: nn.Module) -> list[str]:
    """Top-level children holding parameters outside the encoder (BERT: `classifier`; XLM-R: `classifier`)."""
    prefix = getattr(model, "base_model_prefix", "")
    return [name for name, child in model.named_children() if name != prefix and any(True for _ in child.parameters())]


def _reset_head(model: nn.Module, seed: int) -> None:
    """Re-draw the head's weights from a seeded generator (normal(0, initializer_range), zero biases),
    so two runs with the same seed start from the same head whatever the global RNG did before."""
    generator = torch.Generator().manual_seed(seed)
    std = float(getattr(model.config, "initializer_range", 0.02))
    for name in head_module_names(model):
        for module in getattr(model, name).modules():
            if isinstance(module, nn.Linear):
                with torch.no_grad():
                    module.weight.copy_(torch.randn(module.weight.shape, generator=generator) * std)
                    if module.bias is not None:
                        module.bias.zero_()
            elif isinstance(module, nn.LayerNorm):
                module.reset_parameters()


def load_cross_encoder(
    path: str, fresh_head: bool = False, seed: int = 0, trust_remote_code: bool = False
) -> nn.Module:
    """`AutoModelForSequenceClassification` with one logit; the head is drawn from `seed` when the
    checkpoint has none (an encoder such as MiniLM) or when `fresh_head` asks to discard it."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    config = AutoConfig.from_pretrained(path, num_labels=1, trust_remote_code=trust_remote_code)
    # Mismatched sizes are loaded (and reported) rather than fatal, so that the check below can name
    # the setting that resolves them.
    model, info = AutoModelForSequenceClassification.from_pretrained(
        path, config=config, ignore_mismatched_sizes=True, output_loading_info=True, trust_remote_code=trust_remote_code
    )
    mismatched = [str(item[0] if isinstance(item, (tuple, list)) else item) for item in info.get("mismatched_keys", [])]
    if mismatched and not fresh_head:
        raise ValueError(
            f"model.backbone={path!r} has a head of another shape ({', '.join(mismatched)}); a reranker "
            f"needs one output. Set model.fresh_head=true to replace it"
        )
    heads = head_module_names(model)
    head_missing = any(key.split(".")[0] in heads for key in info.get("missing_keys", []))
    if fresh_head or head_missing:
        _reset_head(model, seed)
    return model
