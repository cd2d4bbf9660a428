"""A multirun leaves one table of its jobs (sweep_summary.csv / .md: overrides, status, metrics), written after
each job so that a failed job's sweep has one too; an Optuna sweep stores its study in the sweep folder, names
each job's trial, and resumes from that storage with the trial numbers going on."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from confrag.infra.run_info import save_failure
from confrag.infra.sweep_summary import main, read_sweep, summarize

from helpers.runs import ROOT

APP = ROOT / "tests" / "fixtures" / "sweep_app" / "app.py"


def job_folder(sweep: Path, num: int, overrides: list[str]) -> Path:
    folder = sweep / str(num)
    (folder / ".hydra").mkdir(parents=True)
    (folder / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    (folder / ".hydra" / "config.yaml").write_text("optimized_metric: val/auroc\n")
    return folder


def rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def test_the_summary_lists_every_job_with_its_overrides_status_and_metrics(tmp_path):
    sweep = tmp_path / "multiruns" / "2026-01-01_00-00-00"
    finished = job_folder(sweep, 0, ["+experiment=probe_smollm2", "model.layer=5"])
    metrics = {"val/auroc": 0.71, "test/auroc": None, "test/acc": 0.6}
    (finished / "metrics.json").write_text(json.dumps({"layer": 5, "metrics": metrics, "layer_scan": [{"a": 1}]}))
    failed = job_folder(sweep, 1, ["+experiment=probe_smollm2", "model.layer=10"])
    save_failure(failed, ValueError("model.layer=10 is out of range\nmore lines"))
    job_folder(sweep, 2, ["+experiment=probe_smollm2", "model.layer=15"])  # killed: neither file

    jobs, md_path = summarize(sweep)
    assert [j.status for j in jobs] == ["finished", "failed", "incomplete"]
    table = rows(sweep / "sweep_summary.csv")
    assert [r["model.layer"] for r in table] == ["5", "10", "15"]
    assert table[0]["val/auroc"] == "0.71" and table[0]["test/auroc"] == "" and table[0]["status"] == "finished"
    assert table[1]["error"] == "builtins.ValueError: model.layer=10 is out of range"
    assert table[2]["status"] == "incomplete" and table[2]["folder"] == "2"
    md = md_path.read_text()
    assert "3 jobs: 1 finished, 1 failed, 1 incomplete." in md
    assert "Every job: `experiment=probe_smollm2`." in md  # the override every job shares, once
    header = next(line for line in md.splitlines() if line.startswith("| job"))
    assert header == "| job | status | model.layer | val/auroc | test/acc | test/auroc |"  # optimized metric first
    assert "| 0 | finished | 5 | 0.71 | 0.6 | null |" in md
    assert "| 1 | failed: builtins.ValueError: model.layer=10 is out of range | 10 |" in md


def test_the_summary_command_rebuilds_a_sweep_folder_and_names_an_empty_one(tmp_path, capsys):
    sweep = tmp_path / "sweep"
    (job_folder(sweep, 0, ["model.lr=0.1"]) / "metrics.json").write_text(json.dumps({"metrics": {"val/auroc": 0.5}}))
    main([str(sweep)])
    assert "| 0 | finished | 0.5 |" in capsys.readouterr().out and (sweep / "sweep_summary.csv").is_file()
    with pytest.raises(SystemExit):
        main([str(tmp_path / "nothing")])
    assert "no job folder" in capsys.readouterr().err


def run_app(root: Path, *args: str, storage: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "SWEEP_ROOT": str(root), "HYDRA_FULL_ERROR": "1"}
    env.pop("SWEEP_STORAGE", None)
    if storage:
        env["SWEEP_STORAGE"] = storage
    command = [sys.executable, str(APP), "-m", *args]
    return subprocess.run(command, env=env, cwd=root, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_a_hydra_multirun_with_a_failing_job_still_leaves_its_table(tmp_path):
    done = run_app(tmp_path, "x=1,2,3")
    assert done.returncode != 0 and "x=3 is refused" in done.stderr  # the third job fails the multirun
    (sweep,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    table = rows(sweep / "sweep_summary.csv")
    assert [(r["x"], r["status"]) for r in table] == [("1", "finished"), ("2", "finished"), ("3", "failed")]
    assert [r["score"] for r in table] == ["-0.5", "0.5", ""] and table[2]["error"].endswith("x=3 is refused")


@pytest.mark.subprocess
def test_a_terminated_multirun_still_writes_the_table_of_its_jobs(tmp_path):
    """SIGTERM during a multirun wrote the stopped job's failure.json but no table with it (Hydra calls no callback
    for a job stopped by SystemExit, and a first job's stop left no table at all)."""
    done = run_app(tmp_path, "x=1,4,2")
    assert done.returncode != 0
    (sweep,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    table = rows(sweep / "sweep_summary.csv")
    assert [(r["x"], r["status"]) for r in table] == [("1", "finished"), ("4", "failed")]  # job 2 never started
    assert table[1]["error"].endswith("terminated by signal SIGTERM")
    assert "2 jobs: 1 finished, 1 failed." in (sweep / "sweep_summary.md").read_text()


@pytest.mark.slow
def test_an_optuna_sweep_names_its_trials_and_resumes_from_its_storage(tmp_path):
    first = run_app(tmp_path, "--config-name=app_optuna")
    assert first.returncode == 0, first.stderr[-3000:]
    (sweep,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert (sweep / "optuna.db").is_file()  # the study lives in the sweep folder
    table = rows(sweep / "sweep_summary.csv")
    assert [r["trial"] for r in table] == ["0", "1", "2"] and all(r["status"] == "finished" for r in table)
    assert "Best trial: " in (sweep / "sweep_summary.md").read_text()

    storage = f"sqlite:///{sweep / 'optuna.db'}"
    second = run_app(tmp_path, "--config-name=app_optuna", "hydra.sweeper.n_trials=2", storage=storage)
    assert second.returncode == 0, second.stderr[-3000:]
    (resumed,) = [p for p in tmp_path.iterdir() if p.is_dir() and p != sweep]
    table = rows(resumed / "sweep_summary.csv")
    assert [r["job"] for r in table] == ["0", "1"] and [r["trial"] for r in table] == ["3", "4"]
    trials = rows(resumed / "optuna_trials.csv")  # the whole study: both sweeps' trials
    assert [t["trial"] for t in trials] == ["0", "1", "2", "3", "4"]
    assert [t["job"] for t in trials] == ["", "", "", "0", "1"]
    jobs = {j.num: j for j in read_sweep(resumed)}
    for trial in trials[3:]:
        assert jobs[int(trial["job"])].overrides["x"] == trial["x"]


def test_the_project_registers_the_summary_and_stores_the_optuna_study_in_the_sweep_folder():
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(
            config_name="train",
            overrides=["+experiment=probe_smollm2", "+hparams_search=probe_optuna"],
            return_hydra_config=True,
        )
    assert cfg.hydra.callbacks.sweep_summary._target_ == "confrag.infra.sweep_callback.SweepSummary"
    storage = cfg.hydra.sweeper.storage
    assert storage == f"sqlite:///{cfg.hydra.sweep.dir}/optuna.db"
