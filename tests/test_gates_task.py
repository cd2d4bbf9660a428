"""Task `gates` on the tiny llama end to end (every gate on clean and conflicting contexts, the bounds,
training on the training split only, the curves and the report), its settings errors, and its pieces
(conflicting contexts, outcome scoring, the wall-time model) on hand-made inputs."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest

from confrag.data.conflicts import ConflictExample
from confrag.data.nq import Passage
from confrag.gates import Decision, MissingTrainingDataError
from confrag.gates.evaluation import quantile_grid, score_decisions, wall_time_per_question
from confrag.gates.settings import gate_from_config
from confrag.retrieval.candidates import make_candidates
from confrag.retrieval.corpus import CorpusPassage
from confrag.stages.gate_questions import CONDITIONS, conflicting_candidates
from confrag.tasks import gates as gates_task
from confrag.train import run_task

from helpers.gates import SHIPPED_GATES
from helpers.runs import check_gates_outputs, compose_cfg
from helpers.wandb_records import artifacts_named


def check_settings(cfg):
    """The task's gate settings (every setting of the run checked on the way)."""
    return gates_task.check(cfg).gates


TINY = ["+experiment=gates_tiny_llama", "trainer.fast_dev_run=true", "logger=csv"]
R, P, X = Decision.RETRIEVE, Decision.PARAMETRIC, Decision.REFUSE
UNCERTAINTY = ["entropy", "max_prob", "perplexity", "p_true"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny gates run, logged to W&B offline (its artifacts are checked below)."""
    root = tmp_path_factory.mktemp("gates")
    cfg = compose_cfg([*TINY[:-1], "logger=wandb"], root)
    with pytest.MonkeyPatch.context() as env:
        for key in ("WANDB_DATA_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_ARTIFACT_DIR"):
            env.setenv(key, str(root / "wandb_home"))
        env.setenv("WANDB_MODE", "offline")
        env.setenv("WANDB_SILENT", "true")
        run_task(cfg)
    out = root / "out"
    return SimpleNamespace(cfg=cfg, out=out, record=json.loads((out / "metrics.json").read_text()), root=root)


@pytest.mark.slow  # make test-all: kept out of make test's 15 minutes
@pytest.mark.task
def test_the_run_links_the_reranker_behind_its_table_and_the_probe_in_wandb(tiny):
    """No artifact was logged: the reranker that ordered the clean contexts (`gates.reranker`) was not linked."""
    names = {"reranker-tiny_llama", "probe-tiny_llama"}  # beside the W&B tables, also logged as artifacts
    found = artifacts_named(tiny.out, names)
    assert {name: kind for name, (kind, _) in found.items()} == {name: "model" for name in names}
    assert "model.safetensors" in found["reranker-tiny_llama"][1]
    assert (tiny.out / "reranker" / "config.json").is_file()


def rows_by(record, condition: str) -> dict[str, dict]:
    return {r["gate"]: r for r in record["table"] if r["contexts"] == condition}


# --- end to end ----------------------------------------------------------------------------------


@pytest.mark.task
def test_every_configured_gate_on_clean_and_conflicting_contexts(tiny):
    check_gates_outputs(tiny.out, list(tiny.cfg.gates.names))
    assert sorted(tiny.cfg.gates.names) == SHIPPED_GATES  # the tiny run covers every shipped gate
    n = len(tiny.record["questions"]["test"])
    for condition in CONDITIONS:
        assert all(r["n"] == n for r in rows_by(tiny.record, condition).values())
        assert all(len(d) == n for d in tiny.record["decisions"][condition].values())


@pytest.mark.task
def test_bounds_refusals_and_costs(tiny):
    for condition in CONDITIONS:
        rows = rows_by(tiny.record, condition)
        assert rows["always"]["retrieval_rate"] == 1.0 and rows["never"]["retrieval_rate"] == 0.0
        assert all(r["refusal_rate"] == 0.0 for gate, r in rows.items() if gate != "bridge")
        assert rows["always"]["llm_passes"] == 1.0 and rows["never"]["llm_passes"] == 1.0
        # Retrieving costs retrieval + a RAG answer; answering closed-book costs one generation.
        timings = tiny.record["timings"]
        assert rows["never"]["wall_s"] == pytest.approx(timings["closed_book"], rel=0.05, abs=1e-3)
        assert rows["always"]["wall_s"] == pytest.approx(
            timings["retrieve"] + timings["rag_answer"], rel=0.05, abs=1e-3
        )
        for r in rows.values():
            answered = 1 - r["refusal_rate"]
            if answered:  # accuracy on answered = correct / answered questions
                assert r["answered_accuracy"] * answered == pytest.approx(r["accuracy"])


@pytest.mark.task
def test_every_gate_is_scored_against_retrieval_helped_and_always_retrieve(tiny):
    report = (tiny.out / "gates.md").read_text()
    assert "| AUROC | PRR | LLM passes / q | Retriever calls / q | Wall s / q | McNemar vs always" in report
    for condition in CONDITIONS:
        rows = rows_by(tiny.record, condition)
        helped = {r["helped"] for r in rows.values()}
        assert len(helped) == 1  # the same labels for every gate
        for gate, r in rows.items():
            assert (math.isnan(r["auroc"]) and math.isnan(r["prr"])) == (helped in ({0}, {r["n"]}))
            assert math.isnan(r["auroc"]) or 0 <= r["auroc"] <= 1
            assert r["only_gate"] + r["only_always"] <= r["n"] and 0 < r["mcnemar_p"] <= 1
            metrics = tiny.record["metrics"]
            assert metrics[f"{condition}/{gate}/retriever_calls"] == r["retriever_calls"]
        # Always-retrieve is its own McNemar pair and a constant score: chance by construction.
        assert rows["always"]["only_gate"] == rows["always"]["only_always"] == 0
        assert rows["always"]["mcnemar_p"] == 1.0
        assert rows["always"]["retriever_calls"] == 1.0 and rows["never"]["retriever_calls"] == 0.0
        assert rows["bridge"]["retriever_calls"] == 1.0  # it retrieves before deciding
        for gate in (*UNCERTAINTY, "cbdr", "dragin", "skr_knn", "ctrla"):
            assert rows[gate]["retriever_calls"] == pytest.approx(rows[gate]["retrieval_rate"])
        for gate in UNCERTAINTY[:3]:  # the draft is the closed-book answer
            assert rows[gate]["llm_passes"] == pytest.approx(1 + rows[gate]["retrieval_rate"])
        assert rows["p_true"]["llm_passes"] == pytest.approx(2 + rows["p_true"]["retrieval_rate"])


@pytest.mark.task
def test_conflicting_contexts_do_not_help_always_retrieve(tiny):
    clean, conflicting = rows_by(tiny.record, "clean"), rows_by(tiny.record, "conflicting")
    assert conflicting["always"]["accuracy"] <= clean["always"]["accuracy"]
    # Gates that decide before retrieving decide the same way whatever the contexts hold.
    for gate in ("never", "cbdr", "dragin", "ctrla", "skr_knn", "ccsk", *UNCERTAINTY):
        assert tiny.record["decisions"]["clean"][gate] == tiny.record["decisions"]["conflicting"][gate]


@pytest.mark.task
def test_gates_are_fitted_on_the_training_split_only(tiny):
    train, test = set(tiny.record["questions"]["train"]), set(tiny.record["questions"]["test"])
    assert train and test and not train & test
    fits = tiny.record["fits"]
    for gate in ("ctrla", "skr_knn", "ccsk", "bridge"):  # the gates that learn
        assert fits[gate]["split"] == "train" and set(fits[gate]["qids"]) == train
    for gate in ("always", "never", "cbdr", "dragin", *UNCERTAINTY):
        assert fits[gate]["qids"] == []


@pytest.mark.task
def test_threshold_curves_span_both_conditions(tiny):
    curves = tiny.record["curves"]
    for gate in ("cbdr", "dragin", "ctrla", "skr_knn", *UNCERTAINTY):
        for condition in CONDITIONS:
            points = [c for c in curves if c["gate"] == gate and c["contexts"] == condition]
            # One point per distinct threshold: a score that takes one value (skr_knn's vote when retrieval
            # never helped a training question) gives a one-point curve.
            assert 1 <= len(points) <= tiny.cfg.gates.curve_points
            assert all(0 <= c["retrieval_rate"] <= 1 and 0 <= c["accuracy"] <= 1 for c in points)
    cbdr = sorted((c["value"], c["retrieval_rate"]) for c in curves if c["gate"] == "cbdr" and c["contexts"] == "clean")
    rates = [rate for _, rate in cbdr]
    assert rates == sorted(rates) and rates[-1] > rates[0]  # a higher β retrieves more


# --- settings --------------------------------------------------------------------------------------


def test_unknown_gate_name_lists_the_available_ones(tmp_path):
    cfg = compose_cfg([*TINY, "gates.names=[always,flare]"], tmp_path)
    with pytest.raises(
        ValueError,
        match=r"unknown gate 'flare'.*always, bridge, cbdr, ccsk, ctrla, dragin, entropy, max_prob, never, "
        "p_true, perplexity, skr_knn",
    ):
        check_settings(cfg)


def test_gate_group_selects_one_gate_beside_the_bounds(tmp_path):
    settings = check_settings(compose_cfg([*TINY, "gate=ccsk", "gate.thresholds.pred=0.55"], tmp_path))
    assert settings.names == ("always", "never", "ccsk")
    thresholds = settings.configs["ccsk"]["thresholds"]
    assert thresholds["pred"] == 0.55 and thresholds["single"] == 0.3
    assert check_settings(compose_cfg([*TINY, "gate=never"], tmp_path)).names == ("always", "never")
    with pytest.raises(ValueError, match=r"^gate\.beta must be a number in \[0, 1\] .*; got 2\.0$"):
        check_settings(compose_cfg([*TINY, "gate=cbdr", "gate.beta=2.0"], tmp_path))


def test_unknown_gate_group_option_lists_the_available_ones(tmp_path):
    with pytest.raises(Exception, match=r"(?s)gate/flare.*Available options.*bridge.*ccsk"):
        compose_cfg([*TINY, "gate=flare"], tmp_path)


@pytest.mark.parametrize(
    "override, message",
    [
        ("gates.configs.cbdr.beta=1.5", r"gates\.configs\.cbdr\.beta must be a number in \[0, 1\]"),
        (
            "gates.configs.skr_knn.threshold=-0.1",
            r"gates\.configs\.skr_knn\.threshold must be a number in \[0\.0, 1\.0\]; got -0\.1",
        ),
        (
            "gates.curves.skr_knn.values=[0.5,2.0]",
            r"gates\.configs\.skr_knn\.threshold must be a number in \[0\.0, 1\.0\]; got 2\.0",
        ),
        ("gates.curves.cbdr.param=gamma", r"gates\.curves\.cbdr\.param='gamma'.*parameters: \['beta'\]"),
        ("gates.top_k=50", r"gates\.top_k=50 asks for more contexts than the retrieval\.top_n=6"),
        ("gates.metric=f1", r"gates\.metric='f1' is not one of"),
        (  # a display label where an id belongs: refused with the ids
            "gates.reranker='bi-encoder (MiniLM cosine)'",
            r"gates\.reranker='bi-encoder \(MiniLM cosine\)' is not one of \('bm25', 'bi_encoder', 'base', "
            r"'relevance_ft', 'confidence_ft\.sign', 'confidence_ft\.rank', 'confidence_ft\.utility', "
            r"'aligned\.likelihood',",
        ),
        (  # a known id of a row these settings do not build: refused before anything runs
            "gates.reranker=bi_encoder",
            r"gates\.reranker='bi_encoder' is not a Table 1 row of this run.*bi_encoder retrieval\.bi_encoder=true",
        ),
    ],
)
def test_bad_settings_name_their_key(tmp_path, override, message):
    with pytest.raises(ValueError, match=message):
        check_settings(compose_cfg([*TINY, override], tmp_path))


def test_a_learning_gate_without_training_data_names_the_stage_that_produces_it(tmp_path):
    settings = check_settings(compose_cfg(TINY, tmp_path))
    gate = gate_from_config("skr_knn", settings.configs["skr_knn"])
    with pytest.raises(MissingTrainingDataError, match="RAG pipeline's cached per-question outcomes"):
        gate.fit(None)


# --- pieces ----------------------------------------------------------------------------------------


def test_conflicting_contexts_put_the_rewritten_gold_paragraph_first_and_drop_the_original():
    passages = [
        CorpusPassage("d1#0", "Other", "unrelated text", "d1"),
        CorpusPassage("g#0", "Gold", "the answer is Paris", "g"),
        CorpusPassage("d2#0", "More", "more text", "d2"),
        CorpusPassage("g#1", "Gold", "Paris again", "g"),
        CorpusPassage("d3#0", "Last", "last text", "d3"),
    ]
    ranked = make_candidates("q1", "capital of france?", ("Paris",), passages, [5.0, 4.0, 3.0, 2.0, 1.0], "g")
    rewritten = Passage("Gold", "the answer is Lyon")
    example = ConflictExample(
        "q1",
        "capital of france?",
        ("Paris",),
        Passage("Gold", "the answer is Paris"),
        rewritten,
        "Paris",
        "Lyon",
        "name",
        "q9",
        1,
    )
    conflict = conflicting_candidates(ranked, example, 3)
    assert [p.text for p in conflict.passages] == ["the answer is Lyon", "unrelated text", "more text"]
    assert conflict.has_answer == [False, False, False] and math.isnan(conflict.scores[0])
    assert conflicting_candidates(ranked, example, 1).passages == [rewritten]


def test_outcomes_follow_the_decision_and_refusals_are_never_correct():
    closed_book = np.array([True, False, True, False])
    rag = np.array([False, True, True, True])
    assert score_decisions([P, R, X, R], closed_book, rag).tolist() == [True, True, False, True]
    assert score_decisions([R, P, P, X], closed_book, rag).tolist() == [False, False, True, False]
    with pytest.raises(ValueError, match="3 decisions for 4"):
        score_decisions([P, P, P], closed_book, rag)


def test_wall_time_model_charges_each_part_once():
    t = {
        "closed_book": 1.0,
        "rag_answer": 2.0,
        "retrieve": 0.5,
        "qa_states": 0.1,
        "draft": 1.2,
        "internal": 3.0,
        "matching": 0.2,
        "embed_question": 0.01,
    }
    # CBDR: states for everyone; parametric continues to a closed-book answer, retrieval pays retrieve + RAG.
    assert wall_time_per_question({"confidence"}, [P, R], t, 0.0) == pytest.approx(0.1 + (1.0 + 2.5) / 2)
    # DRAGIN: the draft is the closed-book answer, so a parametric decision costs nothing more.
    assert wall_time_per_question({"draft"}, [P, P], t, 0.4) == pytest.approx(1.2 + 0.2)
    # P(True): the closed-book answer and the forward that judges it; parametric then costs nothing more.
    assert wall_time_per_question({"p_true"}, [P, R], {**t, "p_true": 0.3}, 0.0) == pytest.approx(1.0 + 0.3 + 2.5 / 2)
    # BRIDGE: decides after retrieving; a refusal costs no answer.
    assert wall_time_per_question({"matching_scores", "question_embedding"}, [X, R], t, 0.0) == pytest.approx(
        3.0 + 1.0 + 0.5 + 0.2 + 0.01 + 2.0 / 2
    )
    with pytest.raises(ValueError, match=r"no timing for \['draft'\]"):
        wall_time_per_question({"draft"}, [P], {"closed_book": 1.0}, 0.0)


def test_quantile_grid_ignores_infinite_scores_and_spans_the_range():
    grid = quantile_grid(np.array([0.2, 0.4, np.inf, 0.9]), 5)
    assert grid[0] == 0.2 and grid[-1] == 0.9 and len(grid) == 5
    assert quantile_grid(np.array([np.inf]), 5) == []
