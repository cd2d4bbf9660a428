"""The pieces of a forward pass that reads hidden states at the last prompt token only: the decoder stack cut
to the layers needed, forward hooks that keep each requested layer's state at each row's last token, and
the deepest layer evaluated at the last token alone (exact for plain pre-norm rotary decoder layers)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Sequence

import torch
from torch import nn
from torch.nn import functional as F
from transformers import PreTrainedModel


@contextlib.contextmanager
def truncated(base: nn.Module, depth: int) -> Iterator[None]:
    """Run only the first `depth` decoder layers for the duration of the block."""
    full = base.layers
    if depth >= len(full):
        yield
        return
    base.layers = nn.ModuleList(list(full)[:depth])
    try:
        yield
    finally:
        base.layers = full


@contextlib.contextmanager
def capture(
    base: nn.Module, layers: Sequence[int], num_layers: int, last: torch.Tensor, full_layer: int | None = None
) -> Iterator[dict]:
    """Forward hooks that keep, for each requested layer, the hidden state at each row's last token,
    and (as "full") every position of `full_layer`, the input of a last-token tail layer."""
    captured: dict = {}
    rows = torch.arange(last.shape[0], device=last.device)

    def keeper(layer: int, full: bool = False):
        def hook(_module, _inputs, output):
            hidden = output[0] if isinstance(output, tuple) else output
            captured["full" if full else layer] = hidden.detach() if full else hidden[rows, last].detach()

        return hook

    def module_of(layer: int) -> nn.Module:
        if layer == 0:
            return base.get_input_embeddings()
        return base.norm if layer == num_layers else base.layers[layer - 1]

    handles = [module_of(layer).register_forward_hook(keeper(layer)) for layer in layers]
    if full_layer is not None:
        handles.append(module_of(full_layer).register_forward_hook(keeper(full_layer, full=True)))
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()


TAIL_MODEL_TYPES = ("llama", "qwen2")


def plain_decoder_layer(model: PreTrainedModel, layer: nn.Module) -> bool:
    """Whether `layer` is a pre-norm rotary decoder layer that `last_token_layer` reproduces exactly
    (Llama and Qwen2 families, no q/k norms or sliding window); other models take the full path."""
    attn = getattr(layer, "self_attn", None)
    needed = ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling", "num_key_value_groups")
    return (
        model.config.model_type in TAIL_MODEL_TYPES
        and attn is not None
        and all(hasattr(attn, name) for name in needed)
        and not any(hasattr(attn, name) for name in ("q_norm", "k_norm", "sinks"))
        and not getattr(attn, "sliding_window", None)
        and all(hasattr(layer, name) for name in ("input_layernorm", "post_attention_layernorm", "mlp"))
        and hasattr(sys.modules[type(attn).__module__], "apply_rotary_pos_emb")
    )


def last_token_layer(base, layer, hidden, last, position_ids, mask, prefix_kv) -> torch.Tensor:
    """One decoder layer evaluated at each row's last token only: keys/values for every position,
    query, output projection and MLP for the last token (the only output anyone reads)."""
    attn = layer.self_attn
    rope = sys.modules[type(attn).__module__].apply_rotary_pos_emb
    batch, width, _ = hidden.shape
    rows = torch.arange(batch, device=hidden.device)
    normed = layer.input_layernorm(hidden)
    keys = attn.k_proj(normed).view(batch, width, -1, attn.head_dim).transpose(1, 2)
    values = attn.v_proj(normed).view(batch, width, -1, attn.head_dim).transpose(1, 2)
    query = attn.q_proj(normed[rows, last]).view(batch, 1, -1, attn.head_dim).transpose(1, 2)
    cos, sin = base.rotary_emb(hidden, position_ids)
    keys = rope(keys, keys, cos, sin)[0]
    query = rope(query, query, cos[rows, last][:, None], sin[rows, last][:, None])[0]
    if prefix_kv is not None:
        keys = torch.cat([prefix_kv[0].expand(batch, -1, -1, -1), keys], dim=2)
        values = torch.cat([prefix_kv[1].expand(batch, -1, -1, -1), values], dim=2)
    keys = keys.repeat_interleave(attn.num_key_value_groups, dim=1)
    values = values.repeat_interleave(attn.num_key_value_groups, dim=1)
    # The last real token comes after every real token, so the padding mask alone is its causal mask.
    context = F.scaled_dot_product_attention(
        query, keys, values, attn_mask=mask.bool()[:, None, None, :], scale=attn.scaling
    )
    state = hidden[rows, last] + attn.o_proj(context.transpose(1, 2).reshape(batch, -1))
    return state + layer.mlp(layer.post_attention_layernorm(state))
