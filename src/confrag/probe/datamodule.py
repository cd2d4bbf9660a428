"""A DataModule that builds (or finds in the cache) NQ_Confidence and streams one layer's states.

Hidden states are read from memory-mapped shards example by example: training never needs the
whole activation cache in memory. `prepare_data` loads the LLM only when something is missing
from the cache and frees it afterwards. With `train_states` ending in `+candidates`, each question's
top `candidates.top_n` BM25 passages over the NQ file's paragraphs (the retrieval stage's default
corpus) are added as prompt kinds, labelled by the LLM's answer under each.

With `ranking.top_n` (the default), the dev and test questions' candidates (the same top-N BM25 passages
with repeated texts removed that NQ_Rerank and the evaluation use) are scored too (`confrag.probe.ranking`):
the dev set chooses the checkpoint, the test set (plus `ranking.test_questions` held-out questions from the
rest of the file, states only) reports the probe as a reranker.
"""

from __future__ import annotations

import functools
import gc
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
from lightning import LightningDataModule
from torch.utils.data import DataLoader

from confrag.data.gold_needs import GoldNeed, refuse_without_gold
from confrag.data.nq import QUESTION_FORMAT_CHOICES, load_questions_jsonl
from confrag.data.splits import check_disjoint, held_out, select_questions
from confrag.infra import checks
from confrag.infra.sharded import ShardedCache
from confrag.llm.config import LLMConfig
from confrag.llm.context import fit_questions
from confrag.llm.hidden_states import HiddenStateEngine, extraction_key
from confrag.llm.loading import DeferredLLM, model_num_layers
from confrag.llm.prompted import PromptedLLM
from confrag.llm.prompts import PromptTemplates
from confrag.probe.activation_dataset import ActivationDataset, unrepeated_sampler
from confrag.probe.data_options import (
    AnswerOptions,
    CandidateOptions,
    ExtractionOptions,
    RankingOptions,
    SplitOptions,
)
from confrag.probe.nq_confidence import (
    ConfidenceData,
    ConfidenceDataSettings,
    activation_identity,
    build_confidence_data,
    resolve_layers,
)
from confrag.probe.prompt_kinds import kinds_of, uses_candidates
from confrag.probe.ranking import RankingSet, candidate_states
from confrag.retrieval import BM25Retriever, corpus_from_gold_paragraphs, retrieve_candidates
from confrag.retrieval.candidates import without_duplicates

log = logging.getLogger(__name__)


def probe_layer(layer: int | str | None, num_layers: int) -> int:
    """The probe's layer from its setting (`model.layer`): `mid` (or None) = Layer/2, or an integer in
    0..num_layers (0 = the embeddings, num_layers = the final norm's output). Resolved once, by the config boundary
    from the LLM's layer count (`recipes.probe_recipe`), and handed as this integer to the data module and model."""
    chosen = num_layers // 2 if layer in (None, "mid") else layer
    if isinstance(chosen, str) and chosen.strip().lstrip("-").isdigit():
        chosen = int(chosen)
    if not checks.is_integer(chosen, numpy=True):
        raise ValueError(f"layer={layer!r}: use 'mid' or an integer in 0..{num_layers}")
    if not 0 <= int(chosen) <= num_layers:
        raise ValueError(
            f"layer={int(chosen)} out of range: valid layers are 0..{num_layers} (0 = embeddings, "
            f"{num_layers // 2} = the paper's Layer/2, {num_layers} = final norm output)"
        )
    return int(chosen)


def extracted_layers(
    layers: str | int | Sequence[int], num_layers: int, layer: int, key: str = "extraction.layers"
) -> list[int]:
    """The extracted layers (`extraction.layers`, named `key`) checked against the model's layer count, holding the
    probe's `layer`."""
    try:
        extracted = resolve_layers(layers, num_layers)
    except ValueError as err:
        raise ValueError(f"{key}={layers!r}: {str(err).removeprefix(f'layers={layers!r}: ')}") from None
    if layer not in extracted:
        raise ValueError(f"{key}={extracted} does not hold the probe's layer {layer}: add it (or use {key}=all)")
    return extracted


def check_loader_settings(batch_size: Any, num_workers: Any) -> None:
    """`batch_size` >= 1 (or null: whole-split batches, for L-BFGS) and `num_workers` >= 0, each an integer."""
    checks.integer(batch_size, "batch_size", 1, allow_none=True, numpy=True)
    checks.integer(num_workers, "num_workers", 0, numpy=True)


class NQConfidenceDataModule(LightningDataModule):
    # wide: built by Hydra from its config node, one keyword per key of the YAML (tests/test_settings_defaults.py
    # checks them against it) beside the probe's layer the config boundary resolves; the options that travel together
    # arrive as its five groups (confrag.probe.data_options).
    def __init__(
        self,
        llm: dict[str, Any],
        prompts: dict[str, Any],
        questions_path: str,
        *,
        questions_format: str,
        layer: int,
        num_questions: int | None,
        train_states: str,
        splits: SplitOptions | dict[str, Any],
        extraction: ExtractionOptions | dict[str, Any],
        answers: AnswerOptions | dict[str, Any],
        candidates: CandidateOptions | dict[str, Any],
        ranking: RankingOptions | dict[str, Any],
        truncate_questions: bool,
        truncate_passages: bool,
        batch_size: int | None,
        num_workers: int,
        cache_dir: str,
        seed: int,
        progress: bool,
        # Where the node sits in the run's config (`probe.data` in a later task): given by the config boundary.
        config_node: str = "data",
    ) -> None:
        super().__init__()
        # Where this module's settings live in the run's config (`probe.data` in a later task): messages that
        # advise a setting name it so that the advice works as an override.
        self.config_node = str(config_node)
        node = self.config_node
        self.splits = SplitOptions.of(splits, f"{node}.splits")
        self.extraction = ExtractionOptions.of(extraction, f"{node}.extraction")
        self.answers = AnswerOptions.of(answers, f"{node}.answers")
        self.candidates = CandidateOptions.of(candidates, f"{node}.candidates")
        self.ranking_options = RankingOptions.of(ranking, f"{node}.ranking")
        self.ranking: dict[str, RankingSet] = {}
        if uses_candidates(train_states):
            hint = f"with {node}.train_states={train_states!r}"
            checks.positive_int(self.candidates.top_n, f"{node}.candidates.top_n", hint=hint)
        self.llm_cfg = LLMConfig(**dict(llm))
        self.templates = PromptTemplates(**dict(prompts))
        checks.choice(questions_format, "questions_format", QUESTION_FORMAT_CHOICES)
        self.questions_path = questions_path
        self.questions_format = questions_format
        # The probe's layer, resolved once from `model.layer` by the config boundary (`probe_layer`).
        self.layer = checks.integer(layer, "layer", 0, numpy=True)
        self.num_questions = num_questions
        self.train_states = train_states
        self.seed = seed
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.cache_dir = cache_dir
        self.progress = progress
        self.truncate_questions = checks.flag(truncate_questions, "truncate_questions")
        self.truncate_passages = checks.flag(truncate_passages, "truncate_passages")
        self.data: ConfidenceData | None = None
        self.llm_identity: dict[str, Any] | None = None
        self.prompts_identity: str | None = None

    def check_settings(self) -> None:
        """Refuse extracted layers the model does not have or that lack the probe's layer, from its config alone
        (no weights are loaded), and batch sizes and workers out of range: before any answer is generated."""
        check_loader_settings(self.batch_size, self.num_workers)
        self.extracted_layers(model_num_layers(self.llm_cfg))

    def extracted_layers(self, num_layers: int) -> list[int]:
        return extracted_layers(self.extraction.layers, num_layers, self.layer, f"{self.config_node}.extraction.layers")

    def gold_paragraph_needs(self) -> list[GoldNeed]:
        """The settings of this data module that read each question's gold paragraph, each with the value that
        does without: the ranking sets (own paragraph first), the gold / other-paragraph RAG states and the
        retrieved candidates' states (retrieved from the gold paragraphs). Empty: it runs on any question set."""
        needs, node = [], self.config_node
        monitor = "callbacks.model_checkpoint.monitor" if node == "data" else f"{node.rsplit('.', 1)[0]}.monitor"
        if self.ranking_options.top_n:
            needs.append(
                GoldNeed(
                    f"{node}.ranking.top_n={self.ranking_options.top_n} (the dev questions' own paragraphs ranked "
                    "to choose the checkpoint)",
                    f"{node}.ranking.top_n=null {monitor}=val/auroc",
                )
            )
        if set(kinds_of(self.train_states, 0)) & {"rag_gold", "rag_other"} or uses_candidates(self.train_states):
            needs.append(
                GoldNeed(
                    f"{node}.train_states={self.train_states} (gold-paragraph RAG states, or candidates retrieved "
                    "from the gold paragraphs)",
                    f"{node}.train_states=qa",
                )
            )
        return needs

    def check_gold_paragraphs(self, rows) -> None:
        """A question set without any gold paragraph (FlashRAG's format has none) is refused here when the
        settings read them (`gold_paragraph_needs`), naming the settings that do without, not after the LLM has
        answered every question."""
        refuse_without_gold(str(self.questions_path), rows, self.gold_paragraph_needs())

    def build(self, llm=None) -> ConfidenceData:
        """Build NQ_Confidence (cached); loads the LLM unless one is given."""
        self.extracted_layers(llm.num_layers if llm is not None else model_num_layers(self.llm_cfg))
        all_rows = load_questions_jsonl(self.questions_path, questions_format=self.questions_format)
        rows = select_questions(all_rows, self.num_questions, self.seed)
        self.check_gold_paragraphs(all_rows)
        own = llm is None
        # Weights load at the first shard to compute (none when the cache is complete): a question longer
        # than the context, or a read-only cache that lacks a shard, is named before they load.
        prompted = PromptedLLM(llm or DeferredLLM(self.llm_cfg), self.templates)
        if own:
            rows = fit_questions(
                rows,
                prompted.limit(self.answers.max_new_tokens),
                self.truncate_questions,
                str(self.questions_path),
                option=f"{self.config_node}.truncate_questions",
                # Questions that also go into RAG prompts leave half the budget to the passages.
                room=(prompted.llm.context - self.answers.max_new_tokens) // 2 if self.rag_prompts else 0,
            )
        candidates = self.retrieved(all_rows, rows) if uses_candidates(self.train_states) else None
        try:
            settings = ConfidenceDataSettings(
                train_states=self.train_states,
                splits=self.splits,
                extraction=self.extraction,
                answers=self.answers,
                truncate_passages=self.truncate_passages,
                config_node=self.config_node,
            )
            data = build_confidence_data(
                prompted,
                rows,
                settings=settings,
                cache=ShardedCache(self.cache_dir, progress=self.progress),
                seed=self.seed,
                candidates=candidates,
            )
            if self.num_questions is not None and self.num_questions > len(all_rows):
                data.requested_questions = int(self.num_questions)
            if self.ranking_options.top_n:
                self.ranking = self.ranking_sets(prompted, data, all_rows)
            self.num_layers = prompted.llm.num_layers
            self.llm_identity = prompted.llm.identity
            self.prompts_identity = prompted.prompts_identity
        finally:
            if own:
                del prompted  # the weights it may have loaded go with it
                gc.collect()
        return data

    def retrieved(self, all_rows, rows) -> list[list]:
        """Each question's top `candidates.top_n` BM25 passages over every paragraph of the NQ file (cached),
        repeated texts removed as where the probe is applied."""
        corpus = corpus_from_gold_paragraphs(all_rows, words_per_passage=self.candidates.words_per_passage)
        found = retrieve_candidates(
            rows, corpus, BM25Retriever(corpus, cache_dir=self.cache_dir), top_n=self.candidates.top_n
        )
        return [without_duplicates(c)[0].passages for c in found]

    def ranking_sets(self, prompted: PromptedLLM, data: ConfidenceData, all_rows) -> dict[str, RankingSet]:
        """The dev and test questions' top-`ranking.top_n` candidates (repeated texts removed, as where the
        probe is applied) with their states at the probe's layer (cached); the test set adds
        `ranking.test_questions` questions from outside the probe's questions (their own artifact, so that
        they are computed once whatever the probe's splits)."""
        groups = {s: [r for r, split in zip(data.rows, data.split_of) if split == s] for s in ("dev", "test")}
        if self.ranking_options.test_questions:
            groups["test_extra"] = self.extra_test_rows(all_rows, data.rows)
        corpus = corpus_from_gold_paragraphs(all_rows, words_per_passage=self.candidates.words_per_passage)
        retriever = BM25Retriever(corpus, cache_dir=self.cache_dir)
        # Built at the first shard to compute: a complete cache loads no weights.
        engine = functools.cache(
            lambda: HiddenStateEngine(
                prompted.llm.model,
                prompted.tokenizer,
                batch_size=self.extraction.batch_size,
                progress=self.progress,
                threads=self.extraction.threads,
            )
        )
        parts = {}
        for name, rows in groups.items():
            ranked = retrieve_candidates(rows, corpus, retriever, self.ranking_options.top_n)
            found = [without_duplicates(c)[0] for c in ranked]
            states, _ = candidate_states(
                prompted,
                found,
                self.layer,
                engine=engine,
                cache=ShardedCache(self.cache_dir, progress=self.progress),
                layers=data.layers,  # every extracted layer: a layer sweep extracts the candidates once
                extraction=extraction_key(self.extraction.batch_size, threads=self.extraction.threads),
            )
            parts[name] = (found, states)
        test = [parts["test"], *([parts["test_extra"]] if "test_extra" in parts else [])]
        sets = {"dev": RankingSet.of("dev", [parts["dev"]]), "test": RankingSet.of("test", test)}
        if "test_extra" in parts:  # the same questions whatever the probe's splits: recipes compare on them
            sets["heldout"] = RankingSet.of("heldout", [parts["test_extra"]])
        return sets

    def extra_test_rows(self, all_rows, probe_rows) -> list:
        """`ranking.test_questions` seeded questions of the file outside the probe's questions."""
        key = f"{self.config_node}.ranking.test_questions"
        outside = held_out(all_rows, probe_rows, "the probe's ranking test", key)
        extra = select_questions(outside, self.ranking_options.test_questions, self.seed)
        check_disjoint(extra, {"the probe's questions": probe_rows}, "the ranking test questions")
        return extra

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
        self.datasets = {
            s: ActivationDataset(self.data.stores, self.layer, self.data.examples[s]) for s in ("train", "dev", "test")
        }

    @property
    def rag_prompts(self) -> bool:
        """Whether the probe's questions also go into RAG prompts (training states or the ranking sets)."""
        return self.train_states != "qa" or bool(self.ranking_options.top_n)

    @property
    def input_dim(self) -> int:
        return next(iter(self.data.stores.values())).dim

    def feature_stats(self) -> tuple[np.ndarray, np.ndarray]:
        """Mean and std of the training states of the chosen layer, streamed in chunks."""
        total = np.zeros(self.input_dim, dtype=np.float64)
        squares = np.zeros(self.input_dim, dtype=np.float64)
        examples = self.data.examples["train"]
        for start in range(0, len(examples), 1024):
            chunk = examples[start : start + 1024]
            for kind in {e.kind for e in chunk}:
                states = (
                    self.data.stores[kind]
                    .take(self.layer, [e.index for e in chunk if e.kind == kind])
                    .astype(np.float64)
                )
                total += states.sum(0)
                squares += (states**2).sum(0)
        mean = total / len(examples)
        return mean.astype(np.float32), np.sqrt(np.maximum(squares / len(examples) - mean**2, 0.0)).astype(np.float32)

    def activations(self) -> dict[str, Any]:
        identity = activation_identity(self.data, self.layer)
        return {**identity, "llm": self.llm_identity, "prompts": self.prompts_identity}

    def _loader(self, split: str, shuffle: bool) -> DataLoader:
        sampler = None if shuffle else unrepeated_sampler(self.datasets[split])
        return DataLoader(
            self.datasets[split],
            # null: the whole split in one batch (full-batch optimizers such as L-BFGS)
            batch_size=self.batch_size or max(1, len(self.datasets[split])),
            shuffle=shuffle,
            sampler=sampler,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader("dev", shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader("test", shuffle=False)
