"""Reranking metrics as the papers define them (Table 1: P@K, R@K, MRR@K for K = 1, 3, 5).

For one query with candidate scores s and binary relevance labels y:

    P@K   = (relevant items among the top K) / K
    R@K   = (relevant items among the top K) / (relevant items of the query)
    MRR@K = 1 / rank of the first relevant item if that rank is <= K, else 0

and each metric is averaged over queries. Choices, matching `torchmetrics.retrieval` defaults so the two
agree number for number:

- P@K always divides by K, also when a query has fewer than K candidates (torchmetrics'
  `adaptive_k=False`): a list of 3 candidates can reach at most P@5 = 3/5.
- A query without any relevant item scores 0 on every metric (torchmetrics'
  `empty_target_action="neg"`); `skip_empty=True` leaves such queries out of the average instead
  (`"skip"`). With every query skipped the average is 0.0, as in torchmetrics.
- Ties in scores keep the original candidate order (a stable sort). Whoever builds candidate lists
  must therefore not put positives first, or a constant scorer would look perfect: see
  `confrag.reranker.rows.candidate_lists`, which shuffles them with a seed. (torchmetrics sorts with
  `torch.topk`, whose tie order is unspecified, so the two agree only on tie-free scores.)
- Only the order of a query's scores matters. torchmetrics 1.9 also treats a prediction <= 0 as "not
  retrieved" (a relevant item scored -0.3 never counts), which is wrong for raw reranker logits; the
  two agree on positive scores.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torchmetrics import Metric

METRICS = ("P", "R", "MRR")


def _ranked_labels(scores: Sequence[float], labels: Sequence[int], where: str) -> np.ndarray:
    """The labels in ranking order (highest score first, ties in the given order)."""
    s = np.asarray(scores, dtype=np.float64).reshape(-1)
    y = np.asarray(labels).reshape(-1)
    if s.shape != y.shape:
        raise ValueError(f"{where}: {s.size} scores but {y.size} labels")
    if s.size == 0:
        raise ValueError(f"{where}: no candidates")
    if np.isnan(s).any():
        raise ValueError(f"{where}: NaN score")
    if not np.isin(y, (0, 1)).all():
        raise ValueError(f"{where}: labels must be 0 or 1, got {sorted(set(y.tolist()))}")
    return y[np.argsort(-s, kind="stable")].astype(np.int64)


def _check_k(k: int) -> int:
    if isinstance(k, bool) or int(k) != k or k < 1:
        raise ValueError(f"K must be an integer >= 1 (got {k!r})")
    return int(k)


def query_metrics(
    scores: Sequence[float], labels: Sequence[int], ks: Sequence[int] = (1, 3, 5), where: str = "query"
) -> dict[str, float]:
    """P@K, R@K and MRR@K of one query, keyed like `P@1`."""
    ranked = _ranked_labels(scores, labels, where)
    total = int(ranked.sum())
    first = int(np.argmax(ranked)) + 1 if total else None  # 1-based rank of the first relevant item
    out: dict[str, float] = {}
    for k in map(_check_k, ks):
        hits = int(ranked[:k].sum())
        out[f"P@{k}"] = hits / k
        out[f"R@{k}"] = hits / total if total else 0.0
        out[f"MRR@{k}"] = 1.0 / first if first is not None and first <= k else 0.0
    return out


def _per_query(scores: Sequence[Sequence[float]], labels: Sequence[Sequence[int]], ks: Sequence[int]):
    if len(scores) != len(labels):
        raise ValueError(f"{len(scores)} score lists but {len(labels)} label lists")
    rows = [query_metrics(s, y, ks, where=f"query {i}") for i, (s, y) in enumerate(zip(scores, labels))]
    empty = np.array([not np.any(np.asarray(y)) for y in labels], dtype=bool)
    return rows, empty


def _average(values: np.ndarray, empty: np.ndarray, skip_empty: bool) -> float:
    if skip_empty:
        values = values[~empty]
    return float(values.mean()) if values.size else 0.0


def _metric(name: str, scores, labels, k: int, skip_empty: bool) -> float:
    rows, empty = _per_query(scores, labels, (k,))
    return _average(np.array([r[f"{name}@{k}"] for r in rows], dtype=np.float64), empty, skip_empty)


def precision_at_k(
    scores: Sequence[Sequence[float]], labels: Sequence[Sequence[int]], k: int, skip_empty: bool = False
) -> float:
    """Mean over queries of (relevant in top K) / K."""
    return _metric("P", scores, labels, k, skip_empty)


def recall_at_k(
    scores: Sequence[Sequence[float]], labels: Sequence[Sequence[int]], k: int, skip_empty: bool = False
) -> float:
    """Mean over queries of (relevant in top K) / (relevant items of the query)."""
    return _metric("R", scores, labels, k, skip_empty)


def mrr_at_k(
    scores: Sequence[Sequence[float]], labels: Sequence[Sequence[int]], k: int, skip_empty: bool = False
) -> float:
    """Mean over queries of 1 / rank of the first relevant item within the top K (0 when none)."""
    return _metric("MRR", scores, labels, k, skip_empty)


def ranking_metrics(
    scores: Sequence[Sequence[float]],
    labels: Sequence[Sequence[int]],
    ks: Sequence[int] = (1, 3, 5),
    skip_empty: bool = False,
) -> dict[str, float]:
    """Every metric at every K in one pass, ordered like Table 1: P@1, R@1, MRR@1, P@3, ..."""
    rows, empty = _per_query(scores, labels, ks)
    keys = [f"{m}@{k}" for k in ks for m in METRICS]
    return {key: _average(np.array([r[key] for r in rows], dtype=np.float64), empty, skip_empty) for key in keys}


def ranking_table(
    scores_by_system: dict[str, Sequence[Sequence[float]]],
    labels: Sequence[Sequence[int]],
    ks: Sequence[int] = (1, 3, 5),
    skip_empty: bool = False,
    percent: bool = True,
) -> list[dict]:
    """Rows shaped like the papers' Table 1: {"system", "P@1", "R@1", "MRR@1", "P@3", ...}.

    Values are percentages like the paper's table (`percent=False` gives fractions). Every system is
    scored on the same queries and labels, so the rows are comparable."""
    scale = 100.0 if percent else 1.0
    table = []
    for system, scores in scores_by_system.items():
        try:
            values = ranking_metrics(scores, labels, ks, skip_empty)
        except ValueError as err:
            raise ValueError(f"system {system!r}: {err}") from err
        table.append({"system": system, **{key: scale * value for key, value in values.items()}})
    return table


class RankingMetrics(Metric):
    """The same metrics as a torchmetrics `Metric`, for validation / test loops.

    `update` takes whole queries (a query's candidates never span two updates), so per-query values
    are computed at once and only they are kept; under DDP they are gathered by concatenation, which
    averages over all queries of all ranks."""

    full_state_update = False

    def __init__(self, ks: Sequence[int] = (1, 3, 5), skip_empty: bool = False, prefix: str = "", **kwargs) -> None:
        super().__init__(**kwargs)
        self.ks = tuple(_check_k(k) for k in ks)
        self.skip_empty, self.prefix = skip_empty, prefix
        self.keys = [f"{m}@{k}" for k in self.ks for m in METRICS]
        self.add_state("values", default=[], dist_reduce_fx="cat")
        self.add_state("empty", default=[], dist_reduce_fx="cat")

    def update(self, scores: Sequence[Sequence[float]], labels: Sequence[Sequence[int]]) -> None:
        rows, empty = _per_query(
            [np.asarray(torch.as_tensor(s).detach().float().cpu()) for s in scores],
            [np.asarray(torch.as_tensor(y).cpu()) for y in labels],
            self.ks,
        )
        if not rows:
            return
        self.values.append(
            torch.tensor([[r[k] for k in self.keys] for r in rows], dtype=torch.float64, device=self.device)
        )
        self.empty.append(torch.as_tensor(empty, device=self.device))

    def compute(self) -> dict[str, torch.Tensor]:
        values = _cat(self.values, (0, len(self.keys)), torch.float64)
        empty = _cat(self.empty, (0,), torch.bool)
        if self.skip_empty:
            values = values[~empty]
        means = values.mean(0) if len(values) else torch.zeros(len(self.keys), dtype=torch.float64)
        return {self.prefix + key: means[i].float() for i, key in enumerate(self.keys)}


def _cat(state, empty_shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    # After a DDP sync a list state arrives already concatenated into one tensor.
    if isinstance(state, torch.Tensor):
        return state
    return torch.cat(state) if state else torch.zeros(empty_shape, dtype=dtype)
