"""Tokenization of (query, passage) pairs for cross-encoders, FlagEmbedding-style.

The query is cut to `query_max_len` tokens first (as text), then the pair is tokenized with only the
passage truncated to the rest of `query_max_len + passage_max_len`. Qwen3-Reranker's yes/no prompt
(`confrag.reranker.qwen3`) builds on the same budget helpers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["EncodedPairs", "cut_queries", "encode_pairs", "pair_max_length"]


@dataclass
class EncodedPairs:
    features: dict[str, torch.Tensor]  # input_ids, attention_mask (and token_type_ids where the model has them)
    truncated_pairs: int  # pairs whose passage lost tokens
    truncated_queries: int  # pairs whose query was cut to query_max_len


def pair_max_length(tokenizer, query_max_len: int, passage_max_len: int) -> int:
    """Budget of a (query, passage) pair: query_max_len + passage_max_len, capped by the tokenizer's
    model_max_length (MiniLM has 512 positions, so 128 + 512 would index past them)."""
    return int(min(query_max_len + passage_max_len, tokenizer.model_max_length))


def cut_queries(tokenizer, queries: list[str], query_max_len: int) -> tuple[dict[str, str], dict[str, int]]:
    """Each distinct query cut to its first query_max_len tokens (as text), and its token count.

    `truncation="only_second"` never shortens the query, so a long query is cut here first, at the
    character offset where its query_max_len-th token ends."""
    encoded = tokenizer(
        queries,
        add_special_tokens=False,
        truncation=True,
        max_length=query_max_len,
        return_offsets_mapping=True,
        return_overflowing_tokens=False,
    )
    full = tokenizer(queries, add_special_tokens=False, verbose=False)["input_ids"]
    cut, lengths = {}, {}
    for q, ids, offsets, whole in zip(queries, encoded["input_ids"], encoded["offset_mapping"], full):
        cut[q] = q[: offsets[-1][1]] if len(whole) > len(ids) and offsets else q
        lengths[q] = len(ids)
    return cut, lengths


def encode_pairs(
    tokenizer, queries: Sequence[str], passages: Sequence[str], query_max_len: int = 128, passage_max_len: int = 512
) -> EncodedPairs:
    """Tokenize (query, passage) pairs FlagEmbedding-style: the query cut to query_max_len tokens, the
    pair to query_max_len + passage_max_len with only the passage truncated; padded to the longest."""
    if len(queries) != len(passages):
        raise ValueError(f"{len(queries)} queries but {len(passages)} passages")
    max_length = pair_max_length(tokenizer, query_max_len, passage_max_len)
    unique_q = list(dict.fromkeys(queries))
    cut, q_len = cut_queries(tokenizer, unique_q, query_max_len)
    unique_p = list(dict.fromkeys(passages))
    p_len = dict(zip(unique_p, map(len, tokenizer(unique_p, add_special_tokens=False, verbose=False)["input_ids"])))
    special = tokenizer.num_special_tokens_to_add(pair=True)
    truncated = sum(q_len[q] + p_len[p] + special > max_length for q, p in zip(queries, passages))
    features = tokenizer(
        [cut[q] for q in queries],
        list(passages),
        truncation="only_second",
        max_length=max_length,
        padding=True,
        return_tensors="pt",
    )
    return EncodedPairs(dict(features), int(truncated), sum(cut[q] != q for q in queries))
