"""Preference rows (FlagEmbedding's reranker format) checked and read: each row's fields named when wrong,
rows read from a list or a JSONL / Arrow file (its digest checked when it has one), and each query's
candidate list in a seeded shuffled order for evaluation.

    {"query": str, "pos": [str, ...], "neg": [str, ...],
     "pos_scores": [float, ...], "neg_scores": [float, ...], "prompt": str}
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from confrag.data.jsonl import DataFormatError, read_jsonl
from confrag.infra import checks
from confrag.infra.digests import ArtifactDamagedError, covered_problem

RowSource = Sequence[dict] | str | Path


def _passage_list(row: dict, field: str, label: str) -> list[str]:
    value = row.get(field)
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"{label}: field {field!r} must be a non-empty list of passages (got {_short(value)})")
    for j, passage in enumerate(value):
        if not isinstance(passage, str) or not passage.strip():
            raise ValueError(f"{label}: field {field!r} item {j} must be a non-empty string (got {_short(passage)})")
    seen: dict[str, int] = {}
    for j, passage in enumerate(value):
        if passage in seen:
            raise ValueError(
                f"{label}: field {field!r} holds the same passage twice (items {seen[passage]} and {j}): "
                f"{_short(passage)}"
            )
        seen[passage] = j
    return list(value)


def _score_list(row: dict, field: str, passages: list[str], passage_field: str, label: str) -> None:
    scores = row[field]
    if not isinstance(scores, (list, tuple)) or len(scores) != len(passages):
        size = len(scores) if isinstance(scores, (list, tuple)) else _short(scores)
        raise ValueError(
            f"{label}: field {field!r} has {size} values for {len(passages)} passages in {passage_field!r}"
        )
    for j, score in enumerate(scores):
        if not checks.is_number(score):
            raise ValueError(f"{label}: field {field!r} item {j} must be a finite number (got {score!r})")


def validate_row(row: Any, label: str) -> dict:
    """Raise ValueError naming `label` and the field when the row is not a usable preference row."""
    if not isinstance(row, dict):
        raise ValueError(f"{label}: a preference row must be an object with query/pos/neg (got {type(row).__name__})")
    query = row.get("query")
    if not isinstance(query, str) or not query.strip():
        raise ValueError(f"{label}: field 'query' must be a non-empty string (got {_short(query)})")
    pos = _passage_list(row, "pos", label)
    neg = _passage_list(row, "neg", label)
    both = set(pos) & set(neg)
    if both:
        raise ValueError(f"{label}: passage in both 'pos' and 'neg': {_short(next(iter(both)))}")
    has = [f for f in ("pos_scores", "neg_scores") if row.get(f) is not None]
    if len(has) == 1:
        missing = ({"pos_scores", "neg_scores"} - set(has)).pop()
        raise ValueError(f"{label}: has {has[0]!r} but no {missing!r}; teacher scores come in pairs")
    if has:
        _score_list(row, "pos_scores", pos, "pos", label)
        _score_list(row, "neg_scores", neg, "neg", label)
    if row.get("prompt") is not None and not isinstance(row["prompt"], str):
        raise ValueError(f"{label}: field 'prompt' must be a string (got {_short(row['prompt'])})")
    return row


def validate_rows(rows: Iterable[Any], where: str) -> list[dict]:
    """All rows checked (see `validate_row`); errors read `<where> row <i>: ...` with 0-based i."""
    checked = [validate_row(row, f"{where} row {i}") for i, row in enumerate(rows)]
    if not checked:
        raise ValueError(f"{where}: no preference rows")
    return checked


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def load_rows(source: RowSource, where: str) -> list[dict]:
    """Rows from a list, a JSONL file (.jsonl / .jsonl.gz) or a `datasets` folder saved with save_to_disk."""
    if isinstance(source, (str, Path)):
        path = Path(source).expanduser()
        problem = covered_problem(path) if path.exists() else None
        if problem:  # rows `save_rows` wrote, changed since: refused (a user's own file has no digest)
            raise ArtifactDamagedError(f"{where}={str(source)!r}: {problem}")
        if path.is_dir():
            from datasets import load_from_disk

            return validate_rows(load_from_disk(str(path)).to_list(), f"{where} ({path})")
        if path.is_file() and path.name.endswith((".jsonl", ".jsonl.gz")):
            return _load_jsonl(path, where)
        raise FileNotFoundError(
            f"{where}={str(source)!r}: expected a .jsonl / .jsonl.gz file or a `datasets` "
            f"folder (save_to_disk), or a list of rows"
        )
    return validate_rows(source, where)


def _load_jsonl(path: Path, where: str) -> list[dict]:
    expected = "a preference row {query, pos, neg[, pos_scores, neg_scores, prompt]}"
    try:
        rows = [validate_row(row, f"{where} ({path}) line {n}") for n, row in read_jsonl(path, expected)]
    except DataFormatError as err:  # the file's reader names the file and line; the key comes first
        raise DataFormatError(f"{where}: {err}") from err
    if not rows:
        raise ValueError(f"{where} ({path}): no preference rows")
    return rows


def candidate_lists(rows: Sequence[dict], seed: int = 0) -> list[dict]:
    """Per query: {"query", "passages" (pos + neg, shuffled with a seed), "labels" (1 = pos)}."""
    out = []
    for i, row in enumerate(rows):
        passages = list(row["pos"]) + list(row["neg"])
        labels = [1] * len(row["pos"]) + [0] * len(row["neg"])
        order = np.random.default_rng([seed, i]).permutation(len(passages))
        out.append(
            {"query": row["query"], "passages": [passages[j] for j in order], "labels": [labels[j] for j in order]}
        )
    return out
