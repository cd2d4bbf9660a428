"""Wall time and peak GPU memory of the named stages of a run, for its metrics.json and report.

    timer = StageTimer()
    with timer.stage("answers"):
        ...
    timer.stages  # {"answers": {"seconds": 812.4, "peak_gpu_memory_gib": 31.7, "gpu_memory_gib": {...}}}

On CUDA the peak counters of every visible device are reset when a stage starts and read when it ends,
so each stage reports its own peak (what PyTorch's allocator handed out: `max_memory_allocated`, not
what the driver shows, which adds the allocator's cache and the CUDA context). Without CUDA the memory
fields are None. Stages should not nest: an inner stage resets the outer stage's peak.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch

GIB = 2**30


class StageTimer:
    def __init__(self) -> None:
        self.stages: dict[str, dict[str, Any]] = {}

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Time the block as stage `name` (recorded even when the block raises, for the record of a failed run)."""
        devices = _cuda_devices()
        for device in devices:
            torch.cuda.synchronize(device)  # work queued before the stage is not the stage's
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        try:
            yield
        finally:
            for device in devices:
                torch.cuda.synchronize(device)  # the stage's queued kernels are part of its time
            seconds = time.perf_counter() - start
            peaks = {str(d): torch.cuda.max_memory_allocated(d) / GIB for d in devices}
            self.stages[name] = {
                "seconds": seconds,
                "peak_gpu_memory_gib": max(peaks.values()) if peaks else None,
                "gpu_memory_gib": peaks or None,
            }

    def seconds(self) -> dict[str, float]:
        """Each stage's wall seconds."""
        return {name: record["seconds"] for name, record in self.stages.items()}


def _cuda_devices() -> list[torch.device]:
    if not torch.cuda.is_available():
        return []
    return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
