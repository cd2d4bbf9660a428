"""The rerank task on your own preference rows (`preferences.rows_path`): a FlagEmbedding-format JSONL file
(`query, pos, neg[, pos_scores, neg_scores, prompt]`, as this project exports NQ_Rerank) trains the aligned
reranker from the base, in place of the probe and NQ_Rerank.

The rows get the checks the project's own rows get (`confrag.reranker.rows.validate_row`: every field named
with its file and line when wrong, finite teacher scores in pairs, no passage on both sides), each side of a row
is cut to `preferences.rows_max_passages` (a seeded sample, named in the log), and the rows are split
by query (a query's rows, equal up to case, punctuation and articles, all on one side) into the rows that
train and the held-out ones Table 1 is measured on (`preferences.test_fraction`, seeded). Table 1 then has
the base and the aligned reranker (BM25 and the bi-encoder rows need a corpus the rows do not come with).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from lightning.pytorch.loggers import Logger

from confrag.data.qa_metrics import normalize_answer
from confrag.infra.run_context import RunContext
from confrag.reranker.preferences import split_by_question
from confrag.reranker.rows import load_rows
from confrag.reranker.systems import BASE, OWN_ROWS_FT
from confrag.stages.base_reranker import BaseReranker, ensure_base_reranker
from confrag.stages.rerankers import ensure_reranker, place_on_device
from confrag.stages.teachers import ROW_TEACHERS

ROWS_KEY = "preferences.rows_path"
CAP_KEY = "preferences.rows_max_passages"
log = logging.getLogger(__name__)


@dataclass
class OwnRows:
    """The rows as the task's report and exports read them (NQ_Rerank's `splits` and `report`)."""

    splits: dict[str, list[dict]]
    report: dict[str, Any]


@dataclass
class OwnRowsStage:
    """What the rerank task writes, from your rows: no probe, no retrieval."""

    preferences: OwnRows
    base: BaseReranker
    rerankers: dict[str, Any]
    scorers: dict[str, Any]
    training: dict[str, Any]
    main: str
    probe: None = None

    @property
    def table1_rows(self) -> list[dict]:
        return self.preferences.splits["test"]

    @property
    def table1_systems(self) -> dict[str, Any]:  # no diagnostic row reads your rows' answers
        return self.scorers


def check_own_rows_settings(recipe) -> None:
    """Settings that need the probe's candidates, which your rows do not come with, refused by key."""
    prefs = recipe.preferences
    needs = {
        "base_reranker.train=true (trained on the question file's retrieved passages)": recipe.base.train,
        "preferences.relevance_baseline=true (relevance labels of retrieved candidates)": prefs.relevance_baseline,
        "preferences.mix_relevance=true": prefs.mix_relevance,
        "preferences.select_on=dev_top1 (the LLM's answer under every candidate)": prefs.select_on == "dev_top1",
        "preferences.cross_fit > 0": bool(prefs.cross_fit),
        "preferences.compare (other label rules)": bool(prefs.compare),
    }
    refused = [what for what, on in needs.items() if on]
    if refused:
        raise ValueError(
            f"{ROWS_KEY}={prefs.rows_path}: your rows replace the probe's candidates, which these settings need: "
            f"{'; '.join(refused)}. Turn them off (+experiment=reranker_rows does), or leave {ROWS_KEY} null"
        )


def capped_rows(rows: list[dict], max_passages: int | None, seed: int, where: str) -> tuple[list[dict], int]:
    """Each row with at most `max_passages` positives and as many negatives: a longer side is cut to a seeded sample
    (file order kept, each passage with its teacher score), and each cut row is named in the log. A row of 10,000
    negatives otherwise had every one tokenized, scored by the teacher and the collapse check, and ranked in
    Table 1, silently for many minutes. Returns the rows and how many were cut."""
    if max_passages is None:
        return rows, 0
    out, cut = [], []
    for index, row in enumerate(rows):
        sizes = {side: len(row[side]) for side in ("pos", "neg")}
        if max(sizes.values()) <= max_passages:
            out.append(row)
            continue
        rng = np.random.default_rng([seed, index])
        row = dict(row)
        for side, n in sizes.items():
            if n > max_passages:
                keep = np.sort(rng.choice(n, max_passages, replace=False))
                for key in (side, f"{side}_scores"):
                    if row.get(key) is not None:
                        row[key] = [row[key][i] for i in keep]
        out.append(row)
        cut.append(f"row {index + 1} ({row['query'][:40]!r}: {sizes['pos']} positives, {sizes['neg']} negatives)")
    if cut:
        log.warning(
            "%s: %d of %d rows hold more than %d positives or negatives (%s), each side cut to a seeded sample of %d: "
            "%s%s",
            where,
            len(cut),
            len(rows),
            max_passages,
            CAP_KEY,
            max_passages,
            "; ".join(cut[:3]),
            "; ..." if len(cut) > 3 else "",
        )
    return out, len(cut)


def own_rows(path: str | Path, test_fraction: float, seed: int, max_passages: int | None) -> OwnRows:
    """The file's rows, checked, each side cut to `max_passages` (`capped_rows`), each given the id of its query
    (`q<n>`, by normalized text), split by query."""
    rows, cut = capped_rows(load_rows(str(path), ROWS_KEY), max_passages, seed, f"{ROWS_KEY}={path}")
    query_ids: dict[str, str] = {}
    tagged = []
    for row in rows:
        key = normalize_answer(row["query"])
        tagged.append({**row, "qid": query_ids.setdefault(key, f"q{len(query_ids)}")})
    splits = split_by_question(tagged, test_fraction, seed)
    if not splits["train"] or not splits["test"]:
        raise ValueError(
            f"{ROWS_KEY}={path}: {len(query_ids)} distinct queries split by preferences.test_fraction="
            f"{test_fraction} leave {len({r['qid'] for r in splits['train']})} to train and "
            f"{len({r['qid'] for r in splits['test']})} held out; both need at least one (more rows, or another "
            "fraction)"
        )
    report = {
        "rows_path": Path(path).name,
        "queries": len(query_ids),
        "rows": {split: len(r) for split, r in splits.items()},
        "teacher_scores": all(r.get("pos_scores") is not None for r in rows),
        "rows_cut": {"rows": cut, "max_passages": max_passages},
    }
    return OwnRows(splits, report)


def own_rows_stage(recipe, ctx: RunContext, loggers: list[Logger], run_config: dict | None = None) -> OwnRowsStage:
    """The base (the backbone as it is), fine-tuned on your rows' training split; Table 1's scorers."""
    from confrag.stages.rerank import table1_systems

    check_own_rows_settings(recipe)
    prefs = recipe.preferences
    data = own_rows(prefs.rows_path, prefs.test_fraction, ctx.seed, prefs.rows_max_passages)
    base = ensure_base_reranker(recipe.base, recipe.reranker, None, [], ctx)
    rows = ROW_TEACHERS[prefs.teacher].rewrite(data.splits["train"], base.module, recipe.reranker.eval_batch_size)
    module, info = ensure_reranker(
        recipe.reranker,
        ctx,
        rows,
        "own_rows",
        loggers,
        run_config,
        start_from=base.directory,
    )
    main = OWN_ROWS_FT
    rerankers = {BASE: base.module, main: module}
    place_on_device(recipe.reranker, rerankers.values())
    scorers = table1_systems(None, rerankers, recipe.reranker.eval_batch_size)
    training = {"base": base.info, "own_rows": info}
    return OwnRowsStage(data, base, rerankers, scorers, training, main)


def own_rows_card(report: dict[str, Any], table1: list[dict]) -> str:
    """README.md of the reranker exported from your rows: what it was trained on and its Table 1 rows."""
    lines = [
        f"# A reranker fine-tuned with confrag on {report['rows_path']}",
        "",
        f"Trained on {report['rows']['train']} rows and measured on {report['rows']['test']} held-out rows of other "
        f"queries ({report['queries']} queries in all, split by query), from the base reranker below. The rows are "
        "the user's: check their licence before sharing this model.",
        "",
        "| Reranker | " + " | ".join(k for k in table1[0] if k not in ("system", "id")) + " |",
        "|---|" + "---:|" * (len(table1[0]) - 2),
    ]
    for row in table1:
        values = [f"{v:.2f}" for k, v in row.items() if k not in ("system", "id")]
        lines.append(f"| {row['system']} | " + " | ".join(values) + " |")
    return "\n".join(lines) + "\n"
