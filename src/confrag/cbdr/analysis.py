"""Everything about β from cached outcomes alone (no LLM call): the sweep on test, β chosen on dev,
the `*_at_beta` metrics, Table 3 and the appendix-F flips."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from confrag.cbdr.settings import CBDRSettings
from confrag.cbdr.sweep import (
    FlipReport,
    SweepData,
    SweepResult,
    flip_analysis,
    report_beta,
    sweep,
    table3_markdown,
    with_conf_quantiles,
)
from confrag.reranker.systems import label


@dataclass
class CBDRResults:
    grid: SweepResult  # on test, every β of the grid
    chosen: dict[str, Any]  # report_beta: β chosen on dev, reported on test
    at_beta: dict[str, float]  # cbdr.beta on dev and test
    table3: str  # Markdown, the rows by label
    table3_rows: list[dict[str, Any]]  # each row's label in `reranker`, its system id in `id`
    flips: list[FlipReport]
    quantiles: np.ndarray  # the dev-Conf quantiles added to the grid (empty when none)
    confidence: dict[str, list[float]]  # split -> Conf(H(Q)) min, median, max


def cbdr_results(
    settings: CBDRSettings, dev: SweepData, test: SweepData, base_test: SweepData, questions: str = "NQ"
) -> CBDRResults:
    """The β sweep over the test questions, β chosen on dev, Table 3 (its columns named by `questions`, the
    question set's name) and the flips."""
    betas, quantiles = with_conf_quantiles(settings.betas, dev.confidence, settings.conf_quantiles)
    grid = sweep(test, betas)
    chosen = report_beta(dev, test, settings.k, settings.objective, settings.budget, betas)
    at_beta = {}
    for split, data in (("dev", dev), ("test", test)):
        result = sweep(data, [settings.beta], [settings.k])
        at_beta[f"{split}/accuracy_at_beta"] = float(result.accuracy[settings.k][0])
        at_beta[f"{split}/retrieval_rate_at_beta"] = float(result.retrieval_rate[0])
    # (system id, the row's label in Table 3, outcomes, β)
    ours = label(settings.reranker)
    entries = [(settings.base, label(settings.base), base_test, 0.0)] if settings.base != settings.reranker else []
    entries += [(settings.reranker, ours, test, beta) for beta in (0.0, *settings.table_betas)]
    entries.append((settings.reranker, f"{ours}, β chosen on dev ({settings.objective})", test, chosen["beta"]))
    # Beside the configured pairs: always retrieving against the chosen β (whenever flips are counted at all).
    pairs = (
        [*settings.flip_pairs, *([(0.0, chosen["beta"])] if chosen["beta"] > 0 else [])] if settings.flip_pairs else []
    )
    flips = [flip_analysis(test, settings.k, a, b, settings.flip_examples) for a, b in pairs]
    rows = [
        {
            "reranker": name,
            "id": system,
            "beta": beta,
            **{k: v for k, v in sweep(data, [beta], settings.ks).rows()[0].items() if k != "beta"},
        }
        for system, name, data, beta in entries
    ]
    confidence = {
        split: [float(np.min(d.confidence)), float(np.median(d.confidence)), float(np.max(d.confidence))]
        for split, d in (("dev", dev), ("test", test))
    }
    table3 = table3_markdown([(name, data, beta) for _, name, data, beta in entries], settings.ks, questions)
    return CBDRResults(grid, chosen, at_beta, table3, rows, flips, quantiles, confidence)
