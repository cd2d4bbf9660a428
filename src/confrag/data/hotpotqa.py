"""HotpotQA questions with their gold (supporting-fact) paragraphs, as `QARow`s.

Two row shapes are accepted:

    official distractor / fullwiki JSON (a JSON list of)
    {"_id": str, "question": str, "answer": str,
     "supporting_facts": [[title, sent_id], ...],
     "context": [[title, [sentence, ...]], ...]}

    Hugging Face `hotpot_qa` rows
    {"id": str, "question": str, "answer": str,
     "supporting_facts": {"title": [...], "sent_id": [...]},
     "context": {"title": [...], "sentences": [[sentence, ...], ...]}}

The gold contexts of a row are the paragraphs named by its supporting facts, in the order they are
first named there, each as `Passage(title, text)` with text the paragraph's sentences joined (HotpotQA
sentences carry their own leading spaces, so they are concatenated, then stripped). Sentence ids are
not checked against paragraph lengths: the official files contain a few out-of-range ids, and only
whole paragraphs are used here. A supporting fact naming a title that is not in the row's context is
an error (the gold paragraph would be unknown).

`load_hotpotqa(path)` reads the official `.json` list or a `.jsonl` / `.jsonl.gz` file with one row of
either shape per line; `hotpotqa_rows_from_records(records)` takes in-memory rows, e.g. a split of
`datasets.load_dataset("hotpot_qa", "distractor")`.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from confrag.data.jsonl import DataFormatError, read_jsonl
from confrag.data.nq import Passage, QARow, _check_limit, _RowCollector
from confrag.infra import checks

HOTPOTQA_PATH_KEY = "eval.hotpotqa_path"
_SUFFIXES = (".json", ".jsonl", ".jsonl.gz")
_SHAPES = (
    'official {"_id", "question", "answer", "supporting_facts": [[title, sent_id], ...], '
    '"context": [[title, [sentences]], ...]} or Hugging Face {"id", "question", "answer", '
    '"supporting_facts": {"title", "sent_id"}, "context": {"title", "sentences"}}'
)


def _require_text(row: Mapping[str, Any], key: str, where: str) -> str:
    value = row.get(key)
    if not isinstance(value, str) or not value.strip():
        raise DataFormatError(f'{where}: field "{key}" must be a non-empty string; got {value!r}')
    return value


def _qid(row: Mapping[str, Any], where: str) -> str:
    key = "_id" if "_id" in row else "id"
    raw = row.get(key)
    return checks.identifier(raw, f'{where}: field "_id" (official) or "id" (Hugging Face)', error=DataFormatError)


def _paragraphs(context: Any, where: str) -> dict[str, list[str]]:
    """title -> sentences, from either context shape."""
    if isinstance(context, Mapping):  # Hugging Face: parallel lists
        titles, sentences = context.get("title"), context.get("sentences")
        if not isinstance(titles, list) or not isinstance(sentences, list) or len(titles) != len(sentences):
            raise DataFormatError(
                f'{where}: field "context" must hold equally long lists "title" and "sentences"; '
                f"got {type(titles).__name__} and {type(sentences).__name__}"
            )
        pairs = list(zip(titles, sentences))
    elif isinstance(context, list):  # official: [[title, [sentences]], ...]
        if not all(isinstance(item, list) and len(item) == 2 for item in context):
            raise DataFormatError(f'{where}: field "context" must be a list of [title, [sentence, ...]] pairs')
        pairs = [(item[0], item[1]) for item in context]
    else:
        raise DataFormatError(
            f'{where}: field "context" must be a list (official) or an object (Hugging Face); '
            f"got {type(context).__name__}"
        )
    paragraphs: dict[str, list[str]] = {}
    for position, (title, sentences) in enumerate(pairs):
        if (
            not isinstance(title, str)
            or not isinstance(sentences, list)
            or not all(isinstance(s, str) for s in sentences)
        ):
            raise DataFormatError(
                f"{where}: context paragraph {position} must be a title string with a list of "
                f"sentence strings; got {title!r}"
            )
        paragraphs.setdefault(title, sentences)
    return paragraphs


def _supporting_titles(facts: Any, where: str) -> list[str]:
    """Titles of the supporting facts in order of first mention."""
    if isinstance(facts, Mapping):
        titles = facts.get("title")
    elif isinstance(facts, list) and all(isinstance(f, list) and len(f) == 2 for f in facts):
        titles = [fact[0] for fact in facts]
    else:
        titles = None
    if not isinstance(titles, list) or not titles or not all(isinstance(t, str) for t in titles):
        raise DataFormatError(
            f'{where}: field "supporting_facts" must name at least one paragraph title, as '
            f'[[title, sent_id], ...] or {{"title": [...], "sent_id": [...]}}; got {facts!r}'
        )
    return list(dict.fromkeys(titles))


def hotpotqa_row(row: Any, where: str) -> QARow:
    """One row of either shape (see the module docstring); errors name `where`."""
    if not isinstance(row, Mapping):
        raise DataFormatError(f"{where}: each row must be a JSON object, {_SHAPES}; got {type(row).__name__}")
    for key in ("context", "supporting_facts"):
        if key not in row:
            raise DataFormatError(f'{where}: missing field "{key}"; rows must be {_SHAPES}')
    paragraphs = _paragraphs(row["context"], where)
    contexts = []
    for title in _supporting_titles(row["supporting_facts"], where):
        if title not in paragraphs:
            raise DataFormatError(
                f"{where}: supporting fact names paragraph {title!r}, which is not in the row's "
                f"context (titles there: {list(paragraphs)})"
            )
        contexts.append(Passage(title=title, text="".join(paragraphs[title]).strip()))
    return QARow(
        qid=_qid(row, where),
        question=_require_text(row, "question", where),
        answers=(_require_text(row, "answer", where),),
        contexts=tuple(contexts),
    )


def hotpotqa_rows_from_records(records: Iterable[Mapping[str, Any]]) -> list[QARow]:
    """Rows from in-memory records of either shape, e.g. `load_dataset("hotpot_qa", "distractor")["validation"]`."""
    collector = _RowCollector()
    for index, record in enumerate(records):
        where = f"record {index} (0-based)"
        collector.add(hotpotqa_row(record, where), where)
    return collector.rows


def _load_json_list(path: Path, limit: int | None) -> list[QARow]:
    try:
        data = json.loads(path.read_text(encoding="utf-8-sig"))
    except UnicodeDecodeError as exc:
        raise DataFormatError(f"{path}: not valid UTF-8 ({exc.reason}); files must be UTF-8") from exc
    except json.JSONDecodeError as exc:
        raise DataFormatError(
            f"{path}: malformed JSON ({exc.msg} at line {exc.lineno}, column {exc.colno}); the "
            "official HotpotQA file is one JSON list of rows"
        ) from exc
    if not isinstance(data, list):
        raise DataFormatError(
            f"{path}: expected a JSON list of rows (the official HotpotQA format); got {type(data).__name__}"
        )
    collector = _RowCollector()
    for index, record in enumerate(data[:limit] if limit else data):
        where = f"{path}, row {index} (0-based)"
        collector.add(hotpotqa_row(record, where), where)
    return collector.rows


def _load_jsonl(path: Path, limit: int | None) -> list[QARow]:
    collector = _RowCollector()
    with contextlib.closing(read_jsonl(path, "one JSON object")) as lines:
        for lineno, record in lines:
            if limit is not None and len(collector.rows) >= limit:
                break
            where = f"{path}, line {lineno}"
            collector.add(hotpotqa_row(record, where), where)
    return collector.rows


def load_hotpotqa(path: str | os.PathLike[str], limit: int | None = None) -> list[QARow]:
    """Rows of an official HotpotQA `.json` file or a `.jsonl` / `.jsonl.gz` file of rows of either shape,
    in file order; `limit` keeps the first N. Errors name the file and the row (JSON list) or line (JSONL)."""
    _check_limit(limit)
    path = Path(path)
    if not path.is_file():
        reason = "is a directory, not a file" if path.is_dir() else "not found"
        raise DataFormatError(
            f"HotpotQA data file {path} {reason}; set the path with the `{HOTPOTQA_PATH_KEY}` config value"
        )
    name = path.name.lower()
    if name.endswith(".json"):
        return _load_json_list(path, limit)
    if name.endswith((".jsonl", ".jsonl.gz")):
        return _load_jsonl(path, limit)
    raise DataFormatError(f"{path}: unsupported file name; allowed suffixes are {', '.join(_SUFFIXES)}")
