"""The cbdr report's "From probe to answer": every link from the probe to the answers on one dataset's test
questions, one line each."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from confrag.reranker.systems import ORACLE, PROBE, label
from confrag.stages.evaluation import NQ
from confrag.stages.rerank import RerankStage


def pct(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.1f} %"


def probe_ranking_cell(d: dict[str, Any]) -> str:
    """Where the probe ranks the question's own ¶: unknown where no question's own paragraph is known (a corpus of
    your own), none retrieved, or the share first with chance and the mean rank."""
    if d.get("questions_with_gold_known") == 0:
        return "own ¶ ranked first by Conf(Q + C): unknown (no question's own paragraph is known in this corpus)"
    if not d.get("questions_with_gold_retrieved"):
        return "own ¶ ranked first by Conf(Q + C): — (no question's own paragraph among its candidates)"
    return (
        f"own ¶ ranked first by Conf(Q + C) (chance {pct(d['chance_gold_first'])}, "
        f"mean rank {d['probe_gold_mean_rank']:.1f})"
    )


def chain_intro(diagnostics: dict[str, dict[str, Any]], dataset: str = NQ) -> str:
    """What the chain below measures: the probe's own links and the oracle only where the run measured them."""
    if diagnostics.get(dataset):
        return (
            "Each link of the method measured on the same test questions: does the probe's confidence under a "
            "retrieved context predict the LLM's answer, does it rank the question's own ¶ first, do the labels "
            "built from it put the own ¶ among the positives, and what the rankers trained on them give as answers. "
            "The utility oracle is an upper bound, not a method."
        )
    return (
        "Each link of the method this run measured: do the labels built from the probe's confidence put the "
        "question's own ¶ among the positives, and what the rankers trained on them give as answers on the test "
        "questions. The probe's own links (its AUROC on retrieved contexts, the probe as a reranker) and the utility "
        "oracle are measured with eval.diagnostics=true; this run left them out."
    )


def chain_markdown(
    stage: RerankStage, rows2: list[dict], diagnostics: dict[str, dict[str, Any]], ks: Sequence[int], dataset: str = NQ
) -> str:
    """Every link from probe to answer on one dataset's test questions, one line each: the probe on retrieved
    contexts, the labels each rule builds from it, the rankers trained on them, the answers they lead to."""
    by_id = {r["id"]: r for r in rows2 if r["dataset"] == dataset}
    k1 = ks[0]

    def answer_cells(system: str) -> str:
        row = by_id.get(system)
        if row is None:
            return "not in Table 2"
        gold = f"own ¶ in Top-{k1} {pct(row.get(f'gold_top{k1}'))}, " if f"gold_top{k1}" in row else ""
        held = row.get(f"top{k1}_p_holm")
        if f"gold_top{k1}" in row and row[f"gold_top{k1}"] is None:
            gold = "own ¶ unknown, "
        return f"{gold}Top-{k1} {row[f'top{k1}'].format()}" + ("" if held is None else f" (Holm p vs base {held:.3f})")

    d = diagnostics.get(dataset, {})
    report = stage.preferences.report
    # Whether any preference question's own paragraph is known (not with a corpus of your own): else "unknown".
    gold_known = any(c.gold_source is not None for c in stage.preferences.candidates)
    lines = [f"| link | measured as | {dataset} test |", "| --- | --- | --- |"]
    if d:
        auroc = d["probe_auroc_on_candidates"]
        lines.append(
            f"| probe on retrieved contexts | AUROC of Conf(Q + C) against the LLM's answer under C "
            f"({d['candidates']} candidates; {pct(d['correct_share'])} of them make it right) | "
            f"{'undefined (one class)' if auroc is None else f'{auroc:.3f}'} |"
        )
        lines.append(
            f"| {label(PROBE)} | {probe_ranking_cell(d)}; answers | "
            f"{pct(d['probe_gold_first']) if d.get('questions_with_gold_known') != 0 else 'unknown'}; "
            f"{answer_cells(PROBE)} |"
        )
    trained = report.get("rules", {})
    for rule, r in report.get("by_selection", {}).items():
        # Every rule's labels are measured (cheap); only the compared rules get a reranker and a row below.
        untrained = "" if not trained or rule in trained else " (no reranker: not in preferences.compare)"
        placed = (
            f"{pct(r['gold']['gold_in_pos_rate'])} / {pct(r['gold']['gold_in_neg_rate'])}" if gold_known else "unknown"
        )
        lines.append(
            f"| labels: rule {rule}{untrained} | NQ_Rerank questions: gold passage in pos / neg, rows kept | "
            f"{placed}, {r['kept']} |"
        )
    for system in [s for s in by_id if s not in (PROBE, ORACLE)]:
        lines.append(f"| ranker: {label(system)} | answers | {answer_cells(system)} |")
    if d:
        lines.append(
            f"| {label(ORACLE)} | answers ({pct(d['questions_with_a_correct_candidate'])} of "
            f"questions have a candidate that makes the LLM right) | "
            f"{answer_cells(ORACLE)} |"
        )
    return "\n".join(lines)
