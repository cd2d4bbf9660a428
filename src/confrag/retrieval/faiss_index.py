"""Dense search through FAISS for corpora too large for exact search in numpy.

The kind of index follows the corpus size (`choose_index_kind`): up to EXACT_MAX_PASSAGES passages the
dense retriever keeps its exact numpy search; up to FLAT_MAX_PASSAGES a FAISS flat inner-product index
(still exact, but multi-threaded and without a (queries x corpus) score matrix); above, an IVF index with
8-bit scalar quantization (4 bytes -> 1 per dimension: 21M MiniLM vectors take 8 GB instead of 32 GB),
approximate, searching `nprobe` of its `nlist` lists.

An index answers only for the passages and the encoder it was built from: it is saved with its key (the
corpus fingerprint and the encoder's identity) and a digest of its file, and `FaissIndex.load` refuses an
index whose key differs, naming both, rather than returning neighbours of other passages. The folder also
carries a folder digest (`confrag.digest.json`, as every single result of the cache), so that `cache_verify`
checks it; a damaged index (or one saved without that digest) is `FaissIndexDamaged`, which the dense retriever
rebuilds, as the BM25 index is rebuilt.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import faiss
import numpy as np

from confrag.infra.atomic import atomic_write_text, honour_umask, make_temp_dir, naming_full_disk
from confrag.infra.digests import file_digest, folder_problem, write_folder_digest
from confrag.retrieval.ranking import Hits, check_top_n

EXACT_MAX_PASSAGES = 100_000
FLAT_MAX_PASSAGES = 1_000_000
DENSE_INDEX_KINDS = ("auto", "exact", "flat", "ivf")
IVF_NPROBE = 64
_TRAIN_PER_LIST = 40  # training vectors per IVF list (FAISS warns below 39)
_INDEX_FILE = "index.faiss"
_META_FILE = "meta.json"
_SCHEMA = "confrag.retrieval.faiss.v1"


class FaissIndexMismatch(ValueError):
    """A saved FAISS index was built for other passages or another encoder than the ones asked for."""


class FaissIndexDamaged(ValueError):
    """A saved FAISS index whose files are not whole (or that has no digest to show it): rebuild it."""


INDEX_FILES = (_INDEX_FILE, _META_FILE)  # what `save` writes beside the folder digest


def choose_index_kind(count: int, requested: str = "auto") -> str:
    """`exact` (numpy), `flat` or `ivf` (FAISS) for a corpus of `count` passages; `auto` decides by size."""
    if requested not in DENSE_INDEX_KINDS:
        raise ValueError(f"dense_index={requested!r} is not one of {DENSE_INDEX_KINDS}")
    if requested != "auto":
        return requested
    if count <= EXACT_MAX_PASSAGES:
        return "exact"
    return "flat" if count <= FLAT_MAX_PASSAGES else "ivf"


def ivf_lists(count: int) -> int:
    """IVF lists for `count` vectors: about 4 sqrt(n) (FAISS's guideline), at least 1, and few enough that
    every list gets _TRAIN_PER_LIST training vectors."""
    return max(1, min(int(4 * math.sqrt(count)), count // _TRAIN_PER_LIST))


@dataclass(frozen=True)
class FaissKey:
    """What an index answers for: the passages (corpus fingerprint) and the encoder (its identity)."""

    corpus: str
    encoder: str


def _rows(shards: Sequence[np.ndarray], indices: np.ndarray) -> np.ndarray:
    """The rows at sorted global `indices` of the concatenation of `shards`, without concatenating them."""
    bounds = np.cumsum([0, *(len(s) for s in shards)])
    parts = []
    for i, shard in enumerate(shards):
        mine = indices[(indices >= bounds[i]) & (indices < bounds[i + 1])] - bounds[i]
        if len(mine):
            parts.append(np.asarray(shard[mine], dtype=np.float32))
    return np.concatenate(parts, axis=0)


class FaissIndex:
    def __init__(self, index: faiss.Index, key: FaissKey, kind: str) -> None:
        self.index, self.key, self.kind = index, key, kind

    @property
    def count(self) -> int:
        return int(self.index.ntotal)

    @classmethod
    def build(cls, shards: Sequence[np.ndarray], key: FaissKey, kind: str, seed: int = 0) -> FaissIndex:
        """An index over the unit vectors of `shards` (in order: row i of their concatenation is passage i),
        added shard by shard so the vectors are never all copied at once beside the index."""
        if kind not in ("flat", "ivf"):
            raise ValueError(f"a FAISS index is flat or ivf; got {kind!r}")
        count = sum(len(s) for s in shards)
        if count == 0:
            raise ValueError("cannot build a FAISS index over no vectors")
        dim = int(shards[0].shape[1])
        if kind == "flat":
            index = faiss.IndexFlatIP(dim)
        else:
            nlist = ivf_lists(count)
            index = faiss.index_factory(dim, f"IVF{nlist},SQ8", faiss.METRIC_INNER_PRODUCT)
            rng = np.random.default_rng(seed)
            sample = np.sort(rng.choice(count, size=min(count, nlist * _TRAIN_PER_LIST), replace=False))
            index.train(_rows(shards, sample))
            faiss.extract_index_ivf(index).nprobe = min(IVF_NPROBE, nlist)
        for shard in shards:
            index.add(np.ascontiguousarray(shard, dtype=np.float32))
        return cls(index, key, kind)

    def save(self, directory: str | Path) -> Path:
        """Write index.faiss and meta.json (key, kind, size, the index file's digest) to `directory`, whole or
        not at all: a temporary folder renamed into place."""
        directory = Path(directory)
        directory.parent.mkdir(parents=True, exist_ok=True)
        tmp = make_temp_dir(directory.parent, ".tmp-")
        with naming_full_disk(directory.parent):
            try:
                faiss.write_index(self.index, str(tmp / _INDEX_FILE))
                digest, size = file_digest(tmp / _INDEX_FILE)
                meta = {"schema": _SCHEMA, **asdict(self.key), "kind": self.kind, "count": self.count}
                meta["file"] = {"digest": digest, "bytes": size}
                atomic_write_text(tmp / _META_FILE, json.dumps(meta, indent=1, sort_keys=True))
                write_folder_digest(tmp)
                honour_umask(tmp)
                tmp.rename(directory)
            except OSError:
                if not directory.is_dir():  # else another process saved the same index first
                    raise
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        return directory

    @classmethod
    def load(cls, directory: str | Path, key: FaissKey) -> FaissIndex:
        """The index saved in `directory`, refused (FaissIndexMismatch) unless it was built for `key`'s corpus
        and encoder, and (FaissIndexDamaged) unless its files match their digests."""
        directory = Path(directory)
        meta_path = directory / _META_FILE
        try:
            meta = json.loads(meta_path.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise FaissIndexDamaged(f"{meta_path}: not a readable FAISS index record ({err})") from err
        if meta.get("schema") != _SCHEMA:
            raise FaissIndexDamaged(f"{meta_path}: schema {meta.get('schema')!r}, expected {_SCHEMA!r}")
        saved = FaissKey(corpus=meta.get("corpus"), encoder=meta.get("encoder"))
        if saved != key:
            raise FaissIndexMismatch(
                f"{directory}: this FAISS index was built for corpus {saved.corpus} with encoder {saved.encoder}, "
                f"not for corpus {key.corpus} with encoder {key.encoder}; point retrieval.dense_index_path at "
                f"the index of this corpus and encoder, or at a new folder to build one (or delete {directory})"
            )
        problem = folder_problem(directory)
        if problem:
            raise FaissIndexDamaged(f"{directory}: {problem}")
        index_path = directory / _INDEX_FILE
        if not index_path.is_file() or list(file_digest(index_path)) != [meta["file"]["digest"], meta["file"]["bytes"]]:
            raise FaissIndexDamaged(f"{index_path}: missing, or its content differs from the digest in {_META_FILE}")
        try:
            index = faiss.read_index(str(index_path))
        except RuntimeError as err:  # FAISS's own reader on bytes it cannot parse
            raise FaissIndexDamaged(f"{index_path}: not a readable FAISS index ({err})") from err
        if index.ntotal != meta.get("count"):
            raise FaissIndexDamaged(
                f"{index_path}: holds {index.ntotal} vectors, {_META_FILE} says {meta.get('count')}"
            )
        return cls(index, key, meta["kind"])

    def search(self, query_vectors: np.ndarray, top_n: int) -> list[Hits]:
        """Per query, (passage index, inner product) of the `top_n` best passages, best first (capped at the
        index size; an IVF index may return fewer when its probed lists hold fewer)."""
        check_top_n(top_n)
        scores, ids = self.index.search(np.ascontiguousarray(query_vectors, dtype=np.float32), min(top_n, self.count))
        return [
            [(int(i), float(s)) for i, s in zip(row_ids, row_scores) if i >= 0]
            for row_ids, row_scores in zip(ids, scores)
        ]
