"""What shard checksums cost on reads: an activation artifact read with and without verification.

The artifact has SmolLM2-135M's shape for a layer sweep (31 hidden-state layers x 576 floats per
item, 256 items per shard, 8 shards: 146 MB), written once, then read from the page cache (best of
N runs, so the disk is out of the comparison):

- full read: a fresh handle loads every shard into memory (`shards(mmap=False)`), the first read of
  a process; with verification it hashes every shard once (xxh3-128) before loading it;
- training read: a fresh handle and 4,096 random rows of one layer through `ActivationStore.take`,
  what the probe's data loader does (memory-mapped, so without verification most bytes are never read).

It also prints the hash rates of xxh3-128 and BLAKE2b on the same bytes (why xxhash). The last line
is `full_read_ratio:` (verified / unverified time).

    python benchmarks/checksums.py [--shards 8] [--repeats 5]
"""

from __future__ import annotations

import argparse
import hashlib
import tempfile
import time
from pathlib import Path

import numpy as np
import xxhash

from confrag.artifacts import ActivationStore, ShardedArtifact

LAYERS, DIM, SHARD = 31, 576, 256


def best_of(repeats: int, fn) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def handle(root: Path, shards: int, verified: bool) -> ShardedArtifact:
    """A fresh handle, as a new process opens the artifact; unverified = every shard marked as already
    checked (what reading cost before digests, apart from the shape check both do)."""
    artifact = ShardedArtifact(root, "activations", {"bench": "checksums"}, shards * SHARD, shard_size=SHARD)
    if not verified:
        artifact._verified = {i: artifact._identity(i) for i in range(artifact.num_shards)}
    return artifact


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        rng = np.random.default_rng(0)
        ShardedArtifact(root, "activations", {"bench": "checksums"}, args.shards * SHARD, shard_size=SHARD).compute(
            lambda a, b: rng.standard_normal((LAYERS, b - a, DIM), dtype=np.float32), progress=False
        )
        files = sorted(root.glob("activations/*/shard-*.npy"))
        total = sum(f.stat().st_size for f in files)
        for f in files:  # into the page cache
            f.read_bytes()

        def full(verified: bool) -> None:
            for shard in handle(root, args.shards, verified).shards(mmap=False):
                shard.sum()  # touch the loaded data

        rows = rng.integers(0, args.shards * SHARD, 4096)

        def training(verified: bool) -> None:
            ActivationStore(handle(root, args.shards, verified), list(range(LAYERS))).take(LAYERS // 2, rows)

        full_plain, full_checked = best_of(args.repeats, lambda: full(False)), best_of(args.repeats, lambda: full(True))
        take_plain = best_of(args.repeats, lambda: training(False))
        take_checked = best_of(args.repeats, lambda: training(True))
        data = b"".join(f.read_bytes() for f in files)
        xxh = best_of(args.repeats, lambda: xxhash.xxh3_128(data).hexdigest())
        blake = best_of(args.repeats, lambda: hashlib.blake2b(data, digest_size=16).hexdigest())

    mb = total / 1e6
    print(f"artifact: {len(files)} shards, {mb:.0f} MB ({LAYERS} layers x {SHARD} items x {DIM} floats per shard)")
    print(f"hash rate on these bytes: xxh3-128 {mb / xxh:8.0f} MB/s   BLAKE2b {mb / blake:8.0f} MB/s")
    print(
        f"full read (fresh handle, every shard loaded):   unverified {full_plain:.3f} s   verified "
        f"{full_checked:.3f} s   ratio {full_checked / full_plain:.2f}"
    )
    print(
        f"training read (fresh handle, 4096 rows of one layer): unverified {take_plain:.3f} s   verified "
        f"{take_checked:.3f} s   ratio {take_checked / take_plain:.2f}"
    )
    print(f"full read with BLAKE2b instead (estimated): ratio {(full_plain + blake) / full_plain:.2f}")
    print(f"full_read_ratio: {full_checked / full_plain:.2f}")


if __name__ == "__main__":
    main()
