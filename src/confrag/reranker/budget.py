"""The reranker's token budget over the candidates it scores: how many (question, passage) pairs its tokenization
cuts, counted with the very encoder of its kind (`RerankerKind.encode`), so the count is the cut that happens.

A cross-encoder reads a question and a passage within `query_max_len + passage_max_len` tokens (capped by the
backbone's positions), a bi-encoder each passage within `passage_max_len`: the rest of a longer passage is never
read, and a passage whose answer sits past the cut ranks low without any sign of it. Cutting stays (that is what
these models do); the count goes into the run's report beside the LLM's and the dense encoder's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from confrag.reranker.kinds import RerankerKind

_CHUNK = 256  # pairs tokenized per call, as `collate.truncation_stats` does


@dataclass(frozen=True)
class PairBudget:
    """A reranker's tokenizer and length settings, as its data module cuts training and evaluation pairs."""

    tokenizer: Any
    kind: RerankerKind
    query_max_len: int
    passage_max_len: int

    @property
    def limit(self) -> tuple[int, str]:
        """The tokens one input may hold, and what they hold (`RerankerKind.input_budget`)."""
        return self.kind.input_budget(self.tokenizer, self.query_max_len, self.passage_max_len)

    def count(self, queries: Sequence[str], passages: Sequence[str]) -> dict[str, Any]:
        """How many distinct (query, passage) pairs lose passage tokens to the budget: `over_limit` of `passages`
        (distinct pairs), with the budget's `limit` and what it `holds`."""
        if len(queries) != len(passages):
            raise ValueError(f"{len(queries)} queries but {len(passages)} passages")
        pairs = list(dict.fromkeys(zip(queries, passages)))
        cut = 0
        for start in range(0, len(pairs), _CHUNK):
            chunk = pairs[start : start + _CHUNK]
            encoded = self.kind.encode(
                self.tokenizer, [q for q, _ in chunk], [p for _, p in chunk], self.query_max_len, self.passage_max_len
            )
            cut += int(encoded.truncated_pairs)
        limit, holds = self.limit
        return {"passages": len(pairs), "over_limit": cut, "limit": limit, "holds": holds}
