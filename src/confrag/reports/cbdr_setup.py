"""The cbdr report's opening lines: how to read it, what the cached stage was built from, the evaluation questions
(the base reranker and the candidates are stated as the rerank task states them: `reports.rerank`) and what Table
1's labels are."""

from __future__ import annotations

import numpy as np

from confrag.probe.module import metric_text
from confrag.reranker.label_rules import RULES
from confrag.stages.rerank import RerankStage


def reading_guide(gold_known: bool) -> str:
    """The terms the tables share, defined once, and why Tables 1 and 2 can disagree."""
    own = (
        "**Own ¶** (the question's own paragraph): the paragraph of the question's Wikipedia page that holds its "
        "gold answer; **own ¶ in Top-K**: the share of questions whose own ¶ is among the K passages a ranker puts "
        "first (**own ¶ first**: K = 1)."
        if gold_known
        else "Own ¶ (the question's own paragraph) is not known for this corpus: no column counts it."
    )
    return (
        "How to read it: **Table 1 and Table 2 measure different things on different questions.** Table 1 ranks the "
        "candidates of NQ_Rerank's test questions against the labels the probe's confidence gave them: it measures "
        "agreement with the probe, not whether a passage helps the LLM. Table 2 asks the LLM the evaluation test "
        "questions with a ranker's Top-K passages as contexts and scores its answers (has_answer: a gold answer "
        "string appears in the answer). So a ranker can trail BM25 in Table 1 and lead it in Table 2, or the "
        f"reverse. {own} **Holm p**: the exact McNemar test against the base reranker on the same questions, "
        "Holm-corrected across the rows compared with it; it is the only p-value in the tables."
    )


def stage_line(stage: RerankStage) -> str:
    """What the cached stage was built from: the probe's data and test scores, NQ_Rerank's size."""
    meta, report = stage.probe.meta, stage.preferences.report
    data, metrics = meta.get("nq_confidence", {}), meta.get("metrics", {})
    scores = ", ".join(
        f"{k.split('/')[1]} {metric_text(metrics[k])}" for k in ("test/acc", "test/auroc") if k in metrics
    )
    examples = (
        "balanced examples"
        if stage.probe_data.splits.balance
        else "examples (every state, loss weighted by class)"
        if stage.probe.meta.get("class_weights")
        else "examples (every state)"
    )
    return (
        f"Stage: probe on layer {stage.probe.layer} from {data.get('questions', '?')} questions "
        f"({examples} train {data.get('train/examples', '?')} / dev {data.get('dev/examples', '?')} / "
        f"test {data.get('test/examples', '?')}; test {scores}); NQ_Rerank from {report['questions']} other "
        f"questions: {report['rows']['train']} train / {report['rows']['test']} test rows "
        f"(rule {report['selection']}, reference {report['reference']})."
    )


def evaluation_pool_line(stage: RerankStage, eval_file: str | None = None) -> str:
    """Which questions the evaluation drew from, and why none of them trained what answers it (`eval_file`: the
    file's name when they come from `eval.questions_path`)."""
    if eval_file:
        return (
            f"from the evaluation file {eval_file} (eval.questions_path), checked before the run against every "
            "question the probe, the base reranker and the rerankers train on"
        )
    folds = stage.questions.folds
    if not folds:
        return "no stage trained on (not the probe's, not the preference questions, not the base reranker's)"
    return (
        f"cross-fitted over {len(folds)} folds of the {len(stage.questions.preference)} questions neither the probe "
        f"nor the base reranker uses (folds of {', '.join(str(len(f)) for f in folds)}): each question is answered "
        "by aligned rerankers trained on the other folds' preference rows only"
    )


def table1_labels_line(stage: RerankStage) -> str:
    """What Table 1's labels are, and how much a random order already gets of P@1 (why its rows often tie)."""
    rule = stage.preferences.report["selection"]
    rows = stage.table1_rows
    positives = np.array([len(r["pos"]) for r in rows], dtype=float)
    negatives = np.array([len(r["neg"]) for r in rows], dtype=float)
    if not rows:
        return f"Labels of rule {rule}: no test question kept a row, so Table 1 is empty."
    chance = float(np.mean(positives / np.maximum(positives + negatives, 1)))
    return (
        f"Labels: each question's candidates as rule `{rule}` labels them ({RULES[rule].description}; Conf(Q + C): "
        f"the probe's confidence that the LLM answers Q right with passage C; Inc: Conf(Q + C) minus its confidence "
        f"under the reference prompt), {positives.mean():.1f} positive and {negatives.mean():.1f} negative a "
        f"question. P/R/MRR@K count the positives a ranker puts in its top K: agreement with these labels, not with "
        f"the own ¶ or the LLM's answers. On average {100 * chance:.1f} % of a question's candidates are positive, "
        f"so a random order already puts a positive first that often; with {len(rows)} questions P@1 moves in "
        f"steps of {100 / len(rows):.2f} points, and rows that all put a positive first on the same questions tie."
    )
