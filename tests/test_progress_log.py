"""Long stages say how far they are in train.log: a line per shard with the rate and the time left, and a line
while a slow shard is still computing (a shard of hundreds of answers takes minutes)."""

from __future__ import annotations

import logging
import re
import time

from confrag.infra import locks
from confrag.infra.sharded import ShardedArtifact


def slow_records(delay: float):
    def fn(start: int, stop: int) -> list[int]:
        time.sleep(delay)
        return list(range(start, stop))

    return fn


def test_each_shard_logs_its_rate_and_the_progress_of_the_whole(tmp_path, caplog):
    artifact = ShardedArtifact(tmp_path, "answers", {"x": 1}, 10, shard_size=4, fmt="json")
    with caplog.at_level(logging.INFO, logger="confrag.infra.locks"):
        artifact.compute(slow_records(0.0), desc="answers", progress=False)
    lines = [r.getMessage() for r in caplog.records if "computed shard" in r.getMessage()]
    assert len(lines) == 3
    assert re.search(r"computed shard 0 \(items \[0, 4\)\) in [\d.]+ s, [\d.]+ items/s \[pid \d+\]", lines[0])
    assert "answers: 1 of 3 shards, 4 of 10 items in" in lines[0] and "items/s, about" in lines[0]
    assert "answers: 3 of 3 shards, 10 of 10 items in" in lines[2] and "about 0 s left" in lines[2]


def test_a_slow_shard_says_it_is_still_computing(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(locks, "PROGRESS_LOG_SECONDS", 0.05)
    artifact = ShardedArtifact(tmp_path, "generations", {"x": 2}, 3, shard_size=3, fmt="json")
    with caplog.at_level(logging.INFO, logger="confrag.infra.locks"):
        artifact.compute(slow_records(0.3), desc="generations", progress=False)
    beats = [r.getMessage() for r in caplog.records if "still computing" in r.getMessage()]
    assert beats, "no progress line while the shard computed"
    assert re.match(r"generations [0-9a-f]{16}: shard 0 \(items \[0, 3\)\): still computing after [\d.]+ s", beats[0])
    assert "generations: 0 of 1 shards, 0 of 3 items" in beats[0]
    time.sleep(0.15)  # the heartbeat stops with its shard
    assert len([r for r in caplog.records if "still computing" in r.getMessage()]) == len(beats)
