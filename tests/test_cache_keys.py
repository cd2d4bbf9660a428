"""Cache keys pinned: the identities a run's probe and rerankers are keyed by, as the shipped experiments compose
them, hold the values they had before the reranker's settings became an object and the probe's layer was resolved
in the recipe, so that every probe and reranker trained before is found again (a change here is a new cache)."""

from __future__ import annotations

import pytest

from confrag.infra.digests import fingerprint
from confrag.recipes import probe_recipe, reranker_recipe
from confrag.stages.base_reranker import BASE_MODEL_SETTINGS

from helpers.runs import compose_cfg

# experiment -> (the probe's identity, the aligned rerankers' identity), each as its fingerprint.
PINNED = {
    "cbdr_smollm2": ("6dd6b086bd69e30f", "e833aa48543f33db"),
    "reranker_smollm2": ("6dd6b086bd69e30f", "62c6a88710dd1a5b"),
    "cbdr_tiny_llama": ("40ca3e3c7053d187", "15e8f58310b58786"),
}


@pytest.mark.parametrize("experiment", sorted(PINNED))
def test_the_probe_and_reranker_identities_are_those_of_before(experiment, tmp_path):
    cfg = compose_cfg([f"+experiment={experiment}"], tmp_path)
    probe, reranker = PINNED[experiment]
    assert fingerprint(probe_recipe(cfg.probe, where="probe.").identity) == probe
    recipe = reranker_recipe(cfg)
    assert fingerprint(recipe.identity) == reranker
    # The base reranker fixes the alignment-only settings, which the shipped node already holds as the base does.
    assert fingerprint(recipe.with_model_settings(**BASE_MODEL_SETTINGS).identity) == reranker


def test_a_model_override_changes_the_reranker_key_as_before(tmp_path):
    recipe = reranker_recipe(compose_cfg(["+experiment=cbdr_tiny_llama", "model.tau=0.1"], tmp_path))
    assert fingerprint(recipe.identity) == "8304364366741410"
    assert recipe.identity["model"]["_target_"] == "confrag.reranker.module.RerankerModule"
