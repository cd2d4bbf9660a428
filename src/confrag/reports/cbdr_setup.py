"""The cbdr report's opening lines: what the cached stage was built from and the evaluation questions (the base
reranker and the candidates are stated as the rerank task states them: `reports.rerank`)."""

from __future__ import annotations

from confrag.probe.module import metric_text
from confrag.stages.rerank import RerankStage


def stage_line(stage: RerankStage) -> str:
    """What the cached stage was built from: the probe's data and test scores, NQ_Rerank's size."""
    meta, report = stage.probe.meta, stage.preferences.report
    data, metrics = meta.get("nq_confidence", {}), meta.get("metrics", {})
    scores = ", ".join(
        f"{k.split('/')[1]} {metric_text(metrics[k])}" for k in ("test/acc", "test/auroc") if k in metrics
    )
    examples = (
        "balanced examples"
        if stage.probe_data.balance
        else "examples (every state, loss weighted by class)"
        if stage.probe.meta.get("class_weights")
        else "examples (every state)"
    )
    return (
        f"Stage: probe on layer {stage.probe.layer} from {data.get('questions', '?')} questions "
        f"({examples} train {data.get('train/examples', '?')} / dev {data.get('dev/examples', '?')} / "
        f"test {data.get('test/examples', '?')}; test {scores}); NQ_Rerank from {report['questions']} other "
        f"questions: {report['rows']['train']} train / {report['rows']['test']} test rows "
        f"(rule {report.get('selection', 'sign')}, reference {report['reference']})."
    )


def evaluation_pool_line(stage: RerankStage, eval_file: str | None = None) -> str:
    """Which questions the evaluation drew from, and why none of them trained what answers it (`eval_file`: the
    file's name when they come from `eval.nq_path`)."""
    if eval_file:
        return (
            f"from the evaluation file {eval_file} (eval.nq_path), checked before the run against every question "
            "the probe, the base reranker and the rerankers train on"
        )
    folds = stage.questions.folds
    if not folds:
        return "no stage trained on (not the probe's, not the preference questions, not the base reranker's)"
    return (
        f"cross-fitted over {len(folds)} folds of the {len(stage.questions.preference)} questions neither the probe "
        f"nor the base reranker uses (folds of {', '.join(str(len(f)) for f in folds)}): each question is answered "
        "by aligned rerankers trained on the other folds' preference rows only"
    )
