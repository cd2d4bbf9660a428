"""The one JSON-lines reader of the project: `.jsonl` and `.jsonl.gz` files, decoded line by line so that
every error names the file and the 1-based line, always as `DataFormatError`."""

from __future__ import annotations

import contextlib
import gzip
import json
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

JSONL_SUFFIXES = (".jsonl", ".jsonl.gz")


class DataFormatError(ValueError):
    """A data file or record does not have the expected shape; the message says where and why."""


def _open_binary(path: Path) -> IO[bytes]:
    name = path.name.lower()
    if name.endswith(".jsonl.gz"):
        return gzip.open(path, "rb")
    if name.endswith(".jsonl"):
        return open(path, "rb")
    raise DataFormatError(f"{path}: unsupported file name; allowed suffixes are {', '.join(JSONL_SUFFIXES)}")


def numbered_lines(path: Path, any_name: bool = False) -> Iterator[tuple[int, str]]:
    """(1-based line number, decoded line) for every line; decoding per line keeps the line number. With
    `any_name`, a text file of any name (gzip-compressed when it ends in `.gz`), such as a TREC run file."""
    lineno = 0
    path = Path(path)
    opened = (gzip.open(path, "rb") if path.name.lower().endswith(".gz") else open(path, "rb")) if any_name else None
    try:
        with opened or _open_binary(path) as handle:
            for lineno, raw in enumerate(handle, start=1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    message = f"{path}, line {lineno}: not valid UTF-8 ({exc.reason}); files must be UTF-8"
                    raise DataFormatError(message) from exc
                if lineno == 1:
                    # Editors on Windows may prepend a byte-order mark, which json.loads rejects.
                    line = line.removeprefix("\ufeff")
                yield lineno, line
    except (gzip.BadGzipFile, EOFError, zlib.error) as exc:
        raise DataFormatError(
            f"{path}: not a complete gzip file (after line {lineno}): {exc}; "
            f"{'.gz' if any_name else '.jsonl.gz'} files must be gzip-compressed text"
        ) from exc


def read_jsonl(path: str | Path, expected: str) -> Iterator[tuple[int, Any]]:
    """(1-based line number, decoded JSON value) of every non-blank line of a `.jsonl` / `.jsonl.gz` file. A
    line that is not JSON raises DataFormatError naming the file, the line and `expected` (what each line
    must be). Close the iterator (`contextlib.closing`) when stopping early, so the file closes at once."""
    path = Path(path)
    # closing(): stopping early must still close the (possibly gzip) file now, not at garbage collection.
    with contextlib.closing(numbered_lines(path)) as lines:
        for lineno, line in lines:
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataFormatError(
                    f"{path}, line {lineno}: malformed JSON ({exc.msg} at column {exc.colno}); each line must be "
                    f"{expected}"
                ) from exc
            yield lineno, value
