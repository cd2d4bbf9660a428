"""The probe recipe that trains: loss weighting instead of down-sampling, a logistic probe at scikit-learn's
optimum, question splits the user sets, and selection on the dev questions' candidate ranking."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from lightning import Trainer
from sklearn.linear_model import LogisticRegression
from torch.utils.data import DataLoader, TensorDataset

from confrag.probe.confidence_splits import check_splits, stratified_question_splits
from confrag.probe.module import ProbeModule, check_probe_settings, load_probe, save_probe
from confrag.probe.ranking import RankingSet, gold_rank, ranking_metrics
from confrag.retrieval.candidates import Candidates, make_candidates
from confrag.retrieval.corpus import CorpusPassage

from helpers.modules import probe_module


def _fit(probe: ProbeModule, x: np.ndarray, y: np.ndarray, epochs: int, batch_size: int | None = None) -> None:
    data = TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
    loader = DataLoader(data, batch_size=batch_size or len(y), shuffle=False)
    Trainer(
        max_epochs=epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    ).fit(probe, loader)


def _imbalanced(n: int = 300, d: int = 12, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d)).astype(np.float32) * rng.uniform(0.5, 3.0, size=d).astype(np.float32)
    logits = x @ rng.normal(size=d) * 0.4 - 1.5  # about one positive in five
    y = (rng.random(n) < 1 / (1 + np.exp(-logits))).astype(np.int64)
    return x, y


def test_logistic_probe_reaches_scikit_learns_optimum():
    """hidden_dims=[] + L-BFGS + l2 = 2 / (C n) is scikit-learn's standardized LogisticRegression(C): the same
    probabilities. (Adam for a few epochs with a checkpoint picked by dev AUROC, how the linear probe was trained
    before, stops far from this optimum: the gap to the reference's logistic probe.)"""
    torch.manual_seed(0)
    x, y = _imbalanced()
    mean, std = x.mean(0), x.std(0)
    c = 0.05
    reference = LogisticRegression(C=c, max_iter=10_000, tol=1e-10).fit((x - mean) / std, y)
    probe = probe_module(
        input_dim=x.shape[1], hidden_dims=[], dropout=0.0, lr=1.0, optimizer="lbfgs", l2=2 / (c * len(y))
    )
    probe.set_standardization(mean, std)
    _fit(probe, x, y, epochs=3)
    ours = probe.confidence(x)
    theirs = reference.predict_proba((x - mean) / std)[:, 1]
    assert np.abs(ours - theirs).max() < 2e-3


def test_balanced_class_weights_follow_scikit_learn():
    torch.manual_seed(0)
    x, y = _imbalanced(seed=1)
    mean, std = x.mean(0), x.std(0)
    c = 0.5
    reference = LogisticRegression(C=c, class_weight="balanced", max_iter=10_000, tol=1e-10).fit((x - mean) / std, y)
    probe = probe_module(
        input_dim=x.shape[1], hidden_dims=[], dropout=0.0, lr=1.0, optimizer="lbfgs", l2=2 / (c * len(y)),
        class_weight="balanced",
    )  # fmt: skip
    probe.set_standardization(mean, std)
    probe.set_class_weights(y)
    counts = np.bincount(y)
    assert np.allclose(probe.class_weights.numpy(), len(y) / (2 * counts))
    # scikit-learn sums weighted losses; our mean divides by n (not by the weights' sum): the same optimum
    # once l2 is scaled by the mean weight, which is 1 for balanced weights.
    _fit(probe, x, y, epochs=3)
    assert np.abs(probe.confidence(x) - reference.predict_proba((x - mean) / std)[:, 1]).max() < 2e-3
    # Weighting moves the mean prediction toward 0.5 where an unweighted probe follows the 20 % base rate.
    assert abs(probe.confidence(x).mean() - 0.5) < abs(y.mean() - 0.5)


def test_class_weights_need_both_classes_and_are_off_by_default():
    probe = probe_module(input_dim=4)
    probe.set_class_weights([0, 0, 1])
    assert probe.class_weights.tolist() == [1.0, 1.0]  # the paper's probe: unweighted
    weighted = probe_module(input_dim=4, class_weight="balanced")
    with pytest.raises(ValueError, match="both classes"):
        weighted.set_class_weights([0, 0, 0])


def test_saved_probe_keeps_its_recipe_and_weights(tmp_path):
    probe = probe_module(input_dim=6, hidden_dims=[], dropout=0.0, optimizer="lbfgs", l2=0.1, class_weight="balanced")
    probe.set_standardization(np.arange(6.0), np.full(6, 2.0))
    probe.set_class_weights([0, 0, 0, 1])
    save_probe(probe, tmp_path, {"llm": {}, "prompts": "p", "layer": 0, "key": "k"}, {})
    saved = load_probe(tmp_path)
    assert saved.meta["hparams"]["optimizer"] == "lbfgs" and saved.meta["hparams"]["class_weight"] == "balanced"
    assert torch.equal(torch.tensor(saved.meta["class_weights"]), probe.class_weights)
    x = np.random.default_rng(0).normal(size=(4, 6)).astype(np.float32)
    assert np.allclose(saved.confidence(x), probe.confidence(x))


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"lr": -1.0}, "lr must be > 0"),
        ({"dropout": 2.0}, r"dropout must be in \[0, 1\)"),
        ({"optimizer": "sgd"}, r"optimizer='sgd' is not one of \('adam', 'lbfgs'\)"),
        ({"class_weight": "auto"}, r"class_weight='auto' is not one of \(None, 'balanced'\)"),
        ({"l2": -0.1}, "l2 must be >= 0"),
    ],
)
def test_bad_probe_settings_are_named(settings, message):
    """The library names the parameter (the task's check names `model.<key>`: tests/test_input_checks.py)."""
    with pytest.raises(ValueError, match=f"^{message}"):
        check_probe_settings(**settings)
    with pytest.raises(ValueError, match=f"^{message}"):
        probe_module(input_dim=4, **settings)


def test_question_splits_set_the_share_of_training_questions():
    labels = np.array([0] * 900 + [1] * 100)
    paper = stratified_question_splits(labels, 0, {"train": 1000, "dev": 300, "test": 500})
    ours = stratified_question_splits(labels, 0, {"train": 1000, "dev": 150, "test": 150})
    assert paper.count("train") == 556 and ours.count("train") == 769
    for split in (paper, ours):  # stratified: each split keeps the closed-book positives' share
        assert sum(labels[i] for i, s in enumerate(split) if s == "train") == round(100 * split.count("train") / 1000)
    with pytest.raises(ValueError, match="data.question_splits"):
        check_splits({"train": 10, "dev": 0, "test": 1}, "data.question_splits")


def _candidates(qid: str, gold_positions: list[int], n: int = 4) -> Candidates:
    passages = [
        CorpusPassage(
            pid=f"{qid}-{j}", source_id="gold" if j in gold_positions else f"other{j}", title="t", text=f"p{j}"
        )
        for j in range(n)
    ]
    return make_candidates(qid, f"question {qid}", ["a"], passages, [float(n - j) for j in range(n)], "gold")


def test_ranking_metrics_by_hand():
    assert gold_rank(np.array([0.1, 0.9, 0.5]), [False, False, True]) == 2
    assert gold_rank(np.array([0.5, 0.5]), [False, True]) == 2  # ties keep the retrieval order
    assert gold_rank(np.array([0.5, 0.5]), [False, False]) is None
    found = ranking_metrics(
        [np.array([0.9, 0.1, 0.2]), np.array([0.1, 0.2, 0.9]), np.array([0.3, 0.2, 0.1])],
        [[True, False, False], [True, False, False], [False, False, False]],
    )
    assert found["questions"] == 2  # the third holds no gold candidate
    assert found["gold_first"] == 0.5 and found["gold_mrr"] == pytest.approx((1 + 1 / 3) / 2)
    assert found["chance_gold_first"] == pytest.approx(1 / 3)


def test_ranking_set_joins_parts_and_checks_its_states():
    a, b = _candidates("q1", [2]), _candidates("q2", [0], n=3)
    states_a, states_b = np.eye(4, 5, dtype=np.float32), np.ones((3, 5), dtype=np.float32)
    joined = RankingSet.of("test", [([a], states_a), ([b], states_b)])
    assert joined.bounds.tolist() == [0, 4, 7] and joined.states.shape == (7, 5)
    scores = np.array([0.1, 0.2, 0.9, 0.3, 0.8, 0.1, 0.2])
    assert joined.metrics(scores)["gold_first"] == 1.0
    with pytest.raises(ValueError, match="do not match"):
        RankingSet("dev", [a], states_b, np.array([0, 4]))


# --- the probe task with the ranking metric, on the tiny llama -------------------------------------------


@pytest.mark.task
def test_probe_task_selects_on_the_dev_ranking_and_reports_the_test_ranking(tmp_path):
    import json

    from confrag.train import run_task

    from helpers.runs import compose_cfg

    cfg = compose_cfg(
        [
            "+experiment=probe_tiny_llama",
            "logger=csv",
            "trainer.max_epochs=3",
            "data.ranking.top_n=4",
            "data.ranking.test_questions=6",
            "model.lr=1e-3",  # (the tiny random model answers nothing right: no class weights to compute)
            "optimized_metric=val/gold_mrr",
        ],
        tmp_path,
    )
    metrics = run_task(cfg)
    written = json.loads((tmp_path / "out" / "metrics.json").read_text())["metrics"]
    for key in ("val/gold_mrr", "val/gold_first", "test/gold_first", "test/gold_mrr", "best_epoch", "last_epoch"):
        assert key in written, key
    assert 0 < written["test/gold_mrr"] <= 1 and written["last_epoch"] == 2
    # The test ranking holds the probe's own test questions plus the 6 held-out ones (those with their own
    # paragraph among their 4 candidates).
    assert written["test/questions"] >= 6
    # What a sweeper sees: the best checkpoint's dev ranking, the same when recomputed from the chosen weights.
    assert metrics == pytest.approx(written["val/gold_mrr"])
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert "probe as reranker, dev: own paragraph first" in summary and "best dev checkpoint: epoch" in summary


@pytest.mark.task
def test_a_ranking_monitor_without_a_ranking_set_is_refused(tmp_path):
    from confrag.train import run_task

    from helpers.runs import compose_cfg

    cfg = compose_cfg(["+experiment=probe_tiny_llama", "logger=csv", "data.ranking.top_n=null"], tmp_path)
    with pytest.raises(ValueError, match="monitors 'val/gold_mrr'.*data.ranking.top_n is null"):
        run_task(cfg)
    cfg = compose_cfg(
        ["+experiment=probe_tiny_llama", "logger=csv", "model=probe_logistic", "trainer.max_epochs=1"], tmp_path
    )
    with pytest.raises(ValueError, match="model.optimizer=lbfgs takes whole-split batches: set data.batch_size=null"):
        run_task(cfg)


def test_a_whole_cached_probe_is_kept_not_rewritten(tmp_path, monkeypatch, caplog):
    """A run of the probe task over a complete, read-only cache used to warn that its probe "could not be
    kept": the probe under that key is already there and whole."""
    import stat

    import confrag.stages.probe as probe_stage
    from confrag.infra.digests import write_folder_digest

    written = []
    monkeypatch.setattr(probe_stage, "save_trained_probe", lambda *args: written.append(args[-1]))
    cached = tmp_path / "cache" / "probe"
    cached.mkdir(parents=True)
    (cached / "probe.json").write_text("{}")
    write_folder_digest(cached)
    cached.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        with caplog.at_level(logging.INFO, logger="confrag.stages.probe"):
            probe_stage.cache_trained_probe(None, None, {}, "", cached, tmp_path / "run" / "probe")
        assert written == [] and "already holds this probe" in caplog.text and "could not" not in caplog.text
        # A missing or damaged one is written.
        (tmp_path / "cache" / "other").mkdir()
        probe_stage.cache_trained_probe(None, None, {}, "", tmp_path / "cache" / "other", tmp_path / "run" / "probe")
        assert written == [tmp_path / "cache" / "other"]
    finally:
        cached.chmod(stat.S_IRWXU)


# --- the probe's layer, resolved once ----------------------------------------------------------------------------

# Every experiment whose LLM's layer count is readable offline (the GPU models' configs are not in this cache), with
# the layer its probe reads: Layer/2 of the tiny models' 4 and SmolLM2's 30 unless the experiment sets model.layer.
LAYER_OF = {
    "probe_tiny_llama": 2,
    "probe_tiny_qwen2": 2,
    "probe_smollm2": 15,
    "probe_smollm2_layers": 15,
    "probe_smollm2_qarag": 15,
    "probe_smollm2_candidates": 15,
    "cbdr_tiny_llama": 2,
    "reranker_smollm2": 15,
    "gates_tiny_llama": 2,
}


@pytest.mark.parametrize("experiment", sorted(LAYER_OF))
def test_the_model_and_the_data_module_get_the_layer_the_recipe_resolves_without_a_throwaway_model(
    experiment, tmp_path, monkeypatch
):
    import confrag.probe.module as module
    from confrag.recipes import probe_recipe

    from helpers.runs import compose_cfg

    built = []
    original = module.mlp

    def counted(*args, **kwargs):  # what every ProbeModule builds its network with
        built.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, "mlp", counted)
    cfg = compose_cfg([f"+experiment={experiment}"], tmp_path)
    node, where = (cfg, "") if cfg.task_name == "probe" else (cfg.probe, "probe.")
    recipe = probe_recipe(node, where=where)
    assert not built, "the recipe built a probe to check its settings"
    assert "layer" not in node.data  # the data node holds no copy of the model's key
    model, datamodule = recipe.make_model(input_dim=4), recipe.make_datamodule()
    assert recipe.layer == model.hparams.layer == datamodule.layer == LAYER_OF[experiment]
    assert type(datamodule.layer) is int and len(built) == 1


def test_a_layer_set_on_the_command_line_reaches_both(tmp_path):
    from confrag.recipes import probe_recipe

    from helpers.runs import compose_cfg

    recipe = probe_recipe(compose_cfg(["+experiment=probe_tiny_llama", "model.layer=3"], tmp_path))
    assert recipe.make_model(input_dim=4).hparams.layer == recipe.make_datamodule().layer == 3
    assert recipe.identity["model"]["layer"] == 3  # the probe cache key holds the setting as written
    mid = probe_recipe(compose_cfg(["+experiment=probe_tiny_llama"], tmp_path))
    assert mid.identity["model"]["layer"] == "mid" and mid.layer == 2
