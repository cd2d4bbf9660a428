"""Hidden states at the last prompt token, computed as cheaply as exactness allows.

Indexing follows HF `output_hidden_states`: 0 is the embedding output, i is the output of decoder
layer i, and `num_hidden_layers` is the final-norm output. The engine

- runs only the decoder layers up to the deepest layer requested (the rest of the stack is cut off
  for the call, and no LM head runs);
- captures every requested layer in the same pass, and only at the last real token;
- sorts prompts by length so batches carry little padding, with left or right padding;
- computes the keys/values of the token prefix shared by all prompts of a call once and reuses them
  for every batch (RAG prompts share the system prompt and instruction).

The result equals the per-prompt full forward with `output_hidden_states=True` up to float rounding
(tests check ≤ 1e-5 relative error in fp32).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from confrag.llm.prompts import encode_prompts

PADDING_SIDES = ("left", "right")


def validate_layers(layers: Sequence[int], num_layers: int) -> list[int]:
    layers = [int(layer) for layer in layers]
    bad = [layer for layer in layers if not 0 <= layer <= num_layers]
    if bad or not layers:
        raise ValueError(
            f"layer(s) {bad or '[]'} out of range: valid layers are 0..{num_layers} "
            f"(0 = embeddings, {num_layers // 2} = the paper's Layer/2, {num_layers} = final norm output)"
        )
    return sorted(set(layers))


def common_prefix_length(sequences: Sequence[Sequence[int]]) -> int:
    first = sequences[0]
    length = min(len(seq) for seq in sequences)
    for seq in sequences[1:]:
        i = 0
        while i < length and seq[i] == first[i]:
            i += 1
        length = i
    return length


class HiddenStateEngine:
    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        batch_size: int = 16,
        padding_side: str = "right",
        share_prefix: bool = True,
        min_shared_prefix: int = 8,
        progress: bool = True,
    ) -> None:
        if padding_side not in PADDING_SIDES:
            raise ValueError(f"padding_side={padding_side!r} is not one of {PADDING_SIDES}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.padding_side = padding_side
        self.share_prefix = share_prefix
        self.min_shared_prefix = min_shared_prefix
        self.progress = progress
        self.base = model.base_model
        self.num_layers = int(model.config.num_hidden_layers)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.inference_mode()
    def extract(self, prompts: Sequence[str], layers: Sequence[int], desc: str = "hidden states") -> np.ndarray:
        """Float32 array of shape (len(layers), len(prompts), hidden_size), layers in ascending order."""
        layers = validate_layers(layers, self.num_layers)
        if not prompts:
            return np.zeros((len(layers), 0, self.model.config.hidden_size), dtype=np.float32)
        ids = encode_prompts(self.tokenizer, prompts)
        if any(len(seq) == 0 for seq in ids):
            raise ValueError("a prompt encodes to zero tokens")
        return self.extract_ids(ids, layers, desc)

    @torch.inference_mode()
    def extract_ids(self, ids: Sequence[Sequence[int]], layers: Sequence[int], desc: str = "hidden states") -> np.ndarray:
        layers = validate_layers(layers, self.num_layers)
        depth = min(max(layers), self.num_layers)
        prefix_len = self._shared_prefix_length(ids)
        out = np.zeros((len(layers), len(ids), self.model.config.hidden_size), dtype=np.float32)
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
        batches = [order[i : i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        with _truncated(self.base, depth):
            prefix_cache = self._prefix_cache(ids[0][:prefix_len]) if prefix_len else None
            for batch in tqdm(batches, desc=desc, unit="batch", disable=not self.progress, leave=False):
                states = self._run_batch([ids[i][prefix_len:] for i in batch], prefix_len, prefix_cache, layers)
                out[:, batch, :] = states
        return out

    def _shared_prefix_length(self, ids: Sequence[Sequence[int]]) -> int:
        if not self.share_prefix or len(ids) < 2:
            return 0
        # Every prompt must keep at least one token of its own after the prefix.
        length = min(common_prefix_length(ids), min(len(seq) for seq in ids) - 1)
        return length if length >= self.min_shared_prefix else 0

    def _prefix_cache(self, prefix: Sequence[int]) -> DynamicCache:
        cache = DynamicCache()
        input_ids = torch.tensor([list(prefix)], device=self.device)
        self.base(input_ids=input_ids, past_key_values=cache, use_cache=True)
        return cache

    def _run_batch(self, suffixes, prefix_len, prefix_cache, layers) -> np.ndarray:
        batch = len(suffixes)
        width = max(len(seq) for seq in suffixes)
        input_ids = torch.full((batch, width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((batch, width), dtype=torch.long)
        for row, seq in enumerate(suffixes):
            span = slice(width - len(seq), width) if self.padding_side == "left" else slice(0, len(seq))
            input_ids[row, span] = torch.tensor(seq)
            mask[row, span] = 1
        last = mask.shape[1] - 1 - mask.flip(1).argmax(1)  # index of the last real token per row
        position_ids = (prefix_len + mask.cumsum(1) - 1).clamp(min=0)
        full_mask = torch.cat([torch.ones((batch, prefix_len), dtype=torch.long), mask], dim=1)
        cache = None
        if prefix_cache is not None:
            cache = DynamicCache([(layer.keys.expand(batch, -1, -1, -1), layer.values.expand(batch, -1, -1, -1))
                                  for layer in prefix_cache.layers])
        device = self.device
        with _capture(self.base, layers, self.num_layers, last.to(device)) as captured:
            self.base(
                input_ids=input_ids.to(device),
                attention_mask=full_mask.to(device),
                position_ids=position_ids.to(device),
                past_key_values=cache,
                use_cache=cache is not None,
            )
        return np.stack([captured[layer].float().cpu().numpy() for layer in layers])


@contextlib.contextmanager
def _truncated(base: nn.Module, depth: int) -> Iterator[None]:
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
def _capture(base: nn.Module, layers: Sequence[int], num_layers: int, last: torch.Tensor) -> Iterator[dict]:
    """Forward hooks that keep, for each requested layer, the hidden state at each row's last token."""
    captured: dict[int, torch.Tensor] = {}
    rows = torch.arange(last.shape[0], device=last.device)

    def keeper(layer: int):
        def hook(_module, _inputs, output):
            hidden = output[0] if isinstance(output, tuple) else output
            captured[layer] = hidden[rows, last].detach()
        return hook

    modules = {0: base.get_input_embeddings(), num_layers: base.norm}
    modules.update({layer: base.layers[layer - 1] for layer in layers if 0 < layer < num_layers})
    handles = [modules[layer].register_forward_hook(keeper(layer)) for layer in layers]
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()


def naive_hidden_states(model: PreTrainedModel, ids: Sequence[int], layers: Sequence[int]) -> np.ndarray:
    """The reference (and the papers' Algorithm 1): one full forward per prompt with all hidden states."""
    with torch.inference_mode():
        input_ids = torch.tensor([list(ids)], device=next(model.parameters()).device)
        hidden = model(input_ids=input_ids, output_hidden_states=True).hidden_states
    return np.stack([hidden[layer][0, -1].float().cpu().numpy() for layer in layers])
