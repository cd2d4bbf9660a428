"""The confidence probe: data, LightningModule, layer scan, saved probes."""

from confrag.probe.module import ProbeMismatchError, ProbeModule, SavedProbe, load_probe, save_probe

__all__ = ["ProbeMismatchError", "ProbeModule", "SavedProbe", "load_probe", "save_probe"]
