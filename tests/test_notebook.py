"""The notebook runs as a user runs it (`jupyter nbconvert --execute`) on the runs folder it is given, including
runs with an undefined (null) AUROC and runs written before the reliability diagram."""

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


@pytest.mark.subprocess
def test_the_notebook_executes_on_the_runs_folder_it_is_given(tmp_path):
    runs = tmp_path / "my_runs"
    probe_run(runs / "runs" / "2026-01-01_00-00-00", 4, None, calibration=True)  # one-class test split: null
    probe_run(runs / "multiruns" / "2026-01-02_00-00-00" / "0", 2, 0.71, calibration=False)  # an older run
    env = {**{k: v for k, v in os.environ.items() if k != "MPLBACKEND"}, "CONFRAG_RUNS_DIR": str(runs)}
    command = [sys.executable, "-m", "jupyter", "nbconvert", "--to", "notebook", "--execute", str(NOTEBOOK)]
    command += ["--output-dir", str(tmp_path), "--output", "executed.ipynb", "--ExecutePreprocessor.timeout=120"]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    text = outputs(tmp_path / "executed.ipynb")
    assert f"2 runs found in {runs}" in text
    assert "test AUROC undefined (one-class test split) or not logged in 1 run(s): ['runs/2026-01-01_00-00-00']" in text
    assert "runs/2026-01-01_00-00-00 layer 4 qa {'acc': '0.750', 'auroc': 'undefined', 'ece': '0.100'}" in text
    images = [o for c in nbformat.read(tmp_path / "executed.ipynb", as_version=4).cells for o in c.get("outputs", [])]
    assert sum("image/png" in o.get("data", {}) for o in images) == 2  # the layer plot and the reliability diagram
