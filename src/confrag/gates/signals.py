"""Computing the signals gates read that are not the LLM's own drafts or verdicts (`gates.drafts`,
`gates.p_true`): CtrlA's contrastive direction, MiniLM embeddings (SKR, CCSK, BRIDGE's allocator),
internal passages and matching scores (BRIDGE). The gates themselves only see the resulting arrays
(`GateSignals`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
from sklearn.feature_extraction.text import CountVectorizer
from sklearn.preprocessing import normalize

from confrag.data.nq import Passage
from confrag.gates.directions import ConfidenceDirection, direction_from_states
from confrag.llm.generation import generate_greedy
from confrag.llm.hidden_states import HiddenStateEngine, validate_layers
from confrag.llm.loading import LoadedLLM
from confrag.retrieval.bm25 import BM25_PARAMS
from confrag.retrieval.corpus import document_text

# ------------------------------------------------------------------ CtrlA: contrastive direction


def contrastive_direction(
    llm: LoadedLLM,
    layers: Sequence[int],
    confident_prompts: Sequence[str],
    unconfident_prompts: Sequence[str],
    **engine_kwargs,
) -> ConfidenceDirection:
    """CtrlA's confidence direction at `layers` from paired prompts, via the project's hidden-state engine
    (last prompt token, HF indexing)."""
    if len(confident_prompts) != len(unconfident_prompts) or not confident_prompts:
        raise ValueError(
            f"need the same, non-zero number of confident and unconfident prompts; got "
            f"{len(confident_prompts)} and {len(unconfident_prompts)}"
        )
    layers = validate_layers(layers, llm.num_layers)
    engine = HiddenStateEngine(llm.model, llm.tokenizer, **{"progress": False, **engine_kwargs})
    confident = engine.extract(confident_prompts, layers, desc="confident prompts")
    unconfident = engine.extract(unconfident_prompts, layers, desc="unconfident prompts")
    return direction_from_states(confident, unconfident, layers)


# ------------------------------------------------------------------ embeddings


class TextEncoder(Protocol):
    def encode(self, texts: Sequence[str]) -> np.ndarray: ...


def embed_texts(encoder: TextEncoder, texts: Sequence[str]) -> np.ndarray:
    """(n, d) unit vectors. Pass the pipeline's `confrag.retrieval.DenseRetriever` (all-MiniLM-L6-v2),
    or any object with `.encode(texts)`."""
    if not hasattr(encoder, "encode"):
        raise TypeError(
            f"encoder must have an .encode(texts) method (e.g. a DenseRetriever); got {type(encoder).__name__}"
        )
    vectors = np.asarray(encoder.encode(list(texts)), dtype=np.float32)
    if vectors.shape[0] != len(texts) or vectors.ndim != 2:
        raise ValueError(f"encoder returned shape {vectors.shape} for {len(texts)} texts")
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    return vectors / np.where(norms > 0, norms, 1.0)


# ------------------------------------------------------------------ BRIDGE: knowledge and matching

# BRIDGE, appendix A.1.1: the prompt that makes the LLM write out its internal knowledge.
INTERNAL_KNOWLEDGE_TEMPLATE = (
    "Based on the question, create a piece of evidence that answers the question. This piece of evidence "
    "should be informative and well-structured.\n\nQuestion: {question}\n\nEvidence:"
)


def internal_passages(
    llm: LoadedLLM,
    questions: Sequence[str],
    max_new_tokens: int = 128,
    batch_size: int = 16,
    template: str = INTERNAL_KNOWLEDGE_TEMPLATE,
    progress: bool = False,
) -> list[str]:
    """K_int: the LLM's own evidence passage per question (greedy, through the chat template)."""
    if "{question}" not in template:
        raise ValueError(f"the internal-knowledge template must contain {{question}}; got {template!r}")
    prompts = [
        llm.tokenizer.apply_chat_template(
            [{"role": "user", "content": template.format(question=q)}], tokenize=False, add_generation_prompt=True
        )
        for q in questions
    ]
    return generate_greedy(
        llm.model,
        llm.tokenizer,
        prompts,
        max_new_tokens=max_new_tokens,
        batch_size=batch_size,
        desc="internal passages",
        progress=progress,
    )


def external_knowledge(retrieved: Sequence[Sequence[Passage]]) -> tuple[list[str], list[str]]:
    """(K_ext, K_ret) per question from its ranked retrieved passages: the top passage, and the rest
    joined (empty when only one was retrieved)."""
    if any(len(passages) == 0 for passages in retrieved):
        raise ValueError("every question needs at least one retrieved passage for BRIDGE's external knowledge")
    external = [document_text(passages[0]) for passages in retrieved]
    rest = ["\n\n".join(document_text(p) for p in passages[1:]) for passages in retrieved]
    return external, rest


class SparseMatcher:
    """Lexical match in [0, 1]: cosine of BM25-weighted term vectors (Lucene IDF and the k1, b of the
    project's BM25 retriever), standing in for BGE-M3's sparse lexical-weight score. IDF and average
    length come from `reference_texts`; words never seen there carry no weight."""

    def __init__(
        self, reference_texts: Sequence[str], k1: float = BM25_PARAMS["k1"], b: float = BM25_PARAMS["b"]
    ) -> None:
        self.vectorizer = CountVectorizer(lowercase=True, stop_words="english")
        try:
            counts = self.vectorizer.fit_transform(list(reference_texts))
        except ValueError as err:  # an empty vocabulary
            raise ValueError(f"the sparse matcher's reference texts hold no indexable words ({err})") from err
        documents = counts.shape[0]
        frequency = np.asarray((counts > 0).sum(axis=0)).ravel()
        self.idf = np.log1p((documents - frequency + 0.5) / (frequency + 0.5))
        self.mean_length = max(float(counts.sum(axis=1).mean()), 1e-9)
        self.k1, self.b = k1, b

    def vectors(self, texts: Sequence[str]):
        tf = self.vectorizer.transform(list(texts)).astype(np.float64).tocsr()
        lengths = np.asarray(tf.sum(axis=1)).ravel()
        norm = self.k1 * (1 - self.b + self.b * lengths / self.mean_length)
        rows = np.repeat(np.arange(tf.shape[0]), np.diff(tf.indptr))
        tf.data = tf.data * (self.k1 + 1) / (tf.data + norm[rows]) * self.idf[tf.indices]
        return normalize(tf)

    def similarity(self, a: Sequence[str], b: Sequence[str]) -> np.ndarray:
        return np.asarray(self.vectors(a).multiply(self.vectors(b)).sum(axis=1)).ravel()


def bridge_matching_scores(
    encoder: TextEncoder,
    internal: Sequence[str],
    generated: Sequence[str],
    external: Sequence[str],
    retrieved: Sequence[str],
    sparse: SparseMatcher | None = None,
) -> np.ndarray:
    """(n, 4, 2) matching scores S1..S4 x (dense cosine, sparse BM25 match) for BRIDGE.

    BRIDGE's four sources, and what plays them here without its sub-query generator/retriever:
    K_int = the LLM's evidence passage (`internal_passages`); K_gen = a second, independent piece of
    internal knowledge, here the closed-book answer; K_ext = the top retrieved passage; K_ret = the other
    retrieved passages (`external_knowledge`). So S2 measures the self-consistency of internal knowledge
    and S3 the agreement among retrieved passages, as in the paper. `sparse` defaults to a matcher whose
    IDF is fitted on all texts given."""
    n = len(internal)
    if not len(generated) == len(external) == len(retrieved) == n:
        raise ValueError(
            f"internal ({n}), generated ({len(generated)}), external ({len(external)}) and retrieved "
            f"({len(retrieved)}) knowledge must be aligned per question"
        )
    sources = [list(internal), list(generated), list(external), list(retrieved)]
    if sparse is None:
        sparse = SparseMatcher([text for source in sources for text in source])
    embedded = embed_texts(encoder, [text for source in sources for text in source]).reshape(4, n, -1)
    pairs = [(0, 2), (0, 1), (2, 3), (1, 3)]  # S1 int-ext, S2 int-gen, S3 ext-ret, S4 gen-ret
    scores = np.zeros((n, 4, 2))
    for column, (i, j) in enumerate(pairs):
        scores[:, column, 0] = np.sum(embedded[i] * embedded[j], axis=1)
        scores[:, column, 1] = sparse.similarity(sources[i], sources[j])
    return np.clip(scores, 0.0, 1.0)
