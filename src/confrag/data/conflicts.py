"""Conflicting contexts: gold passages whose answer is swapped for another question's answer.

This is the entity-substitution construction of BRIDGE's FI category (after Longpre et al., 2021):
the passage stays fluent and on topic, but now supports a wrong answer, so retrieving it misleads.

For each question whose gold passage (its first context) contains one of its answers:

1. the *replaced* answer is the first gold answer found in the passage (qa_metrics.has_answer);
2. its *kind* is decided by a simple heuristic (`answer_kind`): year, date, number, name, other;
3. a substitute is drawn (seeded) from the replaced answers of other questions of the same kind; a
   candidate is skipped when it contains one of this question's answers or lies inside one (on token
   boundaries: "Washington" for "Washington D.C."), or when the swap would still leave a gold answer
   in the passage;
4. every occurrence of every gold answer in the title and text is replaced by the substitute, longest
   answer first, case-insensitively on whole words (answers are matched by their normalized tokens,
   so "Super Bowl LII," matches "Super Bowl LII" and "the pituitary gland" matches "pituitary gland",
   and by their raw words, so "Spider-Man" matches although it normalizes to "spiderman").

The passage is NFKC-normalized first (as has_answer compares NFKC text). The title is rewritten too,
because the RAG prompt shows it. Questions whose passage holds no answer, and those with no workable
substitute, are skipped and counted.
"""

from __future__ import annotations

import random
import re
import unicodedata
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from confrag.data.nq import Passage, QARow
from confrag.data.qa_metrics import has_answer, normalize_answer
from confrag.infra import checks

KINDS = ("year", "date", "number", "name", "other")
_MONTHS = (
    "january",
    "february",
    "march",
    "april",
    "may",
    "june",
    "july",
    "august",
    "september",
    "october",
    "november",
    "december",
)
_YEAR = re.compile(r"^\s*(1[0-9]{3}|20[0-9]{2})\s*$")
_NUMBER = re.compile(r"^\s*[$£€]?\s*\d[\d,.]*")
_MAX_TRIES = 20  # substitutes tried per question before giving up


def answer_kind(answer: str) -> str:
    """Year ("1994"), date (a month name and a digit), number (starts with a digit: "291 episodes"),
    name (every word capitalized: "Bianca Ryan"), else other ("beneath the liver")."""
    text = unicodedata.normalize("NFKC", answer).strip()
    lower = text.lower()
    if _YEAR.match(text):
        return "year"
    if any(ch.isdigit() for ch in text) and any(re.search(rf"\b{m}\b", lower) for m in _MONTHS):
        return "date"
    if _NUMBER.match(text):
        return "number"
    words = [w for w in re.findall(r"[^\W\d_]+", text)]
    if words and all(w[0].isupper() for w in words):
        return "name"
    return "other"


def _words_pattern(words: Sequence[str]) -> re.Pattern | None:
    if not words:
        return None
    return re.compile(r"(?<!\w)" + r"[\W_]+".join(re.escape(w) for w in words) + r"(?!\w)", re.IGNORECASE)


def answer_patterns(answer: str) -> list[re.Pattern]:
    """Whole-word, case-insensitive patterns for an answer, any non-word run between its words: one
    over its normalized tokens (articles and punctuation dropped, as has_answer compares), one over its
    raw word runs (so "Spider-Man", normalized to "spiderman", still matches in the passage)."""
    raw = _words_pattern(re.findall(r"[^\W_]+", unicodedata.normalize("NFKC", answer)))
    normalized = _words_pattern(normalize_answer(answer).split())
    return [p for p in (normalized, raw) if p is not None]


def substitute_answers(text: str, answers: Sequence[str], substitute: str) -> tuple[str, int]:
    """`text` with every occurrence of every answer (longest first) replaced; and the count."""
    total = 0
    for answer in sorted(set(answers), key=lambda a: -len(normalize_answer(a))):
        for pattern in answer_patterns(answer):
            # A function, so backslashes or group references in the substitute are taken literally.
            text, count = pattern.subn(lambda _match: substitute, text)
            total += count
    return text, total


@dataclass(frozen=True)
class ConflictExample:
    qid: str
    question: str
    answers: tuple[str, ...]  # the gold answers, still the correct ones
    original: Passage
    passage: Passage  # the gold passage with the substitute in place of the answer
    replaced_answer: str
    substitute: str
    kind: str
    donor_qid: str  # the question the substitute was taken from
    replacements: int

    def as_row(self) -> QARow:
        """The question with the conflicting passage as its only context (for the RAG pipeline)."""
        return QARow(qid=self.qid, question=self.question, answers=self.answers, contexts=(self.passage,))


@dataclass
class ConflictSet:
    examples: list[ConflictExample]
    skipped: Counter = field(default_factory=Counter)  # reason -> questions
    seed: int = 0

    def rows(self) -> list[QARow]:
        return [example.as_row() for example in self.examples]


def _nfkc(passage: Passage) -> Passage:
    return Passage(title=unicodedata.normalize("NFKC", passage.title), text=unicodedata.normalize("NFKC", passage.text))


def build_conflicts(rows: Sequence[QARow], seed: int = 0) -> ConflictSet:
    """The conflicting-context evaluation set of `rows` (see the module docstring)."""
    checks.integer(seed, "seed")
    skipped: Counter = Counter()
    usable: list[tuple[QARow, Passage, str]] = []  # (row, NFKC gold passage, replaced answer)
    for row in rows:
        if not row.contexts:
            skipped["no_passage"] += 1
            continue
        gold = _nfkc(row.contexts[0])
        found = next((a for a in row.answers if has_answer(f"{gold.title}\n{gold.text}", [a])), None)
        if found is None:
            skipped["answer_not_in_passage"] += 1
            continue
        usable.append((row, gold, found))
    donors: dict[str, list[tuple[str, str]]] = {kind: [] for kind in KINDS}
    for row, _, answer in usable:
        donors[answer_kind(answer)].append((row.qid, answer))
    rng = random.Random(seed)
    examples = []
    for row, gold, answer in usable:
        kind = answer_kind(answer)
        example = _swap(row, gold, answer, kind, donors[kind], rng)
        if example is None:
            skipped["no_substitute"] += 1
        else:
            examples.append(example)
    return ConflictSet(examples=examples, skipped=skipped, seed=seed)


def _overlaps(candidate: str, answers: Sequence[str]) -> bool:
    """The candidate contains a gold answer or lies inside one, on token boundaries ("Washington" vs
    "Washington D.C."): too close to the truth to make a conflict."""
    return has_answer(candidate, answers) or any(has_answer(answer, [candidate]) for answer in answers)


def _swap(
    row: QARow, gold: Passage, answer: str, kind: str, donors: list[tuple[str, str]], rng: random.Random
) -> ConflictExample | None:
    candidates = [(qid, a) for qid, a in donors if qid != row.qid and not _overlaps(a, row.answers)]
    for donor_qid, substitute in rng.sample(candidates, min(_MAX_TRIES, len(candidates))):
        title, in_title = substitute_answers(gold.title, row.answers, substitute)
        text, in_text = substitute_answers(gold.text, row.answers, substitute)
        if has_answer(f"{title}\n{text}", row.answers):  # e.g. the substitute contains a gold answer
            continue
        return ConflictExample(
            qid=row.qid,
            question=row.question,
            answers=row.answers,
            original=row.contexts[0],
            passage=Passage(title=title, text=text),
            replaced_answer=answer,
            substitute=substitute,
            kind=kind,
            donor_qid=donor_qid,
            replacements=in_title + in_text,
        )
    return None
