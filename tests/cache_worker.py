"""A worker process for the concurrency tests (run as a script: `python tests/cache_worker.py MODE ...`).

Modes
- fill CACHE COUNTER GO DELAY KEY: compute a 7-shard artifact keyed by KEY in CACHE, once the file GO
  exists (a start barrier, so that two workers really run at the same time); every shard computed
  appends a line to COUNTER and takes DELAY seconds. Prints {"computed": [...]} when done.
- hold CACHE COUNTER MARKER KEY: like fill, but the computation of shard 0 creates MARKER and never
  ends: the process holds shard 0's lock until it is killed.
- convert MODELS COUNTER GO: `llm.pretrained.convert_gguf` into MODELS with the transformers loaders
  replaced by a slow fake that counts conversions in COUNTER.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path

import numpy as np

NUM_ITEMS, SHARD_SIZE, LAYERS, DIM = 13, 2, 2, 3


def values(start: int, stop: int) -> np.ndarray:
    """Deterministic (layers, items, dim) block: every value encodes (layer, item, column)."""
    layer = np.arange(LAYERS, dtype=np.float32)[:, None, None]
    item = np.arange(start, stop, dtype=np.float32)[None, :, None]
    column = np.arange(DIM, dtype=np.float32)[None, None, :]
    return (1000 * layer + 10 * item + column / 10).astype(np.float32)


def artifact(cache: str, key: str):
    from confrag.infra.sharded import ShardedArtifact

    return ShardedArtifact(cache, "activations", {"test": "concurrency", "key": key}, NUM_ITEMS, shard_size=SHARD_SIZE)


def count(counter: str, text: str) -> None:
    # One short O_APPEND write per line: lines of several processes never interleave.
    fd = os.open(counter, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (text + "\n").encode())
    finally:
        os.close(fd)


def wait_for(path: str) -> None:
    while not os.path.exists(path):
        time.sleep(0.01)


def fill(cache: str, counter: str, go: str, delay: float, key: str) -> None:
    def compute(start: int, stop: int) -> np.ndarray:
        count(counter, f"{key} {start} {os.getpid()}")
        time.sleep(delay)
        return values(start, stop)

    handle = artifact(cache, key)
    wait_for(go)
    handle.compute(compute, progress=False, poll_seconds=0.05)
    assert handle.complete
    np.testing.assert_array_equal(
        np.concatenate([np.asarray(s) for s in handle.shards()], axis=1), values(0, NUM_ITEMS)
    )
    print(json.dumps({"computed": handle.computed}), flush=True)


def hold(cache: str, counter: str, marker: str, key: str) -> None:
    def compute(start: int, stop: int) -> np.ndarray:
        count(counter, f"{key} {start} {os.getpid()}")
        if start == 0:
            Path(marker).touch()
            time.sleep(3600)  # killed here, holding shard 0's lock
        return values(start, stop)

    artifact(cache, key).compute(compute, progress=False, poll_seconds=0.05)


class _FakeConverted:
    """Stands in for the transformers model/tokenizer of a GGUF file: slow to save, and counted."""

    counter = ""

    def __init__(self) -> None:
        self.config = type("Config", (), {})()
        self.hf_quantizer = None

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        return cls()

    def save_pretrained(self, directory) -> None:
        count(self.counter, f"save {os.getpid()}")
        time.sleep(0.5)
        Path(directory, "config.json").write_text("{}")
        Path(directory, f"part-{os.getpid()}.bin").write_bytes(b"weights")


def convert(models: str, counter: str, go: str) -> None:
    from confrag.llm import pretrained

    _FakeConverted.counter = counter
    pretrained.AutoTokenizer = pretrained.AutoModelForCausalLM = _FakeConverted
    wait_for(go)
    pretrained.convert_gguf(Path(models) / "model.gguf", Path(models) / "model-0123")
    print(json.dumps({"converted": True}), flush=True)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s %(levelname)s %(message)s")
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "fill":
        fill(args[0], args[1], args[2], float(args[3]), args[4])
    elif mode == "hold":
        hold(*args)
    elif mode == "convert":
        convert(*args)
    else:
        raise SystemExit(f"unknown mode {mode!r}")
