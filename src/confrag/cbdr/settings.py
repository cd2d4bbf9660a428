"""The validated settings of CBDR's β analysis (the `cbdr` node), checked with the `rag` and `eval` settings.

Built from plain values (the config nodes as containers) before anything expensive runs: a bad value
fails at once, named by its key.
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
    """The `cbdr` node, checked together with the K of Table 2 and the candidates retrieved."""

    ks: tuple[int, ...]  # every K answered: rag.top_k plus cbdr.top_k
    k: int  # cbdr.top_k: the K of the gate, the chosen β and the flips
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


def cbdr_settings(
    cbdr: dict[str, Any], rag: AnswerSettings, evaluation: EvalSettings, top_n: int, candidates_file: bool
) -> CBDRSettings:
    """Every bad value of the `cbdr` node (and its combination with `rag` / `retrieval`), named by its key."""
    k = checks.positive_int(cbdr["top_k"], "cbdr.top_k")
    if max(*rag.top_k, k) > top_n and not candidates_file:
        raise ValueError(
            f"rag.top_k={list(rag.top_k)} / cbdr.top_k={k} ask for more contexts than the "
            f"retrieval.top_n={top_n} candidates retrieved per question; lower K or raise retrieval.top_n"
        )
    flip_betas = as_list(cbdr.get("flip_betas") or [])
    flip_betas = tuple(float(b) for b in check_betas(flip_betas, "cbdr.flip_betas")) if flip_betas else ()
    if len(flip_betas) == 1:
        raise ValueError(
            f"cbdr.flip_betas must list at least two thresholds (flips between consecutive ones), or "
            f"none; got {list(flip_betas)}"
        )
    if flip_betas and cbdr["metric"] == "f1":
        raise ValueError(
            "cbdr.metric=f1 has no right and wrong answers to count flips with; set cbdr.flip_betas=[] "
            "or cbdr.metric=has_answer / em"
        )
    objective, budget = cbdr["objective"], cbdr.get("retrieval_budget")
    checks.choice(objective, "cbdr.objective", OBJECTIVES)
    if objective == "budget" and budget is None:
        raise ValueError("cbdr.objective=budget needs cbdr.retrieval_budget, a fraction in [0, 1]")
    if budget is not None:  # checked whatever the objective: a bad value is a typo either way
        budget = check_beta(budget, "cbdr.retrieval_budget")
        if objective != "budget":
            budget = None  # only the budget objective reads it
    checks.choice(cbdr["metric"], "cbdr.metric", METRICS)
    return CBDRSettings(
        ks=tuple(sorted({*rag.top_k, k})),
        k=k,
        beta=check_beta(cbdr["beta"], "cbdr.beta"),
        betas=beta_grid(cbdr.get("betas"), cbdr.get("beta_step")),
        table_betas=tuple(float(b) for b in check_betas(as_list(cbdr["table_betas"]), "cbdr.table_betas")),
        flip_pairs=tuple(zip(flip_betas, flip_betas[1:])),
        objective=objective,
        budget=budget,
        metric=cbdr["metric"],
        eval_metric=evaluation.metric,
        expected_discordance=float(evaluation.expected_discordance),
        base=str(evaluation.base_reranker),
        reranker=check_reranker(cbdr["reranker"], "cbdr.reranker"),
        rerankers=evaluation.rerankers,
        flip_examples=checks.non_negative_int(cbdr["flip_examples"], "cbdr.flip_examples"),
        gate_check_questions=checks.non_negative_int(cbdr["gate_check_questions"], "cbdr.gate_check_questions"),
        conf_quantiles=checks.non_negative_int(cbdr["conf_quantiles"], "cbdr.conf_quantiles"),
        gate_max_new_tokens=checks.positive_int(cbdr.get("max_new_tokens", rag.max_new_tokens), "cbdr.max_new_tokens"),
        gate_batch_size=check_batch_size(cbdr.get("batch_size", rag.batch_size), "cbdr.batch_size"),
    )
