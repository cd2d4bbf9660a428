"""Sweeps through Hydra's launchers on one shared cache: parallel local jobs (joblib) compute each shard
once between them; the SLURM launcher config composes and turns into the sbatch script submitit would
submit (a stand-in `sbatch` records it and refuses: nothing is submitted)."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from helpers.runs import MODEL_DIR, ROOT

SHARD_LINE = re.compile(r"(\w+) ([0-9a-f]{16}): computed shard (\d+) \(items")


def environment(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_NTASKS")}
    env.update(TOKENIZERS_PARALLELISM="false", WANDB_SILENT="true", CUDA_VISIBLE_DEVICES="", **extra)
    return env


def hydra_node(overrides: list[str]):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(config_name="train", overrides=overrides, return_hydra_config=True).hydra


@pytest.mark.slow  # make test-all: kept out of make test's 15 minutes
@pytest.mark.subprocess
@pytest.mark.task
def test_joblib_sweep_jobs_share_the_cache_and_compute_each_shard_once(tmp_path):
    """The issue's command: `-m +experiment=probe_tiny_llama model.layer=1,2 hydra/launcher=joblib
    hydra.launcher.n_jobs=2`. Both jobs need the same answers and states (all layers are extracted in one
    pass) and start together: the shards' claims split them, and both jobs train their probe."""
    cache, logs = tmp_path / "cache", tmp_path / "logs"
    command = [
        sys.executable,
        "train.py",
        "-m",
        "+experiment=probe_tiny_llama",
        "model.layer=1,2",
        "hydra/launcher=joblib",
        "hydra.launcher.n_jobs=2",
        "data.num_questions=16",
        "trainer.max_epochs=1",
        "logger=csv",
        "trainer.enable_progress_bar=false",
        f"paths.cache_dir={cache}",
        f"paths.model_dir={MODEL_DIR}",
        f"paths.log_dir={logs}",
    ]
    done = subprocess.run(command, cwd=ROOT, env=environment(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]

    jobs = sorted((logs / "probe" / "multiruns").glob("*/[0-9]*"))
    assert len(jobs) == 2
    computed = [m for job in jobs for m in SHARD_LINE.findall((job / "train.log").read_text())]
    shards = sorted(
        p
        for kind in ("generations", "activations")
        for p in (cache / kind).glob("*/shard-*.*")
        if p.suffix in (".npy", ".json")
    )
    # answers and states of three prompt kinds, and the states of the dev and test questions' candidates (the
    # probe's checkpoint metric), one shard each
    assert len(shards) == 8
    assert len(computed) == len(set(computed)) == len(shards), computed  # each computed once, by one job or the other
    assert sorted((kind, key) for kind, key, _ in computed) == sorted(
        (p.parent.parent.name, p.parent.name) for p in shards
    )
    layers = sorted(json.loads((job / "probe" / "probe.json").read_text())["activations"]["layer"] for job in jobs)
    assert layers == [1, 2]


def test_local_parallel_launcher_is_joblib_with_two_jobs():
    launcher = hydra_node(["+experiment=probe_tiny_llama", "hydra/launcher=local_parallel"]).launcher
    assert launcher._target_ == "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher"
    assert launcher.n_jobs == 2


def test_slurm_launcher_config_composes_with_one_gpu_per_job():
    launcher = hydra_node(
        ["+experiment=probe_llama3", "hydra/launcher=slurm_gpu", "hydra.launcher.partition=gpu"]
    ).launcher
    assert launcher._target_ == "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
    assert (launcher.gpus_per_node, launcher.tasks_per_node, launcher.nodes) == (1, 1, 1)
    assert launcher.partition == "gpu" and launcher.account is None and launcher.timeout_min == 240


@pytest.mark.subprocess
def test_slurm_sweep_builds_one_array_job_of_one_gpu_each(tmp_path):
    """`-m +experiment=probe_llama3 model.layer=8,16,24 hydra/launcher=slurm_gpu` up to the sbatch call:
    stand-ins for `srun` and `sbatch` record the batch script and refuse, so nothing runs or is submitted."""
    bin_dir, record = tmp_path / "bin", tmp_path / "submitted.sh"
    bin_dir.mkdir()
    for name in ("sbatch", "srun"):
        tool = bin_dir / name
        tool.write_text(
            '#!/bin/sh\nfor a in "$@"; do last="$a"; done\ncp "$last" "$SBATCH_RECORD"\n'
            'echo "stand-in $0: nothing submitted" >&2\nexit 1\n'
        )
        tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    command = [
        sys.executable,
        "train.py",
        "-m",
        "+experiment=probe_llama3",
        "model.layer=8,16,24",
        "hydra/launcher=slurm_gpu",
        "hydra.launcher.partition=gpu",
        "hydra.launcher.account=proj",
        f"paths.log_dir={tmp_path / 'logs'}",
    ]
    env = environment(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", SBATCH_RECORD=str(record))
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "nothing submitted" in done.stderr, done.stderr[-3000:]
    script = record.read_text()
    for line in (
        "#SBATCH --array=0-2%3",
        "#SBATCH --gpus-per-node=1",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --cpus-per-task=8",
        "#SBATCH --partition=gpu",
        "#SBATCH --account=proj",
        "#SBATCH --time=240",
    ):
        assert line in script, script
    assert "-m submitit.core._submit" in script


def test_task_name_is_checked_where_hydra_resolves_the_run_folder(tmp_path):
    """`task_name=../../escape` made a folder outside paths.log_dir before the task refused it: the run folder's
    task part is now a resolver (`confrag_task`) that refuses a path or an unknown task as Hydra resolves it."""
    from omegaconf.errors import InterpolationResolutionError

    import confrag.train  # noqa: F401 (the entry point's resolver, which knows the task names)

    for name, message in (("../../escape", "must be a plain folder name"), ("cdbr", "is not one of")):
        node = hydra_node([f"task_name={name}", f"paths.log_dir={tmp_path / 'logs'}"])
        with pytest.raises(InterpolationResolutionError, match=re.escape(f"task_name={name!r} ") + message):
            str(node.run.dir)
        with pytest.raises(InterpolationResolutionError, match="cbdr"):
            str(node.sweep.dir)
    assert str(hydra_node(["task_name=cbdr", f"paths.log_dir={tmp_path}"]).run.dir).startswith(f"{tmp_path}/cbdr/runs/")


@pytest.mark.slow
def test_an_escaping_task_name_makes_no_folder(tmp_path):
    """The issue's command through train.py: refused, and no folder exists anywhere under tmp_path."""
    work = tmp_path / "a" / "b"
    work.mkdir(parents=True)
    command = [sys.executable, str(ROOT / "train.py"), "task_name=../../escape", f"paths.log_dir={work / 'logs'}"]
    done = subprocess.run(command, cwd=work, env=environment(), capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "must be a plain folder name" in done.stderr
    assert [p for p in tmp_path.rglob("*")] == [tmp_path / "a", work]
