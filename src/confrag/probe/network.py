"""The trained probe as others load it: a plain `nn.Module` with `huggingface_hub.PyTorchModelHubMixin`, so that
`ProbeNetwork.from_pretrained(folder_or_repo)`, `save_pretrained` and `push_to_hub` work as for any Hub model.

Its `config.json` holds everything needed to use it on the right states: the layer, the identity of the LLM
and prompt template whose hidden states it was trained on, and the input standardization (the training
split's per-dimension mean and std, as exact float32 values; null when the probe has none). The weights
(`model.safetensors`) are the MLP's alone. Training (Lightning, metrics, optimizers) stays in
`ProbeModule`; `ProbeNetwork.from_module` copies a trained one.

Integrity: the folder carries confrag's folder digest (`confrag.digest.json`), and `from_pretrained` checks
the config and weights against it, from a local folder or from a Hub download; a folder without it is
refused (nothing read back is trusted without its digest).
"""

from __future__ import annotations

import contextlib
import io
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from huggingface_hub import ModelCard, ModelCardData, PyTorchModelHubMixin
from torch import nn

from confrag.infra.digests import FOLDER_DIGEST, ArtifactDamagedError, folder_problem, write_folder_digest
from confrag.infra.finite import require_finite

WEIGHTS = "model.safetensors"
CONFIG = "config.json"
# What `from_pretrained` reads: both must match the folder digest.
VERIFIED_FILES = (CONFIG, WEIGHTS)


def mlp(input_dim: int, hidden_dims: Sequence[int], dropout: float = 0.0) -> nn.Sequential:
    """d → hidden_dims → 2 with ReLU and dropout between: the probe's layers, shared by training and export
    (so their state-dict keys match)."""
    dims = [int(input_dim), *(int(d) for d in hidden_dims)]
    blocks: list[nn.Module] = []
    for d_in, d_out in zip(dims[:-1], dims[1:]):
        blocks += [nn.Linear(d_in, d_out), nn.ReLU(), nn.Dropout(dropout)]
    return nn.Sequential(*blocks, nn.Linear(dims[-1], 2))


class ProbeNetwork(
    nn.Module,
    PyTorchModelHubMixin,
    library_name="confrag",
    license="apache-2.0",
    tags=["confrag", "confidence-probe", "rag"],
    pipeline_tag="tabular-classification",
):
    """P(the LLM answers correctly) from its hidden state at `layer`, last prompt token."""

    def __init__(
        self,
        input_dim: int,
        hidden_dims: Sequence[int] = (512, 64, 32),
        layer: int | None = None,
        llm: dict[str, Any] | None = None,
        prompts: str | None = None,
        activations_key: str | None = None,
        standardization: dict[str, list[float]] | None = None,
    ) -> None:
        super().__init__()
        self.input_dim, self.layer = int(input_dim), None if layer is None else int(layer)
        self.llm, self.prompts, self.activations_key = llm, prompts, activations_key
        self.net = mlp(self.input_dim, hidden_dims)
        mean, std = np.zeros(self.input_dim, np.float32), np.ones(self.input_dim, np.float32)
        if standardization is not None:
            mean = np.asarray(standardization["mean"], dtype=np.float32)
            std = np.asarray(standardization["std"], dtype=np.float32)
            if mean.shape != (self.input_dim,) or std.shape != (self.input_dim,) or not (std > 0).all():
                raise ValueError(
                    f"probe config: standardization needs {self.input_dim} means and {self.input_dim} positive "
                    f"stds; got {mean.shape[0]} and {std.shape[0]}"
                )
        # Not in the weights file: the config is where the standardization is stated (and read from).
        self.register_buffer("mean", torch.from_numpy(mean), persistent=False)
        self.register_buffer("std", torch.from_numpy(std), persistent=False)

    @classmethod
    def from_module(cls, module: nn.Module, activations: dict[str, Any]) -> ProbeNetwork:
        """The network of a trained `ProbeModule` (its `net`, `mean`, `std`, hparams) with the identity of
        the activations it was trained on (`{"llm", "prompts", "layer", "key"}`)."""
        hparams = module.hparams
        mean, std = module.mean.detach().cpu().float(), module.std.detach().cpu().float()
        plain = bool((mean == 0).all() and (std == 1).all())
        layer = activations.get("layer", hparams.get("layer"))
        network = cls(
            input_dim=int(hparams["input_dim"]),
            hidden_dims=[int(d) for d in hparams["hidden_dims"]],
            layer=None if layer is None else int(layer),
            llm=activations.get("llm"),
            prompts=activations.get("prompts"),
            activations_key=activations.get("key"),
            # float32 → Python float (float64) is exact, and json writes it so that it reads back the same.
            standardization=None if plain else {"mean": mean.tolist(), "std": std.tolist()},
        )
        network.net.load_state_dict(module.net.state_dict())
        return network.eval()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.net((hidden.float() - self.mean) / self.std)

    @torch.no_grad()
    def confidence(self, hidden_states: np.ndarray | torch.Tensor) -> np.ndarray:
        """P(correct) = softmax(E(H))[1] for a (n, d) or (d,) array of hidden states."""
        return probe_confidence(self, hidden_states, self.layer)

    def hub_config(self) -> dict[str, Any]:
        """What `config.json` holds: every `__init__` argument (the mixin would silently drop one it cannot
        encode; here a value JSON cannot hold fails the save instead)."""
        standardization = None
        if not bool((self.mean == 0).all() and (self.std == 1).all()):
            standardization = {"mean": self.mean.cpu().tolist(), "std": self.std.cpu().tolist()}
        config = {
            "input_dim": self.input_dim,
            "hidden_dims": [m.out_features for m in self.net if isinstance(m, nn.Linear)][:-1],
            "layer": self.layer,
            "llm": self.llm,
            "prompts": self.prompts,
            "activations_key": self.activations_key,
            "standardization": standardization,
        }
        return json.loads(json.dumps(config, allow_nan=False))

    def generate_model_card(self, *args: Any, **kwargs: Any) -> ModelCard:
        llm = (self.llm or {}).get("name") or (self.llm or {}).get("source") or "the LLM"
        data = ModelCardData(library_name="confrag", license="apache-2.0", tags=["confrag", "confidence-probe", "rag"])
        text = "\n".join(
            [
                "---",
                data.to_yaml(),
                "---",
                "",
                f"# Confidence probe for {llm}, layer {self.layer}",
                "",
                "P(the LLM's greedy answer is correct) from its hidden state at the last prompt token (confrag: "
                '"Rethinking LLM Parametric Knowledge as Post-retrieval Confidence for Dynamic Retrieval and '
                'Reranking"). `config.json` names the layer, the LLM identity and the prompt template the states '
                "must come from, and the input standardization.",
                "",
                "```python",
                "from confrag.probe.network import ProbeNetwork",
                "",
                'probe = ProbeNetwork.from_pretrained("<this folder or repo id>")',
                "confidence = probe.confidence(hidden_states)  # (n, d) states at probe.layer",
                "```",
                "",
            ]
        )
        return ModelCard(text)

    def save_pretrained(self, save_directory: str | Path, **kwargs: Any) -> str | None:
        """The mixin's save (config.json from `hub_config`, model.safetensors, README.md) followed by the folder
        digest, so that what `push_to_hub` uploads (it saves through here) loads with `from_pretrained`."""
        kwargs.setdefault("config", self.hub_config())
        push, repo_id = kwargs.pop("push_to_hub", False), kwargs.pop("repo_id", None)
        super().save_pretrained(
            save_directory, **{k: kwargs[k] for k in ("config", "model_card_kwargs") if k in kwargs}
        )
        write_folder_digest(save_directory)
        if push:
            return self.push_to_hub(repo_id or Path(save_directory).name, **kwargs)
        return None

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | Path, **kwargs: Any) -> ProbeNetwork:
        """The mixin's loader, with the config and weights checked against the folder digest first (a local
        folder, or the snapshot a Hub repo is downloaded to) and every weight required."""
        source = str(pretrained_model_name_or_path)
        if Path(source).is_dir():
            folder = Path(source)
        else:
            from huggingface_hub import hf_hub_download

            hub = {
                k: kwargs[k]
                for k in ("revision", "cache_dir", "force_download", "token", "local_files_only")
                if k in kwargs
            }
            # The files of one revision lie in one snapshot folder of the HF cache, beside their digest.
            for name in (FOLDER_DIGEST, *VERIFIED_FILES):
                folder = Path(hf_hub_download(repo_id=source, filename=name, **hub)).parent
        problem = folder_problem(folder, only=list(VERIFIED_FILES))
        if problem:
            raise ArtifactDamagedError(f"probe {source}: {problem}")
        kwargs.setdefault("strict", True)  # the mixin's default (False) would leave a missing weight random
        with contextlib.redirect_stdout(io.StringIO()):  # the mixin prints "Loading weights from local directory"
            return super().from_pretrained(source, **kwargs)


@torch.no_grad()
def probe_confidence(probe: nn.Module, hidden_states: np.ndarray | torch.Tensor, layer: int | None) -> np.ndarray:
    """P(correct) = softmax(probe(H))[1] for a (n, d) or (d,) array of hidden states, in eval mode (the probe's
    mode is restored), checked finite. Shared by the training module and the exported network."""
    was_training = probe.training
    probe.eval()
    hidden = torch.as_tensor(np.asarray(hidden_states, dtype=np.float32)).to(probe.mean.device)
    probs = torch.softmax(probe(hidden.reshape(-1, hidden.shape[-1])), dim=-1)[:, 1]
    probe.train(was_training)
    probs = probs.cpu().numpy()
    require_finite(probs, stage="probe confidence", artifact=f"the probe's output (layer {layer})")
    return probs
