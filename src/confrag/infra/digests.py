"""Content digests: the short key hash of a canonical JSON (`fingerprint`), xxh3-128 digests of bytes and
files, and the folder digest of single-file and single-folder results.

Single-file and single-folder results (converted models, probes, reranker exports, BM25 indexes,
preference rows) carry a folder digest (`confrag.digest.json`: xxh3-128 and size of every file), written
before the folder is renamed into place and checked where it is read (`folder_problem`).
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import xxhash

from confrag.infra.atomic import atomic_write_text

DIGEST_ALGORITHM = "xxh3_128"
DIGEST_SUFFIX = ".digest"


def fingerprint(obj: Any) -> str:
    """Short sha256 of a canonical JSON encoding."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, ensure_ascii=False, default=str).encode()).hexdigest()[:16]


# --- digests ---------------------------------------------------------------------------------------


def bytes_digest(data: bytes | memoryview | mmap.mmap) -> str:
    return xxhash.xxh3_128(data).hexdigest()


def file_digest(path: Path) -> tuple[str, int]:
    """(xxh3-128 hex digest, size) of a file's bytes, read through a memory map (no copy)."""
    with open(path, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        if size == 0:
            return bytes_digest(b""), 0
        with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            return bytes_digest(mapped), size


def digest_record(data: bytes) -> dict[str, Any]:
    return {"algorithm": DIGEST_ALGORITHM, "digest": bytes_digest(data), "bytes": len(data)}


# --- folder digests (single results: converted models, probes, reranker exports, indexes) -----------

FOLDER_DIGEST = "confrag.digest.json"


class ArtifactDamagedError(RuntimeError):
    """A stored result fails its digest (or has none): rebuilt where the project made it, refused where
    a user supplied it."""


def _listed_files(directory: Path, names: Sequence[str] | None = None) -> list[Path]:
    # Dot files are locks and temp files, never part of a result.
    roots = [directory] if names is None else [directory / name for name in names]
    found = []
    for root in roots:
        found += [root] if root.is_file() else [p for p in root.rglob("*") if p.is_file()]
    return sorted(
        p
        for p in found
        if p.name != FOLDER_DIGEST and not any(part.startswith(".") for part in p.relative_to(directory).parts)
    )


def write_folder_digest(directory: Path | str, names: Sequence[str] | None = None) -> None:
    """Record the xxh3-128 digest and size of every file under `directory` (dot files aside; only the files
    and folders `names` when given) in `<directory>/confrag.digest.json`, atomically. Call it on the
    finished folder, before renaming it into place, or after the last file of an in-place result."""
    directory = Path(directory)
    files = {}
    for path in _listed_files(directory, names):
        digest, size = file_digest(path)
        files[path.relative_to(directory).as_posix()] = {"digest": digest, "bytes": size}
    record = {"algorithm": DIGEST_ALGORITHM, "files": files}
    atomic_write_text(directory / FOLDER_DIGEST, json.dumps(record, indent=1, sort_keys=True))


def covered_problem(path: Path | str) -> str | None:
    """For a file or folder inside a folder with a digest: what is wrong with it ("" when whole), or None
    when no digest covers it (a user's own file)."""
    path = Path(path)
    try:
        record = json.loads((path.parent / FOLDER_DIGEST).read_text())
        listed = [name for name in record["files"] if name == path.name or name.startswith(path.name + "/")]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return folder_problem(path.parent, only=listed) if listed else None


def has_folder_digest(directory: Path | str) -> bool:
    return (Path(directory) / FOLDER_DIGEST).is_file()


def folder_problem(directory: Path | str, only: Sequence[str] | None = None) -> str:
    """What is wrong with a folder result against its `confrag.digest.json` ("" when every listed file
    is whole): no digest, an unreadable one, a listed file missing, resized or with other bytes. `only`
    checks just those listed files (a config read without the weights). Files the digest does not list
    are not judged."""
    directory = Path(directory)
    path = directory / FOLDER_DIGEST
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        return f"has no digest file {FOLDER_DIGEST}" if directory.is_dir() else "does not exist"
    except (OSError, ValueError) as err:
        return f"unreadable digest file {FOLDER_DIGEST} ({err})"
    files = record.get("files") if isinstance(record, dict) else None
    if record.get("algorithm") != DIGEST_ALGORITHM or not isinstance(files, dict) or not files:
        return f"digest file {FOLDER_DIGEST} is not a {DIGEST_ALGORITHM} record of its files"
    names = list(files) if only is None else [name for name in only if name in files]
    if only is not None and len(names) != len(only):
        return f"digest file {FOLDER_DIGEST} does not list {sorted(set(only) - set(names))}"
    for name in names:
        entry = files[name]
        try:
            found, size = file_digest(directory / name)
        except FileNotFoundError:
            return f"{name} is missing"
        except OSError as err:
            return f"{name} is unreadable ({err})"
        if not isinstance(entry, dict) or size != entry.get("bytes"):
            return (
                f"{name} holds {size} bytes, its digest says {entry.get('bytes') if isinstance(entry, dict) else '?'}"
            )
        if found != entry.get("digest"):
            return f"{name}: checksum mismatch ({DIGEST_ALGORITHM} {found}, recorded {entry.get('digest')})"
    return ""


def require_whole_folder(directory: Path | str, what: str) -> None:
    """Raise ArtifactDamagedError naming `what` and the folder when `folder_problem` finds anything."""
    problem = folder_problem(directory)
    if problem:
        raise ArtifactDamagedError(f"{what} {directory}: {problem}")
