"""The records of an offline W&B run file (`run-*.wandb`), read without a network or a W&B server: the file
is a LevelDB-style log (a 7-byte header `:W&B` + magic + version, then 32 KiB blocks of chunks, each
with a 4-byte checksum, 2-byte length and 1-byte type: full, first, middle or last) of `Record` protobufs."""

from __future__ import annotations

import struct
import time
from pathlib import Path

from wandb.proto import wandb_internal_pb2

BLOCK = 32768
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def run_records(path: Path | str) -> list[wandb_internal_pb2.Record]:
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    records, pending, pos = [], b"", HEADER
    while pos + HEADER <= len(data):
        room = BLOCK - pos % BLOCK
        if room < HEADER:  # the tail of a block too short for a chunk header is padding
            pos += room
            continue
        _checksum, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        chunk = data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if kind == 0 and length == 0:
            continue
        pending = chunk if kind in (FULL, FIRST) else pending + chunk
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def logged_artifacts(run_dir: Path | str, expected: int = 0, wait: float = 60.0) -> list[tuple[str, str, list[str]]]:
    """(name, type, file paths) of every artifact an offline run under `run_dir` logged. W&B's service writes
    the run file after `finish()` returns, on a loaded machine seconds later: with `expected`, the file is
    read again until that many artifacts are in it (or `wait` seconds have passed)."""
    deadline = time.monotonic() + wait
    while True:
        found = []
        for path in sorted(Path(run_dir).rglob("run-*.wandb")):
            try:
                records = list(run_records(path))
            except Exception:  # a file still being written may end mid-record
                records = []
            for record in records:
                if record.WhichOneof("record_type") == "artifact":
                    artifact = record.artifact
                    found.append((artifact.name, artifact.type, sorted(e.path for e in artifact.manifest.contents)))
        if len(found) >= expected or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


def artifacts_named(run_dir: Path | str, names: set[str], wait: float = 60.0) -> dict[str, tuple[str, list[str]]]:
    """{name: (type, file paths)} of the artifacts of `names` an offline run under `run_dir` logged, read again until
    all of them are in the run file (or `wait` seconds have passed): a run logs its tables as artifacts too."""
    deadline = time.monotonic() + wait
    while True:
        found = {name: (kind, files) for name, kind, files in logged_artifacts(run_dir, wait=0) if name in names}
        if set(found) == names or time.monotonic() > deadline:
            return found
        time.sleep(0.5)
