"""Several processes on one cache, with real processes (`tests/cache_worker.py`):

- two workers filling the same artifact compute each shard once and leave the cache byte-identical to
  one worker's; a third run computes nothing;
- a shard whose owner is killed while computing it is taken over by a waiting worker;
- two workers with different keys in one directory do not disturb each other;
- two processes converting the same GGUF model at once both succeed, and convert it once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "cache_worker.py"
sys.path.insert(0, str(ROOT / "tests"))
from cache_worker import NUM_ITEMS, SHARD_SIZE, values  # noqa: E402

NUM_SHARDS = -(-NUM_ITEMS // SHARD_SIZE)
DEADLINE_S = 120.0

pytestmark = pytest.mark.subprocess  # every test starts worker processes


@pytest.fixture()
def children():
    """Processes started by a test; any still running at the end are killed (by their own handle)."""
    started: list[subprocess.Popen] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def start(children, tmp_path: Path, name: str, *args) -> subprocess.Popen:
    out, err = open(tmp_path / f"{name}.out", "w"), open(tmp_path / f"{name}.err", "w")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_NTASKS"):
        env.pop(var, None)
    proc = subprocess.Popen([sys.executable, str(WORKER), *map(str, args)], stdout=out, stderr=err, env=env, cwd=ROOT)
    proc.name, proc.tmp = name, tmp_path
    children.append(proc)
    return proc


def finish(proc: subprocess.Popen) -> dict:
    assert proc.wait(timeout=DEADLINE_S) == 0, (proc.tmp / f"{proc.name}.err").read_text()[-3000:]
    lines = (proc.tmp / f"{proc.name}.out").read_text().splitlines()
    return json.loads(lines[-1])


def counted(counter: Path) -> Counter:
    return (
        Counter(tuple(line.split()[:2]) for line in counter.read_text().splitlines()) if counter.exists() else Counter()
    )


def snapshot(cache: Path) -> dict[str, bytes]:
    return {str(p.relative_to(cache)): p.read_bytes() for p in sorted(cache.rglob("*")) if p.is_file()}


def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.05)


def test_two_workers_compute_each_shard_once_and_match_one_worker(children, tmp_path):
    go = tmp_path / "go"
    alone, shared = tmp_path / "alone", tmp_path / "shared"
    reference = start(children, tmp_path, "alone", "fill", alone, tmp_path / "alone.count", go, 0, "k")
    pair = [start(children, tmp_path, f"w{i}", "fill", shared, tmp_path / "shared.count", go, 0.2, "k") for i in (1, 2)]
    go.touch()  # all three start computing together
    assert sorted(finish(reference)["computed"]) == list(range(NUM_SHARDS))
    computed = [finish(proc)["computed"] for proc in pair]

    # Every shard computed exactly once, by one of the two workers.
    assert sorted(computed[0] + computed[1]) == list(range(NUM_SHARDS))
    per_shard = counted(tmp_path / "shared.count")
    assert sorted(int(start) // SHARD_SIZE for _, start in per_shard) == list(range(NUM_SHARDS))
    assert set(per_shard.values()) == {1}
    # The shared cache holds exactly what one worker alone writes (manifest, shards, digests, locks).
    assert snapshot(shared) == snapshot(alone)
    assert not list(shared.rglob(".tmp-*"))

    # A third run finds everything and computes nothing.
    third = start(children, tmp_path, "third", "fill", shared, tmp_path / "shared.count", go, 0, "k")
    assert finish(third)["computed"] == []
    assert counted(tmp_path / "shared.count") == per_shard


def test_lock_of_a_killed_worker_is_taken_over(children, tmp_path):
    cache, counter, marker, go = tmp_path / "cache", tmp_path / "count", tmp_path / "holding", tmp_path / "go"
    go.touch()
    owner = start(children, tmp_path, "owner", "hold", cache, counter, marker, "k")
    wait_until(marker.exists, "the first worker to claim shard 0")
    waiter = start(children, tmp_path, "waiter", "fill", cache, counter, go, 0, "k")
    # The second worker computes every other shard, then waits for shard 0, which the first one holds.
    wait_until(lambda: "waiting for 1 shard(s)" in (tmp_path / "waiter.err").read_text(), "the waiter to wait")
    assert waiter.poll() is None
    os.kill(owner.pid, signal.SIGKILL)  # dies holding the lock: the kernel releases the flock
    owner.wait()
    computed = finish(waiter)["computed"]
    assert sorted(computed) == list(range(NUM_SHARDS))  # shards 1..n first, then the dead owner's shard 0
    assert computed[-1] == 0
    from confrag.infra.sharded import ShardedArtifact

    handle = ShardedArtifact(
        cache, "activations", {"test": "concurrency", "key": "k"}, NUM_ITEMS, shard_size=SHARD_SIZE
    )
    np.testing.assert_array_equal(
        np.concatenate([np.asarray(s) for s in handle.shards()], axis=1), values(0, NUM_ITEMS)
    )


def test_workers_with_different_keys_in_one_directory_are_independent(children, tmp_path):
    cache, counter, go = tmp_path / "cache", tmp_path / "count", tmp_path / "go"
    workers = {key: start(children, tmp_path, key, "fill", cache, counter, go, 0.05, key) for key in ("a", "b")}
    go.touch()
    for _, proc in workers.items():
        assert sorted(finish(proc)["computed"]) == list(range(NUM_SHARDS))  # each computed all of its own
    per_shard = counted(counter)
    assert len(per_shard) == 2 * NUM_SHARDS and set(per_shard.values()) == {1}
    assert len(list((cache / "activations").iterdir())) == 2


def test_concurrent_gguf_conversions_both_succeed_and_convert_once(children, tmp_path):
    models, counter, go = tmp_path / "models", tmp_path / "count", tmp_path / "go"
    models.mkdir()
    (models / "model.gguf").write_bytes(b"GGUF")
    pair = [start(children, tmp_path, f"c{i}", "convert", models, counter, go) for i in (1, 2)]
    go.touch()
    for proc in pair:  # before: one of them died with "OSError: [Errno 39] Directory not empty"
        assert finish(proc) == {"converted": True}
    saves = counter.read_text().splitlines()
    assert len(saves) == 2 and len({line.split()[1] for line in saves}) == 1  # model + tokenizer, one process
    target = models / "model-0123"
    assert (target / "config.json").is_file()
    assert not [p for p in models.iterdir() if ".tmp-" in p.name]
