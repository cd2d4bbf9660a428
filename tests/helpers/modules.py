"""The classes YAML instantiates, built in tests from their shipped nodes (the one place their defaults are written:
docs/architecture.md, "Settings pattern") through `confrag.instantiators.shipped`, with a test's own values on top.
What a node takes from the rest of a run's config is given here: the seed the tests have always used (0) and the
reranker's lengths from the shipped `data` node, as a run's `${data.query_max_len}` reads them."""

from __future__ import annotations

from typing import Any

from omegaconf import OmegaConf

from confrag.infra.paths import config_dir, default_cache_dir
from confrag.instantiators import shipped
from confrag.llm.loading import model_num_layers
from confrag.probe.datamodule import probe_layer
from confrag.reranker.data import PreferenceDataModule
from confrag.reranker.module import RerankerModule

SEED = 0


def preference_data(**values: Any):
    """A PreferenceDataModule over the batching of conf/data/preference_pairs.yaml (its keys in `values` go to the
    batching, `train`, `val`, `test`, `tokenizer` and `kind` to the module)."""
    module = {k: values.pop(k) for k in ("train", "val", "test", "tokenizer", "kind") if k in values}
    return PreferenceDataModule(shipped("data/preference_pairs.yaml", **{"seed": SEED, **values}), **module)


def reranker_module(**values: Any):
    """A RerankerModule of the settings of conf/model/reranker_minilm.yaml (the embedded MiniLM unless `backbone`
    says otherwise), the lengths of the shipped `data` node as a run's `${data.query_max_len}` reads them."""
    data = OmegaConf.load(config_dir() / "data" / "preference_pairs.yaml")
    lengths = {"query_max_len": data.query_max_len, "passage_max_len": data.passage_max_len}
    return RerankerModule(shipped("model/reranker_minilm.yaml", **{"seed": SEED, **lengths, **values}))


def probe_module(**values: Any):
    """A ProbeModule from conf/model/probe.yaml (`input_dim` in `values`). Its `layer: mid` is resolved against an
    LLM by the probe stage; a probe built here has no LLM, so it is tied to no layer unless `values` names one."""
    return shipped("model/probe.yaml", **{"layer": None, **values})


def confidence_data(**values: Any):
    """An NQConfidenceDataModule from conf/data/nq_confidence.yaml (`llm`, `prompts`, `questions_path` in
    `values`), with what a run gives it: the probe's layer resolved from the model node's (`mid`: Layer/2 of `llm`,
    as `recipes.probe_recipe` resolves it), the NQ dataset's questions format, the default cache folder. An option
    group in `values` (`splits={"balance": False}`) is merged into the shipped one."""
    spec = values.pop("layer", OmegaConf.load(config_dir() / "model" / "probe.yaml").layer)
    layer = spec if isinstance(spec, int) else probe_layer(spec, model_num_layers(values["llm"]))
    questions_format = OmegaConf.load(config_dir() / "dataset" / "nq.yaml").questions_format
    borrowed = {
        "seed": SEED,
        "layer": layer,
        "questions_format": questions_format,
        "cache_dir": str(default_cache_dir()),
    }
    node = OmegaConf.to_container(OmegaConf.load(config_dir() / "data" / "nq_confidence.yaml"))
    # An option group given in part (`answers={"max_new_tokens": 2}`) keeps the shipped values of its other keys.
    groups = {k: {**node[k], **v} for k, v in values.items() if isinstance(v, dict) and isinstance(node.get(k), dict)}
    return shipped("data/nq_confidence.yaml", **{**borrowed, **values, **groups})
