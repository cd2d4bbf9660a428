"""Every CPU core, the same bytes: independent batches of a forward run on parallel worker threads, each on a fixed
number of intra-op threads.

torch splits a product's reductions over its intra-op threads, so the same batch summed on 1 and on 2 threads can
differ in the last bits (measured on SmolLM2: up to 7.6e-6 in 24 of 64 states), and a cache whose bytes depended
on the thread count of the process that filled it would hold two answers under one key. A batch computed on one
intra-op thread is the same bytes whichever worker computed it and however many workers there were; running
`workers` such batches at once (torch releases the GIL inside its kernels) uses every core. Measured on SmolLM2-135M
on 2 cores (batches of 16 x 300 tokens): 2 workers at 1.81x one worker, the same bytes; 2 intra-op threads 1.98x,
other bytes (benchmarks/cpu_llm.py prints the current figures).

On a GPU, batches run one after another on the device (`workers` does not apply).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch
from tqdm.auto import tqdm

from confrag.infra import checks

T = TypeVar("T")
R = TypeVar("R")

# Intra-op threads of one CPU batch: fixed, so that a batch's bytes do not depend on the machine's core count.
CPU_THREADS = 1


def available_cores() -> int:
    """The cores this process may run on (its affinity mask, as a job scheduler or `taskset` sets it)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def resolve_workers(workers: int | None, threads: int | None, key: str = "workers") -> int:
    """`workers` checked, None resolved to as many workers as the cores allow at `threads` intra-op threads each."""
    checks.positive_int(workers, key, allow_none=True, none="None", hint="(one per available core)")
    if workers is not None:
        return int(workers)
    return max(1, available_cores() // max(1, threads or 1))


@contextlib.contextmanager
def fixed_threads(device: torch.device, threads: int | None) -> Iterator[None]:
    """Within the block, torch's intra-op thread count is `threads` when computing on the CPU (restored after);
    on a GPU, or with `threads=None`, nothing changes. Worker threads started inside the block take the count
    too (torch hands the process-wide setting to each new thread)."""
    if threads is None or device.type != "cpu" or torch.get_num_threads() == threads:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def longest_first(batches: Sequence[T], cost: Callable[[T], float]) -> list[T]:
    """The batches in decreasing cost, the order workers take them in: with few batches a long one started last
    leaves the other workers idle (3 equal batches on 2 workers: 2 rounds; a long one last: nearly 2 rounds of
    it). A batch's bytes do not depend on when it runs."""
    return sorted(batches, key=cost, reverse=True)


def run_batches(
    work: Callable[[T], R],
    batches: Sequence[T],
    device: torch.device,
    workers: int = 1,
    progress: tqdm | None = None,
) -> Iterator[tuple[T, R]]:
    """(batch, work(batch)) for every batch, in the order of `batches`; on the CPU with `workers` > 1 the batches
    run on that many threads at once (call it inside `fixed_threads`). A worker's exception is raised here."""
    if workers <= 1 or device.type != "cpu" or len(batches) <= 1:
        for batch in batches:
            result = work(batch)
            if progress is not None:
                progress.update(1)
            yield batch, result
        return
    # Grad and inference modes are per thread: a worker computes in the caller's.
    inference, grad = torch.is_inference_mode_enabled(), torch.is_grad_enabled()

    def in_callers_mode(batch: T) -> R:
        with torch.inference_mode(inference), torch.set_grad_enabled(grad):
            return work(batch)

    with ThreadPoolExecutor(max_workers=min(workers, len(batches)), thread_name_prefix="confrag-batch") as pool:
        futures = [pool.submit(in_callers_mode, batch) for batch in batches]
        try:
            for batch, future in zip(batches, futures):
                result = future.result()
                if progress is not None:
                    progress.update(1)
                yield batch, result
        finally:
            for future in futures:  # an error or an abandoned generator: start nothing new
                future.cancel()
