"""Resumable, content-keyed artifacts computed in fixed shards.

An artifact lives in `<cache>/<kind>/<key>/`, where `key` hashes exactly the inputs and settings that
change its content (model identity, prompt template, data rows, layers, dtype, ...). Each shard is
computed independently from a fixed slice of the items and written atomically (temp file + rename),
so a process killed at any moment leaves only whole shards behind, and a rerun computes the missing
ones to the same result as an uninterrupted run. A shard that cannot be read is reported and
recomputed; a manifest whose spec differs from the requested one is refused.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
from tqdm.auto import tqdm

log = logging.getLogger(__name__)

FORMATS = ("npy", "json")
STALE_TMP_SECONDS = 600


class CacheMismatchError(RuntimeError):
    """An artifact directory holds something other than what its key promises."""


def fingerprint(obj: Any) -> str:
    """Short sha256 of a canonical JSON encoding."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, ensure_ascii=False, default=str).encode()).hexdigest()[:16]


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_save_png(figure: Any, path: str | os.PathLike[str]) -> Path:
    """A matplotlib Figure written atomically as PNG (a reader never sees half an image)."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    path = Path(path)
    atomic_write_bytes(path, buffer.getvalue())
    return path


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def atomic_save_npy(path: Path, array: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".npy", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            np.save(handle, array, allow_pickle=False)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class ShardedArtifact:
    def __init__(self, root: Path | str, kind: str, spec: dict[str, Any], num_items: int,
                 shard_size: int = 256, fmt: str = "npy") -> None:
        if fmt not in FORMATS:
            raise ValueError(f"fmt={fmt!r} is not one of {FORMATS}")
        if shard_size < 1 or num_items < 0:
            raise ValueError(f"shard_size must be >= 1 and num_items >= 0 (got {shard_size}, {num_items})")
        self.kind, self.spec, self.num_items, self.shard_size, self.fmt = kind, spec, num_items, shard_size, fmt
        self.key = fingerprint({"kind": kind, "spec": spec, "num_items": num_items, "shard_size": shard_size, "fmt": fmt})
        self.dir = Path(root) / kind / self.key
        self.manifest_path = self.dir / "manifest.json"
        self._open()

    # --- layout -------------------------------------------------------------------------------
    @property
    def num_shards(self) -> int:
        return (self.num_items + self.shard_size - 1) // self.shard_size

    def shard_range(self, index: int) -> tuple[int, int]:
        start = index * self.shard_size
        return start, min(start + self.shard_size, self.num_items)

    def shard_path(self, index: int) -> Path:
        return self.dir / f"shard-{index:05d}.{self.fmt}"

    # --- state --------------------------------------------------------------------------------
    def _manifest(self) -> dict[str, Any]:
        return {"kind": self.kind, "key": self.key, "spec": self.spec, "num_items": self.num_items,
                "shard_size": self.shard_size, "fmt": self.fmt, "num_shards": self.num_shards}

    def _open(self) -> None:
        if self.manifest_path.exists():
            try:
                stored = json.loads(self.manifest_path.read_text())
            except (OSError, json.JSONDecodeError) as err:
                raise CacheMismatchError(f"unreadable manifest {self.manifest_path}: {err}; delete {self.dir}") from err
            expected = json.loads(json.dumps(self._manifest(), default=str))
            if {k: stored.get(k) for k in expected} != expected:
                raise CacheMismatchError(
                    f"{self.manifest_path} describes a different artifact than key {self.key} promises; "
                    f"refusing to reuse it. Delete {self.dir} to recompute."
                )
        else:
            atomic_write_text(self.manifest_path, json.dumps(self._manifest(), indent=2, default=str))
        # Temp files left by a killed writer are never part of the result. Only old ones are removed, so
        # that a second process writing the same artifact right now keeps its file.
        for stale in self.dir.glob(".tmp-*"):
            with contextlib.suppress(FileNotFoundError):
                if time.time() - stale.stat().st_mtime > STALE_TMP_SECONDS:
                    stale.unlink()

    def _readable(self, index: int) -> bool:
        path = self.shard_path(index)
        if not path.exists():
            return False
        start, stop = self.shard_range(index)
        try:
            payload = self._read(path, mmap=True)
            if self.fmt == "npy" and payload.ndim != 3:
                raise ValueError(f"has {payload.ndim} dimensions, expected 3 (layers, items, dim)")
            if self.fmt == "json" and not isinstance(payload, list):
                raise ValueError("is not a JSON list")
            rows = payload.shape[1] if self.fmt == "npy" else len(payload)
            if rows != stop - start:
                raise ValueError(f"holds {rows} items, expected {stop - start}")
            return True
        except (OSError, ValueError, EOFError, json.JSONDecodeError) as err:
            log.warning("Cache shard %s is damaged (%s); recomputing it.", path, err)
            path.unlink(missing_ok=True)
            return False

    def pending(self) -> list[int]:
        return [i for i in range(self.num_shards) if not self._readable(i)]

    @property
    def complete(self) -> bool:
        return not self.pending()

    # --- io -----------------------------------------------------------------------------------
    def _read(self, path: Path, mmap: bool = False):
        if self.fmt == "npy":
            return np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)
        return json.loads(path.read_text())

    def write(self, index: int, payload: Any) -> None:
        if self.fmt == "npy":
            atomic_save_npy(self.shard_path(index), np.ascontiguousarray(payload))
        else:
            atomic_write_text(self.shard_path(index), json.dumps(payload, ensure_ascii=False))

    def compute(self, fn: Callable[[int, int], Any], desc: str | None = None, progress: bool = True) -> "ShardedArtifact":
        """Compute every missing shard with `fn(start, stop)`; shards already on disk are kept."""
        todo = self.pending()
        if todo:
            log.info("%s %s: %d of %d shards to compute", self.kind, self.key, len(todo), self.num_shards)
        for index in tqdm(todo, desc=desc or self.kind, unit="shard", disable=not progress or not todo):
            self.write(index, fn(*self.shard_range(index)))
        return self

    def shards(self, mmap: bool = True) -> list[Any]:
        if not self.complete:
            raise CacheMismatchError(f"artifact {self.dir} is incomplete; call compute() first")
        return [self._read(self.shard_path(i), mmap=mmap) for i in range(self.num_shards)]

    def records(self) -> list[Any]:
        """All items of a json artifact, in order."""
        return [item for shard in self.shards() for item in shard]


class ActivationStore:
    """Read access to a npy activation artifact of shape (layers, items, dim) per shard, memory-mapped."""

    def __init__(self, artifact: ShardedArtifact, layers: Sequence[int]) -> None:
        self.artifact = artifact
        self.layers = list(layers)
        self._arrays: list[np.ndarray] | None = None
        self.dim = int(self.arrays[0].shape[-1]) if self.arrays else 0

    @property
    def arrays(self) -> list[np.ndarray]:
        # Opened lazily so that DataLoader workers map the files themselves instead of receiving copies.
        if self._arrays is None:
            self._arrays = self.artifact.shards(mmap=True)
        return self._arrays

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_arrays": None}

    def __len__(self) -> int:
        return self.artifact.num_items

    @property
    def key(self) -> str:
        return self.artifact.key

    def layer_index(self, layer: int) -> int:
        if layer not in self.layers:
            raise ValueError(f"layer {layer} was not extracted; this cache holds layers {self.layers} "
                             f"(set data.layers to include it)")
        return self.layers.index(layer)

    def _locate(self, index: int) -> tuple[int, int]:
        if not 0 <= int(index) < len(self):
            raise IndexError(f"item {index} outside 0..{len(self) - 1}")
        return divmod(int(index), self.artifact.shard_size)

    def get(self, layer: int, index: int) -> np.ndarray:
        shard, offset = self._locate(index)
        return np.array(self.arrays[shard][self.layer_index(layer), offset], dtype=np.float32)  # a writable copy

    def take(self, layer: int, indices: Sequence[int]) -> np.ndarray:
        position = self.layer_index(layer)
        out = np.empty((len(indices), self.dim), dtype=np.float32)
        for row, index in enumerate(indices):
            shard, offset = self._locate(index)
            out[row] = self.arrays[shard][position, offset]
        return out
