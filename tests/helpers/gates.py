"""Building gates in tests the way a run does: from their shipped configs (`conf/gate/<name>.yaml`)
through `gate_from_config`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from confrag.gates import Gate
from confrag.gates.settings import gate_from_config

ROOT = Path(__file__).resolve().parents[2]
SHIPPED_GATES = sorted(p.stem for p in (ROOT / "conf" / "gate").glob("*.yaml"))


def shipped_config(name: str) -> dict[str, Any]:
    """conf/gate/<name>.yaml resolved as in a run: its interpolations (cbdr's `beta: ${cbdr.beta}`) read the
    shipped `cbdr` node."""
    root = OmegaConf.create(
        {
            "cbdr": OmegaConf.load(ROOT / "conf" / "cbdr" / "default.yaml"),
            "gate": OmegaConf.load(ROOT / "conf" / "gate" / f"{name}.yaml"),
        }
    )
    return OmegaConf.to_container(root.gate, resolve=True)


def make_gate(name: str, **overrides: Any) -> Gate:
    """The shipped gate `name` with `overrides`, built as `gates.configs.<name>` is in a run. An option group given
    in part (`fusion={"heads": 2}`) keeps the shipped values of its other keys."""
    config = shipped_config(name)
    groups = {
        k: {**config[k], **v} for k, v in overrides.items() if isinstance(v, dict) and isinstance(config.get(k), dict)
    }
    return gate_from_config(name, config, **{**overrides, **groups})
