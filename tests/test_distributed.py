"""Rank environment of torchrun / Lightning / SLURM launches, the device of a rank, and the shard spread."""

from __future__ import annotations

import logging

import pytest

from confrag.infra.distributed import RankInfo, rank_device, rank_info, spread, warn_if_more_ranks_than_shards


@pytest.mark.parametrize(
    "env, expected",
    [
        ({}, RankInfo(0, 1, 0, "single")),
        ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}, RankInfo(1, 2, 1, "torchrun")),
        ({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1"}, RankInfo(5, 8, 1, "torchrun")),
        ({"LOCAL_RANK": "1", "WORLD_SIZE": "2", "NODE_RANK": "0"}, RankInfo(1, 2, 1, "lightning")),
        (
            {"LOCAL_RANK": "1", "WORLD_SIZE": "4", "NODE_RANK": "1", "LOCAL_WORLD_SIZE": "2"},
            RankInfo(3, 4, 1, "lightning"),
        ),
        ({"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1"}, RankInfo(3, 4, 1, "slurm")),
        # One SLURM task per job (a submitit sweep): every job is on its own, not a rank of a group.
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "0"}, RankInfo(0, 1, 0, "single")),
    ],
    ids=["none", "torchrun-1", "torchrun-5", "lightning", "lightning-node-1", "slurm", "slurm-single-task"],
)
def test_rank_info_reads_each_launcher(env, expected):
    assert rank_info(env) == expected
    assert expected.is_main == (expected.rank == 0)


@pytest.mark.parametrize(
    "env, message",
    [
        ({"RANK": "one", "WORLD_SIZE": "2"}, r"RANK='one' must be a non-negative integer"),
        ({"RANK": "2", "WORLD_SIZE": "2"}, r"rank 2 is outside a world of 2"),
        ({"RANK": "-1", "WORLD_SIZE": "2"}, r"RANK='-1'"),
        ({"LOCAL_RANK": "0", "WORLD_SIZE": "4", "NODE_RANK": "1"}, r"NODE_RANK=1 without RANK or LOCAL_WORLD_SIZE"),
    ],
)
def test_bad_rank_environment_is_named(env, message):
    with pytest.raises(ValueError, match=message):
        rank_info(env)


def test_rank_device_on_cpu(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert rank_device(RankInfo(1, 2, 1, "torchrun")) == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert rank_device(RankInfo(1, 2, 1, "torchrun")) == "cuda:1"
    with pytest.raises(ValueError, match="local rank 2 has no GPU of its own"):
        rank_device(RankInfo(2, 3, 2, "torchrun"))


def test_spread_starts_each_rank_at_its_share():
    items = list(range(10))
    assert spread(items, RankInfo()) == items
    starts = [spread(items, RankInfo(r, 4, r, "torchrun"))[0] for r in range(4)]
    assert starts == [0, 2, 5, 7]
    assert all(sorted(spread(items, RankInfo(r, 4, r, "torchrun"))) == items for r in range(4))


def test_more_ranks_than_shards_is_warned(caplog):
    with caplog.at_level(logging.WARNING, logger="confrag.infra.distributed"):
        assert warn_if_more_ranks_than_shards(3, "activations abc", RankInfo(0, 4, 0, "torchrun"))
        assert not warn_if_more_ranks_than_shards(4, "activations abc", RankInfo(0, 4, 0, "torchrun"))
    assert "3 shard(s) for 4 ranks: 1 rank(s) have nothing to compute" in caplog.text


def test_only_rank_0_runs_what_goes_through_on_main(tmp_path):
    from confrag.infra.run_context import RunContext

    calls = []

    def write(name, suffix=""):
        calls.append(name)
        return name + suffix

    results = [
        RunContext(tmp_path, 0, False, tmp_path / "out", RankInfo(rank, 2, rank, "torchrun")).on_main(
            write, "report", suffix=".md"
        )
        for rank in (0, 1)
    ]
    assert results == ["report.md", None] and calls == ["report"]
