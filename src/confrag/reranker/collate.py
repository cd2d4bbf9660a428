"""Batches of (query, passage) pairs tokenized with a backbone kind's encoder (`reranker.kinds`): the train
groups and the evaluation candidate lists, with counts of the pairs and queries cut to the length budget."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from confrag.reranker.tokenization import EncodedPairs, encode_pairs


class PairCollator:
    """Shared tokenization; counts the pairs it has seen and how many were truncated (in this process:
    with DataLoader workers each worker counts its own batches)."""

    def __init__(
        self, tokenizer, query_max_len: int, passage_max_len: int, encode: Callable[..., EncodedPairs] = encode_pairs
    ) -> None:
        self.tokenizer, self.query_max_len, self.passage_max_len = tokenizer, query_max_len, passage_max_len
        self.encode = encode
        self.pairs = self.truncated_pairs = self.truncated_queries = 0

    def _encode(self, queries: list[str], passages: list[str]) -> dict[str, Any]:
        encoded = self.encode(self.tokenizer, queries, passages, self.query_max_len, self.passage_max_len)
        self.pairs += len(queries)
        self.truncated_pairs += encoded.truncated_pairs
        self.truncated_queries += encoded.truncated_queries
        return {"features": encoded.features}


class GroupCollator(PairCollator):
    """Train batch: features of B·G pairs (group-major), "group_size", optional "teacher_scores" (B, G)."""

    def __call__(self, items: list[dict]) -> dict[str, Any]:
        queries = [item["query"] for item in items for _ in item["passages"]]
        batch = self._encode(queries, [p for item in items for p in item["passages"]])
        batch["group_size"] = len(items[0]["passages"])
        if all(item["teacher_scores"] is not None for item in items):
            batch["teacher_scores"] = torch.tensor([item["teacher_scores"] for item in items], dtype=torch.float32)
        return batch


class CandidateCollator(PairCollator):
    """Eval batch: features of every candidate of every query, "group_sizes", "labels" per query."""

    def __call__(self, items: list[dict]) -> dict[str, Any]:
        queries = [item["query"] for item in items for _ in item["passages"]]
        batch = self._encode(queries, [p for item in items for p in item["passages"]])
        batch["group_sizes"] = [len(item["passages"]) for item in items]
        batch["labels"] = [list(item["labels"]) for item in items]
        return batch


def truncation_stats(
    rows: Sequence[dict],
    tokenizer,
    query_max_len: int,
    passage_max_len: int,
    encode: Callable[..., EncodedPairs] = encode_pairs,
) -> dict[str, int]:
    """How many distinct (query, passage) pairs of the rows exceed the budget: a property of the data,
    independent of sampling and workers."""
    queries = [r["query"] for r in rows for _ in (*r["pos"], *r["neg"])]
    passages = [p for r in rows for p in (*r["pos"], *r["neg"])]
    truncated = cut = 0
    for start in range(0, len(queries), 256):
        encoded = encode(
            tokenizer, queries[start : start + 256], passages[start : start + 256], query_max_len, passage_max_len
        )
        truncated += encoded.truncated_pairs
        cut += encoded.truncated_queries
    return {"pairs": len(queries), "truncated_pairs": truncated, "truncated_queries": cut}
