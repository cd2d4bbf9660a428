"""What a run folder tells afterwards: the confrag version and thread counts in run_info.json, and a failure
marker with the exception when the run failed (none when it finished)."""

from __future__ import annotations

import json
import os
import signal
from importlib import metadata
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from confrag import train
from confrag.infra.run_info import save_run_info

from helpers.runs import compose_cfg


def test_run_info_records_the_confrag_version_and_the_thread_counts(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    info = save_run_info(OmegaConf.create({"seed": 1}), tmp_path)
    saved = json.loads((tmp_path / "run_info.json").read_text())
    assert saved["confrag"] == metadata.version("confrag") == info["confrag"]
    threads = saved["environment"]["threads"]
    assert threads["torch_threads"] == torch.get_num_threads()
    assert threads["torch_interop_threads"] == torch.get_num_interop_threads()
    assert threads["env"]["OMP_NUM_THREADS"] == "3"


def fake_task(run):
    return SimpleNamespace(
        check=lambda cfg: None, run=run, write=lambda cfg, checked, ctx, computed: {"val/auroc": 0.5}
    )


def tiny_cfg(tmp_path):
    return compose_cfg(["+experiment=probe_tiny_llama", "logger=none"], tmp_path)


def test_a_failed_run_leaves_a_failure_marker_with_the_exception(tmp_path, monkeypatch):
    def run(cfg, checked, ctx):
        raise RuntimeError("shard 3 of activations could not be computed")

    monkeypatch.setitem(train.TASKS, "probe", fake_task(run))
    with pytest.raises(RuntimeError, match="shard 3"):
        train.run_task(tiny_cfg(tmp_path))
    marker = json.loads((tmp_path / "out" / "failure.json").read_text())
    assert marker["exception"] == "builtins.RuntimeError"
    assert marker["message"] == "shard 3 of activations could not be computed"
    assert "in run" in marker["traceback"] and marker["rank"] == 0
    assert (tmp_path / "out" / "run_info.json").is_file()  # the record of what failed is kept


def test_a_terminated_run_leaves_a_failure_marker(tmp_path, monkeypatch):
    def run(cfg, checked, ctx):
        os.kill(os.getpid(), signal.SIGTERM)  # what SLURM or torchrun's agent sends before killing
        raise AssertionError("SIGTERM should have stopped the run")

    monkeypatch.setitem(train.TASKS, "probe", fake_task(run))
    with pytest.raises(SystemExit, match="SIGTERM"):
        train.run_task(tiny_cfg(tmp_path))
    assert json.loads((tmp_path / "out" / "failure.json").read_text())["exception"] == "builtins.SystemExit"
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # the handler does not outlive the run


def test_a_finished_run_has_no_failure_marker(tmp_path, monkeypatch):
    monkeypatch.setitem(train.TASKS, "probe", fake_task(lambda cfg, checked, ctx: None))
    assert train.run_task(tiny_cfg(tmp_path)) == 0.5
    assert not (tmp_path / "out" / "failure.json").exists()


def test_a_refusal_after_the_run_folder_exists_leaves_a_failure_marker(tmp_path, monkeypatch):
    """Refusals of `check` (the evaluation file's overlap, the FAISS index) left only train.log in the folder Hydra
    had made, which reads as a run killed outright: every refusal once the folder exists writes failure.json."""

    def refuse(cfg):
        raise ValueError("eval.questions_path=mine.jsonl: 1 of its 4 questions are training questions")

    task = fake_task(lambda cfg, checked, ctx: None)
    task.check = refuse
    monkeypatch.setitem(train.TASKS, "probe", task)
    cfg = tiny_cfg(tmp_path)
    with pytest.raises(ValueError, match="training questions"):
        train.run_task(cfg)
    assert not (tmp_path / "out").exists()  # started from Python, before any folder: none is made for the marker
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "train.log").write_text("")  # what Hydra leaves before the task starts
    with pytest.raises(ValueError, match="training questions"):
        train.run_task(cfg)
    marker = json.loads((tmp_path / "out" / "failure.json").read_text())
    assert marker["exception"] == "builtins.ValueError" and "training questions" in marker["message"]
    assert "in refuse" in marker["traceback"] and not (tmp_path / "out" / "metrics.json").exists()
