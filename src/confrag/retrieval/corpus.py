"""Retrieval corpora: documents split DPR-style into ~100-word passages.

Two sources:

- `corpus_from_gold_paragraphs(rows)`: the gold paragraphs ("ctxs") of question rows (NQ-open's, or any file
  in the `confrag` format), so every question's own evidence is in the pool and "was the gold document
  retrieved" can be measured. A paragraph shared by several
  questions is kept once; `Corpus.gold_source_of` maps each question to the document holding it.
- `load_corpus_jsonl(path)`: a user corpus in one of two formats (`corpus_format`; `auto` detects it from
  the first record): `confrag`, one `{"id": str, "title": str, "text": str}` per record, or `flashrag`,
  FlashRAG's `{"id": str, "contents": "title\ntext"}` (a title in double quotes, as wiki-18 writes it,
  loses them). Files are `.jsonl` / `.jsonl.gz` or `.parquet`, read one record at a time (`iter_documents`).

Splitting follows DPR (Karpukhin et al., 2020): whitespace words in consecutive chunks of
`words_per_passage`; the title travels with every chunk. Unlike DPR, a short tail (< 20 words) is
merged into the chunk before it, because a 3-word passage is noise for both retrievers and the LLM.
`words_per_passage=None` keeps each document as one passage, as given (a corpus already split, such as
FlashRAG's wiki-18): its id is the document's id, so a candidates file or a FAISS index built on the
corpus names the same passages.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from confrag.data.nq import DataFormatError, QARow
from confrag.data.records import RecordFile, formats_text
from confrag.infra import checks
from confrag.infra.digests import fingerprint

DEFAULT_WORDS_PER_PASSAGE = 100
MIN_LAST_WORDS = 20
# Bump when splitting or the passage serialization changes, so caches keyed on old corpora are not reused.
_CORPUS_SCHEMA = "confrag.retrieval.corpus.v1"
_CORPUS_FIELDS = '{"id": str, "title": str, "text": str}'


def _confrag_document(obj: Mapping[str, Any], where: str) -> tuple[str, str]:
    title = obj.get("title", "")
    if not isinstance(title, str):
        raise DataFormatError(f'{where}: field "title" must be a string (may be empty or absent); got {title!r}')
    text = obj.get("text")
    if not isinstance(text, str) or not text.strip():
        raise DataFormatError(f'{where}: field "text" must be a non-empty string; got {text!r}')
    return title, text


def _flashrag_document(obj: Mapping[str, Any], where: str) -> tuple[str, str]:
    contents = obj.get("contents")
    if not isinstance(contents, str) or not contents.strip():
        raise DataFormatError(f'{where}: field "contents" must be a non-empty string "title\\ntext"; got {contents!r}')
    title, _, text = contents.partition("\n") if "\n" in contents else ("", "", contents)
    title = title.strip()
    if len(title) >= 2 and title[0] == title[-1] == '"':
        title = title[1:-1]
    if not text.strip():
        raise DataFormatError(f'{where}: field "contents" has a title but no text after its first line')
    return title, text


@dataclass(frozen=True)
class CorpusFormat:
    """One way of writing a corpus: the field that tells it apart and how a record becomes (title, text)."""

    name: str
    fields: str  # how the format is shown in errors
    key_field: str
    parse: Callable[[Mapping[str, Any], str], tuple[str, str]]

    def matches(self, obj: Any) -> bool:
        return isinstance(obj, Mapping) and self.key_field in obj


CORPUS_FORMATS = {
    f.name: f
    for f in (
        CorpusFormat("confrag", _CORPUS_FIELDS, "text", _confrag_document),
        CorpusFormat("flashrag", '{"id": str, "contents": "title\\ntext"}', "contents", _flashrag_document),
    )
}
CORPUS_FORMAT_CHOICES = ("auto", *CORPUS_FORMATS)


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


def check_words_per_passage(words_per_passage: int | None, key: str = "words_per_passage") -> None:
    """A positive integer, or None (each document one passage, as given)."""
    if words_per_passage is not None:
        checks.positive_int(words_per_passage, key, hint="(or null: passages as given)")


def split_passages(
    title: str,
    text: str,
    source_id: str,
    words_per_passage: int | None = DEFAULT_WORDS_PER_PASSAGE,
    min_last_words: int = MIN_LAST_WORDS,
) -> list[CorpusPassage]:
    """Consecutive chunks of `words_per_passage` whitespace words; a tail shorter than `min_last_words`
    joins the previous chunk (so the last passage holds up to words_per_passage + min_last_words - 1
    words). Whitespace inside a chunk is collapsed to single spaces. Empty text gives no passages.
    `words_per_passage=None`: the document itself, text untouched, under its own id."""
    check_words_per_passage(words_per_passage)
    if words_per_passage is None:
        return [CorpusPassage(pid=source_id, title=title, text=text, source_id=source_id)] if text.strip() else []
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


def corpus_from_gold_paragraphs(
    rows: Sequence[QARow], words_per_passage: int | None = DEFAULT_WORDS_PER_PASSAGE
) -> Corpus:
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
            "rows from a file with passages, such as the shared nq_open_gold.jsonl.gz, or a corpus file "
            "(`dataset.corpus_path` / `retrieval.corpus_path`, read by load_corpus_jsonl)"
        )
    return _make_corpus(passages, gold_source_of)


def _parse_document(obj: Any, where: str, fmt: CorpusFormat) -> tuple[str, str, str]:
    if not isinstance(obj, Mapping):
        raise DataFormatError(f"{where}: each line must be a JSON object {fmt.fields}; got {type(obj).__name__}")
    doc_id = obj.get("id")
    doc_id = checks.identifier(doc_id, f'{where}: field "id"', error=DataFormatError)
    title, text = fmt.parse(obj, where)
    return doc_id, title, text


# What a corpus file is to the one record reader (confrag.data.records).
CORPUS_FILE = RecordFile(
    noun="corpus file",
    hint="set it with the `retrieval.corpus_path` config value",
    formats=CORPUS_FORMATS,
    format_key="retrieval.corpus_format",
    expected=formats_text(CORPUS_FORMATS),
    parse=lambda record, _index, where, fmt: _parse_document(record, where, fmt),
)


def iter_documents(path: str | os.PathLike[str], corpus_format: str = "auto") -> Iterator[tuple[str, str, str]]:
    """(id, title, text) of every document of a corpus file, one record at a time (a corpus of any size is
    never held whole), checked as it is read; blank lines skipped. `corpus_format` is one of
    CORPUS_FORMAT_CHOICES (`auto`: the first record's). Raises DataFormatError naming the file and line
    (or parquet row) of the first bad record, the format, and both places of the first repeated id."""
    for _, doc_id, title, text in located_documents(path, corpus_format):
        yield doc_id, title, text


def located_documents(path: str | os.PathLike[str], corpus_format: str = "auto") -> Iterator[tuple[str, str, str, str]]:
    """(position, id, title, text) of every document (`iter_documents`), the position as errors name it
    ("line N" of a JSONL file, "row N" of a parquet file)."""
    checks.choice(corpus_format, "corpus_format", CORPUS_FORMAT_CHOICES)
    first_seen: dict[str, str] = {}
    # closing(): an error mid-file must close the (possibly gzip) handle now, not at garbage collection.
    with contextlib.closing(CORPUS_FILE.parsed(path, corpus_format)) as documents:
        for position, where, (doc_id, title, text) in documents:
            if doc_id in first_seen:
                raise DataFormatError(
                    f"{where}: duplicate id {doc_id!r} (first at {first_seen[doc_id]}); ids must be unique"
                )
            first_seen[doc_id] = position
            yield position, doc_id, title, text
    if not first_seen:
        raise DataFormatError(f"{path}: no documents; each record must be {CORPUS_FILE.expected}")


def iter_passages(
    path: str | os.PathLike[str], words_per_passage: int | None = DEFAULT_WORDS_PER_PASSAGE, corpus_format: str = "auto"
) -> Iterator[CorpusPassage]:
    """The passages of a corpus file, streamed: documents are read and split one at a time."""
    check_words_per_passage(words_per_passage)
    for doc_id, title, text in iter_documents(path, corpus_format):
        yield from split_passages(title, text, doc_id, words_per_passage)


def load_corpus_jsonl(
    path: str | os.PathLike[str], words_per_passage: int | None = DEFAULT_WORDS_PER_PASSAGE, corpus_format: str = "auto"
) -> Corpus:
    """A corpus from a `.jsonl` / `.jsonl.gz` / `.parquet` file in `corpus_format` (see the module
    docstring), each document split into passages. Raises DataFormatError naming the file and line of the
    first bad record, and both places of a duplicate id."""
    check_words_per_passage(words_per_passage)
    passages: list[CorpusPassage] = []
    for doc_id, title, text in iter_documents(path, corpus_format):
        passages.extend(split_passages(title, text, doc_id, words_per_passage))
    return _make_corpus(passages, {})


def validate_corpus_jsonl(path: str | os.PathLike[str], corpus_format: str = "auto") -> int:
    """Parse and check a whole corpus file without splitting it or building any index: a bad file fails
    here, naming the file, line and format, before any expensive work. Returns the number of documents."""
    return sum(1 for _ in iter_documents(path, corpus_format))
