"""Reranking metrics (Table 1): hand-worked cases, ties, empty queries, and torchmetrics as the reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torchmetrics.retrieval import RetrievalMRR, RetrievalPrecision, RetrievalRecall

from confrag.reranker.metrics import (
    RankingMetrics,
    mrr_at_k,
    precision_at_k,
    query_metrics,
    ranking_metrics,
    ranking_table,
    recall_at_k,
)
from confrag.reranker.rows import candidate_lists


def test_one_query_by_hand():
    # Ranked by score: 0.9 (irrelevant), 0.7 (irrelevant), 0.5 (relevant), 0.1 (relevant).
    scores, labels = [0.9, 0.5, 0.1, 0.7], [0, 1, 1, 0]
    m = query_metrics(scores, labels, ks=(1, 3, 5))
    assert m["P@1"] == 0 and m["R@1"] == 0 and m["MRR@1"] == 0
    assert m["P@3"] == pytest.approx(1 / 3) and m["R@3"] == pytest.approx(1 / 2) and m["MRR@3"] == pytest.approx(1 / 3)
    # Only 4 candidates: P@5 still divides by 5.
    assert m["P@5"] == pytest.approx(2 / 5) and m["R@5"] == 1.0 and m["MRR@5"] == pytest.approx(1 / 3)


def test_averages_over_queries():
    scores = [[3.0, 2.0, 1.0], [1.0, 2.0, 3.0]]
    labels = [[1, 0, 0], [1, 1, 0]]
    # Query 0: relevant at rank 1. Query 1: ranking is (label 0, 1, 1) -> first relevant at rank 2.
    assert precision_at_k(scores, labels, 1) == pytest.approx((1 + 0) / 2)
    assert precision_at_k(scores, labels, 3) == pytest.approx((1 / 3 + 2 / 3) / 2)
    assert recall_at_k(scores, labels, 1) == pytest.approx((1 + 0) / 2)
    assert recall_at_k(scores, labels, 2) == pytest.approx((1 + 1 / 2) / 2)
    assert mrr_at_k(scores, labels, 1) == pytest.approx((1 + 0) / 2)
    assert mrr_at_k(scores, labels, 3) == pytest.approx((1 + 1 / 2) / 2)


def test_ties_keep_the_candidate_order():
    # All scores equal: the ranking is the given order, so the first relevant item is at rank 2 here ...
    assert query_metrics([1.0, 1.0, 1.0], [0, 1, 0], ks=(3,))["MRR@3"] == pytest.approx(1 / 2)
    # ... and at rank 1 when it comes first; the sort is stable, not reversed for equal scores.
    assert query_metrics([1.0, 1.0, 1.0], [1, 0, 0], ks=(1,))["P@1"] == 1.0
    assert query_metrics([2.0, 1.0, 1.0, 1.0], [0, 0, 0, 1], ks=(3,))["R@3"] == 0.0


def test_queries_without_relevant_items_count_as_zero_or_are_skipped():
    scores = [[2.0, 1.0], [2.0, 1.0]]
    labels = [[1, 0], [0, 0]]
    assert precision_at_k(scores, labels, 1) == 0.5 and recall_at_k(scores, labels, 1) == 0.5
    assert mrr_at_k(scores, labels, 1) == 0.5
    assert precision_at_k(scores, labels, 1, skip_empty=True) == 1.0
    assert recall_at_k(scores, labels, 1, skip_empty=True) == 1.0
    assert mrr_at_k([[1.0]], [[0]], 1, skip_empty=True) == 0.0  # nothing left to average: 0, as in torchmetrics


def _random_queries(seed: int, count: int = 60):
    rng = np.random.default_rng(seed)
    scores, labels = [], []
    for _ in range(count):
        n = int(rng.integers(1, 9))  # lists shorter than K = 3 or 5 included
        # Continuous (no ties, where torchmetrics' order is unspecified) and positive: torchmetrics 1.9
        # treats a prediction <= 0 as "not retrieved" (see test_scores_are_only_compared_with_each_other).
        scores.append(rng.uniform(0.01, 1.0, size=n).tolist())
        labels.append((rng.random(n) < 0.35).astype(int).tolist())  # some queries have no relevant item
    assert any(sum(y) == 0 for y in labels) and any(len(y) < 5 for y in labels)
    return scores, labels


def _torchmetrics(metric, scores, labels, chunks: int = 3) -> float:
    """Fed in several updates; a query's `indexes` value is unique across all of them."""
    bounds = np.linspace(0, len(scores), chunks + 1).astype(int)
    for a, b in zip(bounds[:-1], bounds[1:]):
        preds = torch.tensor([s for q in scores[a:b] for s in q], dtype=torch.float64)
        target = torch.tensor([y for q in labels[a:b] for y in q], dtype=torch.long)
        indexes = torch.tensor([a + i for i, q in enumerate(scores[a:b]) for _ in q], dtype=torch.long)
        metric.update(preds, target, indexes=indexes)
    return float(metric.compute())


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("action", ["neg", "skip"])
def test_matches_torchmetrics_on_random_data(seed, action):
    scores, labels = _random_queries(seed)
    skip = action == "skip"
    for k in (1, 3, 5):
        expected_p = _torchmetrics(
            RetrievalPrecision(top_k=k, adaptive_k=False, empty_target_action=action), scores, labels
        )
        expected_r = _torchmetrics(RetrievalRecall(top_k=k, empty_target_action=action), scores, labels)
        expected_mrr = _torchmetrics(RetrievalMRR(top_k=k, empty_target_action=action), scores, labels)
        assert precision_at_k(scores, labels, k, skip_empty=skip) == pytest.approx(expected_p, abs=1e-6)
        assert recall_at_k(scores, labels, k, skip_empty=skip) == pytest.approx(expected_r, abs=1e-6)
        assert mrr_at_k(scores, labels, k, skip_empty=skip) == pytest.approx(
            expected_mrr, abs=1e-6
        )  # torchmetrics averages in float32


def test_scores_are_only_compared_with_each_other():
    """Raw reranker logits are often negative: shifting every score changes nothing here, whereas
    torchmetrics (1.9) drops relevant items whose prediction is <= 0 from the top K."""
    scores, labels = _random_queries(4)
    shifted = [[s - 2.0 for s in q] for q in scores]
    assert ranking_metrics(shifted, labels) == ranking_metrics(scores, labels)
    tm = _torchmetrics(RetrievalMRR(top_k=5), shifted, labels)
    assert tm == 0.0 < mrr_at_k(shifted, labels, 5)


def test_ranking_table_rows_look_like_table_1():
    scores, labels = _random_queries(5, count=30)
    perfect = [[float(y) for y in q] for q in labels]
    table = ranking_table({"random": scores, "oracle": perfect}, labels)
    assert [row["system"] for row in table] == ["random", "oracle"]
    assert list(table[0]) == ["system", "P@1", "R@1", "MRR@1", "P@3", "R@3", "MRR@3", "P@5", "R@5", "MRR@5"]
    for row in table:
        assert row["P@1"] == pytest.approx(row["MRR@1"])  # as in every row of the paper's table
        assert all(0 <= row[key] <= 100 for key in row if key != "system")
    nonempty = sum(1 for q in labels if any(q)) / len(labels)
    assert table[1]["MRR@5"] == pytest.approx(100 * nonempty)  # oracle: rank 1 whenever there is a positive
    assert table[0]["P@3"] == pytest.approx(100 * precision_at_k(scores, labels, 3))
    fractions = ranking_table({"random": scores}, labels, ks=(2,), percent=False)[0]
    assert list(fractions) == ["system", "P@2", "R@2", "MRR@2"] and fractions["R@2"] == pytest.approx(
        recall_at_k(scores, labels, 2)
    )


def test_torchmetrics_style_metric_accumulates_whole_queries():
    scores, labels = _random_queries(7, count=20)
    metric = RankingMetrics(ks=(1, 3), prefix="val/")
    metric.update([torch.tensor(s) for s in scores[:8]], labels[:8])
    metric.update([torch.tensor(s) for s in scores[8:]], [torch.tensor(y) for y in labels[8:]])
    got = {k: float(v) for k, v in metric.compute().items()}
    expected = ranking_metrics(scores, labels, ks=(1, 3))
    assert set(got) == {"val/" + k for k in expected}
    assert all(got["val/" + k] == pytest.approx(v, abs=1e-6) for k, v in expected.items())
    metric.reset()
    assert all(float(v) == 0.0 for v in metric.compute().values())


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="query 1: 2 scores but 3 labels"):
        precision_at_k([[1.0], [1.0, 2.0]], [[1], [1, 0, 0]], 1)
    with pytest.raises(ValueError, match="labels must be 0 or 1"):
        recall_at_k([[1.0, 2.0]], [[2, 0]], 1)
    with pytest.raises(ValueError, match="K must be an integer >= 1"):
        mrr_at_k([[1.0]], [[1]], 0)
    with pytest.raises(ValueError, match="system 'bad'"):
        ranking_table({"bad": [[float("nan")]]}, [[1]])


def test_candidate_lists_do_not_put_positives_first():
    rows = [{"query": f"q{i}", "pos": [f"p{i}a", f"p{i}b"], "neg": [f"n{i}{j}" for j in range(6)]} for i in range(40)]
    lists = candidate_lists(rows, seed=3)
    assert lists == candidate_lists(rows, seed=3)  # seeded
    for row, item in zip(rows, lists):
        assert sorted(item["passages"]) == sorted(row["pos"] + row["neg"])
        assert all((p in row["pos"]) == bool(y) for p, y in zip(item["passages"], item["labels"]))
    # A constant scorer only gets the chance level (2 of 8 candidates relevant), not a perfect P@1.
    constant = [[0.0] * len(item["passages"]) for item in lists]
    p1 = precision_at_k(constant, [item["labels"] for item in lists], 1)
    assert 0.05 < p1 < 0.6
