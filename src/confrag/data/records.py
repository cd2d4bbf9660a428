"""The one reader of record files, questions and corpora alike: `.jsonl`, `.jsonl.gz` or `.parquet`, each record
checked as it is read, its format named or detected from the first record, every error naming the file and the
line (or parquet row) and the format it was read in.

A kind of file (`RecordFile`: what it is called in errors, how to point a run at another, its suffixes and
formats, the setting that names its format) reads its records through `RecordFile.parsed`; the question reader
(`confrag.data.nq`) and the corpus reader (`confrag.retrieval.corpus`) each give it their record parser.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from confrag.data.jsonl import JSONL_SUFFIXES, DataFormatError, read_jsonl

T = TypeVar("T")
PARQUET_SUFFIX = ".parquet"
RECORD_SUFFIXES = (*JSONL_SUFFIXES, PARQUET_SUFFIX)


def formats_text(formats: Mapping[str, Any]) -> str:
    """Every format of `formats` with its fields, as errors name what a record must be."""
    return " or ".join(f"{f.name} {f.fields}" for f in formats.values())


def detect_format(obj: Any, where: str, formats: Mapping[str, Any], key: str) -> Any:
    """The first of `formats` whose `matches(obj)` holds; else a DataFormatError naming every format. A
    record that is not an object gets the first format, whose parser then says what a record must be."""
    if not isinstance(obj, Mapping):
        return next(iter(formats.values()))
    for fmt in formats.values():
        if fmt.matches(obj):
            return fmt
    raise DataFormatError(
        f"{where}: this record is in none of the known formats: {formats_text(formats)}; "
        f"fix the file, or name its format with `{key}`"
    )


def _check_parquet_not_empty(path: Path) -> None:
    """An empty file (0 bytes) or a parquet file of no rows named as empty: pyarrow and `datasets` report both as
    an unreadable file ("Parquet file size is 0 bytes", "BatchSize must be greater than 0")."""
    if path.stat().st_size == 0:
        raise DataFormatError(f"{path}: the file is empty (0 bytes); a .parquet file of records is expected")
    import pyarrow.parquet as pq

    try:
        rows = pq.ParquetFile(path).metadata.num_rows
    except Exception as exc:  # not parquet at all: named as such below, by the reader
        raise DataFormatError(f"{path}: not a readable parquet file ({type(exc).__name__}: {exc})") from exc
    if rows == 0:
        raise DataFormatError(f"{path}: the parquet file is empty (0 rows)")


def _parquet_records(path: Path) -> Iterator[tuple[str, Any]]:
    # Streaming: rows are read batch by batch from the file, nothing is copied into the datasets cache.
    from datasets import load_dataset

    _check_parquet_not_empty(path)
    try:
        stream = load_dataset("parquet", data_files=str(path), split="train", streaming=True)
        for index, record in enumerate(stream, start=1):
            yield f"row {index}", record
    except Exception as exc:  # pyarrow and datasets raise many types for a file that is not parquet
        raise DataFormatError(f"{path}: not a readable parquet file ({type(exc).__name__}: {exc})") from exc


def read_records(path: Path, expected: str) -> Iterator[tuple[str, Any]]:
    """(position, record) of every record of a `.jsonl` / `.jsonl.gz` file ("line N", blank lines skipped)
    or of a `.parquet` file ("row N", 1-based, streamed by Hugging Face `datasets`). A line that is not
    JSON raises DataFormatError naming the file, the line and `expected` (what each line must be)."""
    if path.name.lower().endswith(PARQUET_SUFFIX):
        yield from _parquet_records(path)
        return
    with contextlib.closing(read_jsonl(path, expected)) as lines:
        for lineno, obj in lines:
            yield f"line {lineno}", obj


@dataclass(frozen=True)
class RecordFile(Generic[T]):
    """A kind of record file: `noun` names it in errors ("question file"), `hint` says how a run is pointed at
    another, `formats` are its record formats (each with `name`, `fields` and `matches(record)`), `format_key` the
    setting that names one, `expected` what a JSONL line must be, `parse(record, index, where, format)` one
    record's value (`index`: its 0-based place among the records; raising DataFormatError)."""

    noun: str
    hint: str
    formats: Mapping[str, Any]
    format_key: str
    expected: str
    parse: Callable[[Any, int, str, Any], T]

    def parsed(self, path: str | Path, choice: str = "auto") -> Iterator[tuple[str, str, T]]:
        """(position, where, value) of every record of the file at `path`, in file order, in format `choice`
        (`auto`: the first record's, which every later record must then be in). The file is checked first (it
        exists, its name is a record file's); a record the format refuses is named with the format and where
        it was detected. Close the iterator (`contextlib.closing`) to stop early: the file closes at once."""
        path = Path(path)
        if not path.is_file():
            reason = "is a directory, not a file" if path.is_dir() else "not found"
            raise DataFormatError(f"{self.noun} {path} {reason}; {self.hint}")
        if not path.name.lower().endswith(RECORD_SUFFIXES):
            raise DataFormatError(f"{path}: unsupported file name; allowed suffixes are {', '.join(RECORD_SUFFIXES)}")
        fmt = None if choice == "auto" else self.formats[choice]
        chosen = f"{self.format_key}={choice}"
        with contextlib.closing(read_records(path, self.expected)) as records:
            for index, (position, obj) in enumerate(records):
                where = f"{path}, {position}"
                if fmt is None:
                    fmt = detect_format(obj, where, self.formats, self.format_key)
                    chosen = f"format {fmt.name} {fmt.fields}, detected at {position}"
                try:
                    value = self.parse(obj, index, where, fmt)
                except DataFormatError as exc:
                    raise DataFormatError(f"{exc} ({chosen})") from None
                yield position, where, value
