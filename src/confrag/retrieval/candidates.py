"""Candidate contexts per question: the top-N retrieved passages the preference stage scores.

A candidates file holds one question per line:

    {"qid": str, "question": str, "answers": [str, ...], "gold_source": str | null,
     "contexts": [{"title": str, "text": str, "score": float, "pid": str, "source_id": str}, ...]}

Only "qid", "question", "answers" and each context's "title", "text" and "score" are required, so a
prebuilt retrieval (any retriever, any corpus) can be brought in. Rows are joined to the dataset by
qid and checked by content (`match_candidates`): a file whose question under a qid is not the dataset's
question (default qids are line positions, so a file built from another NQ file or version shifts) is
refused, naming the first mismatches. Without "gold_source" the
question's gold document is unknown and `gold_retrieved` is False. `has_answer` is never read from
the file: it is recomputed from the answers, so it cannot disagree with `qa_metrics.has_answer`.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from confrag.data.jsonl import DataFormatError, read_jsonl
from confrag.data.nq import QARow
from confrag.data.qa_metrics import has_answer, normalize_question
from confrag.infra import checks
from confrag.infra.atomic import atomic_write_bytes
from confrag.retrieval.corpus import Corpus, CorpusPassage, document_text
from confrag.retrieval.ranking import Hits, check_top_n

_ROW_FIELDS = (
    '{"qid": str, "question": str, "answers": [str, ...], '
    '"contexts": [{"title": str, "text": str, "score": float}, ...]}'
)


class Retriever(Protocol):
    corpus: Corpus

    def search(self, queries: list[str], top_n: int) -> list[Hits]: ...


@dataclass(frozen=True)
class Candidates:
    qid: str
    question: str
    answers: tuple[str, ...]
    passages: list[CorpusPassage]  # best first
    scores: list[float]  # retrieval scores, aligned with passages
    has_answer: list[bool]  # the passage text contains a gold answer (qa_metrics.has_answer)
    gold_source: str | None = None  # source_id of the question's gold document, when known

    @property
    def from_gold(self) -> list[bool]:
        """Per passage: split from the question's gold document."""
        return [self.gold_source is not None and p.source_id == self.gold_source for p in self.passages]

    @property
    def gold_retrieved(self) -> bool:
        """Some retrieved passage comes from the question's gold document (False when it is unknown)."""
        return any(self.from_gold)


def subset_positions(candidate_sets: Sequence[Candidates], within: Sequence[Candidates]) -> list[int] | None:
    """The position in `within` of each of `candidate_sets` (by qid, the question and its passages equal, in
    order), or None if any is not there."""

    def content(c: Candidates) -> tuple:
        return (c.question, tuple((p.title, p.text) for p in c.passages))

    where = {c.qid: (i, content(c)) for i, c in enumerate(within)}
    positions = []
    for c in candidate_sets:
        found = where.get(c.qid)
        if found is None or found[1] != content(c):
            return None
        positions.append(found[0])
    return positions


def make_candidates(
    qid: str,
    question: str,
    answers: Sequence[str],
    passages: list[CorpusPassage],
    scores: list[float],
    gold_source: str | None,
) -> Candidates:
    return Candidates(
        qid=qid,
        question=question,
        answers=tuple(answers),
        passages=passages,
        scores=scores,
        has_answer=[has_answer(p.text, answers) for p in passages],
        gold_source=gold_source,
    )


def retrieve_candidates(
    rows: Sequence[QARow], corpus: Corpus, retriever: Retriever, top_n: int = 20
) -> list[Candidates]:
    """The `top_n` passages `retriever` finds for each row's question (capped at the corpus size)."""
    check_top_n(top_n)
    if retriever.corpus.fingerprint != corpus.fingerprint:
        raise ValueError(
            f"the retriever indexes a different corpus (fingerprint {retriever.corpus.fingerprint}) than the one "
            f"given ({corpus.fingerprint}); build the retriever over this corpus"
        )
    hits = retriever.search([row.question for row in rows], top_n)
    return [
        make_candidates(
            row.qid,
            row.question,
            row.answers,
            [corpus.passages[i] for i, _ in row_hits],
            [score for _, score in row_hits],
            corpus.gold_source_of.get(row.qid),
        )
        for row, row_hits in zip(rows, hits)
    ]


# ---------------------------------------------------------------- files


def without_duplicates(candidates: Candidates) -> tuple[Candidates, int]:
    """The same candidates with repeated passage texts removed (first kept), and how many went."""
    seen: set[str] = set()
    keep = []
    for j, passage in enumerate(candidates.passages):
        text = document_text(passage)
        if text not in seen:
            seen.add(text)
            keep.append(j)
    if len(keep) == len(candidates.passages):
        return candidates, 0
    return make_candidates(
        candidates.qid,
        candidates.question,
        candidates.answers,
        [candidates.passages[j] for j in keep],
        [candidates.scores[j] for j in keep],
        candidates.gold_source,
    ), len(candidates.passages) - len(keep)


def _candidates_record(c: Candidates) -> dict[str, Any]:
    contexts = [
        {"title": p.title, "text": p.text, "score": s, "pid": p.pid, "source_id": p.source_id}
        for p, s in zip(c.passages, c.scores)
    ]
    return {
        "qid": c.qid,
        "question": c.question,
        "answers": list(c.answers),
        "gold_source": c.gold_source,
        "contexts": contexts,
    }


def save_candidates_jsonl(candidates: Sequence[Candidates], path: str | os.PathLike[str]) -> Path:
    """Write one JSON line per question, atomically; `.jsonl.gz` is gzip-compressed (without a
    timestamp, so equal candidates give equal bytes)."""
    path = Path(path)
    if not path.name.lower().endswith((".jsonl", ".jsonl.gz")):
        raise ValueError(f"{path}: candidates files must end in .jsonl or .jsonl.gz")
    data = "".join(json.dumps(_candidates_record(c), ensure_ascii=False) + "\n" for c in candidates).encode("utf-8")
    if path.name.lower().endswith(".gz"):
        data = gzip.compress(data, mtime=0)
    atomic_write_bytes(path, data)
    return path


def _require_str(obj: Mapping[str, Any], key: str, where: str, allow_empty: bool = False) -> str:
    value = obj.get(key)
    if not isinstance(value, str) or (not allow_empty and not value.strip()):
        kind = "a string" if allow_empty else "a non-empty string"
        raise DataFormatError(f'{where}: field "{key}" must be {kind}; got {value!r}')
    return value


def _parse_answers(obj: Mapping[str, Any], where: str) -> tuple[str, ...]:
    answers = obj.get("answers")
    if not isinstance(answers, list) or not answers or not all(isinstance(a, str) and a.strip() for a in answers):
        raise DataFormatError(
            f'{where}: field "answers" must be a non-empty list of non-empty strings; got {answers!r}'
        )
    return tuple(answers)


def _parse_context(ctx: Any, qid: str, position: int, where: str) -> tuple[CorpusPassage, float]:
    where = f"{where}, contexts[{position}]"
    if not isinstance(ctx, Mapping):
        raise DataFormatError(
            f'{where}: must be an object {{"title": str, "text": str, "score": float}}; got {type(ctx).__name__}'
        )
    title = _require_str(ctx, "title", where, allow_empty=True)
    text = _require_str(ctx, "text", where)
    score = ctx.get("score")
    checks.number(score, f'{where}: field "score"', error=DataFormatError)
    # Without ids, a context is its own document: it can only match a gold_source naming it.
    pid = _require_str(ctx, "pid", where) if "pid" in ctx else f"{qid}@ctx{position}"
    source_id = _require_str(ctx, "source_id", where) if "source_id" in ctx else pid
    return CorpusPassage(pid=pid, title=title, text=text, source_id=source_id), float(score)


def _parse_candidates(obj: Any, where: str) -> Candidates:
    if not isinstance(obj, Mapping):
        raise DataFormatError(f"{where}: each line must be a JSON object {_ROW_FIELDS}; got {type(obj).__name__}")
    qid = obj.get("qid")
    qid = checks.identifier(qid, f'{where}: field "qid"', error=DataFormatError)
    question = _require_str(obj, "question", where)
    answers = _parse_answers(obj, where)
    gold_source = obj.get("gold_source")
    if gold_source is not None and (not isinstance(gold_source, str) or not gold_source.strip()):
        raise DataFormatError(f'{where}: field "gold_source" must be a non-empty string or null; got {gold_source!r}')
    contexts = obj.get("contexts")
    if not isinstance(contexts, list):
        raise DataFormatError(
            f'{where}: field "contexts" must be a list of {{"title", "text", "score"}} objects; got {contexts!r}'
        )
    parsed = [_parse_context(ctx, qid, j, where) for j, ctx in enumerate(contexts)]
    return make_candidates(qid, question, answers, [p for p, _ in parsed], [s for _, s in parsed], gold_source)


def load_candidates_jsonl(path: str | os.PathLike[str]) -> list[Candidates]:
    """Candidates from a `.jsonl` / `.jsonl.gz` file (format in the module docstring), in file order;
    blank lines are skipped. Raises DataFormatError naming the file and line of the first bad record,
    and both lines of a duplicate qid."""
    path = Path(path)
    if not path.is_file():
        reason = "is a directory, not a file" if path.is_dir() else "not found"
        raise DataFormatError(
            f"candidates file {path} {reason}; set it with the `retrieval.candidates_path` config value"
        )
    first_line_of: dict[str, int] = {}
    out: list[Candidates] = []
    with contextlib.closing(read_jsonl(path, _ROW_FIELDS)) as lines:
        for lineno, obj in lines:
            where = f"{path}, line {lineno}"
            candidates = _parse_candidates(obj, where)
            if candidates.qid in first_line_of:
                raise DataFormatError(
                    f"{where}: duplicate qid {candidates.qid!r} (first at line "
                    f"{first_line_of[candidates.qid]}); qids must be unique"
                )
            first_line_of[candidates.qid] = lineno
            out.append(candidates)
    return out


class CandidatesMismatchError(DataFormatError):
    """Candidates joined to dataset rows by qid hold other questions, or none for some rows."""


def same_question(a: str, b: str) -> bool:
    """Equal up to case, punctuation, articles, whitespace, Unicode form and hyphens (`normalize_question`)."""
    return normalize_question(a) == normalize_question(b)


def match_candidates(
    rows: Sequence[QARow], candidates: Sequence[Candidates], source: str = "candidates", shown: int = 3
) -> list[Candidates]:
    """The candidates of each row, in row order: joined by qid, then checked by content. Raises
    CandidatesMismatchError naming `source` (e.g. the file) when some row has no entry, or when an entry's
    question differs from the row's question under the same qid, listing the first `shown` of them."""
    by_qid = {c.qid: c for c in candidates}
    missing = [row.qid for row in rows if row.qid not in by_qid]
    if missing:
        raise CandidatesMismatchError(
            f"{source}: no candidates for {len(missing)} of {len(rows)} questions, e.g. {missing[:shown]}"
        )
    differ = [(row, by_qid[row.qid]) for row in rows if not same_question(row.question, by_qid[row.qid].question)]
    if differ:
        listed = "; ".join(
            f"qid {row.qid!r}: the data asks {row.question!r}, {source} has {found.question!r}"
            for row, found in differ[:shown]
        )
        raise CandidatesMismatchError(
            f"{source}: {len(differ)} of {len(rows)} questions differ from the data's question with the same qid "
            f"({listed}{'; ...' if len(differ) > shown else ''}). The candidates were built from other data (another "
            f"NQ file or version; default qids are line positions): rebuild them from this data, or give the "
            f'rows stable "id"s'
        )
    return [by_qid[row.qid] for row in rows]


def validate_candidates_jsonl(path: str | os.PathLike[str], rows: Sequence[QARow] | None = None) -> int:
    """Parse and check a whole candidates file (format in the module docstring) without keeping it or
    building anything: a bad file fails here, naming the file, line and allowed format, before any
    expensive work. With `rows`, also check it holds every row's question under its qid
    (`match_candidates`). Returns the number of questions in the file."""
    found = load_candidates_jsonl(path)
    if rows is not None:
        match_candidates(rows, found, source=f"candidates file {path}")
    return len(found)
