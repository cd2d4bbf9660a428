"""The rerank task's report: NQ_Rerank's summary, Table 1 (table1.md, summary.txt, metrics.json, W&B)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from lightning.pytorch.loggers import Logger

from confrag.artifacts import atomic_write_text
from confrag.reports.tables import log_rows, markdown_table, wandb_loggers


def nq_rerank_summary(report: dict[str, Any]) -> str:
    """Sizes, drops, retrieval and, per reference, where the gold passage lands."""
    by_ref = "\n".join(
        f"  reference {ref:9}: kept {r['kept']:4} rows, Inc>0 for {100 * r['share_positive']:.1f}% of contexts, "
        f"gold passage in pos {100 * r['gold']['gold_in_pos_rate']:.1f}% / neg {100 * r['gold']['gold_in_neg_rate']:.1f}% "
        f"(of {r['gold']['questions_with_gold']} questions with gold retrieved)"
        for ref, r in report["by_reference"].items())
    return "\n".join([
        f"NQ_Rerank — {report['questions']} questions, rows train {report['rows']['train']} / test "
        f"{report['rows']['test']}, dropped {report['dropped']}",
        "  retrieval: gold passage retrieved for {:.1f} % of questions, an answer-bearing passage for {:.1f} %, "
        "{} duplicate passages removed".format(100 * report["retrieval"]["gold_retrieved"],
                                             100 * report["retrieval"]["answer_in_candidates"],
                                             report["retrieval"]["duplicate_passages_removed"]),
        by_ref])


def write_rerank_report(out: Path, llm_name: str, report: dict[str, Any], test_questions: int, rows: list[dict],
                        training: dict[str, Any], loggers: Sequence[Logger]) -> str:
    title = (f"Table 1 — {llm_name}, NQ_Rerank test split ({test_questions} questions; "
             f"reference {report['reference']}, K={report['top_k']})")
    table = markdown_table(rows, title)
    text = "\n".join([nq_rerank_summary(report), "", table])
    atomic_write_text(out / "table1.md", table + "\n")
    atomic_write_text(out / "summary.txt", text + "\n")
    atomic_write_text(out / "metrics.json", json.dumps({"table1": rows, "training": training, "nq_rerank": report},
                                                       indent=2, ensure_ascii=False))
    for logger in wandb_loggers(loggers):
        log_rows(logger, "table1", rows)
    return text
