"""What a question set without gold paragraphs cannot feed, refused once with every setting that reads them.

A question file in FlashRAG's format (`{id, question, golden_answers}`) carries no gold paragraph ("ctxs"). The
settings that read one (the probe's ranking sets and gold-paragraph states, the gold paragraphs as the corpus, the
base reranker's relevance rows, the perfect-relevance control) are each a `GoldNeed`: the setting with its value,
what reads the paragraphs, and the override that does without. `refuse_without_gold` names all of them at once,
with the overrides on one line, before any stage runs: each stage used to refuse its own, one run at a time.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from confrag.data.jsonl import DataFormatError
from confrag.data.nq import QARow


class GoldNeed(NamedTuple):
    """A setting that reads each question's gold paragraph, and the overrides that do without it."""

    setting: str  # `key=value (what reads the gold paragraphs)`
    fix: str  # the overrides that do without, as one would type them
    alternative: str = ""  # another way out, in words

    def __str__(self) -> str:
        return f"{self.setting}: set {self.fix}" + (f", or {self.alternative}" if self.alternative else "")


def refuse_without_gold(path: str, rows: Sequence[QARow], needs: Sequence[GoldNeed | str], advice: str = "") -> None:
    """Refuse a question file none of whose questions has a gold paragraph when `needs` is not empty: every need
    (a `GoldNeed`, or a sentence when nothing does without), the overrides of all of them on one line, `advice`."""
    if not needs or any(r.contexts for r in rows):
        return
    fixes = " ".join(need.fix for need in needs if isinstance(need, GoldNeed))
    raise DataFormatError(
        f'{path}: none of its {len(rows)} questions has a gold paragraph ("ctxs"), which '
        + ("these settings read: " if any(isinstance(need, GoldNeed) for need in needs) else "")
        + "; ".join(str(need) for need in needs)
        + (f". All at once: {fixes}" if len(needs) > 1 and fixes else "")
        + (f" ({advice})" if advice else "")
    )
