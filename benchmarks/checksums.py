"""What shard checksums cost on reads: an activation artifact read with and without verification.

The artifact has SmolLM2-135M's shape for a layer sweep (31 hidden-state layers x 576 floats per
item, 256 items per shard, 8 shards: 146 MB), written once, then read from the page cache (best of
N runs, so the disk is out of the comparison):

- full read: a fresh handle loads every shard into memory (`shards(mmap=False)`), the first read of
  a process; with verification it hashes every shard once (xxh3-128) before loading it;
- training read: a fresh handle and 4,096 random rows of one layer through `ActivationStore.take`,
  what the probe's data loader does (memory-mapped, so without verification most bytes are never read).

It also prints the hash rates of xxh3-128 and BLAKE2b on the same bytes (why xxhash), and what the
NaN/inf check of a shard costs on the same bytes.

Single results (folder digests), each verified as a run verifies it before reading it, against what
reading it costs anyway:

- the converted SmolLM2-135M (the dequantized safetensors the tiny models' tokenizer also comes from;
  converted first when missing): verify vs `AutoModelForCausalLM.from_pretrained` of the folder;
- the BM25 index of the retrieval stage's corpus (the NQ file's paragraphs, the largest index the
  project builds from its shared data), and a synthetic one of `--bm25-passages` passages for scale:
  verify vs `bm25s.BM25.load` (and the build).

The last line is `full_read_ratio:` (verified / unverified time of the activation read).

    python benchmarks/checksums.py [--shards 8] [--repeats 5] [--bm25-passages 50000] [--skip-model]
"""

from __future__ import annotations

import argparse
import hashlib
import tempfile
import time
from pathlib import Path

import numpy as np
import xxhash

from confrag.infra.activation_store import ActivationStore
from confrag.infra.digests import folder_problem
from confrag.infra.finite import nonfinite_rows
from confrag.infra.sharded import ShardedArtifact

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
    parser.add_argument("--bm25-passages", type=int, default=50000)
    parser.add_argument("--skip-model", action="store_true", help="leave out the converted model")
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
        finite = best_of(args.repeats, lambda: [nonfinite_rows(np.load(f, mmap_mode="r"), axis=1) for f in files])
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
    print(f"NaN/inf check of every shard (included in 'verified'): {finite:.3f} s ({mb / finite:.0f} MB/s)")
    if not args.skip_model:
        converted_model(args.repeats)
    bm25_indexes(args.repeats, args.bm25_passages)
    print(f"full_read_ratio: {full_checked / full_plain:.2f}")


def folder_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def verify_vs(name: str, directory: Path, repeats: int, read, read_label: str) -> None:
    for path in directory.rglob("*"):  # into the page cache, as after the first read of a run
        if path.is_file():
            path.read_bytes()
    assert folder_problem(directory) == "", folder_problem(directory)
    verify = best_of(repeats, lambda: folder_problem(directory))
    reading = best_of(max(1, repeats // 2), read)
    mb = folder_bytes(directory) / 1e6
    print(
        f"{name}: {mb:.0f} MB   verify {verify:.3f} s ({mb / verify:.0f} MB/s)   {read_label} {reading:.3f} s   "
        f"verify / {read_label} {verify / reading:.1%}"
    )


def converted_model(repeats: int) -> None:
    from omegaconf import OmegaConf
    from transformers import AutoModelForCausalLM

    import confrag.llm.pretrained as pretrained

    node = OmegaConf.load(Path(__file__).resolve().parents[1] / "conf" / "llm" / "smollm2_135m.yaml")
    cfg = pretrained.LLMConfig(**{**OmegaConf.to_container(node), "cache_dir": None})  # the embedded LLM's node
    path = pretrained.gguf_location(cfg)
    target = pretrained.model_cache(cfg) / f"{path.stem}-{pretrained.file_sha256(path)[:16]}"
    pretrained.ensure_converted(path, target)
    verify_vs(
        "converted SmolLM2-135M",
        target,
        repeats,
        lambda: AutoModelForCausalLM.from_pretrained(target),
        "load",
    )


def bm25_indexes(repeats: int, synthetic: int) -> None:
    import bm25s

    from confrag.data.nq import default_questions_path, load_questions_jsonl
    from confrag.retrieval import BM25Retriever, corpus_from_gold_paragraphs
    from confrag.retrieval.corpus import Corpus, CorpusPassage, passages_fingerprint

    nq = corpus_from_gold_paragraphs(load_questions_jsonl(default_questions_path()), words_per_passage=100)
    words = np.array(" ".join(p.text for p in nq.passages).split())
    rng = np.random.default_rng(0)
    passages = [
        CorpusPassage(pid=f"s{i}#0", title=f"s{i}", text=" ".join(rng.choice(words, 100)), source_id=f"s{i}")
        for i in range(synthetic)
    ]
    big = Corpus(passages=passages, gold_source_of={}, fingerprint=passages_fingerprint(passages))
    for name, corpus in (
        (f"BM25 index, NQ corpus ({len(nq)} passages)", nq),
        (f"BM25 index, {synthetic} passages", big),
    ):
        with tempfile.TemporaryDirectory() as tmp:
            start = time.perf_counter()
            retriever = BM25Retriever(corpus, cache_dir=tmp)
            built = time.perf_counter() - start
            directory = retriever.index_dir
            verify_vs(
                name,
                directory,
                repeats,
                lambda d=directory: bm25s.BM25.load(d, show_progress=False),
                "load",
            )
            print(f"  (built and saved in {built:.2f} s)")


if __name__ == "__main__":
    main()
