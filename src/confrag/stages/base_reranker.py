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
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from confrag.data.nq import QARow
from confrag.data.qa_metrics import has_answer
from confrag.infra import checks
from confrag.infra.run_context import RunContext
from confrag.reranker.module import RerankerModule
from confrag.reranker.preferences import RERANK_INSTRUCTION
from confrag.retrieval import Candidates, CorpusPassage, document_text, split_passages
from confrag.stages.rerankers import RerankerRecipe, ensure_reranker, reranker_cache_dir
from confrag.stages.retrieval import Retrieval, question_candidates

log = logging.getLogger(__name__)

# The model settings of the aligned rerankers that the base does not take: it is a full fine-tuning (whatever
# model.lora) on relevance rows, which carry no teacher scores to distil (whatever model.distill_weight). Fixed
# here, they are out of its cache key too: trying an alignment option reuses the base instead of retraining it.
BASE_MODEL_SETTINGS: dict[str, Any] = {"lora": None, "distill_weight": 0.0, "distill_tau": None}


@dataclass(frozen=True)
class BaseRerankerSettings:
    """The `base_reranker` config node. Defaults: conf/base_reranker/default.yaml."""

    train: bool  # false: `model.backbone` already is a reranker and is the base as it is
    num_questions: int | None  # NQ questions used by no other stage; None = all that are left
    questions_path: str | None  # another question file to draw them from (e.g. NQ train); None = the probe's file
    negatives: int  # BM25 hard negatives per row (no answer, not from the gold paragraph)
    negatives_top_n: int  # how deep in BM25's ranking they are drawn from
    max_epochs: int
    # The base's learning rate; None = model.lr (the aligned rerankers' too). A fresh scoring head on a bi-encoder
    # learns to rank in few steps only at a larger rate than fine-tuning needs (the demo's base: docs/results.md).
    lr: float | None
    # The share of its steps over which the rate warms up; None = model.warmup_ratio. With a fresh head, a warm-up
    # lets the head settle before the encoder moves (the demo's base: docs/results.md).
    warmup_ratio: float | None

    def __post_init__(self) -> None:
        for key, minimum in (("negatives", 1), ("negatives_top_n", 2), ("max_epochs", 1)):
            checks.integer(getattr(self, key), key, minimum)
        checks.number(self.lr, "lr", 0, low_open=True, allow_none=True)
        checks.number(self.warmup_ratio, "warmup_ratio", 0, 1, high_open=True, allow_none=True)
        checks.integer(self.num_questions, "num_questions", 2, allow_none=True)


@dataclass
class BaseReranker:
    module: RerankerModule
    directory: Path | None  # the exported base (None: the backbone itself)
    info: dict[str, Any]  # questions, rows, drops, steps, training seconds


def gold_passages(row: QARow, words_per_passage: int | None) -> list[CorpusPassage]:
    """The question's own gold paragraph cut into passages as the corpus cuts it, those that hold a gold
    answer (else all of them): taken from the row itself, so a question file other than the corpus's works."""
    if not row.contexts:
        return []
    paragraph = row.contexts[0]
    own = split_passages(paragraph.title, paragraph.text, f"{row.qid}-gold", words_per_passage)
    return [p for p in own if has_answer(p.text, row.answers)] or own


def relevance_training_rows(
    rows: Sequence[QARow], candidates: Sequence[Candidates], negatives: int, words_per_passage: int | None
) -> tuple[list[dict], dict[str, int]]:
    """One row per question: its gold passages as `pos`, the first `negatives` retrieved passages that are
    not from its gold paragraph and hold no answer as `neg`. Questions without a gold paragraph or without
    such a negative are dropped and counted."""
    out, dropped = [], {"no_gold_paragraph": 0, "no_hard_negative": 0}
    for row, c in zip(rows, candidates):
        pos = gold_passages(row, words_per_passage)
        if not pos:
            dropped["no_gold_paragraph"] += 1
            continue
        own_texts = {p.text for p in pos}
        neg = [
            p
            for p, hit, gold in zip(c.passages, c.has_answer, c.from_gold)
            if not hit and not gold and p.text not in own_texts
        ][:negatives]
        if not neg:
            dropped["no_hard_negative"] += 1
            continue
        out.append(
            {
                "qid": row.qid,
                "query": row.question,
                "pos": [document_text(p) for p in pos],
                "neg": [document_text(p) for p in neg],
                "prompt": RERANK_INSTRUCTION,
            }
        )
    return out, dropped


def ensure_base_reranker(
    settings: BaseRerankerSettings,
    recipe: RerankerRecipe,
    retrieval: Retrieval,
    rows: Sequence[QARow],
    ctx: RunContext,
) -> BaseReranker:
    """The base: trained on `rows` (questions no other stage uses) and cached by key, or the backbone."""
    recipe = recipe.with_model_settings(**BASE_MODEL_SETTINGS)
    if not settings.train:
        module = recipe.make_model()
        # What the untrained base scores with, for the reports (the kind's own words, e.g. a bi-encoder's cosine).
        return BaseReranker(module, None, {"trained": False, "kind": module.kind.description})
    start = time.perf_counter()
    candidates, stats = question_candidates(retrieval, rows, top_n=settings.negatives_top_n)
    train_rows, dropped = relevance_training_rows(
        rows, candidates, settings.negatives, retrieval.settings.words_per_passage
    )
    if not train_rows:
        hint = "raise base_reranker.num_questions or base_reranker.negatives_top_n"
        if dropped.get("no_gold_paragraph") == len(rows):
            # e.g. FlashRAG question sets: their rows name no gold passage to train relevance on.
            hint = (
                'these questions carry no gold paragraph ("ctxs"): train the base on a file that has them '
                "(base_reranker.questions_path=...), or start from a reranker as it comes (base_reranker.train=false "
                "with model=reranker_bge_m3)"
            )
        raise ValueError(f"the base reranker has no training rows ({len(rows)} questions, dropped {dropped}); {hint}")
    trainer_settings = {"max_epochs": settings.max_epochs}
    overrides: dict[str, Any] = {}
    if settings.lr is not None:
        overrides["lr"] = float(settings.lr)
    if settings.warmup_ratio is not None:
        overrides["warmup_ratio"] = float(settings.warmup_ratio)
    directory = reranker_cache_dir(
        recipe, ctx.cache_dir, train_rows, trainer_settings=trainer_settings, model_overrides=overrides
    )
    cached = (directory / "confrag_training.json").is_file()
    module, info = ensure_reranker(recipe, ctx, train_rows, "base", [], trainer_settings=trainer_settings, **overrides)
    info = {
        **info,
        "trained": True,
        "questions": len(rows),
        "rows": len(train_rows),
        "dropped": dropped,
        "retrieval": stats,
        "cached": cached,
        "stage_seconds": time.perf_counter() - start,
    }
    log.info(
        "Base reranker: %d rows from %d questions (dropped %s), trained in %.0f s%s",
        len(train_rows),
        len(rows),
        dropped,
        info.get("train_seconds", float("nan")),
        " (read from the cache)" if cached else "",
    )
    return BaseReranker(module, None if recipe.fast_dev_run else directory, info)
