"""Retrieval corpora: documents split DPR-style into ~100-word passages.

Two sources:

- `corpus_from_nq(rows)`: the gold paragraphs of NQ-open rows, so every question's own evidence is in
  the pool and "was the gold document retrieved" can be measured. A paragraph shared by several
  questions is kept once; `Corpus.gold_source_of` maps each question to the document holding it.
- `load_corpus_jsonl(path)`: a user corpus, one `{"id": str, "title": str, "text": str}` per line.

Splitting follows DPR (Karpukhin et al., 2020): whitespace words in consecutive chunks of
`words_per_passage`; the title travels with every chunk. Unlike DPR, a short tail (< 20 words) is
merged into the chunk before it, because a 3-word passage is noise for both retrievers and the LLM.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from confrag.artifacts import fingerprint
from confrag.data.nq import DataFormatError, QARow, _numbered_lines

DEFAULT_WORDS_PER_PASSAGE = 100
MIN_LAST_WORDS = 20
# Bump when splitting or the passage serialization changes, so caches keyed on old corpora are not reused.
_CORPUS_SCHEMA = "confrag.retrieval.corpus.v1"
_CORPUS_FIELDS = '{"id": str, "title": str, "text": str}'


@dataclass(frozen=True)
class CorpusPassage:
    pid: str  # f"{source_id}#{chunk index}"
    title: str
    text: str
    source_id: str  # id of the document (NQ: the first question's qid) this passage was split from


@dataclass(frozen=True)
class Corpus:
    passages: list[CorpusPassage]
    # qid -> source_id of the question's gold document; only questions that have a gold paragraph.
    gold_source_of: dict[str, str] = field(default_factory=dict)
    # Hash of exactly the passages (ids, titles, texts, in order): the key of every index built on them.
    fingerprint: str = ""

    def __len__(self) -> int:
        return len(self.passages)


def document_text(passage: CorpusPassage) -> str:
    """What the retrievers index for a passage: title and text, as DPR encodes them."""
    return f"{passage.title}\n{passage.text}" if passage.title else passage.text


def check_words_per_passage(words_per_passage: int) -> None:
    if isinstance(words_per_passage, bool) or not isinstance(words_per_passage, int) or words_per_passage < 1:
        raise ValueError(f"retrieval.words_per_passage must be an integer >= 1; got {words_per_passage!r}")


def split_passages(
    title: str,
    text: str,
    source_id: str,
    words_per_passage: int = DEFAULT_WORDS_PER_PASSAGE,
    min_last_words: int = MIN_LAST_WORDS,
) -> list[CorpusPassage]:
    """Consecutive chunks of `words_per_passage` whitespace words; a tail shorter than `min_last_words`
    joins the previous chunk (so the last passage holds up to words_per_passage + min_last_words - 1
    words). Whitespace inside a chunk is collapsed to single spaces. Empty text gives no passages."""
    check_words_per_passage(words_per_passage)
    words = text.split()
    chunks = [words[start : start + words_per_passage] for start in range(0, len(words), words_per_passage)]
    if len(chunks) > 1 and len(chunks[-1]) < min_last_words:
        tail = chunks.pop()
        chunks[-1] = chunks[-1] + tail
    return [
        CorpusPassage(pid=f"{source_id}#{index}", title=title, text=" ".join(chunk), source_id=source_id)
        for index, chunk in enumerate(chunks)
    ]


def passages_fingerprint(passages: Iterable[CorpusPassage]) -> str:
    """Short hash of the passages in order, streamed so a large corpus is never serialized whole."""
    digest = hashlib.sha256()
    for p in passages:
        # One JSON line per passage: string escaping makes the concatenation unambiguous.
        digest.update(json.dumps([p.pid, p.title, p.text, p.source_id], ensure_ascii=False).encode("utf-8") + b"\n")
    return fingerprint({"schema": _CORPUS_SCHEMA, "passages": digest.hexdigest()})


def _make_corpus(passages: list[CorpusPassage], gold_source_of: dict[str, str]) -> Corpus:
    return Corpus(passages=passages, gold_source_of=gold_source_of, fingerprint=passages_fingerprint(passages))


def corpus_from_nq(rows: Sequence[QARow], words_per_passage: int = DEFAULT_WORDS_PER_PASSAGE) -> Corpus:
    """The gold paragraphs of `rows` as a corpus. A (title, text) paragraph that several questions
    share is one document, named after the first of them; every question maps to it in
    `gold_source_of`. A row with several paragraphs maps to the first one's document (the shared NQ
    file has exactly one per row); rows without paragraphs have no entry."""
    check_words_per_passage(words_per_passage)
    source_of_paragraph: dict[tuple[str, str], str] = {}
    gold_source_of: dict[str, str] = {}
    passages: list[CorpusPassage] = []
    for row in rows:
        for position, ctx in enumerate(row.contexts):
            key = (ctx.title, ctx.text)
            source_id = source_of_paragraph.get(key)
            if source_id is None:
                source_id = row.qid if position == 0 else f"{row.qid}.{position}"
                source_of_paragraph[key] = source_id
                passages.extend(split_passages(ctx.title, ctx.text, source_id, words_per_passage))
            gold_source_of.setdefault(row.qid, source_id)
    if not passages:
        raise DataFormatError(
            f'none of the {len(rows)} NQ rows has a non-empty gold paragraph ("ctxs"); a corpus needs '
            "rows from a file with passages, such as the shared nq_open_gold.jsonl.gz, or use load_corpus_jsonl"
        )
    return _make_corpus(passages, gold_source_of)


def _parse_document(obj: Any, where: str) -> tuple[str, str, str]:
    if not isinstance(obj, Mapping):
        raise DataFormatError(f"{where}: each line must be a JSON object {_CORPUS_FIELDS}; got {type(obj).__name__}")
    doc_id = obj.get("id")
    # bool is an int subclass, but True/False as an id is always a data bug.
    if isinstance(doc_id, bool) or not isinstance(doc_id, (str, int)) or str(doc_id).strip() == "":
        raise DataFormatError(f'{where}: field "id" must be a non-empty string (or an integer); got {doc_id!r}')
    title = obj.get("title", "")
    if not isinstance(title, str):
        raise DataFormatError(f'{where}: field "title" must be a string (may be empty or absent); got {title!r}')
    text = obj.get("text")
    if not isinstance(text, str) or not text.strip():
        raise DataFormatError(f'{where}: field "text" must be a non-empty string; got {text!r}')
    return str(doc_id), title, text


def _documents(path: str | os.PathLike[str]) -> Iterator[tuple[str, str, str]]:
    """(id, title, text) of every document of a corpus file, checked line by line; blank lines skipped.
    Raises DataFormatError naming the file and line of the first bad record, and both lines of a
    duplicate id."""
    path = Path(path)
    if not path.is_file():
        reason = "is a directory, not a file" if path.is_dir() else "not found"
        raise DataFormatError(f"corpus file {path} {reason}; set it with the `retrieval.corpus_path` config value")
    first_line_of: dict[str, int] = {}
    # closing(): an error mid-file must close the (possibly gzip) handle now, not at garbage collection.
    with contextlib.closing(_numbered_lines(path)) as lines:
        for lineno, line in lines:
            if not line.strip():
                continue
            where = f"{path}, line {lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataFormatError(
                    f"{where}: malformed JSON ({exc.msg} at column {exc.colno}); each line must be {_CORPUS_FIELDS}"
                ) from exc
            doc_id, title, text = _parse_document(obj, where)
            if doc_id in first_line_of:
                raise DataFormatError(
                    f"{where}: duplicate id {doc_id!r} (first at line {first_line_of[doc_id]}); ids must be unique"
                )
            first_line_of[doc_id] = lineno
            yield doc_id, title, text
    if not first_line_of:
        raise DataFormatError(f"{path}: no documents; each line must be {_CORPUS_FIELDS}")


def load_corpus_jsonl(path: str | os.PathLike[str], words_per_passage: int = DEFAULT_WORDS_PER_PASSAGE) -> Corpus:
    """A corpus from a `.jsonl` / `.jsonl.gz` file of `{"id", "title", "text"}` objects, each split
    into passages; blank lines are skipped. Raises DataFormatError naming the file and line of the
    first bad record, and both lines of a duplicate id."""
    check_words_per_passage(words_per_passage)
    passages: list[CorpusPassage] = []
    for doc_id, title, text in _documents(path):
        passages.extend(split_passages(title, text, doc_id, words_per_passage))
    return _make_corpus(passages, {})


def validate_corpus_jsonl(path: str | os.PathLike[str]) -> int:
    """Parse and check a whole corpus file (`{"id", "title", "text"}` per line) without splitting it or
    building any index: a bad file fails here, naming the file, line and allowed format, before any
    expensive work. Returns the number of documents."""
    return sum(1 for _ in _documents(path))
