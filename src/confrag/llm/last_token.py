"""The pieces of a forward pass that reads hidden states at the last prompt token only: the decoder stack cut
to the layers needed, forward hooks that keep each requested layer's state at each row's last token, and
the deepest layer evaluated at the last token alone (exact for plain pre-norm rotary decoder layers)."""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from collections.abc import Iterator, Sequence

import torch
from torch import nn
from torch.nn import functional as F
from transformers import PreTrainedModel

log = logging.getLogger(__name__)


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


class LastTokenCapture:
    """Forward hooks, registered once for a call (`with LastTokenCapture(...) as capture:`), that keep for each
    requested layer the hidden state at each row's last token, and (as "full") every position of `full_layer`,
    the input of a last-token tail layer. Batches may run on several threads at once: each opens its own slot
    (`with capture.batch(last) as captured:`) and the hooks write into the slot of the thread that runs them."""

    def __init__(self, base: nn.Module, layers: Sequence[int], num_layers: int, full_layer: int | None = None) -> None:
        self.base, self.layers, self.num_layers, self.full_layer = base, list(layers), num_layers, full_layer
        self._local = threading.local()
        self._handles: list = []

    def _module(self, layer: int) -> nn.Module:
        if layer == 0:
            return self.base.get_input_embeddings()
        return self.base.norm if layer == self.num_layers else self.base.layers[layer - 1]

    def _hook(self, key: object, full: bool):
        def hook(_module, _inputs, output):
            slot = getattr(self._local, "slot", None)
            if slot is None:  # a forward outside a batch (e.g. a shared prefix's keys/values)
                return
            captured, rows, last = slot
            hidden = output[0] if isinstance(output, tuple) else output
            captured[key] = hidden.detach() if full else hidden[rows, last].detach()

        return hook

    def __enter__(self) -> LastTokenCapture:
        self._handles = [self._module(layer).register_forward_hook(self._hook(layer, False)) for layer in self.layers]
        if self.full_layer is not None:
            self._handles.append(self._module(self.full_layer).register_forward_hook(self._hook("full", True)))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    @contextlib.contextmanager
    def batch(self, last: torch.Tensor) -> Iterator[dict]:
        """This thread's slot for one batch whose rows end at positions `last`."""
        captured: dict = {}
        self._local.slot = (captured, torch.arange(last.shape[0], device=last.device), last)
        try:
            yield captured
        finally:
            self._local.slot = None


# The model families (their config's `model_type`) whose decoder layer `last_token_layer` reproduces exactly:
# pre-norm, rotary, plain q/k/v/o projections, no q/k norms or attention sinks, no sliding window. A family of that
# shape joins the fast path with one entry here, once tests/test_hidden_states.py shows its two paths agree; any other
# runs its deepest layer over every token (exact, slower), and the log says so once, with the reason.
TAIL_MODEL_TYPES = ("llama", "qwen2")
_told: set[tuple[str, str]] = set()


def tail_refusal(model: PreTrainedModel, layer: nn.Module) -> str | None:
    """Why `layer` cannot be finished at the last token alone by `last_token_layer` (None: it can)."""
    family = model.config.model_type
    if family not in TAIL_MODEL_TYPES:
        return (
            f"the family {family!r} is not in TAIL_MODEL_TYPES {TAIL_MODEL_TYPES} (confrag/llm/last_token.py; one "
            "entry there once its last-token layer is tested equal to the full forward)"
        )
    attn = getattr(layer, "self_attn", None)
    needed = ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling", "num_key_value_groups")
    if attn is None or not all(hasattr(attn, name) for name in needed):
        return f"its attention lacks one of {needed}"
    if any(hasattr(attn, name) for name in ("q_norm", "k_norm", "sinks")):
        return "its attention normalizes queries or keys (q_norm / k_norm) or has attention sinks"
    if getattr(attn, "sliding_window", None):
        return "its attention has a sliding window"
    if not all(hasattr(layer, name) for name in ("input_layernorm", "post_attention_layernorm", "mlp")):
        return "its layer is not input_layernorm → attention → post_attention_layernorm → mlp"
    if not hasattr(sys.modules[type(attn).__module__], "apply_rotary_pos_emb"):
        return "its attention's module has no apply_rotary_pos_emb"
    return None


def plain_decoder_layer(model: PreTrainedModel, layer: nn.Module) -> bool:
    """Whether `layer` is a pre-norm rotary decoder layer that `last_token_layer` reproduces exactly (`tail_refusal`);
    a model that takes the full path instead is named in the log once, with the reason."""
    reason = tail_refusal(model, layer)
    told = (model.config.model_type, reason)
    if reason is not None and told not in _told:
        _told.add(told)
        log.info(
            "%s: the deepest requested layer runs over every prompt token (exact, slower than the one-token path): %s",
            model.config.model_type,
            reason,
        )
    return reason is None


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
