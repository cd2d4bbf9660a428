"""The validated settings of end-to-end evaluation (`rag`, `eval`), shared by the cbdr and gates tasks.

Built from plain values (the config nodes as containers) before anything expensive runs: a bad value
fails at once, named by its key.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from confrag.llm.batching import check_batch_size
from confrag.llm.generation import GreedyOptions
from confrag.rag.answers import AnswerStore
from confrag.rag.pipeline import check_ks
from confrag.rag.stats import BINARY_METRICS


def positive_int(value: Any, key: str, minimum: int = 1, allow_none: bool = False) -> int | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{key} must be an integer >= {minimum}{' or null' if allow_none else ''}; got {value!r}")
    return value


def as_list(value: Any) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


@dataclass(frozen=True)
class AnswerSettings:
    """The `rag` node: greedy answers for Table 2 (every K of `top_k`)."""

    top_k: Any = (1, 3)
    max_new_tokens: int = 24
    batch_size: int = 16
    chunk_size: int = 64  # prompts per answer-cache chunk (the unit of resumption)
    extract_batch_size: int = 16  # prompts per batch of hidden states (Conf(H(Q)))
    generation: Any = None  # the `rag.generation` node: how the greedy answers are generated (GreedyOptions)
    truncate_passages: bool = False  # a RAG prompt longer than the context: refused (false) or its passages cut

    def __post_init__(self) -> None:
        object.__setattr__(self, "top_k", check_ks(as_list(self.top_k)))
        for key in ("max_new_tokens", "chunk_size"):
            positive_int(getattr(self, key), f"rag.{key}")
        for key in ("batch_size", "extract_batch_size"):  # or "auto": from free device memory
            check_batch_size(getattr(self, key), f"rag.{key}")
        if not isinstance(self.truncate_passages, bool):
            raise ValueError(f"rag.truncate_passages must be true or false; got {self.truncate_passages!r}")
        if not isinstance(self.generation, GreedyOptions):
            object.__setattr__(self, "generation", GreedyOptions.from_mapping(self.generation, "rag.generation"))

    def store(self, llm: Any, templates: Any, cache_dir: Any, progress: bool = True) -> AnswerStore:
        """The answer cache these settings describe, for `llm` (a LoadedLLM) and its prompt templates."""
        return AnswerStore(
            llm,
            templates,
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
    """The `eval` node: the held-out questions and Table 2."""

    num_questions: int | None = 200  # a seeded sample of the NQ questions the probe did not use; None = all
    dev_fraction: float = 0.5  # share of them used to choose β (dev); the rest is test
    rerankers: tuple[str, ...] | None = None  # Table 2's rows (Table 1 names); None = all
    base_reranker: str = "cross-encoder (untuned)"  # the row the others are tested against (McNemar)
    metric: str = "has_answer"
    n_resamples: int = 10000  # bootstrap resamples of each 95 % interval
    hotpotqa_path: str | None = None  # HotpotQA (official JSON or JSONL); None = NQ only
    hotpotqa_num_questions: int | None = 200
    diagnostics: bool = True  # Table 2's probe-as-reranker and utility-oracle rows (one answer per candidate)
    nq_path: str | None = None  # evaluation questions from their own file (NQ format), checked disjoint from training

    def __post_init__(self) -> None:
        if self.metric not in BINARY_METRICS:
            raise ValueError(
                f"eval.metric={self.metric!r} is not one of {BINARY_METRICS} (the tests need 0/1 outcomes)"
            )
        fraction = self.dev_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction < 1:
            raise ValueError(
                f"eval.dev_fraction must be a number in (0, 1), the share of evaluation questions used "
                f"to choose β (or to fit the gates); got {fraction!r}"
            )
        if self.nq_path is not None and not Path(self.nq_path).is_file():
            raise ValueError(f"eval.nq_path={self.nq_path!r} is not a file (a JSONL of NQ-format questions)")
        positive_int(self.num_questions, "eval.num_questions", minimum=2, allow_none=True)
        positive_int(self.hotpotqa_num_questions, "eval.hotpotqa_num_questions", minimum=2, allow_none=True)
        positive_int(self.n_resamples, "eval.n_resamples", minimum=100)
        if self.rerankers is not None:
            object.__setattr__(self, "rerankers", tuple(str(r) for r in self.rerankers))
