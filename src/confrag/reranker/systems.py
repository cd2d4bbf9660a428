"""The systems that order a question's candidates (the rows of Tables 1-3, the rerankers CBDR and the gates
retrieve with): a short stable id for each, and its display label.

Code and config name a system by its id (`cbdr.reranker: confidence_ft.sign`, `eval.base_reranker: base`,
dictionary keys, outcome file names); the label is for a reader and appears only where text is rendered
(report.md, table1.md, model cards, the label field of metrics.json's rows, W&B tables). A label may then
change without touching a config, a cache or a dictionary key.
"""

from __future__ import annotations

from typing import Any

from confrag.infra import checks
from confrag.reranker.label_rules import RULES
from confrag.reranker.listwise_teachers import LISTWISE

BM25, BI_ENCODER = "bm25", "bi_encoder"  # the retrieval corpus's own scores
BASE, RELEVANCE_FT = "base", "relevance_ft"  # the base reranker; the base fine-tuned on relevance labels
CONFIDENCE_FT = "confidence_ft"  # the family `confidence_ft.<rule>`: the base fine-tuned on a label rule's rows
# The family `aligned.<teacher>`: a listwise student of an alignment teacher over the base's top k (`stages.alignment`)
ALIGNED = "aligned"
PROBE, ORACLE = "probe", "oracle"  # Table 2's diagnostic rows (`stages.diagnostics`), never chosen by config
FUSION = "fusion"  # z(base) + w·z(ℓ): Tables 1-2's diagnostic row that reads the gold answer, never chosen by config
OWN_ROWS_FT = "own_rows_ft"  # the base fine-tuned on the user's rows (preferences.rows_path; the rerank task only)

# The display label of every system id but the rule family's (see `label`).
LABELS = {
    BM25: "BM25",
    BI_ENCODER: "bi-encoder (MiniLM cosine)",
    BASE: "base reranker",
    RELEVANCE_FT: "base + relevance FT",
    PROBE: "probe as reranker",
    ORACLE: "utility oracle (upper bound)",
    FUSION: "fusion z(base) + w·z(ℓ) (reads the gold answer)",
    OWN_ROWS_FT: "base + FT on your rows",
}


def confidence_ft(rule: str) -> str:
    """The id of the base fine-tuned on the rows of label rule `rule` (`confrag.reranker.label_rules.RULES`)."""
    return f"{CONFIDENCE_FT}.{rule}"


def aligned(teacher: str) -> str:
    """The id of the base's listwise student of teacher `teacher` (`confrag.reranker.listwise_teachers`)."""
    return f"{ALIGNED}.{teacher}"


def label(system: str) -> str:
    """The display label of system id `system` (the families': `base + confidence FT (<rule>)`, `base aligned to
    <teacher> (listwise)`)."""
    family, dot, rule = system.partition(".")
    if dot and family == CONFIDENCE_FT and rule in RULES:
        return f"base + confidence FT ({rule})"
    if dot and family == ALIGNED and rule in LISTWISE:
        return f"base aligned to {rule} (listwise)"
    if system not in LABELS:
        raise ValueError(f"no system has the id {system!r}; ids: {', '.join(ALL)}")
    return LABELS[system]


# What a config may name as a reranker (a Table 1 row): every id but the diagnostic rows'.
TABLE1 = (
    BM25,
    BI_ENCODER,
    BASE,
    RELEVANCE_FT,
    *(confidence_ft(rule) for rule in RULES),
    *(aligned(teacher) for teacher in LISTWISE),
)
ALL = (*TABLE1, PROBE, ORACLE, FUSION, OWN_ROWS_FT)


def check_reranker(value: Any, key: str) -> str:
    """`value` if it is the id of a Table 1 row (`bm25`, `base`, `confidence_ft.sign`, ...), refused naming `key`
    and the ids otherwise. Whether this run builds that row (a compared rule, the relevance control, the
    bi-encoder) is checked again against the rows the run has."""
    return str(checks.choice(value, key, TABLE1, hint="(a Table 1 row's id; labels such as 'BM25' are for reports)"))


def labelled(row: dict[str, Any], field: str) -> dict[str, Any]:
    """A table row keyed by a system id in `field`, as written for readers: `field` holds the label, `id` the
    id (right after it)."""
    out: dict[str, Any] = {}
    for key, value in row.items():
        out[key] = label(value) if key == field else value
        if key == field:
            out["id"] = value
    return out
