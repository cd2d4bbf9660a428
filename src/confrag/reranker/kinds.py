"""Reranker kinds (`model.kind`): how a backbone is loaded, how it scores a (query, passage) pair, and so how
pairs are tokenized, one registered class per kind (as FlagEmbedding has one model class per reranker kind).

- `cross_encoder`: any `AutoModelForSequenceClassification` with one logit (bge-reranker-v2-m3, or an encoder
  such as all-MiniLM-L6-v2 with a freshly drawn, seeded head), pairs tokenized FlagEmbedding-style.
- `qwen3_yes_no`: a Qwen3-Reranker causal LM scored as logit(yes) − logit(no) on its own prompt (`qwen3`).
- `bi_encoder`: a sentence-transformers bi-encoder (all-MiniLM-L6-v2) scored by the cosine of the query's and
  the passage's mean-pooled embeddings (`bi_encoder`): a reranker as it comes, no head to train.

A new kind is a subclass with its `id`, registered with `@register_kind`: the module, the data module and
the export ask the registry, never compare kind names.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import nn

from confrag.reranker import bi_encoder, qwen3
from confrag.reranker.tokenization import EncodedPairs, encode_pairs, pair_max_length

__all__ = [
    "RerankerKind",
    "CrossEncoderKind",
    "Qwen3YesNoKind",
    "BiEncoderKind",
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
    # The model card's: what the export is (its tag too) and the library that loads it.
    noun: ClassVar[str]
    library: ClassVar[str]
    # The model card's "Use" section: how an export of this kind is loaded and scored elsewhere (markdown lines).
    usage: ClassVar[tuple[str, ...]]
    # Whether the kind scores a pair from the query's and the passage's embeddings taken apart (a bi-encoder): a
    # listwise student that reads those embeddings (`confrag.reranker.listwise_student.STUDENTS`) needs such a base.
    embeds_apart: ClassVar[bool] = False

    def load_tokenizer(self, path: str, trust_remote_code: bool = False) -> Any:
        """The backbone's tokenizer, for the module and the data module alike (so both cut pairs alike)."""
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)

    @abstractmethod
    def load(self, path: str, tokenizer: Any, fresh_head: bool, seed: int, trust_remote_code: bool) -> nn.Module:
        """The scoring model, whose forward returns `.logits` with one score per pair."""

    def check(self, fresh_head: bool) -> None:
        """Refuse settings this kind cannot honour (before any weights load); every setting is fine by default."""
        return None

    def _no_head(self, fresh_head: bool, why: str) -> None:
        if fresh_head:
            raise ValueError(f"fresh_head must be false with kind={self.id} ({why}) (got {fresh_head!r})")

    def lora_settings(self, lora: dict[str, Any]) -> dict[str, Any]:
        """peft.LoraConfig fields for this kind's model, from the user's `model.lora`."""
        return dict(lora)

    def input_budget(self, tokenizer: Any, query_max_len: int, passage_max_len: int) -> tuple[int, str]:
        """The tokens this kind reads of one (query, passage) input, and what they hold, as a report says it; `encode`
        cuts the passage to fit. By default a pair of both (`pair_max_length`), as FlagEmbedding's rerankers read it."""
        return pair_max_length(tokenizer, query_max_len, passage_max_len), "question and passage together"

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
    """The registered kind of `kind` (the `model.kind` key); anything else is refused, naming the choices."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)} (got {kind!r})")
    return KINDS[kind]


@register_kind
class CrossEncoderKind(RerankerKind):
    id = "cross_encoder"
    description = "AutoModelForSequenceClassification with one logit"
    noun, library = "cross-encoder", "sentence-transformers"
    encode = staticmethod(encode_pairs)

    usage = (
        "```python",
        "from sentence_transformers import CrossEncoder",
        "",
        'model = CrossEncoder("<this folder or repo id>")',
        'scores = model.predict([("who wrote hamlet", "Hamlet is a tragedy by William Shakespeare.")])',
        "```",
        "",
        "It loads as well with `transformers.AutoModelForSequenceClassification` (one logit) and with "
        "FlagEmbedding's `FlagReranker`.",
    )

    def load(self, path: str, tokenizer: Any, fresh_head: bool, seed: int, trust_remote_code: bool) -> nn.Module:
        return load_cross_encoder(path, fresh_head=fresh_head, seed=seed, trust_remote_code=trust_remote_code)

    def prepare_export(self, model: nn.Module) -> None:
        model.config.sentence_transformers = {"activation_fn": IDENTITY_ACTIVATION}


@register_kind
class Qwen3YesNoKind(RerankerKind):
    id = "qwen3_yes_no"
    description = "Qwen3-Reranker causal LM, logit(yes) - logit(no)"
    noun, library = "causal-LM reranker", "transformers"
    encode = staticmethod(qwen3.encode_yes_no_pairs)

    usage = (
        "A Qwen3 causal LM, saved as Qwen3-Reranker is released: score a pair as Qwen3-Reranker's model card does "
        "(its yes/no prompt; confrag's score is logit(yes) − logit(no), whose sigmoid is that card's p(yes)).",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        'model = AutoModelForCausalLM.from_pretrained("<this folder or repo id>")',
        'tokenizer = AutoTokenizer.from_pretrained("<this folder or repo id>")',
        "```",
    )

    def load(self, path: str, tokenizer: Any, fresh_head: bool, seed: int, trust_remote_code: bool) -> nn.Module:
        return qwen3.load_yes_no_scorer(path, tokenizer, trust_remote_code=trust_remote_code)

    def check(self, fresh_head: bool) -> None:
        self._no_head(fresh_head, "its score comes from the LM head's yes/no rows, there is no head to redraw")

    def lora_settings(self, lora: dict[str, Any]) -> dict[str, Any]:
        return qwen3.lora_settings(lora)


@register_kind
class BiEncoderKind(RerankerKind):
    id = "bi_encoder"
    description = (
        f"bi-encoder, {bi_encoder.SCALE:g} × the cosine of the query's and the passage's mean-pooled embeddings"
    )
    noun, library = "bi-encoder", "sentence-transformers"
    encode = staticmethod(bi_encoder.encode_query_passage_pairs)
    embeds_apart = True
    usage = (
        "```python",
        "from sentence_transformers import SentenceTransformer",
        "",
        'model = SentenceTransformer("<this folder or repo id>")',
        'query, passages = "who wrote hamlet", ["Hamlet is a tragedy by William Shakespeare."]',
        "scores = model.similarity(model.encode([query]), model.encode(passages))  # cosines; confrag's logit is "
        f"{bi_encoder.SCALE:g} x cosine",
        "```",
        "",
        "It loads as well with `transformers.AutoModel` (mean pooling over the real tokens, then L2 normalization).",
    )

    def load_tokenizer(self, path: str, trust_remote_code: bool = False) -> Any:
        return bi_encoder.load_tokenizer(path, trust_remote_code=trust_remote_code)

    def input_budget(self, tokenizer: Any, query_max_len: int, passage_max_len: int) -> tuple[int, str]:
        # Each text is encoded on its own: the passage's budget is passage_max_len within the encoder's own.
        return min(passage_max_len, int(tokenizer.model_max_length)), "the passage alone, special tokens included"

    def load(self, path: str, tokenizer: Any, fresh_head: bool, seed: int, trust_remote_code: bool) -> nn.Module:
        return bi_encoder.load_bi_encoder(path, tokenizer, trust_remote_code=trust_remote_code)

    def check(self, fresh_head: bool) -> None:
        self._no_head(fresh_head, "it scores by the cosine of two embeddings, there is no head")

    def lora_settings(self, lora: dict[str, Any]) -> dict[str, Any]:
        return bi_encoder.lora_settings(lora)


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
