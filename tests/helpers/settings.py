"""Settings dataclasses in tests, built the way a run builds them: from the shipped YAML node (the one place
their defaults are written: docs/architecture.md, "Settings pattern") with a test's own values on top."""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path
from typing import Any, TypeVar

from omegaconf import OmegaConf

from confrag.instantiators import settings_from

from helpers.runs import compose_cfg

T = TypeVar("T")

# The config groups whose shipped node each settings dataclass reads, composed onto the root config.
SHIPPED_NODES = [
    "+rag=default",
    "+eval=default",
    "+preferences=default",
    "+alignment=default",
    "+base_reranker=default",
    "+retrieval=nq",
]


@functools.cache
def shipped_nodes() -> dict[str, Any]:
    """The root config with every settings group's shipped node, resolved (plain values)."""
    with tempfile.TemporaryDirectory() as folder:
        return OmegaConf.to_container(compose_cfg(SHIPPED_NODES, Path(folder)), resolve=True)


def shipped_settings(cls: type[T], key: str, **values: Any) -> T:
    """`cls` from the shipped node `key` (rag, eval, preferences, base_reranker, retrieval, hub) with `values`."""
    return settings_from(cls, {**shipped_nodes()[key], **values}, key)


@functools.cache
def shipped_data_node() -> dict[str, Any]:
    """The probe data node as shipped (conf/data/nq_confidence.yaml), its interpolations left unresolved."""
    return OmegaConf.to_container(OmegaConf.load(Path(__file__).parents[2] / "conf/data/nq_confidence.yaml"))


def data_settings(train_states: str = "qa", truncate_passages: bool = False, **groups: dict[str, Any]):
    """`ConfidenceDataSettings` from the shipped probe data node's option groups with a test's own values on top:
    `data_settings("qa+rag", extraction={"layers": [0, 2], "batch_size": 4}, answers={"max_new_tokens": 3})`."""
    from confrag.probe.data_options import AnswerOptions, ExtractionOptions, SplitOptions
    from confrag.probe.nq_confidence import ConfidenceDataSettings

    classes = {"splits": SplitOptions, "extraction": ExtractionOptions, "answers": AnswerOptions}
    unknown = sorted(set(groups) - set(classes))
    assert not unknown, f"groups of ConfidenceDataSettings: {sorted(classes)}; got {unknown}"
    node = shipped_data_node()
    built = {name: cls.of({**node[name], **groups.get(name, {})}, name) for name, cls in classes.items()}
    return ConfidenceDataSettings(train_states=train_states, truncate_passages=truncate_passages, **built)
