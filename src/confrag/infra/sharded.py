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

Several processes may fill one artifact together: shards are claimed under their locks
(`confrag.infra.locks.compute_shards`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from filelock import FileLock

from confrag.infra.atomic import (
    CacheReadOnlyError,
    atomic_write_bytes,
    atomic_write_text,
    npy_bytes,
    read_only_message,
    writable,
)
from confrag.infra.digests import DIGEST_ALGORITHM, DIGEST_SUFFIX, bytes_digest, digest_record, file_digest, fingerprint
from confrag.infra.finite import nonfinite_rows, require_finite
from confrag.infra.locks import LOCK_SUFFIX, WAIT_POLL_SECONDS, compute_shards, try_claim

log = logging.getLogger(__name__)

FORMATS = ("npy", "json")
STALE_TMP_SECONDS = 600


class CacheMismatchError(RuntimeError):
    """An artifact directory holds something other than what its key promises."""


@dataclass(frozen=True)
class ShardStatus:
    """What a look at one shard found: `state` is ok, legacy (whole, written without a digest),
    missing or damaged; `reason` says why a damaged shard is damaged."""

    index: int
    state: str
    reason: str = ""


# --- sharded artifacts -----------------------------------------------------------------------------


@dataclass(frozen=True)
class ShardedCache:
    """Where a computation's sharded artifacts live and how they are filled: the cache folder, the items per
    shard, and whether filling them shows progress. The three travel together through every function that
    caches per-prompt states or answers, so they are one value."""

    root: Path | str
    shard_size: int = 256
    progress: bool = True

    def artifact(self, kind: str, spec: dict[str, Any], num_items: int, fmt: str) -> ShardedArtifact:
        """The artifact `kind` keyed by `spec`, of `num_items` items, in this cache's shards."""
        return ShardedArtifact(self.root, kind, spec, num_items, self.shard_size, fmt=fmt)


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
            if not writable(self.dir):
                raise CacheReadOnlyError(read_only_message(f"{self.kind} artifact {self.key}", self.dir))
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
                    "`python -m confrag.infra.cache_verify verify --adopt` records them instead).",
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
        return try_claim(self.lock_path(index))

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
