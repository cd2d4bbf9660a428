"""The validated settings of CBDR's β analysis (the `cbdr` node), checked with the `rag` and `eval` settings.

`CBDRNode` is the node as written, checked on construction under each key's own name (the config boundary,
`recipes.cbdr_recipe`, reports it as `cbdr.<key>`); `CBDRSettings` is what the analysis reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from confrag.cbdr.gate import check_beta
from confrag.cbdr.sweep import METRICS, OBJECTIVES, beta_grid, check_betas
from confrag.infra import checks
from confrag.llm.batching import check_batch_size
from confrag.rag.settings import AnswerSettings, EvalSettings, as_list
from confrag.reranker.systems import check_reranker


@dataclass(frozen=True)
class CBDRSettings:
    """The checked `cbdr` node (`CBDRNode`) with what the analysis reads of `rag` and `eval`."""

    ks: tuple[int, ...]  # every K answered: rag.top_k plus cbdr.top_k
    k: int  # top_k: the K of the gate, the chosen β and the flips
    beta: float
    betas: np.ndarray
    table_betas: tuple[float, ...]
    flip_pairs: tuple[tuple[float, float], ...]
    objective: str
    budget: float | None
    metric: str  # cbdr.metric (sweep)
    eval_metric: str  # eval.metric (Table 2)
    expected_discordance: float  # eval.expected_discordance (Table 2's detectable difference, from the design)
    base: str  # eval.base_reranker: the id of Table 2's base row (`confrag.reranker.systems`)
    reranker: str  # cbdr.reranker: the id of the row CBDR retrieves with
    rerankers: tuple[str, ...] | None  # eval.rerankers: Table 2's rows by id (None = every Table 1 row)
    flip_examples: int
    gate_check_questions: int
    conf_quantiles: int  # that many quantiles of the dev split's Conf join the grid
    gate_max_new_tokens: int  # cbdr.max_new_tokens (rag's unless overridden)
    gate_batch_size: int | str  # cbdr.batch_size, or "auto"


@dataclass(frozen=True)
class CBDRNode:
    """The `cbdr` node as the YAML writes it (conf/cbdr/default.yaml holds the defaults), each value checked
    under its own name; `instantiators.settings_from(CBDRNode, cfg.cbdr, "cbdr")` reports it as `cbdr.<key>`."""

    reranker: str
    top_k: int
    beta: float
    betas: Any  # a list of thresholds, or null for the default grid by beta_step
    beta_step: float
    conf_quantiles: int
    table_betas: Any
    objective: str
    retrieval_budget: float | None
    metric: str
    flip_betas: Any
    flip_examples: int
    gate_check_questions: int
    max_new_tokens: int
    batch_size: int | str

    def __post_init__(self) -> None:
        checks.positive_int(self.top_k, "top_k")
        if self.flip_betas:
            check_betas(as_list(self.flip_betas), "flip_betas")
        if self.flip_betas and len(as_list(self.flip_betas)) == 1:
            raise ValueError(
                f"flip_betas must list at least two thresholds (flips between consecutive ones), or "
                f"none; got {as_list(self.flip_betas)}"
            )
        checks.choice(self.metric, "metric", METRICS)
        if self.flip_betas and self.metric == "f1":
            raise ValueError(
                "metric=f1 has no right and wrong answers to count flips with; set flip_betas=[] "
                "or metric=has_answer / em"
            )
        checks.choice(self.objective, "objective", OBJECTIVES)
        if self.objective == "budget" and self.retrieval_budget is None:
            raise ValueError("objective=budget needs retrieval_budget, a fraction in [0, 1]")
        if self.retrieval_budget is not None:  # checked whatever the objective: a bad value is a typo either way
            check_beta(self.retrieval_budget, "retrieval_budget")
        check_beta(self.beta, "beta")
        beta_grid(self.betas, self.beta_step)
        check_betas(as_list(self.table_betas), "table_betas")
        check_reranker(self.reranker, "reranker")
        for key in ("flip_examples", "gate_check_questions", "conf_quantiles"):
            checks.non_negative_int(getattr(self, key), key)
        checks.positive_int(self.max_new_tokens, "max_new_tokens")
        check_batch_size(self.batch_size, "batch_size")


def cbdr_settings(cbdr: CBDRNode, rag: AnswerSettings, evaluation: EvalSettings) -> CBDRSettings:
    """The checked `cbdr` node with what it takes from `rag` and `eval`; the check of K against the candidates
    retrieved (three nodes) is the boundary's (`recipes.cbdr_recipe`)."""
    flip_betas = tuple(float(b) for b in as_list(cbdr.flip_betas)) if cbdr.flip_betas else ()
    return CBDRSettings(
        ks=tuple(sorted({*rag.top_k, cbdr.top_k})),
        k=cbdr.top_k,
        beta=float(cbdr.beta),
        betas=beta_grid(cbdr.betas, cbdr.beta_step),
        table_betas=tuple(float(b) for b in as_list(cbdr.table_betas)),
        flip_pairs=tuple(zip(flip_betas, flip_betas[1:])),
        objective=cbdr.objective,
        budget=float(cbdr.retrieval_budget) if cbdr.objective == "budget" else None,  # only that objective reads it
        metric=cbdr.metric,
        eval_metric=evaluation.metric,
        expected_discordance=float(evaluation.expected_discordance),
        base=str(evaluation.base_reranker),
        reranker=cbdr.reranker,
        rerankers=evaluation.rerankers,
        flip_examples=cbdr.flip_examples,
        gate_check_questions=cbdr.gate_check_questions,
        conf_quantiles=cbdr.conf_quantiles,
        gate_max_new_tokens=cbdr.max_new_tokens,
        gate_batch_size=cbdr.batch_size,
    )
