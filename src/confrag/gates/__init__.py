"""Retrieval gates under one interface: decide per question to answer from parametric knowledge,
retrieve, or refuse. `make_gate(name, **config)` builds one by name; each is also a Hydra node
(`conf/gate/<name>.yaml`, `_target_` = the class)."""

from __future__ import annotations

from typing import Any

from confrag.gates.base import (
    Decision,
    DraftSignals,
    Gate,
    GateSignals,
    GateTrainingData,
    MissingSignalError,
    MissingTrainingDataError,
    UnavailableSignalError,
    retrieval_helped,
)
from confrag.gates.bridge import BridgeGate
from confrag.gates.ccsk import CCSKGate
from confrag.gates.ctrla import CtrlAGate
from confrag.gates.directions import ConfidenceDirection
from confrag.gates.dragin import DraginGate
from confrag.gates.simple import AlwaysGate, CBDRGate, NeverGate
from confrag.gates.skr import SKRKnnGate
from confrag.gates.uncertainty import EntropyGate, MaxProbGate, PerplexityGate, PTrueGate

GATES: dict[str, type[Gate]] = {
    gate.name: gate
    for gate in (
        AlwaysGate,
        NeverGate,
        CBDRGate,
        DraginGate,
        CtrlAGate,
        SKRKnnGate,
        CCSKGate,
        BridgeGate,
        EntropyGate,
        MaxProbGate,
        PerplexityGate,
        PTrueGate,
    )
}


def make_gate(name: str, **config: Any) -> Gate:
    """The gate called `name`, built from its config values (the keys of `conf/gate/<name>.yaml`)."""
    if name not in GATES:
        raise ValueError(f"unknown gate {name!r}; available gates: {', '.join(sorted(GATES))}")
    return GATES[name](**config)


__all__ = [
    "GATES",
    "AlwaysGate",
    "BridgeGate",
    "CBDRGate",
    "CCSKGate",
    "ConfidenceDirection",
    "CtrlAGate",
    "Decision",
    "DraftSignals",
    "DraginGate",
    "EntropyGate",
    "Gate",
    "GateSignals",
    "GateTrainingData",
    "MissingSignalError",
    "MaxProbGate",
    "MissingTrainingDataError",
    "NeverGate",
    "PTrueGate",
    "PerplexityGate",
    "SKRKnnGate",
    "UnavailableSignalError",
    "make_gate",
    "retrieval_helped",
]
