"""Sparse retrieval with bm25s (the maintained, fast BM25; `rank_bm25` is slow and has scoring bugs)."""

from __future__ import annotations

import contextlib
import logging
import shutil
import time
from pathlib import Path

import bm25s
import numpy as np

from confrag.artifacts import (
    STALE_TMP_SECONDS,
    exclusive,
    fingerprint,
    folder_problem,
    honour_umask,
    make_temp_dir,
    write_folder_digest,
)
from confrag.retrieval.corpus import Corpus, document_text
from confrag.retrieval.ranking import Hits, check_top_n, top_n_hits

log = logging.getLogger(__name__)

STOPWORDS = "en"
# The scoring settings are bm25s' defaults (Lucene variant); they are part of the cache key.
BM25_PARAMS = {"method": "lucene", "k1": 1.5, "b": 0.75}
_INDEX_SCHEMA = "confrag.retrieval.bm25.v1"


def _tokenize(texts: list[str]) -> list[list[str]]:
    # Lower-cased word tokens without English stopwords; no stemmer (PyStemmer is not a dependency).
    return bm25s.tokenize(texts, stopwords=STOPWORDS, return_ids=False, show_progress=False)


class BM25Retriever:
    """BM25 over title + text of every passage of `corpus`.

    With `cache_dir`, the index is stored under `<cache_dir>/retrieval/bm25/<key>/`, where the key
    hashes the corpus fingerprint, tokenizer and BM25 settings; it is written to a temporary directory
    and renamed into place, so a killed build never leaves a partial index behind. Without
    `cache_dir` the index lives in memory only."""

    def __init__(self, corpus: Corpus, cache_dir: str | Path | None = None, progress: bool = False) -> None:
        if len(corpus) == 0:
            raise ValueError("cannot build a BM25 index over an empty corpus")
        self.corpus = corpus
        self.progress = progress
        self.key = fingerprint(
            {
                "schema": _INDEX_SCHEMA,
                "corpus": corpus.fingerprint,
                "stopwords": STOPWORDS,
                "params": BM25_PARAMS,
                "bm25s": bm25s.__version__,
            }
        )
        self.index_dir = Path(cache_dir) / "retrieval" / "bm25" / self.key if cache_dir is not None else None
        if self.index_dir is None:
            self.model = self._build()
            return
        self.model = self._load()  # without the lock: a complete cache may be read-only
        if self.model is None:
            # One process builds an index that several want at once; the others wait and load it.
            with exclusive(self.index_dir.parent / f".{self.key}.lock", f"the BM25 index {self.key}"):
                self.model = self._load()
                if self.model is None:
                    self.model = self._build()
                    self._save(self.model)

    def _build(self) -> bm25s.BM25:
        tokens = bm25s.tokenize(
            [document_text(p) for p in self.corpus.passages], stopwords=STOPWORDS, show_progress=self.progress
        )
        model = bm25s.BM25(**BM25_PARAMS)
        model.index(tokens, show_progress=self.progress)
        return model

    def _load(self) -> bm25s.BM25 | None:
        assert self.index_dir is not None
        if not self.index_dir.is_dir():
            return None
        problem = folder_problem(self.index_dir)
        if problem:
            # Bit rot in the score matrix loads without a complaint and ranks passages by garbage.
            log.warning("BM25 index %s: %s; rebuilding it.", self.index_dir, problem)
            shutil.rmtree(self.index_dir, ignore_errors=True)
            return None
        try:
            model = bm25s.BM25.load(self.index_dir, show_progress=False)
            num_docs = model.scores["num_docs"]
            if num_docs != len(self.corpus):
                raise ValueError(f"holds {num_docs} passages, the corpus has {len(self.corpus)}")
            return model
        except (OSError, ValueError, KeyError) as err:
            # A directory only appears by rename, so this is outside damage; rebuilding is always safe.
            log.warning("BM25 index %s is unreadable (%s); rebuilding it.", self.index_dir, err)
            shutil.rmtree(self.index_dir, ignore_errors=True)
            return None

    def _save(self, model: bm25s.BM25) -> None:
        assert self.index_dir is not None
        self.index_dir.parent.mkdir(parents=True, exist_ok=True)
        self._remove_stale_tmp()
        tmp = make_temp_dir(self.index_dir.parent, ".tmp-")
        try:
            model.save(tmp, show_progress=False)
            write_folder_digest(tmp)
            honour_umask(tmp)
            tmp.rename(self.index_dir)
        except OSError:
            # Another process renamed the same index into place first: its content is identical.
            if not self.index_dir.is_dir():
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _remove_stale_tmp(self) -> None:
        # Left by a killed build. Only old ones go, so a build running now in another process keeps its own.
        assert self.index_dir is not None
        for stale in self.index_dir.parent.glob(".tmp-*"):
            with contextlib.suppress(FileNotFoundError):
                if time.time() - stale.stat().st_mtime > STALE_TMP_SECONDS:
                    shutil.rmtree(stale, ignore_errors=True)

    def _scores(self, query_tokens: list[str]) -> np.ndarray:
        ids = self.model.get_tokens_ids(query_tokens)
        if not ids:
            # bm25s fails on an empty id list; no known word means no evidence for any passage.
            return np.zeros(len(self.corpus), dtype=np.float32)
        return self.model.get_scores_from_ids(ids)

    def scores(self, query: str) -> np.ndarray:
        """BM25 score of every passage for `query`; all zero when no query word is in the index."""
        return self._scores(_tokenize([query])[0])

    def search(self, queries: list[str], top_n: int) -> list[Hits]:
        """Per query, (passage index, score) of the `top_n` best passages, best first; equal scores in
        passage order. `top_n` larger than the corpus is capped at the corpus size, so a query
        whose words are all unknown still gets `min(top_n, len(corpus))` passages, all scored 0."""
        check_top_n(top_n)
        if not queries:
            return []
        return [top_n_hits(self._scores(tokens), top_n) for tokens in _tokenize(list(queries))]
