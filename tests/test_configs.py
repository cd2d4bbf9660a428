"""Every experiment composes; the ones that can run here run end to end on the tiny models."""

from __future__ import annotations

import csv
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

from confrag.probe.module import load_probe
from confrag.train import TASKS, run_task

from helpers.runs import (
    EXPERIMENTS,
    MODEL_DIR,
    ROOT,
    check_cbdr_outputs,
    check_gates_outputs,
    check_rerank_outputs,
    compose_cfg,
)
from helpers.wandb_records import logged_artifacts

# Tiny experiments whose task tests already run them end to end and check the same outputs in a module fixture
# (check_cbdr_outputs, check_gates_outputs): run once there, not again here.
COVERED_BY_TASK_TESTS = {
    "cbdr_tiny_llama": "test_cbdr_task.py",
    "gates_tiny_llama": "test_gates_task.py",
    "cbdr_own_questions_tiny_llama": "test_own_questions.py",
    "reranker_likelihood_tiny_llama": "test_likelihood_alignment_task.py",
}
CHECKS = {"reranker": "rerank"}  # the output check of a task whose experiments' names say it otherwise
RUNNABLE_HERE = [name for name in EXPERIMENTS if "tiny" in name and name not in COVERED_BY_TASK_TESTS]


def test_every_tiny_experiment_runs_in_some_test():
    tests = Path(__file__).parent
    for name, module in COVERED_BY_TASK_TESTS.items():
        text = (tests / module).read_text()
        task = name.split("_")[0]
        assert f"+experiment={name}" in text and f"check_{CHECKS.get(task, task)}_outputs" in text, (name, module)
    assert {n for n in EXPERIMENTS if "tiny" in n} == set(RUNNABLE_HERE) | set(COVERED_BY_TASK_TESTS)


# A command in the docs, the Makefile, the experiment scripts or a config: `+experiment=<name>`.
NAMED = re.compile(r"\+experiment=([a-z][a-z0-9_]*[a-z0-9])(?![a-z0-9_])")
WRITTEN = ["README.md", "Makefile", "docs/*.md", "experiments/**/*", "conf/**/*.yaml", "src/**/*.py", "notebooks/*"]


def test_every_experiment_a_command_names_exists():
    """A renamed or removed experiment breaks the commands that name it: each one named anywhere is there."""
    named = {}
    for pattern in WRITTEN:
        for path in ROOT.glob(pattern):
            if path.is_file():
                for name in NAMED.findall(path.read_text(errors="replace")):
                    named.setdefault(name, str(path.relative_to(ROOT)))
    assert "cbdr_smollm2" in named and len(named) >= 10, named  # the README's demo is found
    assert {name: where for name, where in named.items() if name not in EXPERIMENTS} == {}


def test_every_task_has_a_tiny_experiment(tmp_path):
    """Each task runs on CPU in a test, through its tiny experiment (every experiment's task is checked below)."""
    tiny = {compose_cfg([f"+experiment={name}"], tmp_path).task_name for name in EXPERIMENTS if "tiny" in name}
    assert tiny == set(TASKS)


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_experiment_composes_and_resolves(name, tmp_path):
    cfg = compose_cfg([f"+experiment={name}"], tmp_path)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    assert resolved["task_name"] in TASKS
    # the probe a rerank or cbdr run scores with
    probe = resolved["probe"] if resolved["task_name"] in ("rerank", "cbdr", "gates") else resolved
    assert "layer" not in probe["data"] and "layer" in probe["model"]  # resolved once, by the recipe
    assert probe["data"]["llm"] == resolved["llm"]  # one LLM for the probe and the confidence shifts
    assert resolved["llm"]["name"] in {path.stem for path in (ROOT / "conf" / "llm").glob("*.yaml")}  # a shipped LLM
    if name.endswith(("llama3", "qwen2_5")):
        assert resolved["llm"]["dtype"] == "bfloat16" and resolved["llm"]["device"] == "cuda"
        assert resolved["trainer"]["accelerator"] == "gpu" and probe["trainer"]["accelerator"] == "gpu"


def test_gpu_experiments_load_the_papers_models(tmp_path):
    assert compose_cfg(["+experiment=probe_llama3"], tmp_path).llm.repo_id == "meta-llama/Meta-Llama-3-8B-Instruct"
    assert compose_cfg(["+experiment=probe_qwen2_5"], tmp_path).llm.repo_id == "Qwen/Qwen2.5-7B-Instruct"
    for name in ("reranker_llama3", "reranker_qwen2_5", "cbdr_llama3", "cbdr_qwen2_5"):
        cfg = compose_cfg([f"+experiment={name}"], tmp_path)
        assert cfg.model.backbone == "BAAI/bge-reranker-v2-m3" and cfg.model.lr == 6e-5
        assert cfg.model.weight_decay == 0.01 and cfg.trainer.max_epochs == 1 and cfg.preferences.reference == "qa"
        # bge-reranker-v2-m3 already is a relevance reranker: it is the base as it comes, aligned from there.
        assert cfg.base_reranker.train is False
    for name, repo in (
        ("cbdr_llama3", "meta-llama/Meta-Llama-3-8B-Instruct"),
        ("cbdr_qwen2_5", "Qwen/Qwen2.5-7B-Instruct"),
    ):
        cfg = compose_cfg([f"+experiment={name}"], tmp_path)
        assert cfg.task_name == "cbdr" and cfg.llm.repo_id == repo and list(cfg.rag.top_k) == [1, 3]


def test_optuna_search_composes(tmp_path):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(
            config_name="train",
            overrides=["+experiment=probe_smollm2", "+hparams_search=probe_optuna"],
            return_hydra_config=True,
        )
    assert "optuna" in cfg.hydra.sweeper._target_.lower()
    assert "model.lr" in cfg.hydra.sweeper.params


def test_unknown_llm_name_lists_the_available_ones(tmp_path):
    with pytest.raises(Exception) as info:
        compose_cfg(["llm=gpt5"], tmp_path)
    message = str(info.value)
    assert "gpt5" in message and "smollm2_135m" in message and "llama3_8b" in message


@pytest.mark.task
@pytest.mark.parametrize("name", RUNNABLE_HERE)
def test_runnable_experiments_fast_dev_run(name, tmp_path):
    cfg = compose_cfg([f"+experiment={name}", "trainer.fast_dev_run=true", "logger=csv"], tmp_path)
    run_task(cfg)
    out = tmp_path / "out"
    if cfg.task_name == "rerank":
        check_rerank_outputs(out)
        return
    if cfg.task_name == "cbdr":
        check_cbdr_outputs(out)
        return
    if cfg.task_name == "gates":
        check_gates_outputs(out, list(cfg.gates.names))
        return
    assert (out / "probe" / "probe.json").is_file() and (out / "probe" / "model.safetensors").is_file()
    # The reliability diagram beside ECE: every test example in a bin, drawn and listed in summary.txt.
    record = json.loads((out / "metrics.json").read_text())
    calibration = record["calibration"]
    assert sum(b["count"] for b in calibration["bins"]) == record["nq_confidence"]["test/examples"]
    assert calibration["ece"] is not None and len(calibration["bins"]) == 10
    assert (out / "reliability.png").read_bytes()[:4] == b"\x89PNG"
    assert "reliability diagram reliability.png" in (out / "summary.txt").read_text()
    info = json.loads((out / "run_info.json").read_text())
    assert info["argv"] and "commit" in info
    env = info["environment"]  # what the run's bytes depend on beyond its config
    assert torch.__version__.startswith(env["packages"]["torch"].split("+")[0])
    assert env["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert OmegaConf.load(out / "config_resolved.yaml").llm.name == cfg.llm.name
    meta = json.loads((out / "probe" / "probe.json").read_text())
    assert meta["activations"]["layer"] == 2 and meta["activations"]["llm"]["name"] == cfg.llm.name
    saved = load_probe(out / "probe")  # the exported probe loads and scores raw hidden states
    assert saved.meta["hparams"]["hidden_dims"] == [512, 64, 32]
    confidence = saved.confidence(np.zeros((3, saved.input_dim), dtype=np.float32))
    assert confidence.shape == (3,) and ((0 <= confidence) & (confidence <= 1)).all()


@pytest.mark.task
def test_checkpoint_carries_resolved_config(tmp_path):
    cfg = compose_cfg(["+experiment=probe_tiny_llama", "trainer.max_epochs=1", "logger=csv"], tmp_path)
    run_task(cfg)
    checkpoint = torch.load(tmp_path / "out" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert checkpoint["confrag_config"]["llm"]["name"] == "tiny_llama"
    assert checkpoint["confrag_config"]["model"]["layer"] == "mid"


@pytest.mark.slow  # make test-all: kept out of make test's 15 minutes
@pytest.mark.subprocess
@pytest.mark.task
def test_layer_sweep_extracts_once_and_logs_one_wandb_run_per_job(tmp_path):
    """`-m model.layer=1,2,3` extracts the activations once; W&B (offline) gets one run per job."""
    cache, logs = tmp_path / "cache", tmp_path / "logs"
    command = [
        sys.executable,
        "train.py",
        "-m",
        "+experiment=probe_tiny_llama",
        "model.layer=1,2,3",
        "trainer.max_epochs=1",
        f"paths.cache_dir={cache}",
        f"paths.model_dir={MODEL_DIR}",
        f"paths.log_dir={logs}",
        "data.train_states=qa",
    ]
    done = subprocess.run(
        command,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**__import__("os").environ, "WANDB_SILENT": "true", "WANDB_DATA_DIR": str(tmp_path / "wandb_data")},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    activation_dirs = list((cache / "activations").iterdir())
    # One prompt kind (qa) and the dev and test questions' candidates (the checkpoint's ranking metric), each
    # extracted once for all three layers.
    assert len(activation_dirs) == 3
    # QA generations and states, dev and test candidates' states: each computed once, by the first job.
    assert (done.stdout + done.stderr).count("shards to compute") == 4
    jobs = sorted((logs / "probe" / "multiruns").glob("*/[0-9]*"))
    assert len(jobs) == 3
    layers = [json.loads((job / "probe" / "probe.json").read_text())["activations"]["layer"] for job in jobs]
    assert sorted(layers) == [1, 2, 3]
    wandb_runs = [run for job in jobs for run in (job / "wandb").glob("offline-run-*")]
    assert len(wandb_runs) == 3
    # The sweep's table (the Hydra callback of conf/hydra/default.yaml): each job's layer and metrics.
    (sweep,) = {job.parent for job in jobs}
    with open(sweep / "sweep_summary.csv", newline="") as handle:
        table = list(csv.DictReader(handle))
    assert sorted(r["model.layer"] for r in table) == ["1", "2", "3"] and {r["status"] for r in table} == {"finished"}
    assert all(r["test/acc"] for r in table)
    assert "| job | status | model.layer |" in (sweep / "sweep_summary.md").read_text()
    # Each job's exported probe is an artifact of its W&B run (lineage), its files and digest included.
    for job in jobs:
        # Besides the probe, a run logs its reliability diagram's table (a run_table artifact).
        models = [a for a in logged_artifacts(job / "wandb", expected=2) if a[1] == "model"]
        assert [a[:2] for a in models] == [("probe-tiny_llama", "model")]
        assert "confrag.digest.json" in models[0][2]


def test_probe_layer_out_of_range_lists_the_valid_range(tmp_path):
    cfg = compose_cfg(
        ["+experiment=probe_tiny_llama", "trainer.fast_dev_run=true", "logger=csv", "model.layer=9"], tmp_path
    )
    with pytest.raises(ValueError, match=r"model.layer=9 out of range: valid layers are 0\.\.4"):
        run_task(cfg)


@pytest.mark.task
def test_missing_nq_file_names_the_path_and_the_setting(tmp_path):
    cfg = compose_cfg(["+experiment=probe_tiny_llama", f"paths.questions_path={tmp_path}/missing.jsonl"], tmp_path)
    with pytest.raises(Exception, match=r"missing\.jsonl[\s\S]*paths\.questions_path"):
        run_task(cfg)


@pytest.mark.subprocess
@pytest.mark.task
def test_tau_and_k_sweep_reuses_probe_and_candidate_states(tmp_path):
    """`-m model.tau=… preferences.top_k=…` computes the probe data and the candidate states once; the
    jobs after the first only rebuild rows (from cached confidences) and retrain the reranker."""
    cache, logs = tmp_path / "cache", tmp_path / "logs"
    command = [
        sys.executable,
        "train.py",
        "-m",
        "+experiment=reranker_tiny_llama",
        "model.tau=0.1,1.0",
        "preferences.top_k=1,2",
        "preferences.relevance_baseline=false",
        "trainer.fast_dev_run=true",
        "logger=csv",
        f"paths.cache_dir={cache}",
        f"paths.model_dir={MODEL_DIR}",
        f"paths.log_dir={logs}",
    ]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    output = done.stdout + done.stderr
    # once: answers and states of the three probe prompt kinds; the probe's dev and test questions' candidates
    # (its checkpoint's ranking metric); the preference questions' QA and empty-context references (they are not
    # the probe's questions) and their candidates
    assert output.count("shards to compute") == 11, output[-3000:]
    jobs = sorted((logs / "rerank" / "multiruns").glob("*/[0-9]*"))
    assert len(jobs) == 4
    settings = {
        (
            OmegaConf.load(j / "config_resolved.yaml").model.tau,
            OmegaConf.load(j / "config_resolved.yaml").preferences.top_k,
        )
        for j in jobs
    }
    assert settings == {(0.1, 1), (0.1, 2), (1.0, 1), (1.0, 2)}
    for job in jobs:
        k = OmegaConf.load(job / "config_resolved.yaml").preferences.top_k
        rows = [json.loads(line) for line in (job / "nq_rerank" / "train.jsonl").read_text().splitlines()]
        assert rows and max(len(r["pos"]) for r in rows) <= k and max(len(r["neg"]) for r in rows) <= k
