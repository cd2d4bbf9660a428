"""Retrieval gates under one interface: decide per question to answer from parametric knowledge,
retrieve, or refuse. Each gate class registers itself in `GATES` under its id (`Gate.name`) and is built
from its Hydra node (`conf/gate/<name>.yaml`, `_target_` = the class) by
`confrag.gates.settings.gate_from_config`; the signals gates read are entries of `registry.SIGNALS`."""

from __future__ import annotations

from confrag.gates import signal_table  # noqa: F401  (registers the built-in signals)
from confrag.gates.base import (
    GATES,
    Decision,
    DraftSignals,
    Gate,
    GateSignals,
    GateTrainingData,
    MissingSignalError,
    MissingTrainingDataError,
    retrieval_helped,
)
from confrag.gates.bridge import BridgeGate
from confrag.gates.ccsk import CCSKGate
from confrag.gates.ctrla import CtrlAGate
from confrag.gates.directions import ConfidenceDirection
from confrag.gates.dragin import DraginGate
from confrag.gates.registry import PARTS, SIGNALS, Part, Signal, UnavailableSignalError, register_signal
from confrag.gates.simple import AlwaysGate, CBDRGate, NeverGate
from confrag.gates.skr import SKRKnnGate
from confrag.gates.uncertainty import EntropyGate, MaxProbGate, PerplexityGate, PTrueGate

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
    "PARTS",
    "Part",
    "SIGNALS",
    "Signal",
    "register_signal",
    "retrieval_helped",
]
