"""A FAISS index built elsewhere (FlashRAG's e5 / bge index of wiki-18, or your own) used as the dense retriever,
its queries encoded by the sentence-transformers model that built it.

Such an index holds vectors only: vector i is passage i of the corpus, in the corpus file's order, with each
document one passage (`retrieval.words_per_passage: null`), as FlashRAG builds it. Nothing here re-encodes the
corpus. What can be checked without the vectors' meaning is checked before any stage: the index holds as
many vectors as the corpus has passages, and as many dimensions as the encoder gives; when the retriever is built
(before the LLM loads), a sample of passages re-encoded by the encoder must find their own vectors first. The
encoder is the model folder's own pipeline (pooling, normalization, dense layers), run by sentence-transformers; a query
prompt it declares (`config_sentence_transformers.json`, `prompts.query`, e.g. e5's "query: ") is used.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import faiss
import numpy as np

from confrag.retrieval.corpus import Corpus, document_text
from confrag.retrieval.ranking import Hits, check_top_n


class PrebuiltIndexError(ValueError):
    """A prebuilt FAISS index that does not fit the corpus or its encoder."""


def read_index_header(index_path: str | Path) -> faiss.Index:
    """The index, memory-mapped where FAISS can (a large flat index is not read whole to check its size)."""
    path = Path(index_path)
    if not path.is_file():
        raise PrebuiltIndexError(
            f"retrieval.dense_index_path={str(index_path)!r}: no such file; with retrieval.dense_encoder it names a "
            "FAISS index file (e.g. FlashRAG's e5_Flat.index)"
        )
    try:
        return faiss.read_index(str(path), faiss.IO_FLAG_MMAP | faiss.IO_FLAG_READ_ONLY)
    except RuntimeError:
        try:
            return faiss.read_index(str(path))
        except RuntimeError as err:
            raise PrebuiltIndexError(f"{path}: not a readable FAISS index ({str(err).splitlines()[0]})") from None


def load_encoder(encoder_dir: str | Path, device: str | None = None):
    """The sentence-transformers model in `encoder_dir` (refused, naming the setting, when it is not one)."""
    from sentence_transformers import SentenceTransformer

    path = Path(encoder_dir).expanduser()
    if not (path / "modules.json").is_file() and not (path / "config.json").is_file():
        raise PrebuiltIndexError(
            f"retrieval.dense_encoder={str(encoder_dir)!r}: not a sentence-transformers model folder (no modules.json "
            "or config.json)"
        )
    return SentenceTransformer(str(path), device=device or "cpu")


def encoder_dimension(model) -> int:
    """The model's embedding size (sentence-transformers renamed the method in 5.x; both are read)."""
    method = getattr(model, "get_embedding_dimension", None) or model.get_sentence_embedding_dimension
    return int(method())


def check_prebuilt_index(index: faiss.Index, index_path: str | Path, passages: int, dimension: int) -> None:
    """The index's size against the corpus's and its dimension against the encoder's."""
    if int(index.ntotal) != passages:
        raise PrebuiltIndexError(
            f"{index_path}: the FAISS index holds {index.ntotal:,} vectors, the corpus {passages:,} passages; vector i "
            "must be passage i of the corpus file (its documents as given: retrieval.words_per_passage=null)"
        )
    if int(index.d) != dimension:
        raise PrebuiltIndexError(
            f"{index_path}: the FAISS index has {index.d} dimensions, retrieval.dense_encoder gives {dimension}: "
            "name the model that built the index"
        )


ENCODER_SAMPLE = 16  # passages re-encoded to check a prebuilt index against its encoder (evenly spaced)
ENCODER_AGREEMENT = 0.5  # the share of them whose own vector must come first (ties with a repeated text count)


def passage_prompt(model) -> str | None:
    """The prompt the model declares for passages (e5's "passage: "), as its index was built with, if any."""
    prompts = getattr(model, "prompts", None) or {}
    return next((name for name in ("passage", "document") if name in prompts), None)


def check_index_encoder(
    index: faiss.Index, index_path: str | Path, model, corpus: Corpus, sample: int = ENCODER_SAMPLE
) -> None:
    """The index against its encoder on a sample of passages: each sampled passage, encoded now by the named
    model, must find its own vector first (or tied first) in the index. An index of the right size and dimension
    built by another encoder, or from another corpus or order, passed the size checks and the run later blamed
    the corpus; fewer than ENCODER_AGREEMENT of the sample finding themselves is refused here."""
    total = int(index.ntotal)
    ids = sorted({int(i) for i in np.linspace(0, total - 1, min(sample, total)).round()})
    texts = [document_text(corpus.passages[i]) for i in ids]
    vectors = model.encode(texts, prompt_name=passage_prompt(model), convert_to_numpy=True, show_progress_bar=False)
    scores, found = index.search(np.ascontiguousarray(vectors, dtype=np.float32), min(total, 8))
    lost = []
    for i, row_ids, row_scores in zip(ids, found, scores):
        first = float(row_scores[0])
        own = [float(s) for j, s in zip(row_ids, row_scores) if j == i]
        if not own or abs(own[0] - first) > 1e-3 * max(1.0, abs(first)):
            lost.append((i, int(row_ids[0])))
    if len(ids) - len(lost) < ENCODER_AGREEMENT * len(ids):
        shown = ", ".join(f"passage {i} finds {j}" for i, j in lost[:3])
        raise PrebuiltIndexError(
            f"{index_path}: of {len(ids)} passages of the corpus encoded by retrieval.dense_encoder, {len(lost)} do "
            f"not find their own vector first in the index ({shown}): the index was built by another encoder, or "
            "from another corpus or order. Name the model that built it (retrieval.dense_encoder) and the corpus "
            "file it was built from, in its order"
        )


class PrebuiltDenseRetriever:
    """Search a prebuilt FAISS index over `corpus` with queries encoded by `encoder_dir`'s model."""

    def __init__(
        self, corpus: Corpus, index_path: str | Path, encoder_dir: str | Path, device: str | None = None
    ) -> None:
        self.corpus = corpus
        self.index_path = Path(index_path)
        self.model = load_encoder(encoder_dir, device)
        self.index = read_index_header(index_path)
        check_prebuilt_index(self.index, index_path, len(corpus), encoder_dimension(self.model))
        check_index_encoder(self.index, index_path, self.model, corpus)
        self.prompt_name = "query" if "query" in (getattr(self.model, "prompts", None) or {}) else None
        # FAISS's L2 indexes return distances (smaller is closer): negated, a higher score is better everywhere.
        self._sign = -1.0 if self.index.metric_type == faiss.METRIC_L2 else 1.0

    @property
    def tokenizer(self):
        return self.model.tokenizer

    @property
    def max_length(self) -> int:
        return int(self.model.max_seq_length)

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        """Query embeddings, as the model's pipeline makes them (with its query prompt, if it declares one)."""
        return np.asarray(
            self.model.encode(
                list(texts), prompt_name=self.prompt_name, convert_to_numpy=True, show_progress_bar=False
            ),
            dtype=np.float32,
        )

    def passage_vectors(self, indices) -> np.ndarray:
        """The stored vectors of the passages at `indices` (Table 1's bi-encoder row scores with them)."""
        try:
            return np.stack([self.index.reconstruct(int(i)) for i in indices]).astype(np.float32, copy=False)
        except RuntimeError as err:
            raise PrebuiltIndexError(
                f"{self.index_path}: this index cannot give back its vectors ({str(err).splitlines()[0]}); set "
                "retrieval.bi_encoder=false to leave out Table 1's bi-encoder row"
            ) from None

    def search(self, queries: list[str], top_n: int) -> list[Hits]:
        """Per query, (passage index, score) of the `top_n` best passages, best first."""
        check_top_n(top_n)
        scores, ids = self.index.search(self.encode(queries), min(top_n, int(self.index.ntotal)))
        return [
            [(int(i), self._sign * float(s)) for i, s in zip(row_ids, row_scores) if i >= 0]
            for row_ids, row_scores in zip(ids, scores)
        ]
