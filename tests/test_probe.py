"""The probe module, its saved form, and the streaming DataModule."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from lightning import Trainer
from torch.utils.data import DataLoader, TensorDataset

from confrag.probe.calibration import reliability_bins
from confrag.probe.module import ProbeMismatchError, load_probe, save_probe

from helpers.modules import confidence_data, probe_module


def test_architecture_follows_the_paper():
    probe = probe_module(input_dim=576)
    linear = [m for m in probe.net if isinstance(m, torch.nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linear] == [(576, 512), (512, 64), (64, 32), (32, 2)]
    assert [m.p for m in probe.net if isinstance(m, torch.nn.Dropout)] == [0.5, 0.5, 0.5]
    assert probe.configure_optimizers().defaults["lr"] == 5e-5


def test_confidence_is_softmax_of_class_one_and_ignores_dropout():
    torch.manual_seed(0)
    probe = probe_module(input_dim=8)
    probe.set_standardization(np.full(8, 1.0), np.full(8, 2.0))
    hidden = np.random.default_rng(0).normal(size=(5, 8)).astype(np.float32)
    probe.train()
    conf = probe.confidence(hidden)
    assert probe.training  # mode restored
    probe.eval()
    expected = torch.softmax(probe(torch.from_numpy(hidden)), -1)[:, 1].detach().numpy()  # forward standardizes
    assert conf.shape == (5,) and np.allclose(conf, expected, atol=1e-6)
    assert np.allclose(probe.confidence(hidden), conf)  # deterministic: dropout off
    assert probe.confidence(hidden[0]).shape == (1,)


@pytest.mark.heavy
def test_probe_learns_a_separable_signal():
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(400, 16)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64)
    probe = probe_module(input_dim=16, lr=1e-2)
    loader = DataLoader(TensorDataset(torch.from_numpy(x), torch.from_numpy(y)), batch_size=32, shuffle=True)
    Trainer(
        max_epochs=15, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False
    ).fit(probe, loader, loader)
    conf = probe.confidence(x)
    assert ((conf > 0.5) == y).mean() > 0.9


def test_saved_probe_round_trips_and_refuses_other_activations(tmp_path):
    probe = probe_module(input_dim=8, layer=15)
    probe.set_standardization(np.arange(8.0), np.full(8, 3.0))
    identity = {"llm": {"name": "smollm2_135m", "ref": "gguf:x@1"}, "prompts": "abc", "layer": 15, "key": "k"}
    save_probe(probe, tmp_path, identity, {"metrics": {"test/auroc": 0.7}})
    saved = load_probe(tmp_path)
    hidden = np.random.default_rng(1).normal(size=(3, 8)).astype(np.float32)
    assert np.allclose(saved.confidence(hidden), probe.confidence(hidden))
    saved.check(identity["llm"], "abc", 15)
    with pytest.raises(ProbeMismatchError, match="layer"):
        saved.check(identity["llm"], "abc", 16)
    with pytest.raises(ProbeMismatchError, match="llm"):
        saved.check({"name": "llama3_8b", "ref": "hf:x"}, "abc", 15)
    with pytest.raises(ProbeMismatchError, match="prompts"):
        saved.check(identity["llm"], "other-template", 15)


def test_missing_probe_directory_says_how_to_make_one(tmp_path):
    with pytest.raises(FileNotFoundError, match="train a probe first"):
        load_probe(tmp_path / "nothing")


def test_bad_hyperparameters_are_refused():
    with pytest.raises(ValueError, match="dropout"):
        probe_module(input_dim=8, dropout=1.5)


def one_class_datamodule(train_positives: int, dev_positives: int, allow: bool):
    from types import SimpleNamespace

    summary = {"train/examples": 40, "train/positives": train_positives, "dev/examples": 10}
    summary["dev/positives"] = dev_positives
    return SimpleNamespace(
        data=SimpleNamespace(summary=lambda: summary),
        config_node="probe.data",
        splits=SimpleNamespace(allow_one_class=allow),
        input_dim=4,
        layer=1,
    )


@pytest.mark.parametrize(
    "train, dev, message",
    [
        (0, 3, r"the train split has 40 examples and no positive \(a right answer\)"),
        (40, 3, r"the train split has 40 examples and no negative \(a wrong answer\)"),
        (5, 0, r"the dev split has 10 examples and no positive"),
    ],
)
def test_a_probe_without_one_class_in_train_or_dev_is_refused_before_training(train, dev, message):
    """A probe trained with 0 positives was exported with only repeated 'val/auroc is undefined' warnings."""
    from types import SimpleNamespace

    from confrag.stages.probe import fit_probe

    def no_model(**kwargs):
        raise AssertionError("the probe was built although a split has one class")

    recipe = SimpleNamespace(make_model=no_model)
    with pytest.raises(ValueError, match=message + r".*set probe\.data\.splits\.allow_one_class=true"):
        fit_probe(recipe, [], [], datamodule=one_class_datamodule(train, dev, allow=False))
    # The explicit override trains it anyway (here: reaches the model), with a warning.
    with pytest.raises(AssertionError, match="the probe was built"):
        fit_probe(recipe, [], [], datamodule=one_class_datamodule(train, dev, allow=True))


def test_the_one_class_override_is_a_flag(templates):
    from dataclasses import asdict

    from helpers.models import tiny_llm_config

    with pytest.raises(ValueError, match=r"data.splits.allow_one_class must be true or false; got 'yes'"):
        confidence_data(
            llm=tiny_llm_config(), prompts=asdict(templates), questions_path="x", splits={"allow_one_class": "yes"}
        )


def test_a_skipped_layer_scan_says_why(caplog, tmp_path):
    """`layer_scan=true` was skipped without a line when a class had fewer than 5 examples."""
    import json
    from types import SimpleNamespace

    from confrag.probe.layer_scan import layer_scan
    from confrag.reports.probe import write_probe_report

    labels = np.array([1, 1, 0, 0, 0, 0, 0, 0, 0, 0])
    data = SimpleNamespace(stores={"qa": None}, labels={"qa": labels}, layers=[1, 2])
    with caplog.at_level("WARNING"):
        assert layer_scan(data) == []
    why = "2 positive and 8 negative examples; 5-fold cross-validation needs at least 5 of each class"
    assert f"layer_scan skipped: {why}" in caplog.text
    summary = {"questions": 10, **{f"{s}/{k}": 1 for s in ("train", "dev", "test") for k in ("examples", "positives")}}
    splits = SimpleNamespace(balance=True)
    datamodule = SimpleNamespace(layer=1, train_states="qa", splits=splits, data=data, num_layers=2)
    text = write_probe_report(
        tmp_path,
        "tiny",
        datamodule,
        {},
        summary,
        [],
        reliability_bins(np.array([0.2, 0.9]), np.array([0, 1])),
        [],
        scan_skipped=why,
    )
    assert f"per-layer scan skipped: {why}" in text
    assert json.loads((tmp_path / "metrics.json").read_text())["layer_scan_skipped"] == why


def _touch(path: str) -> int:
    Path(path).touch()
    return 0


class _Planted:
    """What a replaced checkpoint could hold: an object whose unpickling runs code (here: makes a file)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (_touch, (str(self.path),))


def test_a_probe_checkpoint_is_read_weights_only_and_runs_no_code(tmp_path):
    from confrag.stages.probe import read_checkpoint

    plain = tmp_path / "plain.ckpt"
    torch.save({"state_dict": {"w": torch.ones(2)}, "epoch": 3, "hyper_parameters": {"lr": 1e-3}}, plain)
    assert read_checkpoint(str(plain))["epoch"] == 3
    marker, planted = tmp_path / "ran", tmp_path / "planted.ckpt"
    torch.save({"state_dict": {}, "epoch": 1, "extra": _Planted(marker)}, planted)
    with pytest.raises(pickle.UnpicklingError, match="[Ww]eights only load failed"):
        read_checkpoint(str(planted))
    assert not marker.exists()
