"""The probe task under `torchrun --nproc_per_node=2 ... trainer=ddp trainer.devices=2` on CPU (gloo): the
ranks split NQ_Confidence's shards (each computed once, the arrays those of one process), train the probe
together under Lightning's DDP, and rank 0 alone writes the one run folder they share."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate

from confrag.infra.distributed import launch_stamp
from confrag.probe.activation_dataset import unrepeated_sampler
from confrag.recipes import probe_recipe
from confrag.train import run_task

from helpers.runs import MODEL_DIR, ROOT, compose_cfg

TORCHRUN = Path(sys.executable).parent / "torchrun"
# 16 questions in three prompt kinds: 3 answer and 3 state artifacts of one shard each, six shards to split.
SMALL = [
    "+experiment=probe_tiny_llama",
    "data.num_questions=16",
    "trainer.max_epochs=1",
    "logger=csv",
    "trainer.enable_progress_bar=false",
]
LAUNCH_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "NODE_RANK",
    "SLURM_NTASKS",
    "CONFRAG_RUN_ID",
)


def environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}
    env.update(
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
        CUDA_VISIBLE_DEVICES="",
        WANDB_SILENT="true",
    )
    return env


def shard_bytes(cache: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(cache)): p.read_bytes()
        for kind in ("generations", "activations")
        for p in sorted((cache / kind).glob("*/shard-*"))
        if not p.name.endswith(".lock")
    }


def computed_shards(output: str) -> list[tuple[str, str, int, str]]:
    """(kind, key, shard, pid) of every `computed shard` line the processes logged."""
    return [
        (m[0], m[1], int(m[2]), m[3])
        for m in re.findall(r"(\w+) ([0-9a-f]{16}): computed shard (\d+) \(items .*?\[pid (\d+)\]", output)
    ]


@pytest.mark.slow  # make test-all: kept out of make test's 15 minutes
@pytest.mark.subprocess
@pytest.mark.task
@pytest.mark.skipif(not TORCHRUN.is_file(), reason="needs torchrun")
def test_probe_task_on_two_torchrun_ranks_shares_shards_trains_ddp_and_writes_one_run(tmp_path):
    # One process, in-process through the DataModule: the reference arrays and answers.
    reference_cache = tmp_path / "cache1"
    cfg = compose_cfg(SMALL, tmp_path)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the ranks (OMP_NUM_THREADS=1): the thread count moves float rounding
    try:
        layer = probe_recipe(cfg).layer  # as the task resolves it
        instantiate(cfg.data, cache_dir=str(reference_cache), layer=layer, _convert_="all").prepare_data()
    finally:
        torch.set_num_threads(threads)

    cache, logs = tmp_path / "cache2", tmp_path / "logs"
    # The multi-GPU command of docs/gpu.md on CPU: llm.device=rank is cpu without CUDA, DDP runs over gloo.
    command = [
        str(TORCHRUN),
        "--standalone",
        "--nproc_per_node=2",
        "train.py",
        *SMALL,
        "trainer=ddp",
        "trainer.accelerator=cpu",
        "trainer.devices=2",
        "llm.device=rank",
        f"paths.cache_dir={cache}",
        f"paths.model_dir={MODEL_DIR}",
        f"paths.log_dir={logs}",
    ]
    done = subprocess.run(command, cwd=ROOT, env=environment(), capture_output=True, text=True, timeout=600)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]

    # Same answers and states as one process, bit for bit; every shard computed once (no shard twice).
    reference = shard_bytes(reference_cache)
    # Answers and states of three prompt kinds, and the dev and test questions' candidates' states (the
    # checkpoint's ranking metric).
    assert len([name for name in reference if not name.endswith(".digest")]) == 8
    assert shard_bytes(cache) == reference
    computed = computed_shards(output)
    assert sorted((kind, key, shard) for kind, key, shard, _ in computed) == sorted(
        (name.split("/")[0], name.split("/")[1], int(name.split("/")[2][6:11]))
        for name in reference
        if not name.endswith(".digest")
    )
    # Which rank computes which shard depends on when each started (under load one rank can claim all six
    # before the other has loaded its model); the ranks' different starting shards are `spread`'s, tested
    # in test_distributed.py. Here: computed by the launch's processes only, never by a third.
    assert 1 <= len({pid for *_, pid in computed}) <= 2

    # Trained under DDP across the two ranks, one run folder, written by rank 0 only.
    assert "Initializing distributed: GLOBAL_RANK: 1, MEMBER: 2/2" in output
    runs = list((logs / "probe" / "runs").iterdir())
    assert len(runs) == 1, runs
    run = runs[0]
    for name in (
        "metrics.json",
        "summary.txt",
        "run_info.json",
        "config_resolved.yaml",
        "probe/probe.json",
        "checkpoints/last.ckpt",
        "train.log",
        "train_rank1.log",
        ".hydra/config.yaml",
        ".hydra_rank1/config.yaml",
    ):
        assert (run / name).is_file(), name
    assert output.count("Probe on layer") == 1  # the summary printed once
    record = json.loads((run / "metrics.json").read_text())
    assert {"train/loss", "val/loss", "test/acc"} <= set(record["metrics"])
    # The probe kept in the cache once (beside it, the dot lock file that serializes saves).
    assert len([p for p in (cache / "probes").iterdir() if not p.name.startswith(".")]) == 1


@pytest.mark.parametrize("size", [7, 8])
def test_dev_and_test_examples_are_each_seen_once_across_ddp_ranks(monkeypatch, size):
    """Lightning's DistributedSampler would repeat an example to even out 2 ranks over 7; the repeat would
    count in the dev metric the checkpoint is chosen by and in the test metrics."""
    dataset = list(range(size))
    assert unrepeated_sampler(dataset) is None  # no process group: Lightning's own sampler
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 2)
    seen = []
    for rank in (0, 1):
        monkeypatch.setattr(torch.distributed, "get_rank", lambda r=rank: r)
        seen += list(unrepeated_sampler(dataset))
    assert sorted(seen) == dataset
    assert unrepeated_sampler([0]) is None  # a rank without any example could not gather the metrics


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            [],
            r"trainer: this process is rank 1 of a 2-process torchrun launch, but the trainer trains on one device"
            r"[\s\S]*trainer=ddp trainer.devices=",
        ),
        (
            ["trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=4"],
            r"trainer.devices=4 x trainer.num_nodes=1 = 4 processes; they must multiply to 2",
        ),
    ],
    ids=["one-device", "wrong-count"],
)
def test_probe_task_under_a_multi_rank_launch_refuses_a_trainer_of_another_size(
    tmp_path, monkeypatch, overrides, message
):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    cfg = compose_cfg(["+experiment=probe_tiny_llama", "logger=csv", *overrides], tmp_path)
    with pytest.raises(ValueError, match=message):
        run_task(cfg)
    assert not (tmp_path / "out").exists()  # refused before the run folder got a file


def test_later_tasks_under_a_multi_rank_launch_refuse_a_ddp_trainer(tmp_path, monkeypatch):
    """The rerank, cbdr and gates tasks train on the rank that takes the lock while the others wait: a DDP
    trainer there would wait for ranks that wait for it."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    cfg = compose_cfg(
        [
            "+experiment=reranker_tiny_llama",
            "logger=csv",
            "trainer=ddp",
            "trainer.accelerator=cpu",
            "trainer.devices=2",
        ],
        tmp_path,
    )
    with pytest.raises(
        ValueError,
        match=r"trainer: this process is rank 0 of a 2-process torchrun launch, where this "
        r"task trains on whichever rank comes first",
    ):
        run_task(cfg)


def test_run_folder_stamp_of_each_launcher(capsys):
    when = datetime(2026, 1, 2, 3, 4, 5, 678901)
    pattern = "%Y-%m-%d_%H-%M-%S_%f"
    assert launch_stamp(pattern, {}, when) == "2026-01-02_03-04-05_678901"  # one process: Hydra's `now`
    assert launch_stamp(pattern, {"CONFRAG_RUN_ID": "sweep-7", "RANK": "1", "WORLD_SIZE": "2"}, when) == "sweep-7"
    slurm = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_JOB_ID": "812", "SLURM_STEP_ID": "2"}
    assert launch_stamp(pattern, slurm, when) == "slurm-812.2"
    # torchrun without its agent's store: the rank's own clock, and a warning saying how to share one folder
    alone = {"RANK": "1", "WORLD_SIZE": "2", "TORCHELASTIC_USE_AGENT_STORE": "False"}
    assert launch_stamp(pattern, alone, when) == "2026-01-02_03-04-05_678901"
    assert "set CONFRAG_RUN_ID (the same value in every rank) or hydra.run.dir=..." in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"CONFRAG_RUN_ID='a/b' must be a folder name"):
        launch_stamp(pattern, {"CONFRAG_RUN_ID": "a/b"}, when)
