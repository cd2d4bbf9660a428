"""Settings dataclasses in tests, built the way a run builds them: from the shipped YAML node (the one place
their defaults are written: docs/architecture.md, "Settings pattern") with a test's own values on top."""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path
from typing import Any, TypeVar

from omegaconf import OmegaConf

from confrag.instantiators import renamed_keys, settings_from

from helpers.runs import compose_cfg

T = TypeVar("T")

# The config groups whose shipped node each settings dataclass reads, composed onto the root config.
SHIPPED_NODES = ["+rag=default", "+eval=default", "+preferences=default", "+base_reranker=default", "+retrieval=nq"]


@functools.cache
def shipped_nodes() -> dict[str, Any]:
    """The root config with every settings group's shipped node, resolved (plain values), its renamed keys' old
    names removed as a run removes them (`renamed_keys`)."""
    with tempfile.TemporaryDirectory() as folder:
        return OmegaConf.to_container(renamed_keys(compose_cfg(SHIPPED_NODES, Path(folder))), resolve=True)


def shipped_settings(cls: type[T], key: str, **values: Any) -> T:
    """`cls` from the shipped node `key` (rag, eval, preferences, base_reranker, retrieval, hub) with `values`."""
    return settings_from(cls, {**shipped_nodes()[key], **values}, key)
