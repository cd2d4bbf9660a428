"""Batched greedy generation with a progress bar.

Every path runs transformers' `model.generate` (greedy, one beam), so the generation config's own
logits processors and stopping rules apply exactly as in a plain call; the paths differ in what the
call is given:

- plain (`share_prefix=False`, `static_cache=False`): prompts sorted by length and left-padded, the
  reference the others are tested against;
- shared prefix (`share_prefix`, default on): the token prefix every prompt of the call shares (the
  chat template's system prompt and the instruction) is prefilled once, and each batch starts from its
  keys/values instead of recomputing them per prompt, as `HiddenStateEngine` does for hidden states.
  The batch reads [prefix | left padding | own tokens]; positions count real tokens only, so every
  token sees the keys and positions of the plain path;
- static cache (`static_cache`, off by default; a CUDA lever): keys/values live in a preallocated cache
  of fixed rows and a length from a few buckets (`cache_buckets`), kept for the model between calls, so
  the decoding step has the same shapes and buffers batch after batch and transformers compiles it
  (`torch.compile`, CUDA graphs) once per bucket instead of once per batch width. The last batch is
  filled up with copies of its last prompt. Compilation runs on CUDA only; on other devices, or if it
  fails (then logged once), the same cache runs eagerly.

Batching changes float rounding, never the computation: on the tiny models and SmolLM2 the paths give
the same greedy tokens in fp32 (tests); in a near-tie two paths may decode differently, as two batch
compositions of the plain path may.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase, StaticCache

from confrag.infra import checks
from confrag.llm.batching import AUTO, check_batch_size, generation_rows
from confrag.llm.hidden_states import common_prefix_length
from confrag.llm.kv_cache import cache_argument, expanded_cache
from confrag.llm.prompts import encode_prompts
from confrag.llm.workers import CPU_THREADS, fixed_threads, longest_first, resolve_workers, run_batches

log = logging.getLogger(__name__)

# Static cache lengths: a sequence takes the smallest bucket holding prompt + new tokens. Few buckets
# mean few compilations; the price is attention over the bucket's unused (masked) positions.
DEFAULT_CACHE_BUCKETS = (256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


@dataclass(frozen=True)
class GreedyOptions:
    """How `generate_greedy` runs (its answers do not depend on it beyond float rounding)."""

    share_prefix: bool = True
    min_shared_prefix: int = 8
    static_cache: bool = False
    cache_buckets: tuple[int, ...] = DEFAULT_CACHE_BUCKETS
    compile: bool = True  # with static_cache on CUDA: compile the decoding step
    # On the CPU: batches decoded at once (None: one per available core), each on `threads` intra-op threads, so
    # an answer does not depend on the machine's core count (confrag.llm.workers). None: the process's own count.
    workers: int | None = None
    threads: int | None = CPU_THREADS

    def __post_init__(self) -> None:
        self.check("generation")

    def check(self, key: str) -> None:
        for name in ("share_prefix", "static_cache", "compile"):
            checks.flag(getattr(self, name), f"{key}.{name}")
        checks.positive_int(self.min_shared_prefix, f"{key}.min_shared_prefix")
        checks.positive_int(self.threads, f"{key}.threads", allow_none=True, none="None", hint="(the process's own)")
        resolve_workers(self.workers, self.threads, f"{key}.workers")
        buckets = self.cache_buckets
        if (
            not buckets
            or any(not checks.is_integer(b) or b < 1 for b in buckets)
            or list(buckets) != sorted(set(buckets))
        ):
            raise ValueError(f"{key}.cache_buckets must be increasing integers >= 1; got {buckets!r}")

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any] | None, key: str = "generation") -> GreedyOptions:
        """From a config section; unknown keys are refused with the allowed ones."""
        values = dict(values or {})
        allowed = [f.name for f in fields(cls)]
        unknown = sorted(set(values) - set(allowed))
        if unknown:
            raise ValueError(f"{key}: unknown key(s) {unknown}; allowed: {allowed}")
        if "cache_buckets" in values and values["cache_buckets"] is not None:
            values["cache_buckets"] = tuple(values["cache_buckets"])
        options = cls.__new__(cls)
        for name in allowed:
            object.__setattr__(options, name, values.get(name, getattr(cls, name)))
        options.check(key)
        return options


PLAIN = GreedyOptions(share_prefix=False)


def cache_length(needed: int, buckets: Sequence[int]) -> int:
    """The smallest bucket >= `needed`; past the largest, `needed` rounded up to a multiple of it."""
    for bucket in buckets:
        if bucket >= needed:
            return bucket
    return -(-needed // buckets[-1]) * buckets[-1]


@torch.inference_mode()
def generate_greedy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[str],
    max_new_tokens: int = 32,
    batch_size: int | str = 16,
    desc: str = "generating",
    progress: bool = True,
    options: GreedyOptions | None = None,
) -> list[str]:
    """Greedy answers, in the order of `prompts`."""
    ids = encode_prompts(tokenizer, prompts)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    new = generate_greedy_ids(model, ids, pad_id, max_new_tokens, batch_size, desc, progress, options)
    return [tokenizer.decode(tokens, skip_special_tokens=True).strip() for tokens in new]


@torch.inference_mode()
def generate_greedy_ids(
    model: PreTrainedModel,
    ids: Sequence[Sequence[int]],
    pad_id: int,
    max_new_tokens: int = 32,
    batch_size: int | str = 16,
    desc: str = "generating",
    progress: bool = True,
    options: GreedyOptions | None = None,
) -> list[list[int]]:
    """The new tokens of each prompt (token ids, in the order of `ids`; after an end-of-sequence token
    the rest of the row is `pad_id`, as `model.generate` returns it). `batch_size="auto"` picks the rows
    from free device memory (`confrag.llm.batching`)."""
    options = options or GreedyOptions()
    checks.positive_int(max_new_tokens, "max_new_tokens")
    batch_size = check_batch_size(batch_size, "batch_size")
    if not ids:
        return []
    if any(len(seq) == 0 for seq in ids):
        raise ValueError("a prompt encodes to zero tokens")
    prefix_len = _shared_prefix_length(ids, options) if options.share_prefix else 0
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    rows = generation_batch_rows(model, ids, max_new_tokens, batch_size, options, prefix_len)
    answers: list[list[int]] = [[] for _ in ids]
    batches = [order[i : i + rows] for i in range(0, len(order), rows)]
    # A static cache is one buffer per shape, shared by the batches: they take turns.
    workers = (
        1 if options.static_cache or options.threads is None else resolve_workers(options.workers, options.threads)
    )
    device = next(model.parameters()).device
    bar = tqdm(total=len(batches), desc=desc, unit="batch", disable=not progress)
    with bar, fixed_threads(device, options.threads):  # the shared prefix's keys/values too
        runner = _Runner(model, ids, pad_id, max_new_tokens, prefix_len, options, rows)
        ordered = longest_first(batches, lambda batch: max(len(ids[i]) for i in batch) * len(batch))
        for batch, new in run_batches(runner.run, ordered, device, workers, bar):
            for index, tokens in zip(batch, new):
                answers[index] = tokens
    return answers


def generation_batch_rows(
    model: PreTrainedModel,
    ids: Sequence[Sequence[int]],
    max_new_tokens: int,
    batch_size: int | str,
    options: GreedyOptions,
    prefix_len: int = 0,
) -> int:
    """Sequences per batch. "auto": from free device memory (the CPU default elsewhere); with a static
    cache, the rows of a cache kept from before if one fits, else a power of two, so that free-memory
    noise does not make a new shape to compile. A static-cache call with fewer prompts than rows uses
    the next power of two above their count (less filler)."""
    longest = max(len(seq) for seq in ids)
    if batch_size == AUTO:
        total = longest + max_new_tokens
        if options.static_cache:  # the cache holds the whole bucket
            total = cache_length(total, options.cache_buckets)
        rows = generation_rows(model, longest - prefix_len, total)
        if options.static_cache:
            kept = [r for r, _length in _STATIC_CACHES.get(model, {}) if r <= rows]
            rows = max(kept) if kept else 1 << (rows.bit_length() - 1)
    else:
        rows = int(batch_size)
    if options.static_cache:
        rows = min(rows, 1 << (len(ids) - 1).bit_length())
    return rows


def _shared_prefix_length(ids: Sequence[Sequence[int]], options: GreedyOptions) -> int:
    if len(ids) < 2:
        return 0
    # Every prompt keeps at least one token of its own, which the prefill needs to predict from.
    length = min(common_prefix_length(ids), min(len(seq) for seq in ids) - 1)
    return length if length >= options.min_shared_prefix else 0


# Static caches by model, then by (rows, length): compiled decoding steps are tied to the cache's
# buffers, so a new cache object would compile again. `release_static_caches` frees them.
_STATIC_CACHES: weakref.WeakKeyDictionary[PreTrainedModel, dict[tuple[int, int], StaticCache]] = (
    weakref.WeakKeyDictionary()
)
_COMPILE_FAILED: weakref.WeakSet[PreTrainedModel] = weakref.WeakSet()


def release_static_caches(model: PreTrainedModel) -> None:
    """Drop the static caches kept for `model` (their device memory is freed once unreferenced)."""
    _STATIC_CACHES.pop(model, None)


class _Runner:
    """One call's batches: the shared prefix's keys/values, computed once, and the cache each batch
    starts from."""

    def __init__(self, model, ids, pad_id, max_new_tokens, prefix_len, options: GreedyOptions, rows: int) -> None:
        self.model, self.ids, self.pad_id = model, ids, pad_id
        self.max_new_tokens, self.prefix_len, self.options = max_new_tokens, prefix_len, options
        self.device = next(model.parameters()).device
        self.static = options.static_cache
        self.rows = rows
        self.prefix = None
        if prefix_len:
            cache = DynamicCache()
            prefix = torch.tensor([list(ids[0][:prefix_len])], device=self.device)
            model.base_model(input_ids=prefix, use_cache=True, **cache_argument(model.base_model, cache))
            self.prefix = [(layer.keys, layer.values) for layer in cache.layers]

    def run(self, batch: list[int]) -> list[list[int]]:
        rows = self.rows if self.static else len(batch)
        filled = batch + [batch[-1]] * (rows - len(batch))  # the static cache's fixed rows
        suffixes = [self.ids[i][self.prefix_len :] for i in filled]
        width = max(len(seq) for seq in suffixes)
        total = self.prefix_len + width
        input_ids = torch.full((rows, total), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(input_ids)
        input_ids[:, : self.prefix_len] = torch.tensor(self.ids[batch[0]][: self.prefix_len])
        mask[:, : self.prefix_len] = 1
        for row, seq in enumerate(suffixes):
            input_ids[row, total - len(seq) :] = torch.tensor(seq)
            mask[row, total - len(seq) :] = 1
        kwargs: dict[str, Any] = dict(
            input_ids=input_ids.to(self.device),
            attention_mask=mask.to(self.device),
            max_new_tokens=self.max_new_tokens,
            do_sample=False,
            num_beams=1,
            pad_token_id=self.pad_id,
        )
        if self.static:
            output = self._generate_static(kwargs, rows, total)
        else:
            if self.prefix is not None:
                kwargs.update(cache_argument(self.model, expanded_cache(self.prefix, rows)))
            output = self.model.generate(**kwargs)
        return output[: len(batch), total:].tolist()  # one device-to-host copy for the batch

    def _static_cache(self, rows: int, length: int) -> StaticCache:
        kept = _STATIC_CACHES.setdefault(self.model, {})
        if (rows, length) not in kept:
            kept[(rows, length)] = StaticCache(config=self.model.config, max_cache_len=length)
        cache = kept[(rows, length)]
        cache.reset()
        if self.prefix is not None:
            for layer, (keys, values) in enumerate(self.prefix):
                cache.update(keys.expand(rows, -1, -1, -1), values.expand(rows, -1, -1, -1), layer)
        return cache

    def _generate_static(self, kwargs: dict[str, Any], rows: int, total: int) -> torch.Tensor:
        length = cache_length(total + self.max_new_tokens, self.options.cache_buckets)
        compile_step = self.options.compile and self.device.type == "cuda" and self.model not in _COMPILE_FAILED
        if compile_step:
            try:
                return self.model.generate(**kwargs, **cache_argument(self.model, self._static_cache(rows, length)))
            except Exception as err:  # a compiler or CUDA-graph failure: the eager step computes the same
                log.warning(
                    "compiling the decoding step failed (%s: %s); decoding eagerly from now on", type(err).__name__, err
                )
                _COMPILE_FAILED.add(self.model)
        cache = cache_argument(self.model, self._static_cache(rows, length))
        return self.model.generate(**kwargs, **cache, disable_compile=True)
