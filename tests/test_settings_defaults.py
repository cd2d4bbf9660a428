"""Each default is written once (docs/architecture.md, "Settings pattern"): a settings dataclass has no default
for a key its shipped YAML node provides, so the two cannot drift apart (as `EvalSettings.base_reranker` once
named a Table 2 row that no longer existed while `conf/eval/default.yaml` named the real one); a nested options
node the YAML leaves `{}` (`rag.generation`) keeps its defaults in its dataclass, and the YAML repeats none.
Every experiment's composed nodes build their dataclasses: no key missing, none unknown."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from confrag.instantiators import settings_from
from confrag.llm.generation import GreedyOptions
from confrag.rag.settings import AnswerSettings, EvalSettings
from confrag.reports.hub import HubSettings
from confrag.stages.base_reranker import BaseRerankerSettings
from confrag.stages.nq_rerank import PreferenceSettings
from confrag.stages.retrieval import RetrievalSettings

from helpers.runs import EXPERIMENTS, ROOT, compose_cfg

# config key -> (its settings dataclass, the shipped YAML node it is composed from)
SETTINGS = {
    "rag": (AnswerSettings, "rag/default.yaml"),
    "eval": (EvalSettings, "eval/default.yaml"),
    "preferences": (PreferenceSettings, "preferences/default.yaml"),
    "base_reranker": (BaseRerankerSettings, "base_reranker/default.yaml"),
    "retrieval": (RetrievalSettings, "retrieval/nq.yaml"),
    "hub": (HubSettings, "hub/default.yaml"),
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
