"""The settings a reranker fine-tuning is built from, one typed object each: `RerankerSettings`, what the `model`
node (conf/model/reranker_*.yaml) holds, for `RerankerModule`; `PairBatching`, what the `data` node
(conf/data/preference_pairs.yaml) holds, for `PreferenceDataModule`.

Each node's `_target_` is its settings class: the config boundary builds the object (every value checked, each
named by its field, without loading a backbone or a tokenizer) and the stages build the module from it, with the
rows, the tokenizer and any override a stage sets (`RerankerSettings.replace`). The YAML holds every default once;
these classes take none (tests/test_settings_defaults.py). A later group of options (the alignment's, say) is one
more field holding its own typed object: the modules' signatures stay as they are.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from confrag.infra import checks
from confrag.infra.checks import collect
from confrag.reranker.kinds import reranker_kind

# The class the `model` node built before it built these settings: reranker cache keys name it (`identity`).
MODULE_TARGET = "confrag.reranker.module.RerankerModule"


def _check(problems: list[str], condition: bool, key: str, allowed: str, value: Any) -> None:
    if not condition:
        problems.append(f"{key} must be {allowed} (got {value!r})")


@dataclass(frozen=True)
class RerankerSettings:
    """A reranker's backbone, objective and optimiser (`model.*`); conf/model/reranker_minilm.yaml says what each
    key means."""

    backbone: str  # a model folder, a Hugging Face id or `minilm` (the embedded all-MiniLM-L6-v2)
    kind: str  # how a pair is scored (confrag.reranker.kinds): cross_encoder | qwen3_yes_no | bi_encoder
    tau: float  # InfoNCE temperature
    lr: float
    weight_decay: float
    warmup_ratio: float
    lora: dict[str, Any] | None  # peft.LoraConfig fields, or null: full fine-tuning
    distill_weight: float  # weight of the KL term toward the rows' teacher scores (0: off)
    distill_tau: float | None  # the teacher's temperature (null: tau)
    fresh_head: bool  # a new, seeded scoring head instead of the checkpoint's
    trust_remote_code: bool
    seed: int
    query_max_len: int
    passage_max_len: int

    def __post_init__(self) -> None:
        """Every problem at once, each named by its field (the config boundary adds `model.`): no weights load."""
        problems: list[str] = []
        collect(problems, reranker_kind, self.kind)
        if not problems:
            collect(problems, reranker_kind(self.kind).check, self.fresh_head)
        allowed = "a model folder, a Hugging Face id or `minilm` (the embedded all-MiniLM-L6-v2)"
        _check(problems, isinstance(self.backbone, str) and bool(self.backbone), "backbone", allowed, self.backbone)
        _check(problems, self.tau > 0, "tau", "> 0", self.tau)
        _check(problems, self.lr > 0, "lr", "> 0", self.lr)
        _check(problems, self.weight_decay >= 0, "weight_decay", ">= 0", self.weight_decay)
        _check(problems, 0 <= self.warmup_ratio < 1, "warmup_ratio", "in [0, 1)", self.warmup_ratio)
        _check(problems, self.distill_weight >= 0, "distill_weight", ">= 0", self.distill_weight)
        distill_tau_ok = self.distill_tau is None or self.distill_tau > 0
        _check(problems, distill_tau_ok, "distill_tau", "null or > 0", self.distill_tau)
        lora_ok = self.lora is None or isinstance(self.lora, dict)
        _check(problems, lora_ok, "lora", "null or a mapping of peft.LoraConfig fields", self.lora)
        collect(problems, checks.positive_int, self.query_max_len, "query_max_len")
        collect(problems, checks.positive_int, self.passage_max_len, "passage_max_len")
        checks.refuse(problems)

    def replace(self, **settings: Any) -> RerankerSettings:
        """These settings with `settings` over them (a stage's overrides: another backbone, no LoRA), checked again."""
        return dataclasses.replace(self, **settings)

    def identity(self) -> dict[str, Any]:
        """The settings as reranker cache keys hold them: the `model` node's keys under the class path the node
        named when it built the module itself, so that every reranker trained before is found again."""
        return {"_target_": MODULE_TARGET, **dataclasses.asdict(self)}


@dataclass(frozen=True)
class PairBatching:
    """How preference rows become training and evaluation batches (`data.*`, conf/data/preference_pairs.yaml): one
    positive and `group_size` − 1 negatives a training item, FlagEmbedding-style, cut to the token budgets."""

    group_size: int
    batch_size: int
    eval_batch_size: int
    query_max_len: int
    passage_max_len: int
    num_workers: int
    seed: int

    def __post_init__(self) -> None:
        problems: list[str] = []
        collect(problems, check_group_size, self.group_size)
        for key in ("batch_size", "eval_batch_size", "query_max_len", "passage_max_len"):
            collect(problems, checks.positive_int, getattr(self, key), key)
        collect(problems, checks.non_negative_int, self.num_workers, "num_workers")
        collect(problems, checks.integer, self.seed, "seed")
        checks.refuse(problems)


def check_group_size(group_size: int) -> int:
    if isinstance(group_size, bool) or int(group_size) != group_size or group_size < 2:
        raise ValueError(
            f"group_size must be an integer >= 2 (one positive and at least one negative); got {group_size!r}"
        )
    return int(group_size)
