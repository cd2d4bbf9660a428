"""Preference rows for reranker training, grouped the way FlagEmbedding samples them.

A row (FlagEmbedding's reranker format, as written by `confrag.preferences`):

    {"query": str, "pos": [str, ...], "neg": [str, ...],
     "pos_scores": [float, ...], "neg_scores": [float, ...], "prompt": str}

`pos_scores` / `neg_scores` (the teacher's Inc values) are optional but come together; `prompt` is the
instruction an LLM-based reranker would get and is ignored by cross-encoders (FlagEmbedding's
encoder-only reranker ignores it too). Extra fields such as `qid` are kept and ignored.

Training item i is the query with one positive and G−1 negatives (positive first). As in FlagEmbedding
the positive is drawn afresh every epoch and the negatives are drawn without replacement from the
row's list repeated ceil((G−1)/len(neg)) times, so short lists repeat negatives. Draws depend only on
(seed, epoch, i): the same in every DataLoader worker and every rerun.

Evaluation items are a query's whole candidate list (pos + neg) in a seeded shuffled order: the
metrics break score ties by candidate order, and positives first would reward a constant scorer.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning import LightningDataModule
from torch.utils.data import DataLoader, Dataset, RandomSampler

from confrag.artifacts import ArtifactDamagedError, covered_problem
from confrag.data.jsonl import DataFormatError, read_jsonl
from confrag.reranker.backbone import resolve_backbone
from confrag.reranker.kinds import CrossEncoderKind, reranker_kind
from confrag.reranker.tokenization import EncodedPairs, encode_pairs

RowSource = Sequence[dict] | str | Path


# --- rows ----------------------------------------------------------------------------------------


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
        if isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(score):
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


# --- datasets ------------------------------------------------------------------------------------


def check_group_size(group_size: int) -> int:
    if isinstance(group_size, bool) or int(group_size) != group_size or group_size < 2:
        raise ValueError(
            f"data.group_size must be an integer >= 2 (one positive and at least one negative); got {group_size!r}"
        )
    return int(group_size)


class GroupDataset(Dataset):
    """Item i: {"query", "passages": [positive, G−1 negatives], "teacher_scores": [G floats] or None}."""

    def __init__(self, rows: Sequence[dict], group_size: int, seed: int = 0) -> None:
        self.group_size = check_group_size(group_size)
        self.rows = validate_rows(rows, "train")
        self.seed = int(seed)
        self.epoch = 0
        # Distillation needs scores for every row; a partly scored set trains without them.
        self.has_teacher_scores = all(r.get("pos_scores") is not None for r in self.rows)

    def set_epoch(self, epoch: int) -> None:
        """Draw other positives and negatives from now on (called at the start of each epoch)."""
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict:
        row = self.rows[index]
        rng = np.random.default_rng([self.seed, self.epoch, int(index)])
        p = int(rng.integers(len(row["pos"])))
        need = self.group_size - 1
        pool = list(range(len(row["neg"]))) * math.ceil(need / len(row["neg"]))
        negs = [pool[j] for j in rng.choice(len(pool), need, replace=False)]
        teacher = None
        if self.has_teacher_scores:
            teacher = [float(row["pos_scores"][p])] + [float(row["neg_scores"][j]) for j in negs]
        return {
            "query": row["query"],
            "passages": [row["pos"][p]] + [row["neg"][j] for j in negs],
            "teacher_scores": teacher,
        }


class CandidateDataset(Dataset):
    """Item i: a query's whole candidate list with labels, for P@K / R@K / MRR@K."""

    def __init__(self, rows: Sequence[dict], seed: int = 0, where: str = "eval") -> None:
        self.items = candidate_lists(validate_rows(rows, where), seed)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict:
        return self.items[index]


class _PairCollator:
    """Shared tokenization; counts the pairs it has seen and how many were truncated (in this process:
    with DataLoader workers each worker counts its own batches)."""

    def __init__(
        self, tokenizer, query_max_len: int, passage_max_len: int, encode: Callable[..., EncodedPairs] = encode_pairs
    ) -> None:
        self.tokenizer, self.query_max_len, self.passage_max_len = tokenizer, query_max_len, passage_max_len
        self.encode = encode
        self.pairs = self.truncated_pairs = self.truncated_queries = 0

    def _encode(self, queries: list[str], passages: list[str]) -> dict[str, Any]:
        encoded = self.encode(self.tokenizer, queries, passages, self.query_max_len, self.passage_max_len)
        self.pairs += len(queries)
        self.truncated_pairs += encoded.truncated_pairs
        self.truncated_queries += encoded.truncated_queries
        return {"features": encoded.features}


class GroupCollator(_PairCollator):
    """Train batch: features of B·G pairs (group-major), "group_size", optional "teacher_scores" (B, G)."""

    def __call__(self, items: list[dict]) -> dict[str, Any]:
        queries = [item["query"] for item in items for _ in item["passages"]]
        batch = self._encode(queries, [p for item in items for p in item["passages"]])
        batch["group_size"] = len(items[0]["passages"])
        if all(item["teacher_scores"] is not None for item in items):
            batch["teacher_scores"] = torch.tensor([item["teacher_scores"] for item in items], dtype=torch.float32)
        return batch


class CandidateCollator(_PairCollator):
    """Eval batch: features of every candidate of every query, "group_sizes", "labels" per query."""

    def __call__(self, items: list[dict]) -> dict[str, Any]:
        queries = [item["query"] for item in items for _ in item["passages"]]
        batch = self._encode(queries, [p for item in items for p in item["passages"]])
        batch["group_sizes"] = [len(item["passages"]) for item in items]
        batch["labels"] = [list(item["labels"]) for item in items]
        return batch


def truncation_stats(
    rows: Sequence[dict],
    tokenizer,
    query_max_len: int,
    passage_max_len: int,
    encode: Callable[..., EncodedPairs] = encode_pairs,
) -> dict[str, int]:
    """How many distinct (query, passage) pairs of the rows exceed the budget: a property of the data,
    independent of sampling and workers."""
    queries = [r["query"] for r in rows for _ in (*r["pos"], *r["neg"])]
    passages = [p for r in rows for p in (*r["pos"], *r["neg"])]
    truncated = cut = 0
    for start in range(0, len(queries), 256):
        encoded = encode(
            tokenizer, queries[start : start + 256], passages[start : start + 256], query_max_len, passage_max_len
        )
        truncated += encoded.truncated_pairs
        cut += encoded.truncated_queries
    return {"pairs": len(queries), "truncated_pairs": truncated, "truncated_queries": cut}


# --- Lightning -----------------------------------------------------------------------------------


def _positive_int(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{key} must be an integer >= 1 (got {value!r})")
    return value


class PreferenceDataModule(LightningDataModule):
    """Preference rows → grouped training batches and whole-list evaluation batches.

    `train` / `val` / `test` are row lists or paths (JSONL or a `datasets` folder). `tokenizer` is a
    model folder or HF id (None: the embedded MiniLM); it must be the reranker backbone's tokenizer, and
    `kind` its `model.kind` (which tokenization the pairs get).
    `truncated_pairs` counts the training / evaluation pairs whose passage was cut, as collated in
    this process; `truncation` (after setup) gives the same count over every distinct pair of each split."""

    def __init__(
        self,
        train: RowSource | None = None,
        test: RowSource | None = None,
        val: RowSource | None = None,
        tokenizer: str | None = None,
        query_max_len: int = 128,
        passage_max_len: int = 512,
        batch_size: int = 4,
        eval_batch_size: int = 16,
        group_size: int = 8,
        num_workers: int = 0,
        seed: int = 0,
        kind: str = CrossEncoderKind.id,
    ) -> None:
        super().__init__()
        self.encode = reranker_kind(kind).encode
        self.sources = {"train": train, "val": val, "test": test}
        self.tokenizer_name = tokenizer
        self.query_max_len = _positive_int(query_max_len, "data.query_max_len")
        self.passage_max_len = _positive_int(passage_max_len, "data.passage_max_len")
        self.batch_size = _positive_int(batch_size, "data.batch_size")
        self.eval_batch_size = _positive_int(eval_batch_size, "data.eval_batch_size")
        self.group_size = check_group_size(group_size)
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(f"data.num_workers must be an integer >= 0 (got {num_workers!r})")
        self.num_workers, self.seed = num_workers, seed
        self.rows: dict[str, list[dict]] = {}
        self.truncation: dict[str, dict[str, int]] = {}
        self._tokenizer = None
        self._collators: dict[str, _PairCollator] = {}

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(resolve_backbone(self.tokenizer_name))
        return self._tokenizer

    @property
    def truncated_pairs(self) -> int:
        return sum(c.truncated_pairs for c in self._collators.values())

    def setup(self, stage: str | None = None) -> None:
        for split, source in self.sources.items():
            if source is not None and split not in self.rows:
                self.rows[split] = load_rows(source, f"data.{split}")
                self.truncation[split] = truncation_stats(
                    self.rows[split], self.tokenizer, self.query_max_len, self.passage_max_len, self.encode
                )

    def _rows(self, split: str) -> list[dict]:
        if split not in self.rows:
            self.setup()
        if split not in self.rows:
            raise ValueError(f"data.{split} is not set: give a row list, a JSONL file or a `datasets` folder")
        return self.rows[split]

    def _collator(self, split: str, cls: type[_PairCollator]) -> _PairCollator:
        if split not in self._collators:
            self._collators[split] = cls(self.tokenizer, self.query_max_len, self.passage_max_len, self.encode)
        return self._collators[split]

    def train_dataloader(self) -> DataLoader:
        dataset = GroupDataset(self._rows("train"), self.group_size, self.seed)
        # A seeded generator: the same order on every run; it advances, so each epoch gets a new order.
        sampler = RandomSampler(dataset, generator=torch.Generator().manual_seed(self.seed))
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            sampler=sampler,
            num_workers=self.num_workers,
            collate_fn=self._collator("train", GroupCollator),
        )

    def _eval_dataloader(self, split: str) -> DataLoader:
        dataset = CandidateDataset(self._rows(split), self.seed, where=f"data.{split}")
        return DataLoader(
            dataset,
            batch_size=self.eval_batch_size,
            shuffle=False,
            num_workers=self.num_workers,
            collate_fn=self._collator(split, CandidateCollator),
        )

    def val_dataloader(self) -> DataLoader | list:
        # No validation rows: an empty list tells Lightning to skip validation.
        if self.sources["val"] is None:
            return []
        return self._eval_dataloader("val")

    def test_dataloader(self) -> DataLoader:
        return self._eval_dataloader("test")
