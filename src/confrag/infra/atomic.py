"""Atomic writes with the permissions `open()` / `mkdir` would give, and the read-only cache's error.

Every file is written to a temp file beside its place, flushed, and renamed over it (`os.replace`), so a
reader, or a run killed at any moment, sees the old file or the new one, never half of one. Files get
the permissions `open()` would give them (0666 less the umask), directories those of `mkdir` (0777 less
the umask), so a cache on a shared disk is readable by whom the umask allows.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any

import numpy as np


class CacheReadOnlyError(OSError):
    """Something is missing from a cache this process cannot write: it cannot be computed here."""


def writable(directory: Path) -> bool:
    """Whether this process may create files in `directory` (or, when it does not exist yet, in its
    nearest existing parent): a read-only mount or folder without write permission says no."""
    directory = Path(directory)
    while not directory.exists() and directory != directory.parent:
        directory = directory.parent
    return os.access(directory, os.W_OK | os.X_OK)


def read_only_message(what: str, directory: Path) -> str:
    return (
        f"{what} is missing from the cache and {directory} cannot be written (a read-only cache): it cannot be "
        f"computed here. Fill the cache once from a run that can write it, or set paths.cache_dir to a "
        f"writable folder"
    )


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
