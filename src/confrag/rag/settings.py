"""The validated settings of end-to-end evaluation (`rag`, `eval`), shared by the cbdr and gates tasks.

Built from plain values (the config nodes as containers) before anything expensive runs: a bad value
fails at once, named by its field; `instantiators.settings_from` reports it under the node's key (`rag.top_k`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from confrag.infra import checks
from confrag.llm.batching import check_batch_size
from confrag.llm.generation import GreedyOptions
from confrag.llm.prompted import PromptedLLM
from confrag.rag.answers import AnswerStore
from confrag.rag.pipeline import check_ks
from confrag.rag.stats import BINARY_METRICS
from confrag.reranker.systems import check_reranker


def as_list(value: Any) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


@dataclass(frozen=True)
class AnswerSettings:
    """The `rag` node: greedy answers for Table 2 (every K of `top_k`). Defaults: conf/rag/default.yaml."""

    top_k: Any
    max_new_tokens: int
    batch_size: int
    chunk_size: int  # prompts per answer-cache chunk (the unit of resumption)
    extract_batch_size: int  # prompts per batch of hidden states (Conf(H(Q)))
    generation: Any  # the `rag.generation` node: how the greedy answers are generated (GreedyOptions)
    truncate_passages: bool  # a RAG prompt longer than the context: refused (false) or its passages cut

    def __post_init__(self) -> None:
        object.__setattr__(self, "top_k", check_ks(as_list(self.top_k), "top_k"))
        for key in ("max_new_tokens", "chunk_size"):
            checks.positive_int(getattr(self, key), key)
        for key in ("batch_size", "extract_batch_size"):  # or "auto": from free device memory
            check_batch_size(getattr(self, key), key)
        checks.flag(self.truncate_passages, "truncate_passages")
        if not isinstance(self.generation, GreedyOptions):
            object.__setattr__(self, "generation", GreedyOptions.from_mapping(self.generation, "generation"))

    def store(self, prompted: PromptedLLM, cache_dir: Any, progress: bool = True) -> AnswerStore:
        """The answer cache these settings describe, for `prompted`'s LLM and prompt templates."""
        return AnswerStore(
            prompted,
            cache_dir,
            max_new_tokens=self.max_new_tokens,
            batch_size=self.batch_size,
            chunk_size=self.chunk_size,
            progress=progress,
            generation=self.generation,
            truncate_passages=self.truncate_passages,
        )


@dataclass(frozen=True)
class EvalSettings:
    """The `eval` node: the held-out questions and Table 2. Defaults: conf/eval/default.yaml."""

    num_questions: int | None  # a seeded sample of the NQ questions the probe did not use; None = all
    dev_fraction: float  # share of them used to choose β (dev); the rest is test
    rerankers: tuple[str, ...] | None  # Table 2's rows (Table 1 ids, `confrag.reranker.systems`); None = all
    base_reranker: str  # the id of the row the others are tested against (McNemar)
    metric: str
    n_resamples: int  # bootstrap resamples of each 95 % interval
    hotpotqa_path: str | None  # HotpotQA (official JSON or JSONL); None = NQ only
    hotpotqa_num_questions: int | None
    diagnostics: bool  # Table 2's probe-as-reranker and utility-oracle rows (one answer per candidate)
    questions_path: str | None  # evaluation questions from a file of their own, checked disjoint from training
    expected_discordance: float  # the design's discordance for Table 2's detectable difference (fixed beforehand)

    def __post_init__(self) -> None:
        checks.choice(self.metric, "metric", BINARY_METRICS, hint="(the tests need 0/1 outcomes)")
        checks.fraction(
            self.dev_fraction,
            "dev_fraction",
            hint="(the share of evaluation questions used to choose β, or to fit the gates)",
        )
        checks.existing_path(
            self.questions_path,
            "questions_path",
            allow_none=True,
            hint="(a question file: .jsonl, .jsonl.gz or .parquet)",
        )
        checks.integer(self.num_questions, "num_questions", 2, allow_none=True)
        checks.integer(self.hotpotqa_num_questions, "hotpotqa_num_questions", 2, allow_none=True)
        checks.integer(self.n_resamples, "n_resamples", 100)
        if not 0 < self.expected_discordance <= 1:
            raise ValueError(
                f"expected_discordance must be in (0, 1] (the share of questions a row and the base are "
                f"expected to disagree on); got {self.expected_discordance!r}"
            )
        check_reranker(self.base_reranker, "base_reranker")
        if self.rerankers is not None:
            ids = tuple(check_reranker(r, f"rerankers[{i}]") for i, r in enumerate(self.rerankers))
            object.__setattr__(self, "rerankers", ids)
