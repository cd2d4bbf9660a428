"""Resumable, content-keyed artifacts computed in fixed shards.

An artifact lives in `<cache>/<kind>/<key>/`, where `key` hashes exactly the inputs and settings that
change its content (model identity, prompt template, data rows, layers, dtype, ...). Each shard is
computed independently from a fixed slice of the items and written atomically (temp file + rename),
so a process killed at any moment leaves only whole shards behind, and a rerun computes the missing
ones to the same result as an uninterrupted run. A manifest whose spec differs from the requested one
is refused.

Integrity: beside each shard, `<shard>.digest` records the xxh3-128 hash and size of the shard's
bytes; it is written (atomically) before the shard itself, so a shard on disk always has its digest.
A handle verifies every shard once, on its first read, and a shard that fails (digest mismatch,
truncation, wrong shape or length, NaN or inf in an npy shard) is reported by name and recomputed. A
shard without a digest is not trusted: it is recomputed, unless `cache_verify verify --adopt` recorded
its digest (for caches written before digests). A non-finite array is never written.

Single-file and single-folder results (converted models, probes, reranker exports, BM25 indexes,
preference rows) carry a folder digest (`confrag.digest.json`: xxh3-128 and size of every file), written
before the folder is renamed into place and checked where it is read (`folder_problem`).

Several processes (jobs of a multirun, ranks of a torchrun launch, SLURM jobs) may fill one artifact
together: `compute` claims a shard by taking its lock (`<shard>.lock`, a `filelock` flock) without
waiting, checks again that it is still missing, computes and writes it, and releases it. When only
shards held by others remain it waits for them; a lock whose owner died is released by the kernel,
and the next process to try takes the shard over. Every process returns the complete artifact.

Files get the permissions `open()` would give them (0666 less the umask), directories those of
`mkdir` (0777 less the umask), so a cache on a shared disk is readable by whom the umask allows.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import mmap
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import xxhash
from filelock import FileLock, Timeout
from tqdm.auto import tqdm

from confrag import distributed
from confrag.finite import nonfinite_rows, require_finite

log = logging.getLogger(__name__)

FORMATS = ("npy", "json")
STALE_TMP_SECONDS = 600
DIGEST_ALGORITHM = "xxh3_128"
DIGEST_SUFFIX = ".digest"
LOCK_SUFFIX = ".lock"
WAIT_POLL_SECONDS = 0.5  # how often a process waiting for other processes' shards looks again
WAIT_LOG_SECONDS = 60.0  # how often it says it is still waiting


class CacheMismatchError(RuntimeError):
    """An artifact directory holds something other than what its key promises."""


class CacheReadOnlyError(OSError):
    """Something is missing from a cache this process cannot write: it cannot be computed here."""


def _writable(directory: Path) -> bool:
    """Whether this process may create files in `directory` (or, when it does not exist yet, in its
    nearest existing parent): a read-only mount or folder without write permission says no."""
    directory = Path(directory)
    while not directory.exists() and directory != directory.parent:
        directory = directory.parent
    return os.access(directory, os.W_OK | os.X_OK)


def _read_only_message(what: str, directory: Path) -> str:
    return (
        f"{what} is missing from the cache and {directory} cannot be written (a read-only cache): it cannot be "
        f"computed here. Fill the cache once from a run that can write it, or set paths.cache_dir to a "
        f"writable folder"
    )


def fingerprint(obj: Any) -> str:
    """Short sha256 of a canonical JSON encoding."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, ensure_ascii=False, default=str).encode()).hexdigest()[:16]


# --- permissions -----------------------------------------------------------------------------------

_umask_guard = threading.Lock()


def current_umask() -> int:
    """The process's umask. Read from /proc where possible: `os.umask` can only be read by setting it,
    and a file another thread creates in between would get the wrong mode."""
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/self/status", encoding="ascii", errors="replace") as handle:
            for line in handle:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    with _umask_guard:
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


def file_mode() -> int:
    """What `open(path, "w")` gives a new file: 0666 less the umask."""
    return 0o666 & ~current_umask()


def dir_mode() -> int:
    """What `mkdir` gives a new directory: 0777 less the umask."""
    return 0o777 & ~current_umask()


def make_temp_dir(parent: Path | str, prefix: str) -> Path:
    """A fresh directory in `parent` to build something in before renaming it into place. Unlike
    `tempfile.mkdtemp` (always 0700), it gets the permissions `mkdir` would give."""
    parent = Path(parent)
    parent.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    os.chmod(path, dir_mode())
    return path


def honour_umask(root: Path | str) -> None:
    """Give `root` and everything under it the permissions `open()` / `mkdir` would give: for a folder
    built by a library before it is renamed into place (transformers' save_pretrained writes its
    weights 0600, whatever the umask)."""
    files, dirs = file_mode(), dir_mode()
    root = Path(root)
    os.chmod(root, dirs)
    for parent, dirnames, filenames in os.walk(root):
        for name in dirnames:
            os.chmod(os.path.join(parent, name), dirs)
        for name in filenames:
            os.chmod(os.path.join(parent, name), files)


# --- atomic writes ---------------------------------------------------------------------------------


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
    try:
        os.fchmod(fd, file_mode())  # mkstemp creates 0600 whatever the umask
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_save_png(figure: Any, path: str | os.PathLike[str]) -> Path:
    """A matplotlib Figure written atomically as PNG (a reader never sees half an image)."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    path = Path(path)
    atomic_write_bytes(path, buffer.getvalue())
    return path


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


def atomic_save_npy(path: Path, array: np.ndarray) -> None:
    atomic_write_bytes(path, npy_bytes(array))


def replace_folder(built: Path | str, directory: Path | str) -> None:
    """Put the finished folder `built` (made beside `directory` by `make_temp_dir`) in `directory`'s place:
    an existing one is first renamed aside, then removed, so a reader finds the old folder or the new one,
    never a mix. Callers hold a lock on `directory` (two renames into one place would collide)."""
    built, directory = Path(built), Path(directory)
    old = None
    if directory.exists():
        old = directory.with_name(f".old-{directory.name}-{os.getpid()}")
        os.replace(directory, old)
    os.replace(built, directory)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# --- locks -----------------------------------------------------------------------------------------


@contextlib.contextmanager
def exclusive(lock_path: Path | str, what: str) -> Iterator[None]:
    """Hold the file lock `lock_path` (waiting for it, with a log line saying so) while the block runs:
    for "compute it if it is missing" on a single-file or single-directory result that several
    processes may want at once. The lock is a flock: the kernel releases it when its owner dies. It is
    reentrant within a thread: a block already holding `lock_path` may enter it again (an export inside
    a "train it if missing" block that holds the same lock) instead of waiting for itself."""
    lock_path = Path(lock_path)
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(lock_path), is_singleton=True)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        log.info("Waiting for %s: another process holds %s", what, lock_path)
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


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


@dataclass(frozen=True)
class ShardStatus:
    """What a look at one shard found: `state` is ok, legacy (whole, written without a digest),
    missing or damaged; `reason` says why a damaged shard is damaged."""

    index: int
    state: str
    reason: str = ""


# --- sharded artifacts -----------------------------------------------------------------------------


class ShardedArtifact:
    def __init__(
        self, root: Path | str, kind: str, spec: dict[str, Any], num_items: int, shard_size: int = 256, fmt: str = "npy"
    ) -> None:
        if fmt not in FORMATS:
            raise ValueError(f"fmt={fmt!r} is not one of {FORMATS}")
        if shard_size < 1 or num_items < 0:
            raise ValueError(f"shard_size must be >= 1 and num_items >= 0 (got {shard_size}, {num_items})")
        self._layout(Path(root) / kind, kind, spec, num_items, shard_size, fmt)
        self._open()

    def _layout(self, parent: Path, kind: str, spec: dict[str, Any], num_items: int, shard_size: int, fmt: str) -> None:
        self.kind, self.spec, self.num_items, self.shard_size, self.fmt = kind, spec, num_items, shard_size, fmt
        self.key = fingerprint(
            {"kind": kind, "spec": spec, "num_items": num_items, "shard_size": shard_size, "fmt": fmt}
        )
        self.dir = parent / self.key
        self.manifest_path = self.dir / "manifest.json"
        # Shards this handle has verified, with the file identity they had then: verified once, not per read.
        self._verified: dict[int, tuple[int, int, int]] = {}
        self._reported: set[int] = set()
        self.computed: list[int] = []  # shards this handle computed (the others came from the cache)

    @classmethod
    def from_directory(cls, directory: Path | str) -> ShardedArtifact:
        """A read-only handle on an existing artifact directory (its manifest), writing nothing: what
        `verify` uses. Raises CacheMismatchError when the manifest is unreadable or does not match
        its directory name."""
        directory = Path(directory)
        manifest_path = directory / "manifest.json"
        try:
            stored = json.loads(manifest_path.read_text())
            kind, spec, num_items = stored["kind"], stored["spec"], int(stored["num_items"])
            shard_size, fmt = int(stored["shard_size"]), stored["fmt"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise CacheMismatchError(f"unreadable manifest {manifest_path}: {err}") from err
        if fmt not in FORMATS or shard_size < 1 or num_items < 0:
            raise CacheMismatchError(
                f"{manifest_path}: invalid layout (fmt {fmt!r}, shard_size {shard_size}, num_items {num_items})"
            )
        artifact = cls.__new__(cls)
        artifact._layout(directory.parent, kind, spec, num_items, shard_size, fmt)
        if artifact.key != directory.name or stored.get("key") != directory.name:
            raise CacheMismatchError(
                f"{manifest_path} describes another artifact than its directory name promises "
                f"(its content hashes to {artifact.key})"
            )
        artifact.dir = directory
        return artifact

    # --- layout -------------------------------------------------------------------------------
    @property
    def num_shards(self) -> int:
        return (self.num_items + self.shard_size - 1) // self.shard_size

    def shard_range(self, index: int) -> tuple[int, int]:
        start = index * self.shard_size
        return start, min(start + self.shard_size, self.num_items)

    def shard_path(self, index: int) -> Path:
        return self.dir / f"shard-{index:05d}.{self.fmt}"

    def digest_path(self, index: int) -> Path:
        return self.dir / f"shard-{index:05d}.{self.fmt}{DIGEST_SUFFIX}"

    def lock_path(self, index: int) -> Path:
        return self.dir / f"shard-{index:05d}.{self.fmt}{LOCK_SUFFIX}"

    # --- state --------------------------------------------------------------------------------
    def _manifest(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "key": self.key,
            "spec": self.spec,
            "num_items": self.num_items,
            "shard_size": self.shard_size,
            "fmt": self.fmt,
            "num_shards": self.num_shards,
        }

    def _open(self) -> None:
        if self.manifest_path.exists():
            try:
                stored = json.loads(self.manifest_path.read_text())
            except (OSError, json.JSONDecodeError) as err:
                raise CacheMismatchError(f"unreadable manifest {self.manifest_path}: {err}; delete {self.dir}") from err
            expected = json.loads(json.dumps(self._manifest(), default=str))
            if {k: stored.get(k) for k in expected} != expected:
                raise CacheMismatchError(
                    f"{self.manifest_path} describes a different artifact than key {self.key} promises; "
                    f"refusing to reuse it. Delete {self.dir} to recompute."
                )
        else:
            if not _writable(self.dir):
                raise CacheReadOnlyError(_read_only_message(f"{self.kind} artifact {self.key}", self.dir))
            atomic_write_text(self.manifest_path, json.dumps(self._manifest(), indent=2, default=str))
        # Temp files left by a killed writer are never part of the result. Only old ones are removed, so
        # that a second process writing the same artifact right now keeps its file.
        for stale in self.dir.glob(".tmp-*"):
            with contextlib.suppress(FileNotFoundError):
                if time.time() - stale.stat().st_mtime > STALE_TMP_SECONDS:
                    stale.unlink()

    def inspect(self, index: int) -> ShardStatus:
        """Read shard `index` whole and check it against its digest, shape and length; writes nothing."""
        path = self.shard_path(index)
        try:
            with open(path, "rb") as handle:
                size = os.fstat(handle.fileno()).st_size
                data = handle.read() if self.fmt == "json" else None
        except FileNotFoundError:
            return ShardStatus(index, "missing")
        except OSError as err:
            return ShardStatus(index, "damaged", f"unreadable: {err}")
        recorded = self._recorded_digest(index)
        if isinstance(recorded, str):
            return ShardStatus(index, "damaged", recorded)
        if recorded is not None:
            if recorded["bytes"] != size:
                return ShardStatus(index, "damaged", f"holds {size} bytes, its digest file says {recorded['bytes']}")
            try:
                found = bytes_digest(data) if data is not None else file_digest(path)[0]
            except OSError as err:
                return ShardStatus(index, "damaged", f"unreadable: {err}")
            if found != recorded["digest"]:
                return ShardStatus(
                    index, "damaged", f"checksum mismatch ({DIGEST_ALGORITHM} {found}, recorded {recorded['digest']})"
                )
        problem = self._shape_problem(index, path, data)
        if problem:
            return ShardStatus(index, "damaged", problem)
        return ShardStatus(index, "ok" if recorded is not None else "legacy")

    def _recorded_digest(self, index: int) -> dict[str, Any] | str | None:
        """The shard's digest record, None when it has none (written before digests), or a problem."""
        path = self.digest_path(index)
        try:
            record = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as err:
            return f"unreadable digest file {path.name} ({err})"
        if (
            not isinstance(record, dict)
            or record.get("algorithm") != DIGEST_ALGORITHM
            or not isinstance(record.get("digest"), str)
            or not isinstance(record.get("bytes"), int)
        ):
            return f"digest file {path.name} is not a {DIGEST_ALGORITHM} record"
        return record

    def _shape_problem(self, index: int, path: Path, data: bytes | None) -> str:
        start, stop = self.shard_range(index)
        try:
            if self.fmt == "npy":
                payload = np.load(path, mmap_mode="r", allow_pickle=False)
                if payload.ndim != 3:
                    return f"has {payload.ndim} dimensions, expected 3 (layers, items, dim)"
                rows = payload.shape[1]
            else:
                payload = json.loads(data.decode("utf-8"))
                if not isinstance(payload, list):
                    return "is not a JSON list"
                rows = len(payload)
        except (OSError, ValueError, EOFError, UnicodeDecodeError) as err:
            return f"unreadable: {err}"
        if rows != stop - start:
            return f"holds {rows} items, expected {stop - start}"
        if self.fmt == "npy":
            # Hidden states and embeddings are finite: a NaN or inf here (written by an older version, or
            # by hand with a matching digest) is damage, never data.
            bad = nonfinite_rows(payload, axis=1)
            if len(bad):
                return f"holds NaN or inf in {len(bad)} item(s) (first: item {start + int(bad[0])})"
        return ""

    def _identity(self, index: int) -> tuple[int, int, int] | None:
        try:
            stat = self.shard_path(index).stat()
        except OSError:
            return None
        return stat.st_ino, stat.st_size, stat.st_mtime_ns

    def _readable(self, index: int) -> bool:
        identity = self._identity(index)
        if identity is None:
            return False
        if self._verified.get(index) == identity:
            return True
        status = self.inspect(index)
        if status.state == "damaged":
            if index not in self._reported:  # said once per handle, not at every look
                self._reported.add(index)
                log.warning("Cache shard %s is damaged (%s); it is recomputed.", self.shard_path(index), status.reason)
            return False
        if status.state == "legacy":
            # No digest, no proof: a deleted digest looks the same as a shard from before digests, and
            # damage may have happened in between. Recomputed; `cache_verify verify --adopt` adopts the
            # shards of a cache written before digests when its owner vouches for them.
            if index not in self._reported:
                self._reported.add(index)
                log.warning(
                    "Cache shard %s has no digest file; it is recomputed (for a cache written before digests, "
                    "`python -m confrag.cache_verify verify --adopt` records them instead).",
                    self.shard_path(index),
                )
            return False
        if status.state == "ok":
            self._verified[index] = identity
            return True
        return False

    def adopt(self, index: int) -> bool:
        """Record the digest of shard `index` when it has none and passes the shape, length and finiteness
        checks (a shard written before digests, vouched for by the user); True when it was recorded."""
        if self.inspect(index).state != "legacy":
            return False
        data = self.shard_path(index).read_bytes()
        atomic_write_text(self.digest_path(index), json.dumps(digest_record(data)))
        return True

    def pending(self) -> list[int]:
        return [i for i in range(self.num_shards) if not self._readable(i)]

    @property
    def complete(self) -> bool:
        return not self.pending()

    # --- io -----------------------------------------------------------------------------------
    def _read(self, path: Path, mmap: bool = False):
        if self.fmt == "npy":
            return np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)
        return json.loads(path.read_text())

    def write(self, index: int, payload: Any) -> None:
        """Write shard `index`: its digest first, then the shard, each atomically, so that a shard on disk
        always has the digest of its own bytes (a crash in between leaves the shard missing)."""
        if self.fmt == "npy":
            payload = np.ascontiguousarray(payload)
            start, stop = self.shard_range(index)
            require_finite(
                payload, stage=self.kind, artifact=f"shard {self.shard_path(index)}", axis=1, row_offset=start
            )
            data = npy_bytes(payload)
        else:
            data = json.dumps(payload, ensure_ascii=False).encode("utf-8")
        atomic_write_text(self.digest_path(index), json.dumps(digest_record(data)))
        atomic_write_bytes(self.shard_path(index), data)
        self._reported.discard(index)
        identity = self._identity(index)
        if identity is not None:
            self._verified[index] = identity

    def _try_claim(self, index: int) -> FileLock | None:
        lock = FileLock(str(self.lock_path(index)))
        try:
            lock.acquire(timeout=0)
        except Timeout:
            return None
        return lock

    def compute(
        self,
        fn: Callable[[int, int], Any],
        desc: str | None = None,
        progress: bool = True,
        poll_seconds: float = WAIT_POLL_SECONDS,
    ) -> ShardedArtifact:
        """Compute every missing shard with `fn(start, stop)`; shards already on disk are kept.

        Safe with other processes computing the same artifact: each shard is claimed under its lock and
        computed by one process only; this returns once every shard is on disk, whoever computed it."""
        compute_shards([(self, fn)], desc=desc or self.kind, progress=progress, poll_seconds=poll_seconds)
        return self

    def shards(self, mmap: bool = True) -> list[Any]:
        if not self.complete:
            raise CacheMismatchError(f"artifact {self.dir} is incomplete; call compute() first")
        return [self._read(self.shard_path(i), mmap=mmap) for i in range(self.num_shards)]

    def records(self) -> list[Any]:
        """All items of a json artifact, in order."""
        return [item for shard in self.shards() for item in shard]


def compute_shards(
    jobs: Sequence[tuple[ShardedArtifact, Callable[[int, int], Any]]],
    desc: str = "shards",
    progress: bool = True,
    poll_seconds: float = WAIT_POLL_SECONDS,
) -> None:
    """Compute the missing shards of several artifacts (each with its own `fn(start, stop)`), claiming
    shards across all of them: a process never waits for a shard another one holds while some shard of
    any of the artifacts is still free (many small artifacts, such as answer chunks, split between
    processes as well as the shards of one big one). Returns when every shard of every artifact exists."""
    todo = [(artifact, fn, index) for artifact, fn in jobs for index in artifact.pending()]
    if not todo:
        return
    # Before any shard is computed (and before a deferred LLM loads for it): named, not a raw OSError on a lock.
    for artifact, _, index in todo:
        if not _writable(artifact.dir):
            missing = [a.shard_path(i).name for a, _, i in todo if a is artifact]
            raise CacheReadOnlyError(
                _read_only_message(
                    f"{artifact.shard_path(index)} ({len(missing)} shard(s) of {artifact.kind} {artifact.key})",
                    artifact.dir,
                )
            )
    for artifact, _ in jobs:
        missing = sum(a is artifact for a, _, _ in todo)
        if missing:
            log.info("%s %s: %d of %d shards to compute", artifact.kind, artifact.key, missing, artifact.num_shards)
    rank = distributed.rank_info()
    distributed.warn_if_more_ranks_than_shards(len(todo), desc, rank)
    waiting_since = last_said = None
    with tqdm(total=len(todo), desc=desc, unit="shard", disable=not progress) as bar:
        while todo:
            computed_now = False
            for artifact, fn, index in distributed.spread(todo, rank):
                lock = artifact._try_claim(index)
                if lock is None:  # another process is computing it
                    continue
                try:
                    if artifact._readable(index):  # finished by another process since the last look
                        continue
                    started = time.monotonic()
                    artifact.write(index, fn(*artifact.shard_range(index)))
                    artifact.computed.append(index)
                    # One line per shard, naming the process: who computed what in a shared cache.
                    log.info(
                        "%s %s: computed shard %d (items [%d, %d)) in %.1f s [pid %d]",
                        artifact.kind,
                        artifact.key,
                        index,
                        *artifact.shard_range(index),
                        time.monotonic() - started,
                        os.getpid(),
                    )
                    computed_now = True
                finally:
                    lock.release()
            todo = [(artifact, fn, index) for artifact, fn, index in todo if not artifact._readable(index)]
            bar.n = bar.total - len(todo)
            bar.refresh()
            if todo and not computed_now:
                now = time.monotonic()
                waiting_since = waiting_since or now
                if last_said is None or now - last_said >= WAIT_LOG_SECONDS:
                    names = ", ".join(f"{a.kind}/{a.key}/{a.shard_path(i).name}" for a, _, i in todo[:3])
                    log.info(
                        "waiting for %d shard(s) that other processes are computing (%s%s); waited %.0f s so far",
                        len(todo),
                        names,
                        ", ..." if len(todo) > 3 else "",
                        now - waiting_since,
                    )
                    last_said = now
                time.sleep(poll_seconds)


class ActivationStore:
    """Read access to a npy activation artifact of shape (layers, items, dim) per shard, memory-mapped."""

    def __init__(self, artifact: ShardedArtifact, layers: Sequence[int]) -> None:
        self.artifact = artifact
        self.layers = list(layers)
        self._arrays: list[np.ndarray] | None = None
        self.dim = int(self.arrays[0].shape[-1]) if self.arrays else 0

    @property
    def arrays(self) -> list[np.ndarray]:
        # Opened lazily so that DataLoader workers map the files themselves instead of receiving copies.
        if self._arrays is None:
            self._arrays = self.artifact.shards(mmap=True)
        return self._arrays

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_arrays": None}

    def __len__(self) -> int:
        return self.artifact.num_items

    @property
    def key(self) -> str:
        return self.artifact.key

    def layer_index(self, layer: int) -> int:
        if layer not in self.layers:
            raise ValueError(
                f"layer {layer} was not extracted; this cache holds layers {self.layers} "
                f"(set data.layers to include it)"
            )
        return self.layers.index(layer)

    def _locate(self, index: int) -> tuple[int, int]:
        if not 0 <= int(index) < len(self):
            raise IndexError(f"item {index} outside 0..{len(self) - 1}")
        return divmod(int(index), self.artifact.shard_size)

    def get(self, layer: int, index: int) -> np.ndarray:
        shard, offset = self._locate(index)
        return np.array(self.arrays[shard][self.layer_index(layer), offset], dtype=np.float32)  # a writable copy

    def take(self, layer: int, indices: Sequence[int]) -> np.ndarray:
        position = self.layer_index(layer)
        out = np.empty((len(indices), self.dim), dtype=np.float32)
        for row, index in enumerate(indices):
            shard, offset = self._locate(index)
            out[row] = self.arrays[shard][position, offset]
        return out
