"""Question sets (NQ-open and any other QA set) with their answers and (optionally) passages.

Two formats, chosen by `questions_format` (`auto` detects it from the first record):

- `confrag`, the shared gold file's, DPR/"Lost in the Middle" retrieval files' and Hugging Face `nq_open`'s:
      {"question": str, "answers": [str, ...], "ctxs": [{"title": str, "text": str}, ...]}
      {"question": str, "answer": [str, ...]}                      # HF nq_open; no passages
- `flashrag`, the one FlashRAG ships its 36 QA sets in (NQ, TriviaQA, PopQA, 2Wiki, HotpotQA, ...):
      {"id": str, "question": str, "golden_answers": [str, ...]}

Files are `.jsonl` / `.jsonl.gz` (errors name the line) or `.parquet` (read with Hugging Face `datasets`
in streaming mode; errors name the 1-based row).

An optional "id" field (str or int) becomes the row's qid; otherwise the qid is "nq-" and the row's
0-based position among non-blank lines (or records), zero-padded (the prefix is the shared NQ file's; kept for any
file, as cached states and reports are keyed on these qids). Extra fields are ignored. A second file read beside
the first (`eval.questions_path`) gets an `id_prefix`, so that its qids never equal the first file's.

The module keeps NQ-open's name: the shared file and the first format are NQ-open's. Its functions are not
NQ-specific: `load_questions_jsonl` reads any question set.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from confrag.data.jsonl import DataFormatError
from confrag.data.records import RecordFile, detect_format, formats_text
from confrag.infra import checks
from confrag.infra.paths import project_root

log = logging.getLogger(__name__)

QUESTIONS_PATH_ENV = "CONFRAG_QUESTIONS_PATH"
_PATH_HINT = (
    f"set the path with the `paths.questions_path` config value or the `{QUESTIONS_PATH_ENV}` environment variable"
)
# Bump when the serialization below changes, so caches keyed on old fingerprints are not reused.
_FINGERPRINT_SCHEMA = "confrag.nq.rows.v1"


@dataclass(frozen=True)
class Passage:
    title: str
    text: str


@dataclass(frozen=True)
class QARow:
    qid: str
    question: str
    answers: tuple[str, ...]
    contexts: tuple[Passage, ...]


def default_questions_path() -> Path:
    """`$CONFRAG_QUESTIONS_PATH` if set, else the shared NQ-open sample,
    `<project root>/../shared/data/nq_open_gold.jsonl.gz`."""
    env = os.environ.get(QUESTIONS_PATH_ENV)
    if env:
        return Path(env).expanduser()
    return project_root().parent / "shared" / "data" / "nq_open_gold.jsonl.gz"


def _default_qid(index: int) -> str:
    return f"nq-{index:05d}"


def _parse_qid(row: Mapping[str, Any], index: int, where: str) -> str:
    if "id" not in row:
        return _default_qid(index)
    raw = row["id"]
    return checks.identifier(raw, f'{where}: field "id"', error=DataFormatError)


def _parse_question(row: Mapping[str, Any], where: str) -> str:
    question = row.get("question")
    if not isinstance(question, str) or not question.strip():
        raise DataFormatError(f'{where}: field "question" must be a non-empty string; got {question!r}')
    return question


@dataclass(frozen=True)
class QuestionFormat:
    """One way of writing a question set: the field holding the answers, and whether rows carry passages."""

    name: str
    fields: str  # how the format is shown in errors
    answer_fields: tuple[str, ...]  # the first one present is read
    has_contexts: bool

    def matches(self, row: Any) -> bool:
        return isinstance(row, Mapping) and "question" in row and any(f in row for f in self.answer_fields)


# "answers" is the DPR / shared-file name, "answer" the Hugging Face nq_open one.
QUESTION_FORMATS = {
    f.name: f
    for f in (
        QuestionFormat("confrag", '{"question", "answers", "ctxs"}', ("answers", "answer"), has_contexts=True),
        QuestionFormat("flashrag", '{"id", "question", "golden_answers"}', ("golden_answers",), has_contexts=False),
    )
}
QUESTION_FORMAT_CHOICES = ("auto", *QUESTION_FORMATS)


def _parse_answers(row: Mapping[str, Any], where: str, fmt: QuestionFormat) -> tuple[str, ...]:
    field = next((f for f in fmt.answer_fields if f in row), None)
    if field is None:
        names = " (or ".join(f'"{f}"' for f in fmt.answer_fields) + ")" * (len(fmt.answer_fields) - 1)
        raise DataFormatError(f"{where}: missing field {names}: a non-empty list of strings")
    answers = row[field]
    if not isinstance(answers, list) or not answers:
        raise DataFormatError(f'{where}: field "{field}" must be a non-empty list of strings; got {answers!r}')
    for position, answer in enumerate(answers):
        if not isinstance(answer, str) or not answer.strip():
            raise DataFormatError(f'{where}: field "{field}[{position}]" must be a non-empty string; got {answer!r}')
    return tuple(answers)


def _parse_contexts(row: Mapping[str, Any], where: str) -> tuple[Passage, ...]:
    if "ctxs" not in row:
        return ()
    ctxs = row["ctxs"]
    if not isinstance(ctxs, list):
        raise DataFormatError(
            f'{where}: field "ctxs" must be a list of {{"title": str, "text": str}} objects; got {type(ctxs).__name__}'
        )
    passages = []
    for position, ctx in enumerate(ctxs):
        if not isinstance(ctx, Mapping):
            raise DataFormatError(
                f'{where}: field "ctxs[{position}]" must be an object with string "title" and "text"; '
                f"got {type(ctx).__name__}"
            )
        for key in ("title", "text"):
            if not isinstance(ctx.get(key), str):
                raise DataFormatError(f'{where}: field "ctxs[{position}].{key}" must be a string; got {ctx.get(key)!r}')
        passages.append(Passage(title=ctx["title"], text=ctx["text"]))
    return tuple(passages)


def _row_from_mapping(row: Any, index: int, where: str, fmt: QuestionFormat = QUESTION_FORMATS["confrag"]) -> QARow:
    if not isinstance(row, Mapping):
        raise DataFormatError(
            f'{where}: each row must be a JSON object with "question" and "{fmt.answer_fields[0]}"; '
            f"got {type(row).__name__}"
        )
    return QARow(
        qid=_parse_qid(row, index, where),
        question=_parse_question(row, where),
        answers=_parse_answers(row, where, fmt),
        contexts=_parse_contexts(row, where) if fmt.has_contexts else (),
    )


class _RowCollector:
    """Accumulates rows and rejects duplicate qids, which would collide as cache keys."""

    def __init__(self) -> None:
        self.rows: list[QARow] = []
        self._first_seen: dict[str, str] = {}

    def add(self, row: QARow, where: str) -> None:
        first = self._first_seen.get(row.qid)
        if first is not None:
            raise DataFormatError(
                f'{where}: duplicate id {row.qid!r} (first at {first}); every row needs a unique "id"'
            )
        self._first_seen[row.qid] = where
        self.rows.append(row)


# What a question file is to the one record reader (confrag.data.records).
QUESTION_FILE = RecordFile(
    noun="question file",
    hint=_PATH_HINT,
    formats=QUESTION_FORMATS,
    format_key="questions_format",
    expected="one JSON object",
    parse=_row_from_mapping,
)


def _check_limit(limit: int | None) -> None:
    checks.positive_int(limit, "limit", allow_none=True, none="None")


def load_questions_jsonl(
    path: str | os.PathLike[str], limit: int | None = None, questions_format: str = "auto", id_prefix: str = ""
) -> list[QARow]:
    """Rows of a question file (`.jsonl`, `.jsonl.gz` or `.parquet`), in file order; `limit` keeps the first
    N. `questions_format` is one of QUESTION_FORMAT_CHOICES; `auto` takes the format of the first record,
    and every later record must be in it (errors name the format and where it was detected). `id_prefix` is put
    before every qid (an "id" field's or the position's)."""
    _check_limit(limit)
    checks.choice(questions_format, "questions_format", QUESTION_FORMAT_CHOICES)
    collector = _RowCollector()
    with contextlib.closing(QUESTION_FILE.parsed(path, questions_format)) as rows:
        for _, where, row in rows:
            collector.add(dataclasses.replace(row, qid=id_prefix + row.qid) if id_prefix else row, where)
            if limit is not None and len(collector.rows) >= limit:
                break  # before reading another record: what lies beyond the limit is never parsed
    if not collector.rows:
        raise DataFormatError(
            f"question file {path} is empty (no rows); each record must be {formats_text(QUESTION_FORMATS)}; "
            f"{_PATH_HINT}"
        )
    return collector.rows


def rows_from_hf(records: Iterable[Mapping[str, Any]], questions_format: str = "auto") -> list[QARow]:
    """Rows from in-memory dicts such as `datasets.load_dataset("nq_open")["validation"]` or a FlashRAG
    split; `questions_format` as in `load_questions_jsonl` (`auto`: the first record's)."""
    checks.choice(questions_format, "questions_format", QUESTION_FORMAT_CHOICES)
    fmt = None if questions_format == "auto" else QUESTION_FORMATS[questions_format]
    collector = _RowCollector()
    for index, record in enumerate(records):
        where = f"record {index} (0-based)"
        if fmt is None:
            fmt = detect_format(record, where, QUESTION_FORMATS, "questions_format")
        collector.add(_row_from_mapping(record, index, where, fmt), where)
    return collector.rows


def rows_fingerprint(rows: Sequence[QARow]) -> str:
    """sha256 hex of a canonical serialization of the rows, in order; a cache key for derived data."""
    digest = hashlib.sha256(_FINGERPRINT_SCHEMA.encode("utf-8") + b"\n")
    for row in rows:
        record = [row.qid, row.question, list(row.answers), [[p.title, p.text] for p in row.contexts]]
        # One JSON line per row: string escaping makes the concatenation unambiguous.
        line = json.dumps(record, ensure_ascii=False, separators=(",", ":"))
        digest.update(line.encode("utf-8") + b"\n")
    return digest.hexdigest()
