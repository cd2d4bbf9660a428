"""Keys that moved are refused naming where they went (`confrag.instantiators.MOVED`): a command line before Hydra
reads it, in the run's own task's node (the probe's data node is `data` in the probe task, `probe.data` in the
others); a config file's when the task checks its config; the old environment variable at the entry point."""

from __future__ import annotations

import subprocess
import sys

import pytest
from omegaconf import OmegaConf, open_dict

from confrag.instantiators import (
    CCSK_MOVED,
    MOVED,
    PROBE_DATA_MOVED,
    command_line_task,
    moved_to,
    refuse_moved_arguments,
    refuse_moved_keys,
    settings_from,
)
from confrag.rag.settings import EvalSettings
from confrag.tasks import cbdr, probe

from helpers.runs import ROOT, compose_cfg

# An experiment of each task whose config holds the node of each moved key (the new key's node).
EXPERIMENT_OF = {
    "paths": "probe_tiny_llama",
    "data": "probe_tiny_llama",
    "probe": "cbdr_tiny_llama",
    "retrieval": "cbdr_tiny_llama",
    "base_reranker": "cbdr_tiny_llama",
    "eval": "cbdr_tiny_llama",
    "preferences": "cbdr_tiny_llama",
    "gates": "gates_tiny_llama",
}


def refusal(arguments: list[str], environment: dict | None = None) -> str:
    with pytest.raises(ValueError) as err:
        refuse_moved_arguments(arguments, environment or {})
    return str(err.value)


def test_every_moved_key_on_the_command_line_is_refused_naming_its_new_key():
    for old, new in MOVED.items():
        message = refusal([f"+experiment={EXPERIMENT_OF[old.partition('.')[0]]}", f"{old}=1"])
        assert f"{old} is now {new}" in message and message.endswith("set the new key(s) instead")


@pytest.fixture(scope="module")
def composed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("composed")
    return {name: compose_cfg([f"+experiment={name}"], tmp) for name in sorted(set(EXPERIMENT_OF.values()))}


def test_every_new_key_exists_where_the_refusal_points(composed):
    """A refusal that names a key the config lacks would send the user from one error to the next."""
    for old, new in MOVED.items():
        if old.startswith("preferences."):  # moved to another node, named with its reason
            new = new.partition(" ")[0]
        cfg = composed[EXPERIMENT_OF[old.partition(".")[0]]]
        assert OmegaConf.select(cfg, new, default="absent", throw_on_missing=False) != "absent", (old, new)
        assert OmegaConf.select(cfg, old, default="absent") == "absent", f"{old} is still in the shipped config"


def test_a_probe_data_key_is_pointed_at_the_tasks_own_probe_data_node():
    assert "data.balance is now data.splits.balance:" in refusal(["+experiment=probe_tiny_llama", "data.balance=1"])
    for experiment in ("reranker_tiny_llama", "cbdr_tiny_llama", "gates_tiny_llama"):
        for old in ("data.balance", "probe.data.balance"):
            message = refusal([f"+experiment={experiment}", f"{old}=true"])
            assert f"{old} is now probe.data.splits.balance" in message and "+data" not in message
    # A key under a moved key moves with it; `+` and a sweep's values make no difference.
    message = refusal(["+experiment=cbdr_tiny_llama", "+data.generation.static_cache=true", "data.layers=1,2"])
    assert "data.generation.static_cache is now probe.data.answers.generation.static_cache" in message
    assert "data.layers is now probe.data.extraction.layers" in message


def test_a_current_probe_data_key_under_the_rerank_tasks_data_node_names_probe_data():
    """`data` is the reranker's batches in the later tasks: Hydra would advise `+data.splits.balance` there."""
    message = refusal(["+experiment=reranker_tiny_llama", "data.splits.balance=true", "data.num_questions=9"])
    assert "data.splits.balance: the rerank task's `data` is the reranker's batches" in message
    assert "set probe.data.splits.balance" in message and "set probe.data.num_questions" in message
    refuse_moved_arguments(["+experiment=reranker_tiny_llama", "data.batch_size=2", "data.group_size=4"], {})
    refuse_moved_arguments(["+experiment=probe_tiny_llama", "data.splits.balance=true", "data.num_questions=9"], {})


def test_the_new_keys_and_hydras_own_arguments_pass():
    refuse_moved_arguments(
        [
            "-m",
            "+experiment=cbdr_tiny_llama",
            "probe.data.splits.balance=false",
            "eval.questions_path=x.jsonl",
            "model.tau=0.1,1.0",
            "gates.configs.ccsk.thresholds.pred=0.5",
            "hydra.job.chdir=false",
            "--cfg",
            "job",
        ],
        {"CONFRAG_QUESTIONS_PATH": "x.jsonl"},
    )


def test_ccsks_old_keys_are_refused_under_gate_after_gate_ccsk_only():
    message = refusal(["+experiment=gates_tiny_llama", "gate=ccsk", "gate.tau_pred=0.5", "gate.lr=0.01"])
    assert "gate.tau_pred is now gate.thresholds.pred" in message and "gate.lr is now gate.fusion.lr" in message
    assert moved_to("gate.lr", gate="dragin") is None  # another gate's own key of that name
    assert len(CCSK_MOVED) == 14


def test_the_old_environment_variable_is_refused():
    message = refusal(["+experiment=probe_tiny_llama"], {"CONFRAG_NQ_PATH": "/data/q.jsonl"})
    assert "CONFRAG_NQ_PATH is now CONFRAG_QUESTIONS_PATH" in message


@pytest.mark.parametrize(
    ("arguments", "task"),
    [
        ([], "probe"),
        (["+experiment=probe_tiny_llama"], "probe"),
        (["+experiment=reranker_tiny_llama"], "rerank"),
        (["+experiment=cbdr_smollm2_beta_grid"], "cbdr"),  # through the experiment it extends
        (["+experiment=gates_smollm2"], "gates"),
        (["+experiment=probe_tiny_llama", "task_name=gates"], "gates"),
        (["-m", "+experiment=probe_tiny_llama,cbdr_tiny_llama"], None),
    ],
)
def test_the_task_is_read_from_the_command_line_before_hydra(arguments, task):
    assert command_line_task(arguments) == task


@pytest.mark.subprocess
def test_the_entry_point_refuses_before_hydra_composes():
    done = subprocess.run(
        [sys.executable, "train.py", "+experiment=reranker_tiny_llama", "data.balance=true"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode != 0
    assert "error: data.balance is now probe.data.splits.balance" in done.stderr
    assert "Could not override" not in done.stderr  # Hydra never read it


# --- a config file of the user's own ------------------------------------------------------------------------------


def test_an_old_key_in_a_config_file_is_refused_by_the_tasks_check(tmp_path, nothing_runs):
    cfg = compose_cfg(["+experiment=probe_tiny_llama"], tmp_path)
    with open_dict(cfg):
        cfg.data.extract_batch_size = 5  # as an experiment file written before the groups sets it
    with pytest.raises(ValueError, match=r"data.extract_batch_size is now data.extraction.batch_size"):
        probe.check(cfg)
    cfg = compose_cfg(["+experiment=cbdr_tiny_llama"], tmp_path)
    with open_dict(cfg):
        cfg.eval.nq_path = "mine.jsonl"
        cfg.probe.data.balance = False
    with pytest.raises(ValueError) as err:
        cbdr.check(cfg)
    assert "eval.nq_path is now eval.questions_path" in str(err.value)
    assert "probe.data.balance is now probe.data.splits.balance" in str(err.value)


def test_ccsks_old_key_in_the_selected_gates_node_is_refused(tmp_path):
    cfg = compose_cfg(["+experiment=gates_tiny_llama", "gate=ccsk"], tmp_path)
    with open_dict(cfg):
        cfg.gate.tau_single = 0.2
    with pytest.raises(ValueError, match=r"gate.tau_single is now gate.thresholds.single"):
        refuse_moved_keys(cfg)
    refuse_moved_keys(compose_cfg(["+experiment=gates_tiny_llama", "gate=ccsk"], tmp_path))


def test_a_settings_node_read_on_its_own_names_a_moved_key(tmp_path):
    node = dict(OmegaConf.to_container(compose_cfg(["+experiment=cbdr_tiny_llama"], tmp_path).eval), nq_path="x")
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['nq_path'\].*eval.nq_path is now eval.questions_path"):
        settings_from(EvalSettings, node, "eval")


def test_the_shipped_probe_data_node_holds_the_new_keys_only():
    node = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "data" / "nq_confidence.yaml"))
    for old, new in PROBE_DATA_MOVED.items():
        group, _, field = new.rpartition(".")
        assert old not in node and field in (node[group] if group else node), (old, new)
