"""Sparse retrieval with bm25s (the maintained, fast BM25; `rank_bm25` is slow and has scoring bugs).

The index is built from a stream of texts (`build_bm25`: only token ids are kept, never the texts), saved
with a digest of every file, and loaded memory-mapped (`load_bm25`): a query touches only the postings of
its words, so a corpus of Wikipedia's size is searched without reading its index into memory
(benchmarks/corpus_scale.py, docs/usage.md#a-corpus-of-wikipedias-size).
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import time
from collections.abc import Iterable
from pathlib import Path

import bm25s
import numpy as np
from bm25s.tokenization import Tokenizer
from tqdm.auto import tqdm

from confrag.infra.atomic import written_once
from confrag.infra.digests import fingerprint, folder_problem, write_folder_digest
from confrag.infra.locks import once
from confrag.infra.sharded import STALE_TMP_SECONDS
from confrag.retrieval.corpus import Corpus, document_text
from confrag.retrieval.ranking import Hits, check_top_n, top_n_hits

log = logging.getLogger(__name__)

STOPWORDS = "en"
# The scoring settings are bm25s' defaults (Lucene variant); they are part of the cache key.
BM25_PARAMS = {"method": "lucene", "k1": 1.5, "b": 0.75}
# v2: built from a token-id stream, saved with its folder digest, loaded memory-mapped.
_INDEX_SCHEMA = "confrag.retrieval.bm25.v2"


def _tokenize(texts: list[str]) -> list[list[str]]:
    # Lower-cased word tokens without English stopwords; no stemmer (PyStemmer is not a dependency).
    return bm25s.tokenize(texts, stopwords=STOPWORDS, return_ids=False, show_progress=False)


def build_bm25(texts: Iterable[str], progress: bool = False, total: int | None = None) -> bm25s.BM25:
    """A BM25 index over `texts`, read once and in order: a generator streams a corpus of any size, and only
    each text's token ids are kept (the texts themselves are never held). Tokens are those of `_tokenize`."""
    tokenizer = Tokenizer(lower=True, stopwords=STOPWORDS, stemmer=None)
    stream = tqdm(texts, total=total, desc="BM25 tokens", unit="psg", disable=not progress)
    ids = list(tokenizer.streaming_tokenize(stream))
    if not ids:
        raise ValueError("cannot build a BM25 index over an empty corpus")
    model = bm25s.BM25(**BM25_PARAMS)
    model.index((ids, tokenizer.get_vocab_dict()), show_progress=progress)
    return model


def save_bm25(model: bm25s.BM25, index_dir: str | Path) -> Path:
    """Write the index to `index_dir` whole or not at all (a temporary folder renamed into place), with the
    xxh3 digest and size of each of its files (`confrag.digest.json`, as every folder result of the cache).
    An existing `index_dir` is left as is."""
    index_dir = Path(index_dir)
    with written_once(index_dir) as tmp:
        model.save(tmp, show_progress=False)
        write_folder_digest(tmp)
    return index_dir


def load_bm25(index_dir: str | Path, mmap: bool = True, verified: bool = False) -> bm25s.BM25:
    """The index saved by `save_bm25`, its files checked against their digest first (unless the caller
    just did: `verified`); memory-mapped unless `mmap` is false. Raises ValueError naming what is wrong."""
    index_dir = Path(index_dir)
    problem = "" if verified else folder_problem(index_dir)
    if problem:
        raise ValueError(f"BM25 index {index_dir}: {problem}")
    return bm25s.BM25.load(index_dir, mmap=mmap, show_progress=False)


class BM25Retriever:
    """BM25 over title + text of every passage of `corpus`.

    With `cache_dir`, the index is stored under `<cache_dir>/retrieval/bm25/<key>/`, where the key
    hashes the corpus fingerprint, tokenizer and BM25 settings; it is written to a temporary directory
    and renamed into place, so a killed build never leaves a partial index behind, and loaded
    memory-mapped. Without `cache_dir` the index lives in memory only."""

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
        # Loaded without the lock (a complete cache may be read-only); one process builds an index that several
        # want at once, the others wait and load it.
        self.model = once(
            self.index_dir.parent / f".{self.key}.lock", f"the BM25 index {self.key}", self._load, self._built
        )

    def _built(self) -> bm25s.BM25:
        model = self._build()
        self._save(model)
        return model

    def _build(self) -> bm25s.BM25:
        texts = (document_text(p) for p in self.corpus.passages)
        return build_bm25(texts, progress=self.progress, total=len(self.corpus))

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
            model = load_bm25(self.index_dir, mmap=True, verified=True)
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
        save_bm25(model, self.index_dir)

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
