"""The cbdr report's answers: Table 2 (with how often the question's own paragraph is among the contexts),
the closed-book line, and has_answer beside exact match and token F1."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from confrag.cbdr.settings import CBDRSettings
from confrag.rag import QuestionOutcome, accuracy_ci, table2_markdown, table2_rows
from confrag.reranker.systems import label, labelled

Outcomes = dict[str, dict[str, list[QuestionOutcome]]]  # dataset -> system id -> outcomes


def table2(
    llm_name: str,
    runs: Outcomes,
    settings: CBDRSettings,
    n_resamples: int,
    seed: int,
    gold_of: dict[str, dict[str, str | None]] | None = None,
) -> tuple[list[dict], str]:
    """Table 2's rows (and Markdown) from outcomes by system id; with `gold_of` (dataset -> qid -> source id of
    the question's own paragraph) each row also says how often that paragraph is among the Top-K contexts (None,
    "unknown" in the table, where no question's own paragraph is known: a corpus of your own)."""
    keyed = {
        (llm_name, reranker, dataset): outcomes
        for dataset, by_reranker in runs.items()
        for reranker, outcomes in by_reranker.items()
    }
    rows = table2_rows(
        keyed,
        settings.base,
        settings.ks,
        settings.eval_metric,
        n_resamples,
        seed,
        expected_discordance=settings.expected_discordance,
    )
    for row in rows:
        sources = (gold_of or {}).get(row["dataset"])
        if sources:
            outcomes = runs[row["dataset"]][row["reranker"]]
            known = any(source is not None for source in sources.values())
            row.update({f"gold_top{k}": gold_in_contexts(outcomes, k, sources) if known else None for k in settings.ks})
    rows = [labelled(row, "reranker") for row in rows]  # the label in `reranker`, the id in `id`
    return rows, table2_markdown(rows, label(settings.base), settings.ks)


def closed_book_line(runs: Outcomes, metric: str, n_resamples: int, seed: int) -> str:
    """The LLM alone (QA prompt) on the same questions: the floor retrieval has to beat."""
    parts = []
    for dataset, by_reranker in runs.items():
        outcomes = next(iter(by_reranker.values()))
        acc = accuracy_ci([getattr(o.closed_book, metric) for o in outcomes], n_resamples=n_resamples, seed=seed)
        parts.append(f"{dataset} {acc.format()}")
    return f"Closed-book (QA prompt, no retrieval) {metric}: " + ", ".join(parts) + "."


def own_paragraph_flags(
    outcomes: Sequence[QuestionOutcome], k: int, gold_of: dict[str, str | None] | None = None
) -> list[bool]:
    """Per question, in order: is its own paragraph among its Top-k contexts (a context id `<source>#<n>` whose
    source is the question's gold document: `gold_of`, qid -> source id; without it, the question's qid)."""

    def own(o: QuestionOutcome) -> bool:
        source = gold_of.get(o.qid) if gold_of is not None else o.qid
        return source is not None and any(c.rsplit("#", 1)[0] == source for c in o.rag[k].contexts)

    return [own(o) for o in outcomes]


def gold_in_contexts(
    outcomes: Sequence[QuestionOutcome], k: int, gold_of: dict[str, str | None] | None = None
) -> float:
    """Share of questions whose own paragraph is among their Top-k contexts (`own_paragraph_flags`)."""
    return float(np.mean(own_paragraph_flags(outcomes, k, gold_of))) if outcomes else 0.0


def secondary_markdown(
    runs: Outcomes, ks: Sequence[int], gold_known: bool = False, gold_of: dict[str, dict[str, str | None]] | None = None
) -> str:
    """has_answer beside exact match and token F1 (means, %), per dataset, reranker and K; with `gold_known`
    (passages cut from the questions' own paragraphs, ids `<qid>#<n>`) also how often the question's own
    paragraph is among the K contexts."""
    header = [f"Top-{k} has_answer / EM / F1" for k in ks] + ([f"own ¶ in Top-{k}" for k in ks] if gold_known else [])
    lines = ["| Dataset | Reranker | " + " | ".join(header) + " |", "|" + " --- |" * (2 + len(header))]
    for dataset, by_reranker in runs.items():
        for reranker, outcomes in by_reranker.items():
            cells = [
                " / ".join(
                    f"{100 * np.mean([float(getattr(o.rag[k], m)) for o in outcomes]):.1f}"
                    for m in ("has_answer", "em", "f1")
                )
                for k in ks
            ]
            if gold_known:
                sources = (gold_of or {}).get(dataset)
                cells += [f"{100 * gold_in_contexts(outcomes, k, sources):.1f}" for k in ks]
            lines.append(f"| {dataset} | {label(reranker)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
