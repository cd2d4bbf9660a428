"""Each default is written once (docs/architecture.md, "Settings pattern"): a settings dataclass has no default
for a key its shipped YAML node provides, so the two cannot drift apart (as `EvalSettings.base_reranker` once
named a Table 2 row that no longer existed while `conf/eval/default.yaml` named the real one); a nested options
node the YAML leaves `{}` (`rag.generation`) keeps its defaults in its dataclass, and the YAML repeats none.
Every experiment's composed nodes build their dataclasses: no key missing, none unknown.

The same holds for the project's classes that YAML instantiates (every `_target_` node, shipped or composed by an
experiment): no default in the signature for a key the node holds (`PreferenceDataModule` had eval_batch_size=16
beside the YAML's 32), and no key the signature does not take. Third-party targets (Lightning's Trainer, loggers
and callbacks, Optuna's sampler, Hydra's sweeper) are not ours to change: the YAML sets what the project chooses
for them, their own defaults stay theirs."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path
from typing import Any

import pytest
from hydra.utils import get_class
from omegaconf import OmegaConf

from confrag import instantiators
from confrag.gates.settings import GatesNode
from confrag.instantiators import settings_from
from confrag.llm.config import LLMConfig
from confrag.llm.generation import GreedyOptions
from confrag.llm.prompts import PromptTemplates
from confrag.probe.data_options import AnswerOptions, CandidateOptions, ExtractionOptions, RankingOptions, SplitOptions
from confrag.rag.settings import AnswerSettings, EvalSettings
from confrag.reports.hub import HubSettings
from confrag.stages.alignment import AlignmentSettings
from confrag.stages.base_reranker import BaseRerankerSettings
from confrag.stages.nq_rerank import PreferenceSettings
from confrag.stages.retrieval import RetrievalSettings

from helpers.runs import EXPERIMENTS, ROOT, compose_cfg

# config key -> (its settings dataclass, the shipped YAML node it is composed from)
SETTINGS = {
    "rag": (AnswerSettings, "rag/default.yaml"),
    "eval": (EvalSettings, "eval/default.yaml"),
    "preferences": (PreferenceSettings, "preferences/default.yaml"),
    "alignment": (AlignmentSettings, "alignment/default.yaml"),
    "base_reranker": (BaseRerankerSettings, "base_reranker/default.yaml"),
    "retrieval": (RetrievalSettings, "retrieval/nq.yaml"),
    "hub": (HubSettings, "hub/default.yaml"),
    "prompts": (PromptTemplates, "prompts/paper.yaml"),
}
# Nested options nodes whose defaults live in their dataclass: (config key, its YAML file, the key inside it).
OPTIONS = {"rag.generation": (GreedyOptions, "rag/default.yaml", "generation")}


def defaults_of(cls: type) -> dict[str, object]:
    found = {}
    for field in dataclasses.fields(cls):
        if field.default is not dataclasses.MISSING:
            found[field.name] = field.default
        elif field.default_factory is not dataclasses.MISSING:
            found[field.name] = field.default_factory()
    return found


def shipped(path: str) -> dict[str, object]:
    return OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / path), resolve=False)


@pytest.mark.parametrize("key", sorted(SETTINGS))
def test_a_settings_default_is_written_once(key):
    cls, path = SETTINGS[key]
    node, defaults = shipped(path), defaults_of(cls)
    twice = {name: (defaults[name], node[name]) for name in sorted(set(defaults) & set(node))}
    drifted = {name: pair for name, pair in twice.items() if pair[0] != pair[1]}
    assert not twice, (
        f"{cls.__name__} and conf/{path} both write a default for {sorted(twice)} (dataclass, YAML); drifted "
        f"already: {drifted}. Keep it in the YAML and drop the dataclass default."
    )
    # and the YAML provides every field the dataclass leaves without a default
    assert set(f.name for f in dataclasses.fields(cls)) - set(defaults) <= set(node)


@pytest.mark.parametrize("path", sorted(p.name for p in (ROOT / "conf" / "llm").glob("*.yaml")))
def test_an_llm_node_repeats_no_default_of_llmconfig(path):
    """Seven nodes, one dataclass: what every node sets (dtype, device, attention) has no default in LLMConfig; what
    a source does not use has its "unused" there (None, {}, seed 0), and a node writes it only to set another value
    (22 values were written in both places)."""
    node, defaults = shipped(f"llm/{path}"), defaults_of(LLMConfig)
    repeated = {k: v for k, v in node.items() if k in defaults and v == defaults[k]}
    assert not repeated, f"conf/llm/{path} repeats LLMConfig's defaults {repeated}: drop them from the node"
    assert {f.name for f in dataclasses.fields(LLMConfig)} - set(defaults) <= set(node)
    assert set(node) <= {f.name for f in dataclasses.fields(LLMConfig)}


@pytest.mark.parametrize("key", sorted(OPTIONS))
def test_an_options_node_repeats_no_dataclass_default(key):
    cls, path, inner = OPTIONS[key]
    node = shipped(path)[inner] or {}
    assert not set(node) & set(defaults_of(cls)), f"conf/{path} repeats {sorted(node)} of {cls.__name__}'s defaults"


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_experiment_builds_its_settings(name, tmp_path: Path):
    cfg = compose_cfg([f"+experiment={name}"], tmp_path)
    built = [key for key in SETTINGS if cfg.get(key) is not None]
    assert "hub" in built
    for key in built:
        settings_from(SETTINGS[key][0], cfg[key], key)  # no key missing, none unknown, every value valid
    settings_from(LLMConfig, cfg.llm, "llm")
    if cfg.get("gates") is not None:  # composed from its defaults list: conf/gates/default.yaml and conf/gate/
        assert not defaults_of(GatesNode)
        settings_from(GatesNode, cfg.gates, "gates")


def test_a_missing_key_is_named():
    with pytest.raises(ValueError, match=r"hub: missing key\(s\) \['dataset_repo', 'private'"):
        settings_from(HubSettings, {"push": False}, "hub")


def test_the_utility_rule_answers_with_the_rag_node_itself(tmp_path: Path):
    """NQ_Rerank's answers under each candidate are Table 2's Top-1 answers only if both read the same settings:
    the rerank recipe builds them from `rag`, and `preferences` holds no copy that could drift."""
    from confrag.recipes import evaluation_recipe

    cfg = compose_cfg(["+experiment=cbdr_tiny_llama", "rag.max_new_tokens=7", "rag.chunk_size=5"], tmp_path)
    recipe, answers, _ = evaluation_recipe(cfg)
    assert recipe.answers is answers and (answers.max_new_tokens, answers.chunk_size) == (7, 5)
    assert not {"max_new_tokens", "answer_batch_size", "answer_chunk_size"} & set(cfg.preferences)


def test_a_moved_key_names_where_it_went(tmp_path: Path):
    cfg = compose_cfg(["+experiment=cbdr_tiny_llama", "+preferences.max_new_tokens=8"], tmp_path)
    with pytest.raises(
        ValueError, match=r"unknown key\(s\) \['max_new_tokens'\].*preferences\.max_new_tokens is now rag"
    ):
        settings_from(PreferenceSettings, cfg.preferences, "preferences")


# --- the option groups of the probe data node -------------------------------------------------------------------

# (shipped YAML, group key) -> the dataclass the data module builds from that group (confrag.probe.data_options).
GROUPS = {
    ("data/nq_confidence.yaml", "splits"): SplitOptions,
    ("data/nq_confidence.yaml", "extraction"): ExtractionOptions,
    ("data/nq_confidence.yaml", "answers"): AnswerOptions,
    ("data/nq_confidence.yaml", "candidates"): CandidateOptions,
    ("data/nq_confidence.yaml", "ranking"): RankingOptions,
}


def test_the_groups_cover_every_mapping_of_the_data_node():
    node = shipped("data/nq_confidence.yaml")
    mappings = {k for k, v in node.items() if isinstance(v, dict)}
    assert mappings == {group for _, group in GROUPS}


@pytest.mark.parametrize(("path", "group"), sorted(GROUPS))
def test_an_option_group_default_is_written_once(path, group):
    cls, node = GROUPS[path, group], shipped(path)[group]
    assert not defaults_of(cls), f"{cls.__name__} writes defaults the YAML holds: {defaults_of(cls)}"
    assert {f.name for f in dataclasses.fields(cls)} == set(node), f"conf/{path} {group}: {sorted(node)}"


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_experiment_builds_its_data_option_groups(name, tmp_path: Path):
    cfg = compose_cfg([f"+experiment={name}"], tmp_path)
    for where in ("data", "probe.data"):
        node = OmegaConf.select(cfg, where)
        if node is None or not str(node.get("_target_", "")).endswith("NQConfidenceDataModule"):
            continue
        for (_, group), cls in GROUPS.items():
            cls.of(OmegaConf.to_container(node[group], resolve=True), f"{where}.{group}")


# --- the classes YAML instantiates ------------------------------------------------------------------------------

HYDRA_KEYS = {"_target_", "_partial_", "_convert_", "_recursive_", "_args_"}


def target_nodes(node: Any, where: str = "") -> list[tuple[str, dict]]:
    """Every node holding a `_target_` inside a plain config tree, by its dotted key."""
    found = []
    if isinstance(node, dict):
        if isinstance(node.get("_target_"), str):
            found.append((where or "<root>", node))
        for key, value in node.items():
            found.extend(target_nodes(value, f"{where}.{key}" if where else str(key)))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            found.extend(target_nodes(value, f"{where}[{i}]"))
    return found


def ours(node: dict) -> bool:
    return node["_target_"].startswith("confrag.")


def written_twice(cls: type, node: dict) -> tuple[dict[str, tuple[object, object]], list[str]]:
    """(keys the node holds that `cls`'s signature also gives a default: {key: (signature's, YAML's)}, keys the
    node holds that the signature does not take)."""
    parameters = inspect.signature(cls).parameters
    keys = set(node) - HYDRA_KEYS
    twice = {k: (parameters[k].default, node[k]) for k in sorted(keys & set(parameters))}
    twice = {k: pair for k, pair in twice.items() if pair[0] is not inspect.Parameter.empty}
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    return twice, [] if takes_any else sorted(keys - set(parameters))


def check_written_once(node: dict, where: str, cls: type | None = None) -> None:
    twice, unknown = written_twice(cls or get_class(node["_target_"]), node)
    assert not twice, (
        f"{where}: {node['_target_']} and its YAML both write a default for {sorted(twice)} (signature, YAML): "
        f"{twice}. Keep it in the YAML and drop the signature's default (callers outside a run: "
        "confrag.instantiators.shipped)."
    )
    assert not unknown, f"{where}: {node['_target_']} takes no {unknown}"


SHIPPED_TARGETS = {
    f"{path.relative_to(ROOT / 'conf')}:{key}": node
    for path in sorted((ROOT / "conf").rglob("*.yaml"))
    for key, node in target_nodes(OmegaConf.to_container(OmegaConf.load(path), resolve=False))
}


def test_the_walk_finds_every_class_the_project_instantiates():
    found = {node["_target_"] for node in SHIPPED_TARGETS.values() if ours(node)}
    assert {
        "confrag.gates.ccsk.CCSKGate",
        "confrag.reranker.settings.PairBatching",
        "confrag.reranker.settings.RerankerSettings",
        "confrag.probe.module.ProbeModule",
        "confrag.probe.datamodule.NQConfidenceDataModule",
        "confrag.infra.sweep_callback.SweepSummary",
    } <= found
    assert len(found) >= 17  # 12 gates, the probe's 2 modules, the reranker's 2 settings, the sweep callback


@pytest.mark.parametrize("where", sorted(k for k, node in SHIPPED_TARGETS.items() if ours(node)))
def test_a_target_class_takes_no_default_for_a_key_its_yaml_holds(where):
    check_written_once(SHIPPED_TARGETS[where], f"conf/{where}")


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_composed_target_node_is_written_once(name, tmp_path: Path):
    """As an experiment composes them: the model / data nodes that extend another (reranker_bge_m3 over
    reranker_minilm), the probe's nodes under a later task's `probe`, each gate under `gates.configs`."""
    cfg = OmegaConf.to_container(compose_cfg([f"+experiment={name}"], tmp_path), resolve=False)
    nodes = [(where, node) for where, node in target_nodes(cfg) if ours(node)]
    assert any(where in ("model", "probe.model") for where, _ in nodes)
    for where, node in nodes:
        check_written_once(node, f"+experiment={name}: {where}")


def test_the_check_catches_a_default_written_twice():
    class Module:
        def __init__(self, lr: float, seed: int, eval_batch_size: int = 16) -> None: ...

    node = {"_target_": "tests.Module", "lr": 0.1, "seed": 0, "eval_batch_size": 32, "extra": 1}
    assert written_twice(Module, node) == ({"eval_batch_size": (16, 32)}, ["extra"])
    with pytest.raises(AssertionError, match=r"both write a default for \['eval_batch_size'\]"):
        check_written_once({k: v for k, v in node.items() if k != "extra"}, "a test node", Module)
    with pytest.raises(AssertionError, match=r"takes no \['extra'\]"):
        check_written_once(
            {**node, "eval_batch_size": None},
            "a test node",
            type("Open", (), {"__init__": lambda self, lr, seed, eval_batch_size: None}),
        )


def test_shipped_builds_a_node_with_the_callers_values_on_top():
    yaml = {k: v for k, v in SHIPPED_TARGETS["gate/ccsk.yaml:<root>"].items() if k != "_target_"}
    assert instantiators.shipped("gate/ccsk.yaml", k=3).config == {**yaml, "k": 3}
    with pytest.raises(ValueError, match=r"conf/gate/cbdr.yaml takes beta: \$\{cbdr.beta\} from a run's config"):
        instantiators.shipped("gate/cbdr.yaml")
    with pytest.raises(ValueError, match=r"conf/model/probe_logistic.yaml extends another node"):
        instantiators.shipped("model/probe_logistic.yaml", input_dim=4)
    # The class's own error comes through unwrapped.
    with pytest.raises(ValueError, match="^group_size must be an integer >= 2"):
        instantiators.shipped("data/preference_pairs.yaml", seed=0, group_size=1)
