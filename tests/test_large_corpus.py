"""A corpus of real size: BM25 built from a stream and loaded memory-mapped, FAISS for dense search (flat or
IVF by size), and a FAISS index refused for another corpus or encoder."""

from __future__ import annotations

import json
from pathlib import Path

import bm25s
import numpy as np
import pytest

from confrag.retrieval import Corpus, CorpusPassage, DenseRetriever
from confrag.retrieval.bm25 import BM25_PARAMS, STOPWORDS, build_bm25, load_bm25, save_bm25
from confrag.retrieval.corpus import iter_passages, passages_fingerprint
from confrag.retrieval.faiss_index import (
    EXACT_MAX_PASSAGES,
    FLAT_MAX_PASSAGES,
    FaissIndex,
    FaissIndexDamaged,
    FaissIndexMismatch,
    FaissKey,
    choose_index_kind,
    ivf_lists,
)

TEXTS = [
    "Plants convert sunlight, water and carbon dioxide into glucose and oxygen in their leaves.",
    "The wrought iron lattice tower in Paris was designed by the company of Gustave Eiffel.",
    "Earth's highest mountain above sea level lies in the Mahalangur Himal range of the Himalayas.",
    "A high-level general-purpose programming language whose design emphasizes code readability.",
    "The world's largest coral reef system is located off the coast of Queensland, Australia.",
]
QUERIES = ["highest mountain Himalayas", "glucose sunlight leaves", "coral reef Australia", "unknownword"]


def unit_vectors(count: int, dim: int = 16, seed: int = 0) -> np.ndarray:
    vectors = np.random.default_rng(seed).standard_normal((count, dim)).astype(np.float32)
    return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)


# ---------------------------------------------------------------- BM25


def test_bm25_from_a_stream_scores_as_bm25s_does_from_a_list() -> None:
    streamed = build_bm25(text for text in TEXTS)  # a generator: read once, never held
    reference = bm25s.BM25(**BM25_PARAMS)
    reference.index(bm25s.tokenize(TEXTS, stopwords=STOPWORDS, show_progress=False), show_progress=False)
    for query in QUERIES[:3]:
        tokens = bm25s.tokenize([query], stopwords=STOPWORDS, return_ids=False, show_progress=False)[0]
        np.testing.assert_allclose(
            streamed.get_scores_from_ids(streamed.get_tokens_ids(tokens)),
            reference.get_scores_from_ids(reference.get_tokens_ids(tokens)),
            rtol=1e-6,
        )


def test_bm25_index_saved_with_digests_loads_memory_mapped_and_refuses_a_changed_file(tmp_path: Path) -> None:
    model = build_bm25(iter(TEXTS))
    index_dir = save_bm25(model, tmp_path / "bm25")
    assert json.loads((index_dir / "confrag.digest.json").read_text())["files"]
    loaded = load_bm25(index_dir)
    assert isinstance(loaded.scores["data"], np.memmap)
    tokens = bm25s.tokenize(["coral reef"], stopwords=STOPWORDS, return_ids=False, show_progress=False)[0]
    np.testing.assert_array_equal(
        loaded.get_scores_from_ids(loaded.get_tokens_ids(tokens)),
        model.get_scores_from_ids(model.get_tokens_ids(tokens)),
    )
    data = index_dir / "data.csc.index.npy"
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=r"data\.csc\.index\.npy: checksum mismatch"):
        load_bm25(index_dir)


def test_bm25_indexes_a_streamed_corpus_file(tmp_path: Path) -> None:
    path = tmp_path / "wiki.jsonl"
    path.write_text("".join(json.dumps({"id": str(i), "contents": f"T{i}\n{t}"}) + "\n" for i, t in enumerate(TEXTS)))
    from confrag.retrieval.corpus import document_text

    model = build_bm25(document_text(p) for p in iter_passages(path))
    assert model.scores["num_docs"] == len(TEXTS)


# ---------------------------------------------------------------- FAISS


def test_index_kind_follows_corpus_size() -> None:
    assert choose_index_kind(EXACT_MAX_PASSAGES) == "exact"
    assert choose_index_kind(EXACT_MAX_PASSAGES + 1) == "flat"
    assert choose_index_kind(FLAT_MAX_PASSAGES) == "flat"
    assert choose_index_kind(FLAT_MAX_PASSAGES + 1) == "ivf"
    assert choose_index_kind(10, "ivf") == "ivf"
    assert ivf_lists(21_000_000) == int(4 * np.sqrt(21_000_000))
    with pytest.raises(ValueError, match=r"^dense_index='hnsw' is not one of"):
        choose_index_kind(10, "hnsw")


def test_flat_index_equals_exact_search_and_ivf_finds_the_same_best(tmp_path: Path) -> None:
    vectors = unit_vectors(5000)
    shards = [vectors[:1700], vectors[1700:4000], vectors[4000:]]  # added shard by shard
    queries = vectors[[3, 1999, 4321]] + 0.01 * unit_vectors(3, seed=1)
    exact = np.argsort(-(queries @ vectors.T), axis=1)[:, :5]
    key = FaissKey(corpus="c1", encoder="e1")
    flat = FaissIndex.build(shards, key, "flat")
    assert [[i for i, _ in hits] for hits in flat.search(queries, 5)] == exact.tolist()
    ivf = FaissIndex.build(shards, key, "ivf")
    assert [hits[0][0] for hits in ivf.search(queries, 5)] == [3, 1999, 4321]
    loaded = FaissIndex.load(ivf.save(tmp_path / "ivf"), key)
    assert loaded.kind == "ivf" and loaded.search(queries, 5) == ivf.search(queries, 5)


def test_a_faiss_index_is_refused_for_another_corpus_or_encoder(tmp_path: Path) -> None:
    saved = FaissIndex.build([unit_vectors(50)], FaissKey(corpus="c1", encoder="e1"), "flat").save(tmp_path / "i")
    for other in (FaissKey(corpus="c2", encoder="e1"), FaissKey(corpus="c1", encoder="e2")):
        with pytest.raises(FaissIndexMismatch, match=r"built for corpus c1 with encoder e1, not for corpus"):
            FaissIndex.load(saved, other)
    index_file = saved / "index.faiss"
    index_file.write_bytes(index_file.read_bytes()[:-4] + b"\0\0\0\0")
    with pytest.raises(FaissIndexDamaged, match=r"index\.faiss: checksum mismatch"):
        FaissIndex.load(saved, FaissKey(corpus="c1", encoder="e1"))


def test_dense_retriever_through_faiss_matches_exact_search_and_refuses_another_corpus(tmp_path: Path) -> None:
    passages = [CorpusPassage(pid=f"d{i}#0", title="", text=t, source_id=f"d{i}") for i, t in enumerate(TEXTS)]
    corpus = Corpus(passages, {}, passages_fingerprint(passages))
    exact = DenseRetriever(corpus, progress=False, index="exact")
    flat = DenseRetriever(corpus, progress=False, index="flat", index_path=tmp_path / "faiss")
    assert flat.faiss is not None and (tmp_path / "faiss" / "meta.json").is_file()
    for a, b in zip(exact.search(QUERIES, 3), flat.search(QUERIES, 3)):
        assert [i for i, _ in a] == [i for i, _ in b]
        np.testing.assert_allclose([s for _, s in a], [s for _, s in b], atol=1e-5)
    np.testing.assert_allclose(flat.passage_vectors([4, 0]), exact.passage_embeddings[[4, 0]], atol=1e-6)
    fewer = Corpus(passages[:4], {}, passages_fingerprint(passages[:4]))
    with pytest.raises(FaissIndexMismatch, match="this FAISS index was built for corpus"):
        DenseRetriever(fewer, progress=False, index="flat", index_path=tmp_path / "faiss")


def test_a_damaged_faiss_index_is_rebuilt_and_seen_by_cache_verify(tmp_path: Path, caplog) -> None:
    """A damaged FAISS index was refused but not rebuilt, the message said nothing of what to delete, and
    `cache_verify` reported the cache clean (it read confrag.digest.json; the index kept only meta.json)."""
    from confrag.infra.cache_verify import verify_cache

    passages = [CorpusPassage(pid=f"d{i}#0", title="", text=t, source_id=f"d{i}") for i, t in enumerate(TEXTS)]
    corpus = Corpus(passages, {}, passages_fingerprint(passages))
    cache = tmp_path / "cache"
    first = DenseRetriever(corpus, cache_dir=cache, progress=False, index="flat")
    (folder,) = (cache / "retrieval" / "faiss").iterdir()
    assert [(c.single, c.problem, c.legacy) for c in verify_cache(cache) if c.directory == folder] == [(True, "", [])]
    index_file = folder / "index.faiss"
    index_file.write_bytes(index_file.read_bytes()[:-4] + b"\0\0\0\0")
    damaged = [c for c in verify_cache(cache) if c.directory == folder]
    assert damaged and "index.faiss" in damaged[0].problem
    with caplog.at_level("WARNING"):
        again = DenseRetriever(corpus, cache_dir=cache, progress=False, index="flat")
    assert f"FAISS index {folder}:" in caplog.text and "rebuilding it" in caplog.text
    assert again.search(QUERIES, 3) == first.search(QUERIES, 3)
    assert all(not c.is_damaged for c in verify_cache(cache))
    # A folder holding other files too is not deleted: refused, saying what to delete.
    (folder / "notes.txt").write_text("mine")
    (folder / "meta.json").write_text("{")
    with pytest.raises(FaissIndexDamaged, match=r"also holds \['notes.txt'\].*delete the folder"):
        DenseRetriever(corpus, cache_dir=cache, progress=False, index="flat")
