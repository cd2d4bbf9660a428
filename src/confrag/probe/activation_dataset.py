"""The probe's examples as a torch Dataset read from the activation stores, and the sampler that gives each
DDP rank its share of the dev and test examples once."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler
from torch.utils.data import Dataset, DistributedSampler

from confrag.infra.activation_store import ActivationStore
from confrag.probe.prompt_kinds import Example


class ActivationDataset(Dataset):
    def __init__(self, stores: dict[str, ActivationStore], layer: int, examples: Sequence[Example]) -> None:
        self.stores, self.layer, self.examples = stores, layer, list(examples)
        for kind in {e.kind for e in self.examples}:
            stores[kind].layer_index(layer)  # fail early, naming the layers that exist

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int):
        example = self.examples[i]
        hidden = self.stores[example.kind].get(self.layer, example.index)
        return torch.from_numpy(hidden), torch.tensor(example.label, dtype=torch.long)


def unrepeated_sampler(dataset: Dataset) -> DistributedSampler | None:
    """Under DDP, a sampler giving each rank its share of the dev or test examples, each example once.
    Lightning's default DistributedSampler repeats examples to even out the ranks, and the repeats would
    enter the dev metric the checkpoint is chosen by and the test metrics; the probe's metrics gather
    every rank's predictions (torchmetrics), whatever their counts. None without DDP (Lightning's
    sampler), and when some rank would get no example at all (its metrics could not be gathered)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    world = torch.distributed.get_world_size()
    if world <= 1 or len(dataset) < world:
        return None
    return UnrepeatedDistributedSampler(dataset, num_replicas=world, rank=torch.distributed.get_rank(), shuffle=False)
