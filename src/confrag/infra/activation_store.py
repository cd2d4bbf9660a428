"""Read access to the hidden states of a sharded npy artifact: (layers, items, dim) per shard, memory-mapped."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from confrag.infra.sharded import ShardedArtifact


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
            raise ValueError(
                f"layer {layer} was not extracted; this cache holds layers {self.layers} "
                f"(set data.extraction.layers to include it)"
            )
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
