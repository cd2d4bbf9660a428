"""The rerank task's report: NQ_Rerank's summary, Table 1 (table1.md, summary.txt, metrics.json, W&B)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning.pytorch.loggers import Logger

from confrag.infra.atomic import atomic_write_text
from confrag.reports.small_samples import small_mark
from confrag.reports.tables import log_rows, markdown_table, wandb_loggers
from confrag.retrieval.lengths import budget_line


def rules_summary(report: dict[str, Any]) -> str:
    """Per label rule (with the run's reference): rows kept and where the question's gold passage lands."""
    lines = []
    for rule, r in report.get("by_selection", {}).items():
        rows = report.get("rules", {}).get(rule, {}).get("rows", {})
        split = f" (train {rows['train']} / test {rows['test']})" if rows else ""
        lines.append(
            f"  rule {rule:8}: kept {r['kept']:4} rows{split}, gold passage in pos "
            f"{100 * r['gold']['gold_in_pos_rate']:.1f}% / neg {100 * r['gold']['gold_in_neg_rate']:.1f}% "
            f"(of {r['gold']['questions_with_gold']} questions trained on with gold retrieved)"
        )
    if "utility" in report:
        u = report["utility"]
        lines.append(
            f"  utility: the LLM answers correctly under {100 * u['correct_share']:.1f}% of the "
            f"{u['candidates']} candidates; {100 * u['questions_with_a_correct_candidate']:.1f}% of the "
            "questions have at least one such candidate"
        )
    return "\n".join(lines)


def base_line(info: dict[str, Any]) -> str:
    """What the base reranker is (the stage's `training["base"]`), in every report that names it."""
    if not info.get("trained"):
        return "the backbone as it is" + (f" ({info['kind']})" if info.get("kind") else "")
    return (
        f"trained on {info['rows']} relevance rows of {info['questions']} questions no other stage uses, "
        f"{info.get('steps', '?')} steps, {info.get('train_seconds', float('nan')):.0f} s"
    )


def retrieval_line(stats: dict[str, Any]) -> str:
    """How often the retrieved candidates hold the question's gold paragraph and a gold answer (the retrieval
    stage's `question_candidates` statistics), in every report that states it."""
    joined = stats.get("eval_file")  # eval.questions_path: its paragraphs joined the corpus (stages.retrieval)
    known = stats.get("gold_known", 1.0)
    if known == 0:  # "0 %" would read as a measurement: nothing names the questions' paragraphs
        gold = "the question's gold paragraph is unknown (no question's gold document is named: gold_source), "
    elif known < 1:
        gold = (
            f"the question's gold paragraph is among them for {100 * stats['gold_retrieved'] / known:.0f} % of the "
            f"{100 * known:.0f} % of questions whose gold document is known, "
        )
    else:
        gold = f"the question's gold paragraph is among them for {100 * stats['gold_retrieved']:.0f} % of questions, "
    depth = stats.get("file_depth")  # a candidates file's lists, cut to retrieval.top_n (stages.retrieval)
    return (
        (gold + f"a gold answer string for {100 * stats['answer_in_candidates']:.0f} %")
        + (
            f" (the evaluation file's paragraphs joined the corpus: {joined['with_paragraph']} of its "
            f"{joined['questions']} questions have one, {joined['documents_added']} documents added, the rest already "
            "there)"
            if joined
            else ""
        )
        + (
            f"; the candidates file's lists cut to their first {depth['top_n']} (retrieval.top_n) for "
            f"{depth['lists_cut']} questions (the file gives up to {depth['file_longest']})"
            if depth and depth["lists_cut"]
            else ""
        )
    )


def base_summary(info: dict[str, Any]) -> str:
    """summary.txt's base line: `base_line` and, for this run, what was dropped and whether it was trained now."""
    if not info.get("trained"):
        return f"  base reranker: {base_line(info)} (base_reranker.train=false)"
    cached = ", read from the cache" if info.get("cached") else ""
    return f"  base reranker: {base_line(info)} (questions dropped: {info['dropped']}{cached})"


def lengths_line(stats: dict[str, Any]) -> str | None:
    """The passages' lengths against each model's budget (`question_candidates`' `passage_lengths`), if measured:
    the LLM's cuts (`retrieval.cut_passages`), and what the dense encoder (over the corpus) and the reranker (over
    these candidates) never read."""
    lengths = stats.get("passage_lengths")
    if not lengths:
        return None
    parts = []
    if "llm" in lengths:
        llm = lengths["llm"]
        parts.append(f"LLM: {llm['cut']} of {llm['passages']} corpus passages cut to {llm['limit']} tokens")
    if "dense_encoder" in lengths:
        parts.append(f"corpus {budget_line('dense encoder', lengths['dense_encoder'])}")
    if "reranker" in lengths:
        parts.append(f"candidate {budget_line('reranker', lengths['reranker'])}")
    return "  passage lengths: " + "; ".join(parts) if parts else None


def nq_rerank_summary(report: dict[str, Any]) -> str:
    """Sizes, drops, retrieval and, per reference and per rule, where the gold passage lands."""
    by_ref = "\n".join(
        f"  reference {ref:9}: kept {r['kept']:4} rows, Inc>0 for {100 * r['share_positive']:.1f}% of contexts, "
        f"gold passage in pos {100 * r['gold']['gold_in_pos_rate']:.1f}% / "
        f"neg {100 * r['gold']['gold_in_neg_rate']:.1f}% "
        f"(of {r['gold']['questions_with_gold']} questions trained on with gold retrieved)"
        for ref, r in report["by_reference"].items()
    )
    return "\n".join(
        [
            f"NQ_Rerank — {report['questions']} questions, rows train {report['rows']['train']} / test "
            f"{report['rows']['test']}, dropped {report['dropped']}",
            f"  candidates: {retrieval_line(report['retrieval'])}, "
            f"{report['retrieval']['duplicate_passages_removed']} duplicate passages removed",
            *filter(None, [lengths_line(report["retrieval"])]),
            by_ref,
            rules_summary(report),
        ]
    )


def own_rows_summary(report: dict[str, Any]) -> str:
    """Your rows: the file, its queries and how they were split."""
    scores = "with teacher scores" if report["teacher_scores"] else "without teacher scores"
    return (
        f"Your rows — {report['rows_path']}: {report['queries']} queries, rows train {report['rows']['train']} / "
        f"held out {report['rows']['test']} (split by query), {scores}"
    )


def write_rerank_report(
    out: Path,
    llm_name: str,
    report: dict[str, Any],
    test_questions: int,
    rows: list[dict],
    metrics: dict[str, float],
    training: dict[str, Any],
    loggers: Sequence[Logger],
) -> str:
    """table1.md, summary.txt and metrics.json (`metrics`: the main reranker's test metrics, what a sweeper and
    the sweep summary read, beside Table 1, the training and NQ_Rerank's report)."""
    if "rows_path" in report:  # your own rows (confrag.stages.own_rows)
        title = f"Table 1 — held-out queries of {report['rows_path']} ({test_questions} queries)"
        summary = own_rows_summary(report)
    else:
        title = (
            f"Table 1 — {llm_name}, NQ_Rerank test split ({test_questions} questions{small_mark(test_questions)}; "
            f"reference {report['reference']}, rule {report['selection']}, K={report['top_k']})"
        )
        summary = nq_rerank_summary(report)
    table = markdown_table(rows, title)
    text = "\n".join([summary, base_summary(training.get("base", {})), "", table])
    atomic_write_text(out / "table1.md", table + "\n")
    atomic_write_text(out / "summary.txt", text + "\n")
    atomic_write_text(
        out / "metrics.json",
        json.dumps(
            {"metrics": metrics, "table1": rows, "training": training, "nq_rerank": report},
            indent=2,
            ensure_ascii=False,
        ),
    )
    for logger in wandb_loggers(loggers):
        log_rows(logger, "table1", rows)
    return text
