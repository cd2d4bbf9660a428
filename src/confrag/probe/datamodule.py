"""A DataModule that builds (or finds in the cache) NQ_Confidence and streams one layer's states.

Hidden states are read from memory-mapped shards example by example: training never needs the
whole activation cache in memory. `prepare_data` loads the LLM only when something is missing
from the cache and frees it afterwards.
"""

from __future__ import annotations

import gc
import logging
from typing import Any, Sequence

import numpy as np
import torch
from lightning import LightningDataModule
from torch.utils.data import DataLoader, Dataset

from confrag.artifacts import ActivationStore
from confrag.data.nq import QARow, load_nq_jsonl
from confrag.llm.generation import GreedyOptions
from confrag.llm.loading import LLMConfig, load_llm
from confrag.llm.prompts import PromptTemplates
from confrag.nq_confidence import ConfidenceData, Example, activation_identity, build_confidence_data

log = logging.getLogger(__name__)


class ActivationDataset(Dataset):
    def __init__(self, stores: dict[str, ActivationStore], layer: int, examples: Sequence[Example]) -> None:
        self.stores, self.layer, self.examples = stores, layer, list(examples)
        for kind in {e.kind for e in self.examples}:
            stores[kind].layer_index(layer)  # fail early, naming the layers that exist

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int):
        example = self.examples[i]
        hidden = self.stores[example.kind].get(self.layer, example.index)
        return torch.from_numpy(hidden), torch.tensor(example.label, dtype=torch.long)


def select_questions(rows: Sequence[QARow], num_questions: int | None, seed: int) -> list[QARow]:
    """A seeded sample of `num_questions` rows, kept in file order (all rows when None)."""
    if num_questions is None or num_questions >= len(rows):
        return list(rows)
    if num_questions < 2:
        raise ValueError(f"data.num_questions must be >= 2 (got {num_questions})")
    chosen = np.sort(np.random.default_rng(seed).choice(len(rows), num_questions, replace=False))
    return [rows[i] for i in chosen]


class NQConfidenceDataModule(LightningDataModule):
    def __init__(
        self,
        llm: dict[str, Any],
        prompts: dict[str, Any],
        nq_path: str,
        layer: int | str = "mid",
        layers: str | Sequence[int] = "all",
        num_questions: int | None = None,
        train_states: str = "qa",
        split_sizes: dict[str, int] | None = None,
        balance: bool = True,
        max_new_tokens: int = 24,
        gen_batch_size: int | str = 16,
        extract_batch_size: int | str = 16,
        batch_size: int = 64,
        num_workers: int = 0,
        cache_dir: str = ".cache",
        seed: int = 0,
        progress: bool = True,
        extract_compile: bool = False,
        generation: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        # GPU speed options (docs/gpu.md): compiled engine blocks, the greedy-generation path.
        self.extract_compile = extract_compile
        self.generation = GreedyOptions.from_mapping(generation, "data.generation")
        self.llm_cfg = LLMConfig(**dict(llm))
        self.templates = PromptTemplates(**dict(prompts))
        self.nq_path, self.layer_spec, self.layers = nq_path, layer, layers
        self.num_questions, self.train_states = num_questions, train_states
        self.split_sizes, self.balance, self.seed = split_sizes, balance, seed
        self.max_new_tokens, self.gen_batch_size, self.extract_batch_size = max_new_tokens, gen_batch_size, extract_batch_size
        self.batch_size, self.num_workers, self.cache_dir, self.progress = batch_size, num_workers, cache_dir, progress
        self.data: ConfidenceData | None = None
        self.layer: int | None = None
        self.llm_identity: dict[str, Any] | None = None
        self.prompts_identity: str | None = None

    def build(self, llm=None) -> ConfidenceData:
        """Build NQ_Confidence (cached); loads the LLM unless one is given."""
        rows = select_questions(load_nq_jsonl(self.nq_path), self.num_questions, self.seed)
        own = llm is None
        llm = llm or load_llm(self.llm_cfg)
        try:
            data = build_confidence_data(
                llm, self.templates, rows, layers=self.layers, train_states=self.train_states, seed=self.seed,
                split_sizes=self.split_sizes, balance=self.balance, max_new_tokens=self.max_new_tokens,
                gen_batch_size=self.gen_batch_size, extract_batch_size=self.extract_batch_size,
                cache_dir=self.cache_dir, progress=self.progress, extract_compile=self.extract_compile,
                generation=self.generation,
            )
            num_layers = self.num_layers = llm.num_layers
            self.layer = num_layers // 2 if self.layer_spec in (None, "mid") else int(self.layer_spec)
            if not 0 <= self.layer <= num_layers:
                raise ValueError(f"model.layer={self.layer} out of range: valid layers are 0..{num_layers}")
            self.llm_identity = llm.identity
            self.prompts_identity = self.templates.identity(llm.tokenizer)
        finally:
            if own:
                del llm
                gc.collect()
        return data

    def prepare_data(self) -> None:
        if self.data is None:
            self.data = self.build()

    def setup(self, stage: str | None = None) -> None:
        if self.data is None:
            self.data = self.build()
        if not all(self.data.examples[s] for s in ("train", "dev", "test")):
            raise ValueError(
                f"NQ_Confidence has an empty split ({ {s: len(e) for s, e in self.data.examples.items()} }): the LLM "
                f"answered too few (or too many) questions correctly; raise data.num_questions"
            )
        self.datasets = {s: ActivationDataset(self.data.stores, self.layer, self.data.examples[s])
                         for s in ("train", "dev", "test")}

    @property
    def input_dim(self) -> int:
        return self.data.stores["qa"].dim

    def feature_stats(self) -> tuple[np.ndarray, np.ndarray]:
        """Mean and std of the training states of the chosen layer, streamed in chunks."""
        total = np.zeros(self.input_dim, dtype=np.float64)
        squares = np.zeros(self.input_dim, dtype=np.float64)
        examples = self.data.examples["train"]
        for start in range(0, len(examples), 1024):
            chunk = examples[start : start + 1024]
            for kind in {e.kind for e in chunk}:
                states = self.data.stores[kind].take(self.layer, [e.index for e in chunk if e.kind == kind]).astype(np.float64)
                total += states.sum(0)
                squares += (states**2).sum(0)
        mean = total / len(examples)
        return mean.astype(np.float32), np.sqrt(np.maximum(squares / len(examples) - mean**2, 0.0)).astype(np.float32)

    def activations(self) -> dict[str, Any]:
        identity = activation_identity(self.data, self.layer)
        return {**identity, "llm": self.llm_identity, "prompts": self.prompts_identity}

    def _loader(self, split: str, shuffle: bool) -> DataLoader:
        return DataLoader(self.datasets[split], batch_size=self.batch_size, shuffle=shuffle,
                          num_workers=self.num_workers, persistent_workers=self.num_workers > 0)

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader("dev", shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader("test", shuffle=False)
