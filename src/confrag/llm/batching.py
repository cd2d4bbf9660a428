"""Batch sizes from the device's free memory and the model's shape (`batch_size: auto`).

On a GPU the fastest batch is about the largest that fits: every batch pays fixed costs (kernel
launches, the sync that brings its states to the host, Python), and a forward over many tokens keeps
the matrix units busy. The budget is a share of the memory `torch.cuda.mem_get_info` reports free,
divided by what one token (extraction) or one sequence (generation) needs at its peak, estimated from
the shape; it is capped where larger batches stop paying. On the CPU there is no such gain, and small
batches with little padding are faster: `auto` means the measured CPU defaults there.
"""

from __future__ import annotations

from typing import Any

import torch

from confrag.infra import checks
from confrag.llm.shapes import DecoderCost, dtype_bytes

AUTO = "auto"

# Measured on 2 CPU cores with SmolLM2 (README, Benchmarks): what `auto` means off the GPU.
CPU_EXTRACT_BATCH = 16
CPU_EXTRACT_TOKENS = 4096
CPU_GENERATE_BATCH = 16

# Share of the free device memory a batch may take: the rest is head room for the allocator's
# fragmentation and for what the caller keeps alive (a reranker, outputs).
MEMORY_FRACTION = 0.6
# Above these sizes a batch is no faster per token, only later to report and harder to place.
MAX_EXTRACT_TOKENS = 1 << 16
MAX_EXTRACT_ROWS = 1024
MAX_GENERATE_ROWS = 256


def check_batch_size(value: Any, key: str) -> int | str:
    """An integer >= 1 or "auto"; anything else is refused naming `key`."""
    return checks.positive_int(value, key, also=(AUTO,))


def free_device_memory(device: torch.device) -> int | None:
    """Bytes a new batch can take on a CUDA device: what the driver reports free plus what PyTorch's
    caching allocator holds without using (freed by earlier batches, reusable at once); None off CUDA
    (the CPU defaults apply)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    free, _total = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


def model_dtype_bytes(model: torch.nn.Module) -> int:
    return dtype_bytes(next(model.parameters()).dtype)


def extraction_bytes_per_token(cost: DecoderCost, depth: int, max_length: int, dtype_size: int) -> int:
    """Peak bytes one token of a batch holds during `HiddenStateEngine` extraction up to layer `depth`:
    the keys/values kept for every layer run (the prefix cache path keeps them), one layer's transient
    activations (MLP gate, up and product, q/k/v, residual and norm copies, RMSNorm's float32 upcast),
    and attention scores in float32 in case the attention falls back to the materialised kernel."""
    kv = cost.kv_bytes_per_token(dtype_size, layers=max(depth, 1))
    transient = (4 * cost.intermediate + 6 * cost.hidden + 2 * cost.kv_width) * dtype_size + 2 * 4 * cost.hidden
    scores = 4 * cost.heads * max_length
    return kv + transient + scores


def extraction_budget(
    model: torch.nn.Module, depth: int, max_length: int, memory_fraction: float = MEMORY_FRACTION
) -> tuple[int, int]:
    """(rows, padded tokens) per extraction batch on the model's device: from free memory on CUDA, the
    CPU defaults elsewhere."""
    device = next(model.parameters()).device
    free = free_device_memory(device)
    if free is None:
        return CPU_EXTRACT_BATCH, CPU_EXTRACT_TOKENS
    cost = DecoderCost.of(model.config)
    per_token = extraction_bytes_per_token(cost, depth, max_length, model_dtype_bytes(model))
    tokens = int(min(MAX_EXTRACT_TOKENS, free * memory_fraction // per_token))
    if tokens < max_length:
        raise MemoryError(
            f"free device memory ({free / 2**30:.1f} GiB) holds {tokens} tokens of an extraction batch at "
            f"{per_token / 2**20:.2f} MiB per token, fewer than the longest prompt ({max_length} tokens); "
            f"free memory on {device} or set an integer batch size"
        )
    return MAX_EXTRACT_ROWS, tokens


def generation_bytes_per_row(cost: DecoderCost, prompt_length: int, total_length: int, dtype_size: int) -> int:
    """Peak bytes one sequence of a generation batch holds: its key/value cache over the whole stack for
    `total_length` positions, the prefill's transient activations for its prompt tokens, and the
    float32 logits of one position (the LM head runs at the last position only)."""
    kv = cost.kv_bytes_per_token(dtype_size) * total_length
    transient = prompt_length * (
        (4 * cost.intermediate + 6 * cost.hidden) * dtype_size + 2 * 4 * cost.hidden + 4 * cost.heads * total_length
    )
    logits = cost.vocab * (dtype_size + 2 * 4)
    return kv + transient + logits


def generation_rows(
    model: torch.nn.Module,
    prompt_length: int,
    total_length: int,
    memory_fraction: float = MEMORY_FRACTION,
    max_rows: int = MAX_GENERATE_ROWS,
) -> int:
    """Sequences per greedy-generation batch on the model's device: from free memory on CUDA (at most
    `max_rows`), the CPU default elsewhere."""
    device = next(model.parameters()).device
    free = free_device_memory(device)
    if free is None:
        return CPU_GENERATE_BATCH
    cost = DecoderCost.of(model.config)
    per_row = generation_bytes_per_row(cost, prompt_length, total_length, model_dtype_bytes(model))
    rows = int(min(max_rows, free * memory_fraction // per_row))
    if rows < 1:
        raise MemoryError(
            f"free device memory ({free / 2**30:.1f} GiB) does not hold one sequence of {total_length} tokens "
            f"({per_row / 2**30:.2f} GiB with its cache); free memory on {device} or shorten the prompts"
        )
    return rows
