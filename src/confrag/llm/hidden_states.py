"""Hidden states at the last prompt token, computed as cheaply as exactness allows.

Indexing follows HF `output_hidden_states`: 0 is the embedding output, i is the output of decoder
layer i, and `num_hidden_layers` is the final-norm output. The engine

- runs only the decoder layers up to the deepest layer requested (the rest of the stack is cut off
  for the call, and no LM head runs), and that deepest layer only for the last token (Llama/Qwen2);
- captures every requested layer in the same pass, and only at the last real token;
- groups prompts of similar length so that batches carry little padding (left or right), with batch
  sizes chosen from the device's free memory when set to "auto" (`confrag.llm.batching`);
- computes the keys/values of the token prefix shared by all prompts of a call once and reuses them
  for every batch (RAG prompts share the system prompt and instruction);
- with `compile=True`, on CUDA, runs the RMSNorms and MLPs of the layers it uses through
  `torch.compile` (a graph per block kind and input rank, one more for a one-row batch; shared by every
  layer and batch shape: 8 for a tiny model's 9 batches x 4 layers on an H100): their float32
  upcasts and activation are fused instead of each being a pass over memory. Off by default; if
  compilation fails, the engine logs it and goes on eagerly.

The result equals the per-prompt full forward with `output_hidden_states=True` up to float rounding
(tests check ≤ 1e-5 relative error in fp32).

On the CPU the engine runs with a fixed number of intra-op threads (`threads`, default `CPU_THREADS` = 1),
whatever the process was given: torch splits a product's reductions over its threads, so the same prompts
summed on 1 and on 2 threads differ in the last bits, and jobs of a joblib multirun (which runs its
workers with fewer threads than a lone process) wrote other bytes under the same cache key
(docs/reliability.md#one-answer-however-many-workers-what-a-shards-bytes-depend-on). Every core still works:
`workers` batches run at once (default: one per available core), each on those threads, so a state's bytes are
those of one worker however many there were (`confrag.llm.workers`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from confrag.infra import checks
from confrag.llm.batching import AUTO, check_batch_size, extraction_budget
from confrag.llm.kv_cache import cache_argument, expanded_cache
from confrag.llm.last_token import LastTokenCapture, last_token_layer, plain_decoder_layer, truncated
from confrag.llm.prompts import encode_prompts
from confrag.llm.workers import CPU_THREADS, fixed_threads, longest_first, resolve_workers, run_batches

log = logging.getLogger(__name__)

PADDING_SIDES = ("left", "right")


# The engine's batch settings every cache key of states assumes unless it says otherwise (`extraction_key`).
DEFAULT_BATCH_SIZE = 16


def extraction_key(
    batch_size: int | str = DEFAULT_BATCH_SIZE, max_batch_tokens: int | str = AUTO, threads: int | None = CPU_THREADS
) -> dict[str, object]:
    """What a cached state's bytes depend on beyond its prompts and model, for its artifact's key: the batch
    composition (prompts are padded to their batch's longest and summed in other shapes: batch 8 vs 16 moves
    28 of 64 SmolLM2 states by up to 3.1e-5) and the CPU thread count. Empty for the defaults, so the keys
    of states extracted with them are the keys they always had; a setting that differs is recorded."""
    found: dict[str, object] = {}
    if batch_size != DEFAULT_BATCH_SIZE:
        found["extract_batch_size"] = batch_size
    if max_batch_tokens != AUTO:
        found["extract_batch_tokens"] = max_batch_tokens
    if threads != CPU_THREADS:
        # None runs on the process's own count: the count this process has is what the bytes depend on.
        found["extract_threads"] = torch.get_num_threads() if threads is None else threads
    return found


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
    # wide: the engine's batching and numerics options are independent, each defaulted to its measured
    # value; the ~50 constructions name the one to three they change by keyword (most options only the benchmarks
    # and tests that measure them), as a transformers model takes its keyword options.
    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        batch_size: int | str = DEFAULT_BATCH_SIZE,
        max_batch_tokens: int | str = AUTO,
        padding_tolerance: float = 0.1,
        padding_side: str = "right",
        share_prefix: bool = True,
        min_shared_prefix: int = 8,
        last_token_tail: bool = True,
        progress: bool = True,
        compile: bool = False,
        threads: int | None = CPU_THREADS,
        workers: int | None = None,
    ) -> None:
        if padding_side not in PADDING_SIDES:
            raise ValueError(f"padding_side={padding_side!r} is not one of {PADDING_SIDES}")
        # "auto": rows and padded tokens per batch from the device's free memory at each call (on the
        # CPU, the measured defaults 16 rows / 4096 tokens).
        self.batch_size = check_batch_size(batch_size, "batch_size")
        self.max_batch_tokens = check_batch_size(max_batch_tokens, "max_batch_tokens")
        self.model = model
        self.tokenizer = tokenizer
        self.padding_tolerance = padding_tolerance
        self.padding_side = padding_side
        self.share_prefix = share_prefix
        self.last_token_tail = last_token_tail
        self.min_shared_prefix = min_shared_prefix
        self.progress = progress
        self.compile = checks.flag(compile, "compile")
        # CPU intra-op threads during extraction (None: whatever the process has)
        self.threads = checks.positive_int(
            threads, "threads", allow_none=True, none="None", hint="(the process's own count)"
        )
        # CPU batches computed at once, each on `threads` intra-op threads (None: one per available core); the
        # bytes do not depend on it (confrag.llm.workers), so no cache key records it.
        self.workers = resolve_workers(workers, threads) if threads is not None else 1
        self._compiled: dict[int, object] = {}  # module id -> its compiled call
        self._compile_failed = self._told_cpu = False
        self.base = model.base_model
        self.decoder_layers = list(self.base.layers)  # the whole stack; `_truncated` shortens base.layers
        self.num_layers = int(model.config.num_hidden_layers)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    @property
    def key(self) -> dict[str, object]:
        """`extraction_key` of this engine's settings (for the artifacts it fills)."""
        return extraction_key(self.batch_size, self.max_batch_tokens, self.threads)

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
    def extract_ids(
        self, ids: Sequence[Sequence[int]], layers: Sequence[int], desc: str = "hidden states"
    ) -> np.ndarray:
        layers = validate_layers(layers, self.num_layers)
        depth = max(layers)
        # The deepest layer is needed at one token only: run the stack to the layer before it and
        # finish that one layer for the last token alone.
        tail = self.last_token_tail and depth >= 1 and plain_decoder_layer(self.model, self.decoder_layers[depth - 1])
        prefix_len = self._shared_prefix_length(ids)
        out = np.zeros((len(layers), len(ids), self.model.config.hidden_size), dtype=np.float32)
        if not len(ids):
            return out
        rows, tokens = self.batch_limits(depth, max(len(seq) for seq in ids))
        batches = self.length_batches([len(seq) - prefix_len for seq in ids], rows, tokens)
        with fixed_threads(self.device, self.threads):
            self._extract_batches(ids, layers, batches, prefix_len, depth, tail, out, desc)
        return out

    def _extract_batches(self, ids, layers, batches, prefix_len, depth, tail, out, desc) -> None:
        with truncated(self.base, min(depth, self.num_layers)):
            prefix_cache = self._prefix_cache(ids[0][:prefix_len]) if prefix_len else None
        captured_layers = [layer for layer in layers if layer < depth] if tail else layers
        hooks = LastTokenCapture(self.base, captured_layers, self.num_layers, full_layer=depth - 1 if tail else None)
        bar = tqdm(total=len(batches), desc=desc, unit="batch", disable=not self.progress, leave=False)
        with truncated(self.base, depth - 1 if tail else depth), self._compiled_blocks(depth) as compiled, hooks, bar:

            def work(batch: list[int]) -> np.ndarray:
                suffixes = [ids[i][prefix_len:] for i in batch]
                try:
                    return self._run_batch(suffixes, prefix_len, prefix_cache, layers, tail, hooks)
                except Exception as err:
                    if not compiled:
                        raise
                    # A compiler failure (no Triton, an unsupported op): the eager blocks compute the same.
                    log.warning(
                        "compiled norm/MLP blocks failed (%s: %s); extracting eagerly from now on",
                        type(err).__name__,
                        err,
                    )
                    self._compile_failed = True
                    _eager(compiled)
                    return self._run_batch(suffixes, prefix_len, prefix_cache, layers, tail, hooks)

            widths = [max(len(ids[i]) for i in batch) * len(batch) for batch in batches]
            order = longest_first(range(len(batches)), lambda b: widths[b])
            ordered = [batches[b] for b in order]
            for batch, states in run_batches(work, ordered, self.device, self.workers, bar):
                out[:, batch, :] = states

    @contextlib.contextmanager
    def _compiled_blocks(self, depth: int) -> Iterator[list]:
        """Within the block, the norms and MLPs of layers 1..depth run compiled (see the module doc);
        yields the patched modules (`_eager(them)` goes back to eager early)."""
        patched: list[nn.Module] = []
        if self.compile and not self._compile_failed and self.device.type == "cuda":
            for layer in self.decoder_layers[:depth]:
                for name in ("input_layernorm", "post_attention_layernorm", "mlp"):
                    module = getattr(layer, name, None)
                    if module is None or module._compiled_call_impl is not None:
                        continue
                    if id(module) not in self._compiled:
                        # dynamic: one graph for every batch shape; reused by all layers (same code, params as inputs)
                        self._compiled[id(module)] = torch.compile(module._call_impl, dynamic=True)
                    module._compiled_call_impl = self._compiled[id(module)]
                    patched.append(module)
        elif self.compile and self.device.type != "cuda" and not self._told_cpu:
            log.info("engine compile applies on CUDA only; extracting eagerly on %s", self.device)
            self._told_cpu = True
        try:
            yield patched
        finally:
            _eager(patched)

    def batch_limits(self, depth: int, max_length: int) -> tuple[int, int]:
        """(rows, padded tokens) per batch: the configured numbers, "auto" ones from free memory."""
        if AUTO not in (self.batch_size, self.max_batch_tokens):
            return int(self.batch_size), int(self.max_batch_tokens)
        rows, tokens = extraction_budget(self.model, depth, max_length)
        return (
            rows if self.batch_size == AUTO else int(self.batch_size),
            tokens if self.max_batch_tokens == AUTO else int(self.max_batch_tokens),
        )

    def length_batches(self, lengths: Sequence[int], rows: int, tokens: int) -> list[list[int]]:
        """Indices grouped by length: a batch closes at `rows` rows, `tokens` padded tokens, or when
        padding would exceed `padding_tolerance` of its real tokens (padding is wasted matrix work, and
        on CPU it costs more than small batches do)."""
        order = sorted(range(len(lengths)), key=lambda i: lengths[i])
        batches: list[list[int]] = []
        current: list[int] = []
        real = 0
        for index in order:
            width = lengths[index]  # ascending: the newcomer is the longest
            count = len(current) + 1
            if current and (
                count > rows or count * width > tokens or count * width > (1 + self.padding_tolerance) * (real + width)
            ):
                batches.append(current)
                current, real = [], 0
            current.append(index)
            real += width
        if current:
            batches.append(current)
        return batches

    def _shared_prefix_length(self, ids: Sequence[Sequence[int]]) -> int:
        if not self.share_prefix or len(ids) < 2:
            return 0
        # Every prompt must keep at least one token of its own after the prefix.
        length = min(common_prefix_length(ids), min(len(seq) for seq in ids) - 1)
        return length if length >= self.min_shared_prefix else 0

    def _prefix_cache(self, prefix: Sequence[int]) -> DynamicCache:
        cache = DynamicCache()
        input_ids = torch.tensor([list(prefix)], device=self.device)
        self.base(input_ids=input_ids, use_cache=True, **cache_argument(self.base, cache))
        return cache

    def _run_batch(self, suffixes, prefix_len, prefix_cache, layers, tail: bool, hooks: LastTokenCapture) -> np.ndarray:
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
            cache = expanded_cache([(layer.keys, layer.values) for layer in prefix_cache.layers], batch)
        device = self.device
        last, full_mask, position_ids = last.to(device), full_mask.to(device), position_ids.to(device)
        depth = max(layers)
        with hooks.batch(last) as captured:
            self.base(
                input_ids=input_ids.to(device),
                attention_mask=full_mask,
                position_ids=position_ids,
                use_cache=cache is not None,
                **cache_argument(self.base, cache),
            )
        if tail:
            prefix_kv = None
            if prefix_cache is not None:
                layer_cache = prefix_cache.layers[depth - 1]
                prefix_kv = (layer_cache.keys, layer_cache.values)
            state = last_token_layer(
                self.base,
                self.decoder_layers[depth - 1],
                captured.pop("full"),
                last,
                position_ids,
                full_mask,
                prefix_kv,
            )
            captured[depth] = self.base.norm(state) if depth == self.num_layers else state
        return np.stack([captured[layer].float().cpu().numpy() for layer in layers])


def _eager(modules: list) -> None:
    """Undo `_compiled_blocks` for these modules."""
    for module in modules:
        module._compiled_call_impl = None
    modules.clear()


def naive_hidden_states(model: PreTrainedModel, ids: Sequence[int], layers: Sequence[int]) -> np.ndarray:
    """The reference (and the papers' Algorithm 1): one full forward per prompt with all hidden states."""
    with torch.inference_mode():
        input_ids = torch.tensor([list(ids)], device=next(model.parameters()).device)
        hidden = model(input_ids=input_ids, output_hidden_states=True).hidden_states
    return np.stack([hidden[layer][0, -1].float().cpu().numpy() for layer in layers])
