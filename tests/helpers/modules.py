"""The classes YAML instantiates, built in tests from their shipped nodes (the one place their defaults are written:
docs/architecture.md, "Settings pattern") through `confrag.instantiators.shipped`, with a test's own values on top.
What a node takes from the rest of a run's config is given here: the seed the tests have always used (0) and the
reranker's lengths from the shipped `data` node, as a run's `${data.query_max_len}` reads them."""

from __future__ import annotations

from typing import Any

from omegaconf import OmegaConf

from confrag.infra.paths import config_dir
from confrag.instantiators import shipped

SEED = 0


def preference_data(**values: Any):
    """A PreferenceDataModule from conf/data/preference_pairs.yaml (`train`, `tokenizer`, `kind`, ... in `values`)."""
    return shipped("data/preference_pairs.yaml", **{"seed": SEED, **values})


def reranker_module(**values: Any):
    """A RerankerModule from conf/model/reranker_minilm.yaml (the embedded MiniLM unless `backbone` says otherwise)."""
    data = OmegaConf.load(config_dir() / "data" / "preference_pairs.yaml")
    lengths = {"query_max_len": data.query_max_len, "passage_max_len": data.passage_max_len}
    return shipped("model/reranker_minilm.yaml", **{"seed": SEED, **lengths, **values})
