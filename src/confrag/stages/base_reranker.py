"""The base reranker: a relevance cross-encoder trained before any alignment, as bge-reranker-v2-m3 is in
the paper.

The paper aligns a strong relevance reranker to the LLM's preferences and compares it with that same
reranker before alignment. The embedded encoder (all-MiniLM-L6-v2) is a bi-encoder with no scoring head,
so on the embedded default this stage first makes it a reranker: group InfoNCE on NQ questions that
neither the probe, the preference rows nor the evaluation use (`check_disjoint` asserts it), the
question's gold passage as positive and BM25's hard negatives that hold no answer. With a backbone that
already is a reranker (`base_reranker.train=false`, the GPU configs' bge-reranker-v2-m3) the backbone is
the base as it is.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from confrag.data.nq import QARow
from confrag.preferences import RERANK_INSTRUCTION
from confrag.qa_metrics import has_answer
from confrag.reranker.module import RerankerModule
from confrag.retrieval import Candidates, CorpusPassage, document_text
from confrag.stages.rerankers import RerankerRecipe, ensure_reranker, reranker_cache_dir
from confrag.stages.retrieval import Retrieval, question_candidates

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BaseRerankerSettings:
    """The `base_reranker` config node."""

    train: bool = True  # false: `model.backbone` already is a reranker and is the base as it is
    num_questions: int | None = 700  # NQ questions used by no other stage; None = all that are left
    negatives: int = 7  # BM25 hard negatives per row (no answer, not from the gold paragraph)
    negatives_top_n: int = 30  # how deep in BM25's ranking they are drawn from
    max_epochs: int = 1

    def __post_init__(self) -> None:
        for key, minimum in (("negatives", 1), ("negatives_top_n", 2), ("max_epochs", 1)):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"base_reranker.{key} must be an integer >= {minimum} (got {value!r})")
        if self.num_questions is not None and (isinstance(self.num_questions, bool) or self.num_questions < 2):
            raise ValueError(f"base_reranker.num_questions must be an integer >= 2 or null (got {self.num_questions!r})")


@dataclass
class BaseReranker:
    module: RerankerModule
    directory: Path | None  # the exported base (None: the backbone itself)
    info: dict[str, Any]  # questions, rows, drops, steps, training seconds


def gold_passages(corpus_passages: Sequence[CorpusPassage], candidates: Candidates) -> list[CorpusPassage]:
    """The passages of the question's gold paragraph that hold a gold answer (else all of them)."""
    own = [p for p in corpus_passages if p.source_id == candidates.gold_source]
    holding = [p for p in own if has_answer(p.text, candidates.answers)]
    return holding or own


def relevance_training_rows(candidates: Sequence[Candidates], by_source: dict[str, list[CorpusPassage]],
                            negatives: int) -> tuple[list[dict], dict[str, int]]:
    """One row per question: its gold passages as `pos`, the first `negatives` retrieved passages that are not
    from the gold paragraph and hold no answer as `neg`. Questions without a known gold paragraph or without
    such a negative are dropped and counted."""
    rows, dropped = [], {"no_gold_paragraph": 0, "no_hard_negative": 0}
    for c in candidates:
        pos = gold_passages(by_source.get(c.gold_source or "", []), c) if c.gold_source else []
        if not pos:
            dropped["no_gold_paragraph"] += 1
            continue
        neg = [p for p, hit, gold in zip(c.passages, c.has_answer, c.from_gold) if not hit and not gold][:negatives]
        if not neg:
            dropped["no_hard_negative"] += 1
            continue
        rows.append({"qid": c.qid, "query": c.question, "pos": [document_text(p) for p in pos],
                     "neg": [document_text(p) for p in neg], "prompt": RERANK_INSTRUCTION})
    return rows, dropped


def ensure_base_reranker(settings: BaseRerankerSettings, recipe: RerankerRecipe, retrieval: Retrieval,
                         rows: Sequence[QARow]) -> BaseReranker:
    """The base: trained on `rows` (questions no other stage uses) and cached by key, or the backbone."""
    if not settings.train:
        return BaseReranker(recipe.make_model(lora=None), None, {"trained": False})
    start = time.perf_counter()
    candidates, stats = question_candidates(retrieval, rows, top_n=settings.negatives_top_n)
    by_source: dict[str, list[CorpusPassage]] = defaultdict(list)
    for passage in retrieval.corpus.passages:
        by_source[passage.source_id].append(passage)
    train_rows, dropped = relevance_training_rows(candidates, by_source, settings.negatives)
    if not train_rows:
        raise ValueError(f"the base reranker has no training rows ({len(rows)} questions, dropped {dropped}); "
                         "raise base_reranker.num_questions or base_reranker.negatives_top_n")
    trainer_settings = {"max_epochs": settings.max_epochs}
    directory = reranker_cache_dir(recipe, train_rows, trainer_settings=trainer_settings)
    cached = (directory / "confrag_training.json").is_file()
    module, info = ensure_reranker(recipe, train_rows, "base", [], trainer_settings=trainer_settings, lora=None)
    info = {**info, "trained": True, "questions": len(rows), "rows": len(train_rows), "dropped": dropped,
            "retrieval": stats, "cached": cached, "stage_seconds": time.perf_counter() - start}
    log.info("Base reranker: %d rows from %d questions (dropped %s), trained in %.0f s%s", len(train_rows), len(rows),
             dropped, info.get("train_seconds", float("nan")), " (read from the cache)" if cached else "")
    return BaseReranker(module, None if recipe.fast_dev_run else directory, info)
