"""The probe data node's option groups, one typed object each (`data.splits`, `data.extraction`, `data.answers`,
`data.candidates`, `data.ranking`; `probe.data.*` in a later task).

The YAML (conf/data/nq_confidence.yaml) holds every default once; these classes take none for what it holds
(tests/test_settings_defaults.py). Each is built from its sub-node by `of(values, key)`, which names an unknown or
missing key with the allowed ones and reports a refused value under the sub-node's key (`data.extraction.threads
must be ...`), and checks what can be checked before any model loads.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from confrag.infra import checks
from confrag.llm.batching import check_batch_size
from confrag.llm.generation import GreedyOptions
from confrag.probe.confidence_splits import PAPER_SPLIT_SIZES, check_splits

T = TypeVar("T")


def _of(cls: type[T], values: Any, key: str) -> T:
    """`cls` from the mapping (or `cls` instance) at config key `key`."""
    if isinstance(values, cls):
        return values
    return checks.dataclass_from(cls, values, key)


@dataclass(frozen=True)
class SplitOptions:
    """How the probe's questions are split and its examples balanced (`data.splits`)."""

    sizes: dict[str, int] | None  # per-class caps of the balanced splits; null = the paper's 1000/300/500
    balance: bool  # each split down-sampled to equal classes (the paper); false: every state kept
    proportions: dict[str, int] | None  # questions in train/dev/test; null = the proportions of `sizes`
    allow_one_class: bool  # a split of one class is refused unless this (a smoke test on a random model)

    @classmethod
    def of(cls, values: Any, key: str = "splits") -> SplitOptions:
        options = _of(cls, values, key)
        checks.flag(options.balance, f"{key}.balance")
        checks.flag(options.allow_one_class, f"{key}.allow_one_class")
        options.checked_sizes(key)
        return options

    def checked_sizes(self, key: str = "splits") -> tuple[dict[str, int], dict[str, int]]:
        """The per-class sizes and the question proportions, each checked, the defaults filled in."""
        sizes = check_splits(self.sizes or PAPER_SPLIT_SIZES, f"{key}.sizes")
        return sizes, check_splits(self.proportions or sizes, f"{key}.proportions")


@dataclass(frozen=True)
class ExtractionOptions:
    """Which layers' last-prompt-token states are extracted, and how (`data.extraction`)."""

    layers: str | int | Sequence[int]  # `all` (a layer sweep costs one extraction), `mid` (Layer/2), or a list
    batch_size: int | str  # prompts per forward, or `auto` (from free GPU memory); keys the states' bytes
    threads: int | None  # CPU intra-op threads, fixed so a shard's bytes do not depend on the process; null = own
    compile: bool  # torch.compile of the engine's blocks (a GPU option, docs/gpu.md)

    @classmethod
    def of(cls, values: Any, key: str = "extraction") -> ExtractionOptions:
        options = _of(cls, values, key)
        check_batch_size(options.batch_size, f"{key}.batch_size")
        checks.positive_int(options.threads, f"{key}.threads", allow_none=True)
        checks.flag(options.compile, f"{key}.compile")
        return options


@dataclass(frozen=True)
class AnswerOptions:
    """How the LLM's greedy answers that label the states are generated (`data.answers`)."""

    max_new_tokens: int
    batch_size: int | str  # prompts per generation batch, or `auto`
    generation: GreedyOptions  # the greedy path's options (`{}` in the YAML: GreedyOptions' own defaults)

    @classmethod
    def of(cls, values: Any, key: str = "answers") -> AnswerOptions:
        if isinstance(values, Mapping):
            values = {**values, "generation": GreedyOptions.from_mapping(values.get("generation"), f"{key}.generation")}
        options = _of(cls, values, key)
        checks.positive_int(options.max_new_tokens, f"{key}.max_new_tokens")
        check_batch_size(options.batch_size, f"{key}.batch_size")
        return options


@dataclass(frozen=True)
class CandidateOptions:
    """The retrieved passages of the `+candidates` training states (`data.candidates`): each question's top
    `top_n` BM25 passages over the question file's paragraphs, cut into `words_per_passage`-word passages."""

    top_n: int
    words_per_passage: int

    @classmethod
    def of(cls, values: Any, key: str = "candidates") -> CandidateOptions:
        return _of(cls, values, key)  # `top_n` is checked where it is used (the `+candidates` training states)


@dataclass(frozen=True)
class RankingOptions:
    """The dev and test questions' candidates the probe ranks at every validation (`data.ranking`): the dev set
    chooses the checkpoint by where the question's own paragraph lands."""

    top_n: int | None  # candidates per question; null = off (then monitor val/auroc)
    test_questions: int  # held-out questions from outside the probe's, added to the test ranking (states only)

    @classmethod
    def of(cls, values: Any, key: str = "ranking") -> RankingOptions:
        options = _of(cls, values, key)
        checks.integer(options.top_n, f"{key}.top_n", 2, allow_none=True)
        checks.integer(options.test_questions, f"{key}.test_questions", 0)
        return options
