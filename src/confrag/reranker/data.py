"""Preference rows for reranker training, grouped the way FlagEmbedding samples them.

A row (FlagEmbedding's reranker format, as written by `confrag.reranker.preferences`):

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
from collections.abc import Sequence

import numpy as np
import torch
from lightning import LightningDataModule
from torch.utils.data import DataLoader, Dataset, RandomSampler

from confrag.reranker.backbone import resolve_backbone
from confrag.reranker.collate import CandidateCollator, GroupCollator, PairCollator, truncation_stats
from confrag.reranker.kinds import CrossEncoderKind, reranker_kind
from confrag.reranker.rows import RowSource, candidate_lists, load_rows, validate_rows
from confrag.reranker.settings import PairBatching, check_group_size

# --- datasets ------------------------------------------------------------------------------------


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


# --- Lightning -----------------------------------------------------------------------------------


class PreferenceDataModule(LightningDataModule):
    """Preference rows → grouped training batches and whole-list evaluation batches.

    `train` / `val` / `test` are row lists or paths (JSONL or a `datasets` folder). `tokenizer` is a
    model folder or HF id (None: the embedded MiniLM); it must be the reranker backbone's tokenizer, and
    `kind` its `model.kind` (which tokenization the pairs get).
    `truncated_pairs` counts the training / evaluation pairs whose passage was cut, as collated in
    this process; `truncation` (after setup) gives the same count over every distinct pair of each split.
    The batching settings arrive as one object, `batching` (conf/data/preference_pairs.yaml builds it; outside a
    run: `confrag.instantiators.shipped("data/preference_pairs.yaml", seed=...)`)."""

    def __init__(
        self,
        batching: PairBatching,
        train: RowSource | None = None,
        test: RowSource | None = None,
        val: RowSource | None = None,
        tokenizer: str | None = None,
        kind: str = CrossEncoderKind.id,
    ) -> None:
        super().__init__()
        self.kind = reranker_kind(kind)
        self.encode = self.kind.encode
        self.sources = {"train": train, "val": val, "test": test}
        self.tokenizer_name = tokenizer
        self.batching = batching
        self.query_max_len = batching.query_max_len
        self.passage_max_len = batching.passage_max_len
        self.batch_size = batching.batch_size
        self.eval_batch_size = batching.eval_batch_size
        self.group_size = batching.group_size
        self.num_workers = batching.num_workers
        self.seed = batching.seed
        self.rows: dict[str, list[dict]] = {}
        self.truncation: dict[str, dict[str, int]] = {}
        self._tokenizer = None
        self._collators: dict[str, PairCollator] = {}

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = self.kind.load_tokenizer(resolve_backbone(self.tokenizer_name))
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

    def _collator(self, split: str, cls: type[PairCollator]) -> PairCollator:
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
