"""Published decoder shapes, random-weight models built from them, and the cost arithmetic of a shape.

`PUBLISHED_SHAPES` holds the architecture numbers of the papers' target LLMs as their published
`config.json` files give them, so a random-weight model of the same shape runs the same matrices and
the same attention layout as the real one (same time, same memory) without a download.
`DecoderCost` turns a model config into what benchmarks and batch sizing need: parameters, weight
bytes, matrix-multiply FLOPs per token and key/value bytes per token.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

# From meta-llama/Meta-Llama-3-8B-Instruct and Qwen/Qwen2.5-7B-Instruct config.json. Qwen2's q/k/v
# projections carry a bias (hard-wired in transformers' Qwen2 attention); Llama's do not.
PUBLISHED_SHAPES: dict[str, dict[str, Any]] = {
    "llama3_8b": dict(
        model_type="llama",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        hidden_act="silu",
        attention_bias=False,
        tie_word_embeddings=False,
        bos_token_id=128000,
        eos_token_id=128009,
    ),
    "qwen2_5_7b": dict(
        model_type="qwen2",
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        use_sliding_window=False,
        sliding_window=131072,
        max_window_layers=28,
        tie_word_embeddings=False,
        bos_token_id=151643,
        eos_token_id=151645,
    ),
}


def shape_config(shape: str, **overrides: Any) -> PretrainedConfig:
    """The transformers config of a published shape, with `overrides` (e.g. `num_hidden_layers`,
    `vocab_size`) applied; an override must name a key of the shape."""
    if shape not in PUBLISHED_SHAPES:
        raise ValueError(f"shape={shape!r} is not one of {tuple(PUBLISHED_SHAPES)}")
    numbers = dict(PUBLISHED_SHAPES[shape])
    unknown = sorted(set(overrides) - set(numbers) - {"pad_token_id"})
    if unknown:
        raise ValueError(f"override(s) {unknown} are not keys of shape {shape!r}; keys: {sorted(numbers)}")
    numbers.update({key: value for key, value in overrides.items() if value is not None})
    return AutoConfig.for_model(numbers.pop("model_type"), **numbers)


def random_decoder(
    config: PretrainedConfig,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    seed: int = 0,
    attn_implementation: str | None = "sdpa",
) -> PreTrainedModel:
    """A causal LM of `config`'s shape with seeded random weights (transformers' own initialisation),
    built and drawn directly on `device` (an 8B model drawn on the CPU takes minutes; on a GPU, well
    under a second). The caller's random state is left as it was."""
    if attn_implementation:
        config._attn_implementation = attn_implementation
    device = torch.device(device)
    cuda = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda), device:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


@dataclass(frozen=True)
class DecoderCost:
    """Sizes of a Llama/Qwen2-style decoder and what they cost. FLOPs count multiply-adds as 2."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    qkv_bias: bool

    @classmethod
    def of(cls, config: PretrainedConfig) -> DecoderCost:
        heads = int(config.num_attention_heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
        return cls(
            hidden=int(config.hidden_size),
            intermediate=int(config.intermediate_size),
            layers=int(config.num_hidden_layers),
            heads=heads,
            kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
            head_dim=head_dim,
            vocab=int(config.vocab_size),
            tied=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=config.model_type == "qwen2" or bool(getattr(config, "attention_bias", False)),
        )

    # --- parameters and bytes ------------------------------------------------------------------
    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_matmul_params(self) -> int:
        """Weights of one layer's key and value projections."""
        return 2 * self.hidden * self.kv_width

    @property
    def other_matmul_params(self) -> int:
        """Weights of one layer's query and output projections and MLP."""
        return 2 * self.hidden * self.q_width + 3 * self.hidden * self.intermediate

    @property
    def layer_params(self) -> int:
        bias = (self.q_width + 2 * self.kv_width) if self.qkv_bias else 0
        return self.kv_matmul_params + self.other_matmul_params + bias + 2 * self.hidden  # + the two norms

    @property
    def params(self) -> int:
        embeddings = self.vocab * self.hidden
        return self.layers * self.layer_params + self.hidden + embeddings * (1 if self.tied else 2)

    def weight_bytes(self, dtype_bytes: int) -> int:
        """Bytes one decoding step must read: every weight but the input embedding table (a lookup reads
        one row per sequence); with tied embeddings the table is the LM head and is read once."""
        return (self.layers * self.layer_params + self.hidden + self.vocab * self.hidden) * dtype_bytes

    def kv_bytes_per_token(self, dtype_bytes: int, layers: int | None = None) -> int:
        return (self.layers if layers is None else layers) * 2 * self.kv_width * dtype_bytes

    # --- FLOPs ---------------------------------------------------------------------------------
    def layer_flops(self, tokens: float = 1.0) -> float:
        """Projection and MLP FLOPs of one decoder layer for `tokens` tokens (attention scores apart)."""
        return 2.0 * tokens * (self.kv_matmul_params + self.other_matmul_params)

    def attention_flops(self, query_key_pairs: float) -> float:
        """Score and weighted-sum FLOPs of one layer for that many (query, key) pairs, all heads."""
        return 4.0 * query_key_pairs * self.q_width

    def lm_head_flops(self, tokens: float = 1.0) -> float:
        return 2.0 * tokens * self.hidden * self.vocab


def causal_pairs(own: int, prefix: int = 0) -> int:
    """(query, key) pairs of `own` tokens attending causally to themselves and to `prefix` earlier tokens."""
    return own * prefix + own * (own + 1) // 2


def engine_flops(cost: DecoderCost, lengths: Sequence[int], prefix: int, layer: int, attention: bool = True) -> float:
    """FLOPs of the layers `HiddenStateEngine.extract_ids` runs for hidden states at `layer` (>= 1),
    padding apart: the shared prefix once through layers 1..layer; each prompt's own tokens through
    layers 1..layer-1, the key/value projections of layer `layer`, and the rest of that layer at the
    last token only (the last-token tail; attention of that token over all its keys). `attention=False`
    counts the matrix multiplies of the projections and MLPs alone (the CPU benchmarks' measure: the
    scores are small at their prompt lengths and their kernels are not matmuls)."""
    scores = cost.attention_flops if attention else (lambda pairs: 0.0)
    own = [n - prefix for n in lengths]
    prefix_part = layer * (cost.layer_flops(prefix) + scores(causal_pairs(prefix)))
    per_prompt = 0.0
    for n in own:
        per_prompt += (layer - 1) * (cost.layer_flops(n) + scores(causal_pairs(n, prefix)))
        per_prompt += 2.0 * n * cost.kv_matmul_params
        per_prompt += 2.0 * cost.other_matmul_params + scores(prefix + n)
    return prefix_part + per_prompt


def stack_flops(cost: DecoderCost, tokens: float, head_tokens: float = 0.0) -> float:
    """Projection and MLP FLOPs of every layer for `tokens` tokens and of the LM head for `head_tokens` (attention
    scores apart): a full forward's matrix multiplies."""
    return cost.layers * cost.layer_flops(tokens) + cost.lm_head_flops(head_tokens)


def prefill_flops(cost: DecoderCost, lengths: Sequence[int], prefix: int = 0) -> float:
    """FLOPs of prefilling prompts through the whole stack, the shared `prefix` counted once, plus the
    LM head at each prompt's last token (all that greedy decoding needs from the prefill)."""
    own = [n - prefix for n in lengths]
    total = cost.layers * (cost.layer_flops(prefix) + cost.attention_flops(causal_pairs(prefix)))
    for n in own:
        total += cost.layers * (cost.layer_flops(n) + cost.attention_flops(causal_pairs(n, prefix)))
    return total + cost.lm_head_flops(len(lengths))


def likelihood_flops(
    cost: DecoderCost, lengths: Sequence[int], answer_lengths: Sequence[int], prefix: int = 0
) -> float:
    """FLOPs of the answer likelihood ℓ (`confrag.llm.likelihood`): each prompt's own tokens and its answer's
    through the whole stack, the shared `prefix` counted once, the LM head at the answer's positions only."""
    total = cost.layers * (cost.layer_flops(prefix) + cost.attention_flops(causal_pairs(prefix)))
    for n, answer in zip(lengths, answer_lengths):
        own = n - prefix + answer
        total += cost.layers * (cost.layer_flops(own) + cost.attention_flops(causal_pairs(own, prefix)))
    return total + cost.lm_head_flops(sum(answer_lengths))


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def round_up(value: int, multiple: int) -> int:
    return int(math.ceil(value / multiple) * multiple)


def tiny_overrides(shape: str, hidden_size: int = 128, layers: int = 4, heads: int = 4, vocab: int = 4096) -> dict:
    """A small model of the same family as `shape` (for CPU runs): same MLP/hidden ratio, same grouped
    query ratio (at least one key/value head), same rope and norm settings, qkv bias and untied head."""
    numbers: Mapping[str, Any] = PUBLISHED_SHAPES[shape]
    ratio = numbers["intermediate_size"] / numbers["hidden_size"]
    kv = max(1, round(heads * numbers["num_key_value_heads"] / numbers["num_attention_heads"]))
    return dict(
        hidden_size=hidden_size,
        intermediate_size=round_up(int(hidden_size * ratio), 32),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        vocab_size=vocab,
        bos_token_id=1,
        eos_token_id=2,
    )
