"""The notebook runs as a user runs it (the docs' `jupyter nbconvert --execute` command, from the project's folder) on
the runs folder it is given, including runs with an undefined (null) AUROC and runs written before the reliability
diagram."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from confrag.probe.calibration import reliability_bins
from confrag.reports.reliability import calibration_record

from helpers.runs import ROOT

NOTEBOOK = ROOT / "notebooks" / "probe_layers.ipynb"
pytest.importorskip("nbconvert")
pytest.importorskip("ipykernel")


def probe_run(folder: Path, layer: int, auroc: float | None, calibration: bool) -> None:
    folder.mkdir(parents=True)
    record = {
        "layer": layer,
        "train_states": "qa",
        "metrics": {"test/auroc": auroc, "test/acc": 0.75, "test/ece": 0.1},
        "layer_scan": [
            {"layer": 2, "auroc_mean": 0.6, "auroc_std": 0.05},
            {"layer": 4, "auroc_mean": 0.7, "auroc_std": 0.04},
        ],
    }
    if calibration:
        record["calibration"] = calibration_record(reliability_bins([0.2, 0.3, 0.8, 0.9], [0, 1, 1, 1]), "test")
    (folder / "metrics.json").write_text(json.dumps(record))


def outputs(notebook: Path) -> str:
    cells = nbformat.read(notebook, as_version=4).cells
    return "\n".join(o.get("text", "") for c in cells if c.cell_type == "code" for o in c.outputs)


def documented_command() -> str:
    """The docs' command that runs the notebook (docs/usage.md, "The notebook"), continuation lines joined."""
    text = (ROOT / "docs" / "usage.md").read_text()
    section = text[text.index("**The notebook.**") :]
    block = section.split("```bash", 1)[1].split("```", 1)[0]
    return " ".join(block.replace("\\\n", " ").split())


@pytest.mark.slow  # make test-all: kept out of make test's 15 minutes
@pytest.mark.subprocess
def test_the_notebook_runs_the_documented_way_on_a_relative_runs_folder(tmp_path):
    """As the docs run it: from the project's folder, `CONFRAG_RUNS_DIR=logs/probe jupyter nbconvert --execute
    notebooks/probe_layers.ipynb ...` through a shell. nbconvert starts the kernel in notebooks/, so the relative
    folder is read from where the command was started (it found 0 runs in notebooks/logs/probe). The runs include
    an undefined (null) AUROC and a run written before the reliability diagram."""
    project = tmp_path / "project"  # a checkout's layout: notebooks/ and the runs under logs/probe
    (project / "notebooks").mkdir(parents=True)
    (project / "notebooks" / NOTEBOOK.name).write_bytes(NOTEBOOK.read_bytes())
    runs = project / "logs" / "probe"
    probe_run(runs / "runs" / "2026-01-01_00-00-00", 4, None, calibration=True)  # one-class test split: null
    probe_run(runs / "multiruns" / "2026-01-02_00-00-00" / "0", 2, 0.71, calibration=False)  # an older run
    command = documented_command()
    assert command.startswith("CONFRAG_RUNS_DIR=logs/probe jupyter nbconvert ") and "--output-dir logs/probe" in command
    # `jupyter` of this interpreter's environment, the rest as written.
    command = command.replace(" jupyter ", f" {sys.executable} -m jupyter ", 1) + " --ExecutePreprocessor.timeout=120"
    env = {k: v for k, v in os.environ.items() if k not in ("MPLBACKEND", "CONFRAG_RUNS_DIR")}
    done = subprocess.run(command, shell=True, cwd=project, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    executed = runs / "probe_layers.ipynb"  # where the documented command writes it
    text = outputs(executed)
    assert f"2 runs found in {runs}" in text
    assert "test AUROC undefined (one-class test split) or not logged in 1 run(s): ['runs/2026-01-01_00-00-00']" in text
    assert "runs/2026-01-01_00-00-00 layer 4 qa {'acc': '0.750', 'auroc': 'undefined', 'ece': '0.100'}" in text
    images = [o for c in nbformat.read(executed, as_version=4).cells for o in c.get("outputs", [])]
    assert sum("image/png" in o.get("data", {}) for o in images) == 2  # the layer plot and the reliability diagram
    # A folder that is not there is refused, naming it and where it was read from (it printed "0 runs found").
    command = command.replace("CONFRAG_RUNS_DIR=logs/probe", "CONFRAG_RUNS_DIR=logs/probes", 1)
    done = subprocess.run(command, shell=True, cwd=project, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and f"the runs folder {project / 'logs' / 'probes'} does not exist" in done.stderr
