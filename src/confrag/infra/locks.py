"""Locks and claims in a shared cache: `once` for "read it, else compute it" on a single result (looked at first
without a lock, so a complete cache may be read-only; `exclusive` only while it is missing), and `compute_shards`,
which claims the missing shards of sharded artifacts one lock at a time (none when nothing is missing).

Several processes (jobs of a multirun, ranks of a torchrun launch, SLURM jobs) may fill one artifact
together: `compute_shards` claims a shard by taking its lock (`<shard>.lock`, a `filelock` flock) without
waiting, checks again that it is still missing, computes and writes it, and releases it. When only
shards held by others remain it waits for them; a lock whose owner died is released by the kernel,
and the next process to try takes the shard over. Every process returns the complete artifact.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

from filelock import FileLock, Timeout
from tqdm.auto import tqdm

from confrag.infra import distributed
from confrag.infra.atomic import CacheReadOnlyError, read_only_message, writable

log = logging.getLogger(__name__)
T = TypeVar("T")
# What taking a lock in a folder this process cannot write raises: a read-only file system, no permission.
_UNWRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)

LOCK_SUFFIX = ".lock"
WAIT_POLL_SECONDS = 0.5  # how often a process waiting for other processes' shards looks again
WAIT_LOG_SECONDS = 60.0  # how often it says it is still waiting
PROGRESS_LOG_SECONDS = 60.0  # how often a shard still computing says so (train.log shows a long shard is alive)


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


def once(lock_path: Path | str, what: str, read: Callable[[], T | None], build: Callable[[], T]) -> T:
    """A single result computed once by whichever process gets there first: `read()` (the whole result, or None
    when it is missing or damaged) is tried without any lock, so that a complete result is read from a cache this
    process cannot write (no lock file is made); only a missing one takes `lock_path` (`exclusive`), looks again,
    since another process may have built it meanwhile, and `build()`s it. The one pattern of the project's "read
    it, else compute it": every single result of the cache goes through it (tests/test_architecture.py)."""
    found = read()
    if found is not None:
        return found
    lock_path = Path(lock_path)
    with contextlib.ExitStack() as held:
        try:
            held.enter_context(exclusive(lock_path, what))
        except OSError as err:  # no lock file can be made: the cache cannot be written, and the result is missing
            if err.errno not in _UNWRITABLE:
                raise
            raise CacheReadOnlyError(read_only_message(what, lock_path.parent)) from err
        found = read()
        return found if found is not None else build()


def try_claim(lock_path: Path | str) -> FileLock | None:
    """The file lock `lock_path`, taken without waiting, or None when another process holds it."""
    lock = FileLock(str(lock_path))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        return None
    return lock


def claimed_first(items: Sequence[Any], lock_path: Callable[[Any], Path], run: Callable[[Any], Any], what: str) -> list:
    """`run(item)` for every item, in the order of `items` in the result. Each runs while this process holds the
    item's claim `lock_path(item)`: an item another process is already on is left for last and then waited for
    (its results are cached by then), so processes filling one cache work on different items at once instead of
    queueing on the same one. Only the order of the work depends on the claims, never a result."""
    results: dict[int, Any] = {}
    deferred = []
    for i, item in enumerate(items):
        try:
            claim = try_claim(lock_path(item))
        except OSError as err:  # a cache this process cannot write: no claim to take; `run` reads what is there
            if err.errno not in _UNWRITABLE:
                raise
            results[i] = run(item)
            continue
        if claim is None:
            log.info("%s %d: another process is on it; taking the next one first", what, i)
            deferred.append(i)
            continue
        try:
            results[i] = run(item)
        finally:
            claim.release()
    for i in deferred:
        with exclusive(lock_path(items[i]), f"{what} {i}"):
            results[i] = run(items[i])
    return [results[i] for i in range(len(items))]


def compute_shards(
    jobs: Sequence[tuple[Any, Callable[[int, int], Any]]],  # (ShardedArtifact, fn): confrag.infra.sharded imports this
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
        if not writable(artifact.dir):
            missing = [a.shard_path(i).name for a, _, i in todo if a is artifact]
            raise CacheReadOnlyError(
                read_only_message(
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
    rate = Rate(desc, len(todo), sum(_items(a, i) for a, _, i in todo))
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
                    start, stop = artifact.shard_range(index)
                    with still_computing(
                        f"{artifact.kind} {artifact.key}: shard {index} (items [{start}, {stop}))", rate
                    ):
                        artifact.write(index, fn(start, stop))
                    artifact.computed.append(index)
                    seconds = time.monotonic() - started
                    # One line per shard, naming the process (who computed what in a shared cache), with the rate.
                    log.info(
                        "%s %s: computed shard %d (items [%d, %d)) in %.1f s, %.2f items/s [pid %d]; %s",
                        artifact.kind,
                        artifact.key,
                        index,
                        start,
                        stop,
                        seconds,
                        (stop - start) / max(seconds, 1e-9),
                        os.getpid(),
                        rate.done(stop - start),
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


def _items(artifact: Any, index: int) -> int:
    start, stop = artifact.shard_range(index)
    return stop - start


class Rate:
    """The progress of one `compute_shards` call in train.log: shards and items done by this process, the rate
    and the time left at that rate (shards that other processes compute count as left until they appear)."""

    def __init__(self, desc: str, shards: int, items: int) -> None:
        self.desc, self.shards, self.items = desc, shards, items
        self.shards_done = self.items_done = 0
        self.started = time.monotonic()

    def done(self, items: int) -> str:
        self.shards_done += 1
        self.items_done += items
        return self.line()

    def line(self) -> str:
        elapsed = time.monotonic() - self.started
        done = f"{self.desc}: {self.shards_done} of {self.shards} shards, {self.items_done} of {self.items} items"
        if not self.items_done:
            return f"{done} after {elapsed:.0f} s"
        rate = self.items_done / elapsed
        left = (self.items - self.items_done) / rate
        return f"{done} in {elapsed:.0f} s ({rate:.2f} items/s, about {left:.0f} s left)"


@contextlib.contextmanager
def still_computing(what: str, rate: Rate) -> Iterator[None]:
    """While the block runs, a line every PROGRESS_LOG_SECONDS saying that `what` is still being computed: a
    shard of hundreds of answers takes minutes, and train.log would otherwise say nothing until it ends."""
    stop = threading.Event()
    started = time.monotonic()

    def beat() -> None:
        while not stop.wait(PROGRESS_LOG_SECONDS):
            log.info("%s: still computing after %.0f s; %s", what, time.monotonic() - started, rate.line())

    thread = threading.Thread(target=beat, name="shard-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
