"""Everything the project writes gets the permissions `open()` / `mkdir` would give under the umask
(a cache or run folder on a shared disk is readable by the group when the umask allows it), including
the folders built beside their target and renamed into place."""

from __future__ import annotations

import os
import stat

import numpy as np
import pytest

from helpers.modules import probe_module, reranker_module

UMASK = 0o027  # group may read, others nothing: neither the default umask nor what mkstemp/mkdtemp give


@pytest.fixture()
def umask():
    old = os.umask(UMASK)
    yield UMASK
    os.umask(old)


def modes(root) -> dict[str, int]:
    """Permission bits of everything under `root`, by relative path."""
    return {str(p.relative_to(root)): stat.S_IMODE(p.stat().st_mode) for p in sorted(root.rglob("*"))}


def expected(root) -> dict[str, int]:
    return {str(p.relative_to(root)): (0o777 if p.is_dir() else 0o666) & ~UMASK for p in sorted(root.rglob("*"))}


def test_preference_rows_and_their_arrow_folders(tmp_path, umask):
    from confrag.reranker.preferences import save_rows

    rows = [
        {
            "qid": "q0",
            "query": "x",
            "pos": ["p"],
            "neg": ["n"],
            "pos_scores": [0.1],
            "neg_scores": [-0.1],
            "prompt": "p",
        }
    ]
    save_rows({"train": rows, "test": rows}, tmp_path / "nq_rerank")
    assert (tmp_path / "nq_rerank" / "train_arrow").is_dir()
    assert modes(tmp_path) == expected(tmp_path)


def test_bm25_index(tmp_path, umask):
    from confrag.retrieval import BM25Retriever, CorpusPassage
    from confrag.retrieval.corpus import _make_corpus

    corpus = _make_corpus(
        [CorpusPassage(f"d{i}#0", f"t{i}", f"text number {i} about things", f"d{i}") for i in range(5)], {}
    )
    BM25Retriever(corpus, cache_dir=tmp_path)
    assert any(p.is_dir() for p in (tmp_path / "retrieval" / "bm25").iterdir())
    assert modes(tmp_path) == expected(tmp_path)


def test_saved_probe(tmp_path, umask):
    from confrag.probe.module import load_probe, save_probe

    module = probe_module(input_dim=8, hidden_dims=(4,))
    save_probe(module, tmp_path / "probe", {"layer": 1}, {"metrics": {}})
    assert load_probe(tmp_path / "probe").layer == 1
    assert modes(tmp_path) == expected(tmp_path)


def test_reranker_export(tmp_path, umask):

    module = reranker_module(seed=0)
    module.export(tmp_path / "reranker")
    module.export(tmp_path / "reranker")  # replacing an export keeps the modes too
    assert (tmp_path / "reranker" / "config.json").is_file()
    assert modes(tmp_path) == expected(tmp_path)


def test_activation_cache(tmp_path, umask):
    from confrag.infra.sharded import ShardedArtifact

    artifact = ShardedArtifact(tmp_path, "activations", {"x": 1}, 5, shard_size=2)
    artifact.compute(lambda a, b: np.zeros((1, b - a, 3), dtype=np.float32), progress=False)
    assert modes(tmp_path) == expected(tmp_path)
