"""The confidence probe E: an MLP from a hidden state to P(the LLM answers correctly).

Defaults follow the papers / Ni et al. (2025): d→512→64→32→2, ReLU, dropout 0.5, Adam lr 5e-5.
Inputs are standardized with the training split's mean and std, kept as buffers so that
`confidence()` takes raw hidden states. `hidden_dims=[]` is a logistic probe; with `optimizer="lbfgs"`
(full-batch L-BFGS to convergence, `l2` on the weights) it is the reference's standardized logistic
regression, the same optimum as scikit-learn's (tested). `class_weight="balanced"` weighs the loss by
inverse class frequency, so that every training state is kept instead of down-sampling the majority.

A saved probe is a `PyTorchModelHubMixin` folder (`confrag.probe.network.ProbeNetwork`: config.json with the
layer, the LLM identity and the input standardization; model.safetensors) plus the run record probe.json;
it carries the identity of the activations it was trained on (model, prompt template, layer), and
`load_probe(...).check(...)` refuses another one.
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
from safetensors.torch import load_file
from torch import nn
from torchmetrics import MetricCollection, SumMetric
from torchmetrics.classification import BinaryAccuracy, BinaryAUROC, BinaryCalibrationError

from confrag.infra import checks
from confrag.infra.atomic import swapped_in
from confrag.infra.digests import require_whole_folder, write_folder_digest
from confrag.infra.finite import require_finite
from confrag.infra.locks import exclusive
from confrag.probe.network import CONFIG, ProbeNetwork, mlp, probe_confidence

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
    # wide: built by Hydra from its config node, one keyword per key of the YAML (tests/test_settings_defaults.py
    # checks them against it), beside the input width and layer the run gives; the MLP's shape and its optimiser's
    # settings are the keys a sweep sets one by one (`model.lr=...`), and its saved config reads them by name.
    def __init__(
        self,
        input_dim: int,
        *,
        hidden_dims: Sequence[int],
        dropout: float,
        lr: float,
        weight_decay: float,
        layer: int | str | None,
        optimizer: str,
        l2: float,
        class_weight: str | None,
    ) -> None:
        """The settings have no defaults here: the `model` node (conf/model/probe.yaml) holds them (outside a
        run: `confrag.instantiators.shipped("model/probe.yaml", input_dim=..., layer=...)`). `layer`: the LLM
        layer the states come from, for messages (None: not tied to one); in a run the recipe gives the integer it
        resolved from the node's `layer` (`mid`: Layer/2)."""
        super().__init__()
        hidden_dims = [int(d) for d in hidden_dims]  # plain ints, so the saved hparams stay JSON lists
        check_probe_settings(
            input_dim=input_dim,
            dropout=dropout,
            lr=lr,
            weight_decay=weight_decay,
            optimizer=optimizer,
            l2=l2,
            class_weight=class_weight,
        )
        self.save_hyperparameters()
        self.net = mlp(input_dim, hidden_dims, dropout)
        self.register_buffer("mean", torch.zeros(input_dim))
        self.register_buffer("std", torch.ones(input_dim))
        # Per-class loss weights (1, 1 unless class_weight="balanced" and set_class_weights saw the labels).
        self.register_buffer("class_weights", torch.ones(2))
        metrics = MetricCollection(
            {"acc": BinaryAccuracy(), "auroc": BinaryAUROC(), "ece": BinaryCalibrationError(n_bins=10)}
        )
        self.val_metrics = metrics.clone(prefix="val/")
        self.test_metrics = metrics.clone(prefix="test/")
        # Examples and positives seen per split (synced across DDP ranks like the metrics): AUROC needs both classes.
        self.val_counts = MetricCollection({"examples": SumMetric(), "positives": SumMetric()})
        self.test_counts = self.val_counts.clone()

    @property
    def input_dim(self) -> int:
        return int(self.hparams.input_dim)

    def set_standardization(self, mean: np.ndarray | torch.Tensor, std: np.ndarray | torch.Tensor) -> None:
        self.mean.copy_(torch.as_tensor(mean, dtype=torch.float32))
        self.std.copy_(torch.as_tensor(std, dtype=torch.float32).clamp_min(1e-6))

    def set_class_weights(self, labels: Sequence[int] | np.ndarray) -> None:
        """With class_weight="balanced": weight n / (2 n_c) for class c of the training labels, as
        scikit-learn's class_weight="balanced"; otherwise nothing changes."""
        if self.hparams.class_weight != "balanced":
            return
        counts = np.bincount(np.asarray(labels, dtype=np.int64), minlength=2).astype(np.float64)
        if (counts == 0).any():
            raise ValueError(f"probe: class_weight=balanced needs both classes in the training split (got {counts})")
        self.class_weights.copy_(torch.as_tensor(counts.sum() / (2 * counts), dtype=torch.float32))

    def weight_penalty(self) -> torch.Tensor:
        """l2 / 2 × the squared norm of the weight matrices (biases are not penalized, as in scikit-learn)."""
        return 0.5 * self.hparams.l2 * sum((m.weight**2).sum() for m in self.net if isinstance(m, nn.Linear))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.net((hidden.float() - self.mean) / self.std)

    @torch.no_grad()
    def confidence(self, hidden_states: np.ndarray | torch.Tensor) -> np.ndarray:
        """P(correct) = softmax(E(H))[1] for a (n, d) or (d,) array of hidden states."""
        return probe_confidence(self, hidden_states, self.hparams.layer)

    def _step(self, batch, stage: str):
        hidden, labels = batch
        logits = self(hidden)
        loss = nn.functional.cross_entropy(logits, labels, weight=self.class_weights)
        if stage == "train" and self.hparams.l2 > 0:
            loss = loss + self.weight_penalty()
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
        return OPTIMIZERS[self.hparams.optimizer](self)


# The probe's optimizers by name (`model.optimizer`). L-BFGS takes full batches (`data.batch_size=null`) and
# runs to convergence within each step, so a logistic probe reaches the convex optimum in a few epochs.
OPTIMIZERS = {
    "adam": lambda m: torch.optim.Adam(m.parameters(), lr=m.hparams.lr, weight_decay=m.hparams.weight_decay),
    "lbfgs": lambda m: torch.optim.LBFGS(
        m.parameters(),
        lr=m.hparams.lr,
        max_iter=200,
        tolerance_grad=1e-9,
        tolerance_change=1e-12,
        history_size=20,
        line_search_fn="strong_wolfe",
    ),
}
CLASS_WEIGHTS = (None, "balanced")


def check_probe_settings(**settings: Any) -> None:
    """Refuse settings no probe trains with, naming the parameter (the config boundary adds the node: `model.lr`)
    and what is allowed; each setting given is checked (ProbeModule gives them all; the defaults live in
    conf/model/probe.yaml)."""
    rules = {
        "input_dim": (lambda v: v is None or v >= 1, "input_dim must be >= 1 (got {v})"),
        "dropout": (lambda v: 0.0 <= float(v) < 1.0, "dropout must be in [0, 1) (got {v})"),
        "lr": (lambda v: float(v) > 0, "lr must be > 0 (got {v})"),
        "weight_decay": (lambda v: float(v) >= 0, "weight_decay must be >= 0 (got {v})"),
        "l2": (lambda v: float(v) >= 0, "l2 must be >= 0 (got {v})"),
        "optimizer": (lambda v: v in OPTIMIZERS, "optimizer={v!r} is not one of " + str(tuple(OPTIMIZERS))),
        "class_weight": (lambda v: v in CLASS_WEIGHTS, "class_weight={v!r} is not one of " + str(CLASS_WEIGHTS)),
    }
    problems = [
        message.format(v=settings[key])
        for key, (ok, message) in rules.items()
        if key in settings and not ok(settings[key])
    ]
    checks.refuse(problems)  # each under the node's key at the boundary (`model.lr`)


# --- saved probes ------------------------------------------------------------------------------


class SavedProbe:
    """A trained probe (a `ProbeNetwork` when read from disk; a `ProbeModule` works too) plus the identity of
    the activations it expects and its run record (`probe.json`: training settings, metrics, data summary)."""

    def __init__(self, module: nn.Module, meta: dict[str, Any], directory: Path | None = None) -> None:
        self.module = module.eval()
        self.meta = meta
        self.directory = directory  # the folder it was read from (None when made in memory)

    @property
    def layer(self) -> int:
        return int(self.meta["activations"]["layer"])

    @property
    def input_dim(self) -> int:
        return int(self.module.input_dim)

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


RECORD = "probe.json"  # the run record beside the Hub files (cache_verify recognises a probe folder by it)
LEGACY_WEIGHTS = "probe.safetensors"  # the format before PyTorchModelHubMixin: weights + probe.json


def save_probe(module: ProbeModule, directory: Path | str, activations: dict[str, Any], extra: dict[str, Any]) -> Path:
    """The probe as a `PyTorchModelHubMixin` folder (`config.json`, `model.safetensors`, README.md) plus its run
    record `probe.json`, with the folder digest; built beside `directory` and renamed into place, so a reader
    never sees half a save. Two processes saving to one directory take turns."""
    directory = Path(directory)
    network = ProbeNetwork.from_module(module, activations)
    meta = {
        "hparams": dict(module.hparams),
        "class_weights": module.class_weights.tolist(),  # the loss weights it trained with (not needed to score)
        "activations": activations,
        **extra,
    }
    with exclusive(directory.parent / f".{directory.name}.lock", f"the probe {directory}"):
        with swapped_in(directory) as tmp:
            network.save_pretrained(tmp)
            (tmp / RECORD).write_text(json.dumps(meta, indent=2, default=str), encoding="utf-8")
            write_folder_digest(tmp)  # again: now with the run record
    return directory


# What a probe saved before `optimizer`, `l2` and `class_weight` existed was trained with: a fact of those files,
# not a default (conf/model/probe.yaml holds the defaults of new probes).
LEGACY_SETTINGS = {"optimizer": "adam", "l2": 0.0, "class_weight": None}


def load_probe(directory: Path | str) -> SavedProbe:
    """The probe saved in `directory`, every file checked against the folder digest `save_probe` took:
    ArtifactDamagedError when one differs or the digest is missing (a cached probe is then retrained, a
    user's own export refused). A folder in the format before the Hub mixin (`probe.safetensors` +
    `probe.json`, with its digest) is still read."""
    directory = Path(directory)
    legacy = not (directory / CONFIG).is_file() and (directory / LEGACY_WEIGHTS).is_file()
    for name in (LEGACY_WEIGHTS if legacy else CONFIG, RECORD):
        if not (directory / name).is_file():
            raise FileNotFoundError(
                f"{directory / name} not found: train a probe first (python train.py +experiment=probe_*)"
            )
    require_whole_folder(directory, "probe")
    meta = json.loads((directory / RECORD).read_text())
    if not legacy:
        return SavedProbe(ProbeNetwork.from_pretrained(directory), meta, directory)
    hparams = meta["hparams"]
    module = ProbeModule(
        **{k: hparams[k] for k in ("input_dim", "hidden_dims", "dropout", "lr", "weight_decay", "layer")},
        # Settings added later: probes saved before them were all trained so (Adam, no L2, unweighted).
        **{**LEGACY_SETTINGS, **{k: hparams[k] for k in LEGACY_SETTINGS if k in hparams}},
    )
    module.load_state_dict(load_file(str(directory / LEGACY_WEIGHTS)))
    return SavedProbe(ProbeNetwork.from_module(module, meta["activations"]), meta, directory)
