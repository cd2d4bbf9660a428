"""The probe as others load it: a `PyTorchModelHubMixin` folder (config.json with the layer, the LLM identity and
the input standardization; model.safetensors), read back with `ProbeNetwork.from_pretrained` in a fresh
object, verified against its folder digest; the format before it still read; the W&B artifacts of a run's
exports; the Hub upload never called (the folder it would push is checked instead)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from huggingface_hub import ModelCard
from lightning.pytorch.loggers import WandbLogger
from safetensors.torch import save

from confrag.infra.atomic import atomic_write_bytes
from confrag.infra.digests import FOLDER_DIGEST, ArtifactDamagedError, write_folder_digest
from confrag.probe.module import ProbeModule, load_probe, save_probe
from confrag.probe.network import ProbeNetwork
from confrag.reports.hub import HubSettings, write_dataset
from confrag.reports.wandb_artifacts import artifact_name, log_exports, log_table_exports
from confrag.tasks import probe as probe_task
from test_hub_export import ROWS, exported_folder, run_facts

from helpers.modules import probe_module, reranker_module
from helpers.runs import compose_cfg
from helpers.settings import shipped_settings
from helpers.wandb_records import logged_artifacts

IDENTITY = {"llm": {"name": "tiny", "source": "random", "ref": "tiny:x@1"}, "prompts": "abc", "layer": 2, "key": "k"}


def trained(hidden_dims=(16, 8), input_dim=12, seed=0) -> ProbeModule:
    """A probe with random weights and a standardization no default would give."""
    torch.manual_seed(seed)
    probe = probe_module(input_dim=input_dim, hidden_dims=list(hidden_dims), layer=2)
    rng = np.random.default_rng(seed)
    probe.set_standardization(rng.normal(size=input_dim) * 3, rng.uniform(0.1, 5, size=input_dim))
    return probe


def states(n=7, d=12, seed=1) -> np.ndarray:
    return (np.random.default_rng(seed).normal(size=(n, d)) * 4).astype(np.float32)


@pytest.mark.parametrize("hidden_dims", [(16, 8), ()], ids=["mlp", "logistic"])
def test_saved_probe_loads_with_from_pretrained_in_a_fresh_object(tmp_path, hidden_dims):
    probe = trained(hidden_dims)
    folder = save_probe(probe, tmp_path / "probe", IDENTITY, {"metrics": {"test/auroc": 0.7}})
    assert sorted(p.name for p in folder.iterdir()) == [
        "README.md",
        "config.json",
        FOLDER_DIGEST,
        "model.safetensors",
        "probe.json",
    ]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith((".tmp-", ".old-"))]  # built beside, renamed
    config = json.loads((folder / "config.json").read_text())
    assert config["layer"] == 2 and config["llm"] == IDENTITY["llm"] and config["prompts"] == "abc"
    assert config["hidden_dims"] == list(hidden_dims) and config["input_dim"] == 12
    # The standardization is stated in the config, exactly the float32 values the probe trained with.
    assert np.array_equal(np.float32(config["standardization"]["mean"]), probe.mean.numpy())
    assert np.array_equal(np.float32(config["standardization"]["std"]), probe.std.numpy())

    network = ProbeNetwork.from_pretrained(folder)  # a fresh object, built from config.json + weights
    assert network is not None and network.layer == 2 and not network.training
    x = states()
    expected = probe.confidence(x)
    assert np.array_equal(network.confidence(x), expected)
    assert np.array_equal(load_probe(folder).confidence(x), expected)
    assert load_probe(folder).meta["metrics"] == {"test/auroc": 0.7} and load_probe(folder).directory == folder
    card = ModelCard.load(folder / "README.md")
    assert card.data.library_name == "confrag" and "ProbeNetwork.from_pretrained" in card.text


def test_a_damaged_or_unsigned_probe_folder_is_refused_by_from_pretrained(tmp_path):
    folder = save_probe(trained(), tmp_path / "probe", IDENTITY, {})
    weights = bytearray((folder / "model.safetensors").read_bytes())
    weights[-8] ^= 0xFF  # one byte of the last weight: the file still parses
    (folder / "model.safetensors").write_bytes(bytes(weights))
    with pytest.raises(ArtifactDamagedError, match=r"model.safetensors: checksum mismatch"):
        ProbeNetwork.from_pretrained(folder)
    with pytest.raises(ArtifactDamagedError, match=r"model.safetensors: checksum mismatch"):
        load_probe(folder)

    folder = save_probe(trained(), tmp_path / "layer", IDENTITY, {})
    config = folder / "config.json"
    config.write_text(config.read_text().replace('"layer": 2', '"layer": 3'))
    with pytest.raises(ArtifactDamagedError, match=r"config.json"):
        ProbeNetwork.from_pretrained(folder)

    folder = save_probe(trained(), tmp_path / "unsigned", IDENTITY, {})
    (folder / FOLDER_DIGEST).unlink()
    with pytest.raises(ArtifactDamagedError, match=r"has no digest file"):
        ProbeNetwork.from_pretrained(folder)


def test_what_push_to_hub_would_upload_loads_and_is_verified(tmp_path):
    """`push_to_hub` saves through `save_pretrained` into a temporary folder and uploads it: that folder, made
    here without any upload, carries the digest and loads the same network."""
    network = ProbeNetwork.from_module(trained(), IDENTITY)
    network.save_pretrained(tmp_path / "upload")
    assert (tmp_path / "upload" / FOLDER_DIGEST).is_file()
    x = states()
    assert np.array_equal(ProbeNetwork.from_pretrained(tmp_path / "upload").confidence(x), network.confidence(x))


def test_a_probe_in_the_format_before_the_hub_mixin_is_still_read(tmp_path):
    """Cached probes written before (probe.safetensors + probe.json with their digest) keep their cache key and
    are read as they are; damaged, they are refused like the new format."""
    probe = trained()
    folder = tmp_path / "old"
    tensors = {k: v.detach().contiguous() for k, v in probe.state_dict().items()}
    atomic_write_bytes(folder / "probe.safetensors", save(tensors))
    (folder / "probe.json").write_text(json.dumps({"hparams": dict(probe.hparams), "activations": IDENTITY}))
    write_folder_digest(folder, ["probe.safetensors", "probe.json"])
    saved = load_probe(folder)
    x = states()
    assert np.array_equal(saved.confidence(x), probe.confidence(x)) and saved.layer == 2
    assert isinstance(saved.module, ProbeNetwork) and saved.input_dim == 12
    (folder / "probe.json").write_text(json.dumps({"hparams": dict(probe.hparams), "activations": {}}))
    with pytest.raises(ArtifactDamagedError, match=r"probe.json"):
        load_probe(folder)


def test_probe_push_is_off_by_default_and_needs_the_probe_repo(tmp_path, monkeypatch):
    cfg = compose_cfg(["+experiment=probe_tiny_llama"], tmp_path)
    assert probe_task.check(cfg).hub == shipped_settings(HubSettings, "hub")
    with pytest.raises(ValueError, match=r"hub.push is true: hub.probe_repo must be a repo id"):
        probe_task.check(compose_cfg(["+experiment=probe_tiny_llama", "hub.push=true"], tmp_path))
    # A probe run pushes nothing without reranker repos: each task names its own.
    cfg = compose_cfg(["+experiment=probe_tiny_llama", "hub.push=true", "hub.probe_repo=me/probe"], tmp_path)
    assert probe_task.check(cfg).hub.probe_repo == "me/probe"


def wandb_offline(tmp_path, monkeypatch) -> WandbLogger:
    for key in ("WANDB_DATA_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(key, str(tmp_path / "wandb_home"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    return WandbLogger(project="confrag", save_dir=str(tmp_path / "run"), offline=True)


def test_exports_are_logged_as_wandb_artifacts_offline(tmp_path, monkeypatch):
    exports = {
        "probe": save_probe(trained(), tmp_path / "out" / "probe", IDENTITY, {}),
        "reranker": exported_folder(tmp_path / "out"),
        "nq_rerank": write_dataset(ROWS, tmp_path / "out" / "nq_rerank_dataset", run_facts()),
    }
    assert log_exports([], exports, "tiny_llama") == []  # no W&B logger: nothing to do
    logger = wandb_offline(tmp_path, monkeypatch)
    logged = log_exports([logger], exports, "tiny llama/v1", {"rule": "sign"})
    logger.experiment.finish()
    assert [(a.name, a.type) for a in logged] == [
        ("probe-tiny_llama_v1", "model"),
        ("reranker-tiny_llama_v1", "model"),
        ("nq_rerank-tiny_llama_v1", "dataset"),
    ]
    # What the offline run file records, read back without a network.
    found = {name: (kind, files) for name, kind, files in logged_artifacts(tmp_path / "run", expected=3)}
    assert set(found) == {"probe-tiny_llama_v1", "reranker-tiny_llama_v1", "nq_rerank-tiny_llama_v1"}
    assert found["probe-tiny_llama_v1"] == ("model", sorted(p.name for p in exports["probe"].iterdir()))
    assert found["reranker-tiny_llama_v1"] == ("model", ["config.json"])
    assert found["nq_rerank-tiny_llama_v1"] == (
        "dataset",
        sorted(str(p.relative_to(exports["nq_rerank"])) for p in exports["nq_rerank"].rglob("*") if p.is_file()),
    )
    assert artifact_name("probe", "a b") == "probe-a_b"
    with pytest.raises(ValueError, match=r"unknown export kind\(s\) \['rows'\]"):
        log_exports([logger], {"rows": tmp_path}, "x")


def test_cbdr_and_gates_runs_link_the_reranker_behind_their_tables_and_its_probe(tmp_path, monkeypatch):
    """The cbdr and gates tasks logged no artifact, so the reranker behind Table 2 was not linked to the run: it is
    exported and logged now, with the probe whose confidence labelled its rows, as the rerank task does."""
    probe = save_probe(trained(), tmp_path / "cache" / "probes" / "k", IDENTITY, {})
    reranker = reranker_module(fresh_head=True, seed=0)
    out = tmp_path / "run"
    assert log_table_exports([], reranker, "confidence_ft.sign", probe, out, "tiny") == []
    assert not (out / "reranker").exists()  # without W&B nothing is exported (its size in weights)
    logger = wandb_offline(tmp_path, monkeypatch)
    logged = log_table_exports([logger], reranker, "confidence_ft.sign", probe, out, "tiny")
    bm25_only = log_table_exports([logger], None, "bm25", probe, out, "tiny")  # a row without a model: the probe
    logger.experiment.finish()
    assert [(a.name, a.type, a.metadata["reranker"]) for a in logged] == [
        ("reranker-tiny", "model", "confidence_ft.sign"),
        ("probe-tiny", "model", "confidence_ft.sign"),
    ]
    assert [(a.name, a.metadata["reranker"]) for a in bm25_only] == [("probe-tiny", "bm25")]
    found = {name: files for name, _, files in logged_artifacts(tmp_path / "run", expected=3)}
    assert "model.safetensors" in found["reranker-tiny"] and "confrag.digest.json" in found["reranker-tiny"]
    assert found["probe-tiny"] == sorted(p.name for p in probe.iterdir())
