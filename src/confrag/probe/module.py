"""The confidence probe E: an MLP from a hidden state to P(the LLM answers correctly).

Defaults follow the papers / Ni et al. (2025): d→512→64→32→2, ReLU, dropout 0.5, Adam lr 5e-5.
Inputs are standardized with the training split's mean and std, kept as buffers so that
`confidence()` takes raw hidden states. A saved probe carries the identity of the activations it
was trained on (model, prompt template, layer); `load_probe(...).check(...)` refuses another one.
"""

from __future__ import annotations

import json
import logging
import math
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning import LightningModule
from safetensors.torch import load_file, save
from torch import nn
from torchmetrics import MetricCollection, SumMetric
from torchmetrics.classification import BinaryAccuracy, BinaryAUROC, BinaryCalibrationError

from confrag.artifacts import (
    atomic_write_bytes,
    atomic_write_text,
    exclusive,
    require_whole_folder,
    write_folder_digest,
)
from confrag.finite import require_finite

log = logging.getLogger(__name__)


def metric_value(value: float | None) -> float | None:
    """A metric for JSON: NaN (an undefined metric, such as AUROC on one class) becomes null."""
    if value is None:
        return None
    value = float(value)
    return None if math.isnan(value) else value


def metric_text(value: float | None, digits: int = 3) -> str:
    """A metric for a printed summary: `undefined` for NaN / None, else the number."""
    value = metric_value(value)
    return "undefined" if value is None else f"{value:.{digits}f}"


class ProbeMismatchError(ValueError):
    """A probe is asked to score states of another model, prompt template or layer."""


class ProbeModule(LightningModule):
    def __init__(
        self,
        input_dim: int,
        hidden_dims: Sequence[int] = (512, 64, 32),
        dropout: float = 0.5,
        lr: float = 5e-5,
        weight_decay: float = 0.0,
        layer: int | None = None,
    ) -> None:
        super().__init__()
        hidden_dims = [int(d) for d in hidden_dims]  # plain ints, so the saved hparams stay JSON lists
        if input_dim < 1 or not 0.0 <= dropout < 1.0 or lr <= 0:
            raise ValueError(f"probe: need input_dim >= 1, 0 <= dropout < 1, lr > 0 (got {input_dim}, {dropout}, {lr})")
        self.save_hyperparameters()
        dims = [input_dim, *hidden_dims]
        blocks: list[nn.Module] = []
        for d_in, d_out in zip(dims[:-1], dims[1:]):
            blocks += [nn.Linear(d_in, d_out), nn.ReLU(), nn.Dropout(dropout)]
        self.net = nn.Sequential(*blocks, nn.Linear(dims[-1], 2))
        self.register_buffer("mean", torch.zeros(input_dim))
        self.register_buffer("std", torch.ones(input_dim))
        self.loss = nn.CrossEntropyLoss()
        metrics = MetricCollection(
            {"acc": BinaryAccuracy(), "auroc": BinaryAUROC(), "ece": BinaryCalibrationError(n_bins=10)}
        )
        self.val_metrics = metrics.clone(prefix="val/")
        self.test_metrics = metrics.clone(prefix="test/")
        # Examples and positives seen per split (synced across DDP ranks like the metrics): AUROC needs both classes.
        self.val_counts = MetricCollection({"examples": SumMetric(), "positives": SumMetric()})
        self.test_counts = self.val_counts.clone()

    def set_standardization(self, mean: np.ndarray | torch.Tensor, std: np.ndarray | torch.Tensor) -> None:
        self.mean.copy_(torch.as_tensor(mean, dtype=torch.float32))
        self.std.copy_(torch.as_tensor(std, dtype=torch.float32).clamp_min(1e-6))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.net((hidden.float() - self.mean) / self.std)

    @torch.no_grad()
    def confidence(self, hidden_states: np.ndarray | torch.Tensor) -> np.ndarray:
        """P(correct) = softmax(E(H))[1] for a (n, d) or (d,) array of hidden states."""
        was_training = self.training
        self.eval()
        hidden = torch.as_tensor(np.asarray(hidden_states, dtype=np.float32)).to(self.mean.device)
        probs = torch.softmax(self(hidden.reshape(-1, hidden.shape[-1])), dim=-1)[:, 1]
        self.train(was_training)
        probs = probs.cpu().numpy()
        require_finite(probs, stage="probe confidence", artifact=f"the probe's output (layer {self.hparams.layer})")
        return probs

    def _step(self, batch, stage: str):
        hidden, labels = batch
        logits = self(hidden)
        loss = self.loss(logits, labels)
        self.log(f"{stage}/loss", loss, on_step=False, on_epoch=True, prog_bar=stage != "train", batch_size=len(labels))
        return loss, torch.softmax(logits, dim=-1)[:, 1], labels

    def training_step(self, batch, batch_idx):
        loss, _, _ = self._step(batch, "train")
        require_finite(
            loss, stage="probe training", artifact=f"the loss of batch {batch_idx} (epoch {self.current_epoch})"
        )
        return loss

    def validation_step(self, batch, batch_idx):
        _, probs, labels = self._step(batch, "val")
        self.val_metrics.update(probs, labels)
        self._count(self.val_counts, labels)

    def on_validation_epoch_end(self):
        self.log_dict(self._epoch_metrics(self.val_metrics, self.val_counts, "val"), prog_bar=True)

    def test_step(self, batch, batch_idx):
        _, probs, labels = self._step(batch, "test")
        self.test_metrics.update(probs, labels)
        self._count(self.test_counts, labels)

    def on_test_epoch_end(self):
        self.log_dict(self._epoch_metrics(self.test_metrics, self.test_counts, "test"))

    @staticmethod
    def _count(counts: MetricCollection, labels: torch.Tensor) -> None:
        counts["examples"].update(torch.tensor(float(labels.numel()), device=labels.device))
        counts["positives"].update(labels.sum().float())

    def _epoch_metrics(
        self, metrics: MetricCollection, counts: MetricCollection, stage: str
    ) -> dict[str, torch.Tensor]:
        """The split's metrics; AUROC is NaN ("undefined") when the split holds one class only, where
        torchmetrics would report 0."""
        seen = counts.compute() if counts["examples"].update_called else {"examples": 0, "positives": 0}
        examples, positives = int(seen["examples"]), int(seen["positives"])
        single_class = positives in (0, examples)
        with warnings.catch_warnings():
            if single_class:  # torchmetrics' own warning says the value is meaningless; ours says why
                warnings.simplefilter("ignore", UserWarning)
            values = metrics.compute()
        metrics.reset()
        counts.reset()
        if single_class:
            values[f"{stage}/auroc"] = torch.tensor(float("nan"), device=self.device)
            only = "positive" if positives else "negative"
            log.warning(
                "%s/auroc is undefined: the %s split holds only %s examples (%d of them); reported as NaN "
                "(null in metrics.json)",
                stage,
                "dev" if stage == "val" else stage,
                only,
                examples,
            )
        return values

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # The resolved run config travels inside each checkpoint (set by the task that trains the probe).
        checkpoint["confrag_config"] = getattr(self, "run_config", None)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)


# --- saved probes ------------------------------------------------------------------------------


class SavedProbe:
    """A trained probe plus the identity of the activations it expects."""

    def __init__(self, module: ProbeModule, meta: dict[str, Any]) -> None:
        self.module = module.eval()
        self.meta = meta

    @property
    def layer(self) -> int:
        return int(self.meta["activations"]["layer"])

    def check(self, llm_identity: dict[str, Any], prompts_identity: str, layer: int) -> None:
        expected = self.meta["activations"]
        found = {"llm": llm_identity, "prompts": prompts_identity, "layer": int(layer)}
        diffs = [k for k in found if json.dumps(found[k], sort_keys=True) != json.dumps(expected[k], sort_keys=True)]
        if diffs:
            raise ProbeMismatchError(
                "probe was trained on other activations: "
                + "; ".join(f"{k}: trained on {expected[k]!r}, asked for {found[k]!r}" for k in diffs)
            )

    def confidence(self, hidden_states) -> np.ndarray:
        return self.module.confidence(hidden_states)


PROBE_FILES = ("probe.safetensors", "probe.json")


def save_probe(module: ProbeModule, directory: Path | str, activations: dict[str, Any], extra: dict[str, Any]) -> Path:
    """Weights and metadata, each written atomically; two processes saving to one directory take turns,
    so the weights and the metadata found there always come from the same save."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().cpu().contiguous() for k, v in module.state_dict().items()}
    meta = {"hparams": dict(module.hparams), "activations": activations, **extra}
    with exclusive(directory / ".probe.lock", f"the probe in {directory}"):
        atomic_write_bytes(directory / "probe.safetensors", save(tensors))
        atomic_write_text(directory / "probe.json", json.dumps(meta, indent=2, default=str))
        # Last: a save interrupted before this line leaves a digest that does not match, never a trusted mix.
        write_folder_digest(directory, PROBE_FILES)
    return directory


def load_probe(directory: Path | str) -> SavedProbe:
    """The probe saved in `directory`, its weights and JSON checked against the digest `save_probe` took:
    ArtifactDamagedError when they differ or the digest is missing (a cached probe is then retrained)."""
    directory = Path(directory)
    for name in PROBE_FILES:
        if not (directory / name).is_file():
            raise FileNotFoundError(
                f"{directory / name} not found: train a probe first (python train.py +experiment=probe_*)"
            )
    require_whole_folder(directory, "probe")
    meta = json.loads((directory / "probe.json").read_text())
    hparams = meta["hparams"]
    module = ProbeModule(
        **{k: hparams[k] for k in ("input_dim", "hidden_dims", "dropout", "lr", "weight_decay", "layer")}
    )
    module.load_state_dict(load_file(str(directory / "probe.safetensors")))
    return SavedProbe(module, meta)
