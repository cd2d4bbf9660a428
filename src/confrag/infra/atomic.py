"""Atomic writes with the permissions `open()` / `mkdir` would give, and the read-only cache's error.

Every file is written to a temp file beside its place, flushed, and renamed over it (`os.replace`), so a
reader, or a run killed at any moment, sees the old file or the new one, never half of one. A folder is
built beside its place and exchanged with the old one in one step (`swapped_in`, `replace_folder`), with the
same promise for the whole folder; a folder written once and never replaced is renamed into place
(`written_once`). A full disk while writing raises `DiskFullError` naming the folder. Files get
the permissions `open()` would give them (0666 less the umask), directories those of `mkdir` (0777 less
the umask), so a cache on a shared disk is readable by whom the umask allows.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import io
import logging
import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np


class CacheReadOnlyError(OSError):
    """Something is missing from a cache this process cannot write: it cannot be computed here."""


class DiskFullError(OSError):
    """No space (or no quota) left where something is written; the message names the folder and its free space."""


_FULL = (errno.ENOSPC, errno.EDQUOT)
# How libraries that write through their own code report a full disk (safetensors' Rust error, C's strerror).
_FULL_TEXTS = ("No space left on device", "StorageFull", "Disk quota exceeded")


def _existing(directory: Path) -> Path:
    while not directory.exists() and directory != directory.parent:
        directory = directory.parent
    return directory


def disk_full_message(folder: Path | str, error: BaseException) -> str:
    folder = Path(folder)
    try:
        free = f"{shutil.disk_usage(_existing(folder)).free / 1e6:,.1f} MB free there now"
    except OSError:
        free = "its free space unknown"
    return (
        f"{folder}: the disk is full (or the quota reached) while writing there ({error}; {free}). Free space on that "
        "disk, or move what is written: paths.cache_dir (the caches), paths.log_dir (the run folders)"
    )


@contextlib.contextmanager
def naming_full_disk(folder: Path | str) -> Iterator[None]:
    """A full disk (ENOSPC, EDQUOT, or a library's error saying so) while the block writes into `folder` raises
    `DiskFullError` naming the folder, instead of the library's error that names no place."""
    try:
        yield
    except DiskFullError:
        raise
    except OSError as err:
        if err.errno not in _FULL:
            raise
        raise DiskFullError(err.errno, disk_full_message(folder, err)) from err
    except Exception as err:
        if not any(text in str(err) for text in _FULL_TEXTS):
            raise
        raise DiskFullError(errno.ENOSPC, disk_full_message(folder, err)) from err


def writable(directory: Path) -> bool:
    """Whether this process may create files in `directory` (or, when it does not exist yet, in its
    nearest existing parent): a read-only mount or folder without write permission says no."""
    return os.access(_existing(Path(directory)), os.W_OK | os.X_OK)


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
    with naming_full_disk(parent):
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
    with naming_full_disk(path.parent):
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
    """Put the finished folder `built` (made beside `directory` by `make_temp_dir`) in `directory`'s place, so
    that at every moment, a killed writer included, `directory` is the old folder or the new one, whole: an
    existing folder is exchanged with `built` in one step (`renameat2(RENAME_EXCHANGE)` on Linux,
    `renamex_np(RENAME_SWAP)` on macOS), then removed from where `built` was. Where the file system cannot
    exchange, the old folder is renamed aside first and there is a moment without one (logged once).
    Callers hold a lock on `directory`, so that no other writer takes its place in between."""
    built, directory = Path(built), Path(directory)
    try:
        os.rename(built, directory)  # no folder there yet (or an empty one): nothing to swap
        return
    except OSError as err:
        if err.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
            raise
    if _exchange(built, directory):
        _remove(built)  # now the old folder
        return
    old = directory.with_name(f".old-{directory.name}-{os.getpid()}")
    os.replace(directory, old)
    os.replace(built, directory)
    _remove(old)


@contextlib.contextmanager
def swapped_in(directory: Path | str) -> Iterator[Path]:
    """Build a folder for `directory` and swap it into place (`replace_folder`): the body writes into the
    temporary folder this yields, beside `directory`; when it returns, the folder gets the permissions `mkdir`
    / `open()` would give and takes `directory`'s place. When it raises, `directory` is left as it was and the
    temporary folder removed. Callers hold a lock on `directory` where two processes may write it."""
    directory = Path(directory)
    tmp = make_temp_dir(directory.parent, f".tmp-{directory.name}-")
    try:
        with naming_full_disk(directory.parent):
            yield tmp
            honour_umask(tmp)
            replace_folder(tmp, directory)
    except BaseException:
        _remove(tmp)
        raise


@contextlib.contextmanager
def written_once(directory: Path | str) -> Iterator[Path]:
    """Build a folder that is written once and never replaced (a content-keyed index: two builds of one key are the
    same bytes): the body writes into the temporary folder this yields, beside `directory`; when it returns, the
    folder gets the permissions `mkdir` / `open()` would give and is renamed into place whole. A `directory` that
    another process renamed there first is kept as it is (its content is the same). When the body raises, nothing
    is left behind; a full disk raises `DiskFullError` naming the folder."""
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = make_temp_dir(directory.parent, ".tmp-")
    try:
        with naming_full_disk(directory.parent):
            yield tmp
            honour_umask(tmp)
            tmp.rename(directory)
    except OSError:
        if not directory.is_dir():  # else another process renamed the same folder into place first
            raise
    finally:
        _remove(tmp)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


_AT_FDCWD = -100  # <fcntl.h>: paths relative to the working directory
_RENAME_EXCHANGE = 2  # Linux <linux/fs.h>
_RENAME_SWAP = 2  # macOS <stdio.h>
_exchange_warned = False


def _exchange(a: Path, b: Path) -> bool:
    """Exchange the two paths in one step; False where this system or file system cannot (e.g. NFS)."""
    global _exchange_warned
    libc = _libc()
    name = {"linux": "renameat2", "darwin": "renamex_np"}.get(sys.platform)
    function = getattr(libc, name, None) if libc is not None and name else None
    if function is not None:
        if sys.platform == "linux":
            done = function(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
        else:
            done = function(os.fsencode(a), os.fsencode(b), _RENAME_SWAP)
        if done == 0:
            return True
        code = ctypes.get_errno()
        if code not in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise OSError(code, os.strerror(code), str(a), None, str(b))
    if not _exchange_warned:
        _exchange_warned = True
        logging.getLogger(__name__).warning(
            "This file system cannot exchange two folders in one step: a folder being replaced is briefly absent"
        )
    return False


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
