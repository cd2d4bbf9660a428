"""The NQ_Rerank stage: preference questions → candidates → confidence shifts (and, for a rule that needs them,
the LLM's answer under every candidate) → preference rows for every label rule asked for.

The preference questions are NQ questions the probe was not trained on (as in the paper, where
NQ_Rerank comes from another set than the probe's data): a probe that saw a question's candidates
would label them from memory. Their QA states are extracted here (one prompt each). Rows are split by
question once, the same split for every rule, and written to `<run>/nq_rerank/` (JSONL + Arrow) beside
`report.json`; the other rules' rows to `<run>/nq_rerank/<rule>/`.
"""

from __future__ import annotations

import gc
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from confrag.data.nq import QARow
from confrag.data.qa_metrics import has_answer
from confrag.data.splits import CROSS_FIT
from confrag.infra import checks
from confrag.infra.atomic import atomic_write_text
from confrag.infra.checks import collect
from confrag.infra.digests import fingerprint
from confrag.infra.run_context import RunContext
from confrag.llm.batching import check_batch_size
from confrag.llm.config import LLMConfig
from confrag.llm.hidden_states import HiddenStateEngine
from confrag.llm.loading import load_llm
from confrag.llm.prompted import PromptedLLM
from confrag.llm.prompts import PromptTemplates
from confrag.probe.module import SavedProbe
from confrag.rag import AnswerStore
from confrag.rag.settings import AnswerSettings
from confrag.reranker.confidence_sources import SOURCES as CONFIDENCE_SOURCES
from confrag.reranker.confidence_sources import ConfidenceInputs
from confrag.reranker.label_rules import RULES, sparse_rule_message
from confrag.reranker.preferences import (
    REFERENCES,
    build_rows,
    dataset_report,
    save_rows,
    split_by_question,
)
from confrag.retrieval import Candidates
from confrag.stages.retrieval import Retrieval, question_candidates
from confrag.stages.teachers import ROW_TEACHERS

log = logging.getLogger(__name__)

SELECT_ON = ("last", "dev_top1")


@dataclass(frozen=True)
class PreferenceSettings:
    """The `preferences` config node. Defaults: conf/preferences/default.yaml."""

    num_questions: int | None  # a seeded sample of the NQ questions the probe does not use; None = all
    top_k: int  # K: at most K contexts on each side
    reference: str  # qa (the paper's Eq. 3) | rag_empty (the paper's appendix: RAG prompt, empty context)
    # Where Conf comes from (confrag.reranker.confidence_sources): probe (the paper) | relevance (the control: 1 on
    # the question's own paragraph, 0 elsewhere, references 0.5)
    confidence: str
    selection: str  # the label rule of the reranker CBDR uses: an id of RULES (confrag.reranker.label_rules)
    compare: tuple[str, ...]  # more rules, each with its own fine-tuned reranker (Tables 1-2 rows)
    test_fraction: float  # questions held out for Table 1
    # k >= 2: cross-fitting (confrag.stages.cross_fit): every question no probe and no base uses, in k folds;
    # fold f's aligned rerankers train on the other folds and answer fold f. 0: off (one split, test_fraction).
    cross_fit: int
    # The scores the rows carry for model.distill_weight > 0: an id of ROW_TEACHERS (confrag.stages.teachers).
    teacher: str
    mix_relevance: bool  # also train on the relevance rows of the same questions (answer in passage)
    # The weights an aligned reranker keeps: last (the paper: after its epoch) | dev_top1 (the best Top-1 answers on
    # dev_fraction of its training questions, held out of its rows, the base's weights included; needs the LLM's
    # answer under every candidate, as the utility rule does: confrag.reranker.selection).
    select_on: str
    dev_fraction: float
    relevance_baseline: bool  # also fine-tune on relevance labels (answer in passage): the control row
    extract_batch_size: int
    # Your own rows (FlagEmbedding's format) in place of the probe and NQ_Rerank (confrag.stages.own_rows).
    rows_path: str | None
    rows_max_passages: int | None  # at most this many positives and negatives of a row of yours (a seeded sample)

    def __post_init__(self) -> None:
        object.__setattr__(self, "compare", tuple(self.compare or ()))
        problems = []
        collect(problems, checks.choice, self.reference, "reference", REFERENCES)
        collect(problems, checks.choice, self.confidence, "confidence", tuple(CONFIDENCE_SOURCES))
        for key, rule in [("selection", self.selection)] + [("compare", r) for r in self.compare]:
            collect(problems, checks.choice, rule, key, tuple(RULES))
        collect(problems, checks.positive_int, self.top_k, "top_k")
        # or "auto": from free device memory
        collect(problems, check_batch_size, self.extract_batch_size, "extract_batch_size")
        collect(problems, checks.integer, self.cross_fit, "cross_fit", 2, also=(0,), describe=CROSS_FIT)
        collect(problems, checks.choice, self.teacher, "teacher", tuple(ROW_TEACHERS))
        collect(problems, checks.choice, self.select_on, "select_on", SELECT_ON)
        for key in ("dev_fraction", "test_fraction"):
            collect(problems, checks.fraction, getattr(self, key), key)
        collect(problems, checks.flag, self.mix_relevance, "mix_relevance")
        collect(problems, checks.integer, self.rows_max_passages, "rows_max_passages", 1, allow_none=True)
        checks.refuse(problems)

    @property
    def needs_answers(self) -> bool:
        """Whether the LLM's answer under every candidate is needed (the utility rule, dev Top-1 selection)."""
        return any(RULES[rule].needs_answers for rule in self.rules) or self.select_on == "dev_top1"

    @property
    def rules(self) -> tuple[str, ...]:
        """Every rule trained, the selection first."""
        return tuple(dict.fromkeys([self.selection, *self.compare]))


@dataclass
class PreferenceStage:
    candidates: list[Candidates]  # every preference question, retrieval order, duplicates removed
    splits: dict[str, list[dict]]  # the selection rule's rows by split
    splits_by_rule: dict[str, dict[str, list[dict]]]  # every rule's rows by split (the same questions' split)
    report: dict[str, Any]
    key: str  # identity of the rows: everything that produced them
    utility: list[np.ndarray] | None  # per question, per candidate: the LLM answered correctly under it


def candidate_utility(store: AnswerStore, candidates: Sequence[Candidates]) -> list[np.ndarray]:
    """Per question, per candidate: does the LLM's greedy answer with that candidate alone in the RAG prompt
    hold a gold answer (the prompt of a Top-1 answer, so the answer cache shares them with Table 2)."""
    items = [(c.question, [p]) for c in candidates for p in c.passages]
    answers = store.answer(items)
    flags = np.array(
        [has_answer(a, c.answers) for a, c in zip(answers, (c for c in candidates for _ in c.passages))], dtype=bool
    )
    bounds = np.cumsum([0] + [len(c.passages) for c in candidates])
    return [flags[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


def split_rows(rows: list[dict], test_qids: set[str]) -> dict[str, list[dict]]:
    return {"train": [r for r in rows if r["qid"] not in test_qids], "test": [r for r in rows if r["qid"] in test_qids]}


def build_nq_rerank(
    settings: PreferenceSettings,
    answers: AnswerSettings,
    llm_config: LLMConfig | dict,
    templates: PromptTemplates,
    probe: SavedProbe,
    rows: Sequence[QARow],
    retrieval: Retrieval,
    ctx: RunContext,
) -> PreferenceStage:
    """NQ_Rerank for `rows` under every rule of `settings.rules`, its rows written to `<run folder>/nq_rerank`;
    their candidates retrieved, or read from the retrieval settings' `candidates_path`."""
    candidates, retrieval_stats = question_candidates(retrieval, rows, retrieval.settings.candidates_path)
    if settings.top_k > max(len(c.passages) for c in candidates):
        raise ValueError(
            f"preferences.top_k={settings.top_k} is larger than any question's candidate list "
            f"(at most {max(len(c.passages) for c in candidates)}); lower it or raise retrieval.top_n"
        )
    needs_utility = settings.needs_answers
    llm = load_llm(llm_config)
    prompted = PromptedLLM(llm, templates)
    engine = HiddenStateEngine(llm.model, llm.tokenizer, batch_size=settings.extract_batch_size, progress=ctx.progress)
    try:
        inputs = ConfidenceInputs(prompted, probe, engine, ctx.cache_dir, ctx.progress)
        shifts = CONFIDENCE_SOURCES[settings.confidence](candidates, inputs)
        utility = None
        if needs_utility:
            # rag's answer settings: the same prompts get the same cached answers as Table 2's Top-1 rows.
            store = answers.store(prompted, ctx.cache_dir, ctx.progress)
            utility = candidate_utility(store, candidates)
    finally:
        del engine, llm, prompted
        gc.collect()
    # One split by question for every rule: each rule's Table 1 holds out the same questions.
    test_qids = {
        r["qid"]
        for r in split_by_question([{"qid": c.qid} for c in candidates], float(settings.test_fraction), ctx.seed)[
            "test"
        ]
    }
    splits_by_rule, drops = {}, {}
    for rule in settings.rules:
        kept, drops[rule] = build_rows(candidates, shifts, settings.reference, settings.top_k, rule, utility)
        splits_by_rule[rule] = split_rows(kept, test_qids)
    splits = splits_by_rule[settings.selection]
    report = {
        **dataset_report(
            candidates,
            shifts,
            settings.top_k,
            splits,
            settings.reference,
            drops[settings.selection],
            settings.selection,
            utility,
        ),
        "retrieval": retrieval_stats,
        "rules": {
            rule: {"rows": {s: len(r) for s, r in sp.items()}, "dropped": drops[rule]}
            for rule, sp in splits_by_rule.items()
        },
    }
    share_positive = report["by_reference"][settings.reference]["share_positive"]
    for rule in settings.rules:
        sparse = sparse_rule_message(RULES[rule], drops[rule], len(candidates), share_positive, settings.reference)
        if sparse:
            log.warning(sparse)
    key = fingerprint(
        {
            "rows": splits_by_rule,
            "probe": probe.meta.get("activations", {}).get("key"),
            "confidence": settings.confidence,
        }
    )
    ctx.on_main(save_nq_rerank, splits_by_rule, settings.selection, report, ctx.output_dir / "nq_rerank")
    return PreferenceStage(candidates, splits, splits_by_rule, report, key, utility)


def save_nq_rerank(
    splits_by_rule: dict[str, dict[str, list[dict]]], selection: str, report: dict, folder: Path
) -> None:
    """The selection rule's rows in `folder`, each other compared rule's in `folder/<rule>`, and the report."""
    save_rows(splits_by_rule[selection], folder)
    for rule, rule_splits in splits_by_rule.items():
        if rule != selection:
            save_rows(rule_splits, folder / rule)
    atomic_write_text(folder / "report.json", json.dumps(report, indent=2, ensure_ascii=False))
