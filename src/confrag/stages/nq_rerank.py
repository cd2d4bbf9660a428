"""The NQ_Rerank stage: a sample of the probe's questions → candidates → confidence shifts → rows.

The questions are a seeded sample of the probe's, so their QA states H(Q) come from the probe stage's
activation cache (read, not recomputed); the candidate states are one resumable activation artifact.
The rows are written to `<run>/nq_rerank/` (JSONL + Arrow) beside `report.json`.
"""

from __future__ import annotations

import gc
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from confrag.artifacts import atomic_write_text, fingerprint
from confrag.data.splits import select_questions
from confrag.llm.hidden_states import HiddenStateEngine
from confrag.llm.loading import LLMConfig, load_llm
from confrag.llm.prompts import PromptTemplates
from confrag.preferences import REFERENCES, build_rows, confidence_shifts, dataset_report, save_rows, split_by_question
from confrag.probe.datamodule import NQConfidenceDataModule
from confrag.probe.module import SavedProbe
from confrag.retrieval import Candidates
from confrag.stages.retrieval import Retrieval, question_candidates


@dataclass(frozen=True)
class PreferenceSettings:
    """The `preferences` config node."""

    num_questions: int | None = 300  # a seeded sample of the probe's questions; None = all
    top_k: int = 5  # K: top-K contexts with Inc > 0 are pos, top-K with Inc < 0 neg
    reference: str = "qa"  # qa (the paper) | rag_empty (RAG prompt with an empty context)
    test_fraction: float = 0.2  # questions held out for Table 1
    relevance_baseline: bool = True  # also fine-tune on relevance labels: the ablation row
    extract_batch_size: int = 16

    def __post_init__(self) -> None:
        problems = []
        if self.reference not in REFERENCES:
            problems.append(f"preferences.reference={self.reference!r} is not one of {REFERENCES}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 1:
            problems.append(f"preferences.top_k must be an integer >= 1 (got {self.top_k!r})")
        if not 0 < float(self.test_fraction) < 1:
            problems.append(f"preferences.test_fraction must be in (0, 1) (got {self.test_fraction})")
        if problems:
            raise ValueError("; ".join(problems))


@dataclass
class PreferenceStage:
    candidates: list[Candidates]  # every preference question, retrieval order, duplicates removed
    splits: dict[str, list[dict]]  # NQ_Rerank rows by split
    report: dict[str, Any]
    key: str  # identity of the rows: everything that produced them


def build_nq_rerank(settings: PreferenceSettings, llm_config: LLMConfig | dict, templates: PromptTemplates,
                    probe: SavedProbe, probe_data: NQConfidenceDataModule, retrieval: Retrieval,
                    candidates_path: str | None, cache_dir: str | Path, seed: int, out: Path,
                    progress: bool = True) -> PreferenceStage:
    """NQ_Rerank for a seeded sample of the probe's questions (so H(Q) comes from the probe's cache)."""
    probe_rows = probe_data.data.rows
    rows = select_questions(probe_rows, settings.num_questions, seed)
    candidates, retrieval_stats = question_candidates(retrieval, rows, candidates_path)
    position = {row.qid: i for i, row in enumerate(probe_rows)}
    qa_states = probe_data.data.stores["qa"].take(probe.layer, [position[r.qid] for r in rows])

    llm = load_llm(llm_config)
    engine = HiddenStateEngine(llm.model, llm.tokenizer, batch_size=int(settings.extract_batch_size), progress=progress)
    try:
        shifts = confidence_shifts(llm, templates, probe, candidates, engine=engine, cache_dir=cache_dir,
                                   qa_states=qa_states, progress=progress)
    finally:
        del engine, llm
        gc.collect()
    rows_all, drops = build_rows(candidates, shifts, settings.reference, settings.top_k)
    splits = split_by_question(rows_all, float(settings.test_fraction), seed)
    report = {**dataset_report(candidates, shifts, settings.top_k, splits, settings.reference, drops),
              "retrieval": retrieval_stats}
    key = fingerprint({"rows": splits, "probe": probe.meta.get("activations", {}).get("key")})
    save_rows(splits, out / "nq_rerank")
    atomic_write_text(out / "nq_rerank" / "report.json", json.dumps(report, indent=2, ensure_ascii=False))
    return PreferenceStage(candidates, splits, report, key)
