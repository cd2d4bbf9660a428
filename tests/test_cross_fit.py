"""Cross-fitting (`preferences.cross_fit`): the folds partition the questions no probe and no base uses, every
fold's rerankers train on the other folds only, each question is scored by its own fold's rerankers, and the
evaluation refuses a question its rerankers trained on."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest
from omegaconf import open_dict

from confrag.data.nq import QARow
from confrag.data.splits import QuestionPlan, cross_fit_plan, plan_questions
from confrag.stages.cross_fit import FoldedReranker
from confrag.stages.evaluation import check_held_out
from confrag.train import run_task

from helpers.runs import compose_cfg


def rows_named(prefix: str, n: int) -> list[QARow]:
    return [QARow(f"{prefix}{i}", f"question {prefix} number {i}", ("a",), ()) for i in range(n)]


def test_folds_partition_the_pool_and_train_on_the_other_folds():
    rows = rows_named("q", 60)
    plain = plan_questions(rows, rows[:10], 8, 12, seed=0, where="file")
    plan = cross_fit_plan(plain, 3, seed=0)
    pool = {r.qid for r in plain.preference} | {r.qid for r in plain.held_out}
    assert {r.qid for r in plan.preference} == pool and len(pool) == 38 and not plan.held_out
    assert plan.base == plain.base and plan.probe == plain.probe  # the base reranker is the plain runs' one
    folds = [{r.qid for r in fold} for fold in plan.folds]
    assert sorted(len(f) for f in folds) == [12, 13, 13] and set().union(*folds) == pool
    for f, fold in enumerate(folds):
        training = {r.qid for r in plan.training_questions(f)}
        assert not training & fold and training | fold == pool
        assert all(plan.fold_of(r) == f for r in plan.folds[f])
        assert all(plan.fold_of_question(r.question.upper() + "?") == f for r in plan.folds[f])  # normalized text
    assert plan.fold_of(rows[0]) is None and {r.qid for r in plan.evaluation_pool} == pool
    assert cross_fit_plan(plain, 3, seed=0) == plan  # seeded


@pytest.mark.parametrize("folds", [1, -2, True, 2.5])
def test_a_bad_fold_count_is_refused(folds):
    rows = rows_named("q", 30)
    with pytest.raises(ValueError, match=r"^folds must be 0 \(off\) or an integer >= 2"):
        cross_fit_plan(plan_questions(rows, rows[:5], 5, 5, seed=0, where="file"), folds, seed=0)


def test_folds_that_overlap_are_refused():
    rows = rows_named("q", 30)
    plan = cross_fit_plan(plan_questions(rows, rows[:5], 5, 5, seed=0, where="file"), 2, seed=0)
    leaked = (plan.folds[0], (*plan.folds[1], plan.folds[0][0]))
    with pytest.raises(ValueError, match="partition"):
        QuestionPlan(plan.probe, plan.preference, plan.base, [], leaked)
    with pytest.raises(ValueError, match="of fold 0 are also in the training folds of fold 0"):
        QuestionPlan(plan.probe, [*plan.preference, plan.folds[0][0]], plan.base, [], leaked)


class Constant:
    """A stand-in reranker scoring every pair with its own fold number."""

    def __init__(self, value: float) -> None:
        self.value, self.calls = value, []

    def score(self, queries, passages, batch_size=32):
        self.calls.append(list(queries))
        return np.full(len(queries), self.value, dtype=np.float32)


def test_each_pair_is_scored_by_its_questions_fold():
    folds = [Constant(0.0), Constant(1.0), Constant(2.0)]
    route = {"a": 1, "b": 2, "c": 0}
    reranker = FoldedReranker(folds, route.get)
    scores = reranker.score(["a", "b", "a", "c", "unknown"], ["p"] * 5)
    assert scores.tolist() == [1.0, 2.0, 1.0, 0.0, 0.0]  # outside every fold: fold 0's
    assert folds[1].calls == [["a", "a"]] and folds[2].calls == [["b"]] and folds[0].calls == [["c", "unknown"]]
    with pytest.raises(ValueError, match="one reranker per fold"):
        FoldedReranker(folds[:1], route.get)


@pytest.fixture(scope="module")
def cross_fitted(tmp_path_factory):
    """The tiny cbdr run, cross-fitted in 2 folds, over a 90-question NQ file (26 questions in the folds), each
    fold's rerankers keeping their best dev Top-1 weights."""
    root = tmp_path_factory.mktemp("cross_fit")
    source = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "nq_open_gold.jsonl.gz"
    if not source.is_file():
        pytest.skip("the shared NQ data is not beside the project")
    with gzip.open(source, "rt", encoding="utf-8") as f:
        lines = [next(f) for _ in range(90)]
    small = root / "nq_small.jsonl"
    small.write_text("".join(lines), encoding="utf-8")
    cfg = compose_cfg(
        [
            "+experiment=cbdr_tiny_llama",
            "trainer.max_epochs=1",
            "logger=csv",
            f"dataset.questions_path={small}",
            "preferences.cross_fit=2",
            "preferences.select_on=dev_top1",  # weights chosen on the training folds' dev questions
            "preferences.dev_fraction=0.3",
            "eval.num_questions=null",
            "eval.hotpotqa_path=null",
            "cbdr.gate_check_questions=0",
        ],
        root,
    )
    with open_dict(cfg):
        cfg.paths.cache_dir = str(root / "cache")
    run_task(cfg)
    out = root / "out"
    return cfg, out, json.loads((out / "metrics.json").read_text())


@pytest.mark.task
def test_every_pool_question_is_evaluated_by_rerankers_that_never_saw_it(cross_fitted):
    cfg, out, record = cross_fitted
    evaluated = set(record["eval"]["dev"]) | set(record["eval"]["test"])
    assert len(evaluated) == 90 - cfg.probe.data.num_questions - cfg.base_reranker.num_questions
    training = record["training"]
    assert {"fold0", "fold1"} <= set(training) and training["fold0"]["sign"]["train_rows"] > 0
    folds = [set(f) for f in record["folds"]]
    assert len(folds) == 2 and not folds[0] & folds[1] and folds[0] | folds[1] == evaluated
    report = (out / "report.md").read_text()
    assert "cross-fitted over 2 folds" in report and "each by its fold's rerankers" in report


@pytest.mark.task
def test_the_evaluation_refuses_a_question_its_rerankers_trained_on(cross_fitted):
    from types import SimpleNamespace

    rows = rows_named("q", 30)
    plan = cross_fit_plan(plan_questions(rows, rows[:5], 5, 5, seed=0, where="file"), 2, seed=0)
    stage = SimpleNamespace(questions=plan, probe_data=SimpleNamespace(data=SimpleNamespace(rows=plan.probe)))
    check_held_out(stage, plan.preference)  # every pool question, each against its own fold's training
    with pytest.raises(ValueError, match=r"also in the probe's questions"):
        check_held_out(stage, [*plan.preference, rows[0]])
    # A question routed to a fold whose rerankers trained on it: fold 1's question claimed by fold 0.
    tampered = SimpleNamespace(
        folds=plan.folds,
        base=plan.base,
        preference=plan.preference,
        fold_of=lambda r: 0,
        training_questions=plan.training_questions,
    )
    with pytest.raises(ValueError, match=r"fold 0's rerankers trained on"):
        check_held_out(SimpleNamespace(questions=tampered, probe_data=stage.probe_data), list(plan.folds[1]))


# --- alignment that keeps what the base knows (preferences.teacher, preferences.mix_relevance) -------------------


def test_the_base_teacher_writes_the_base_rerankers_scores_into_the_rows():
    from confrag.stages.teachers import ROW_TEACHERS

    class Lengths:  # a stand-in base: the score of a pair is its passage's length
        def score(self, queries, passages, batch_size=32):
            return np.array([len(p) for p in passages], dtype=np.float32)

    rows = [
        {
            "qid": "a",
            "query": "q",
            "pos": ["xx"],
            "neg": ["y", "zzzz"],
            "pos_scores": [0.1],
            "neg_scores": [-0.1, -0.2],
        },
        {"qid": "b", "query": "r", "pos": ["abc", "d"], "neg": ["ee"], "pos_scores": [0.0, 0.3], "neg_scores": [-0.3]},
    ]
    out = ROW_TEACHERS["base"].rewrite(rows, Lengths(), 8)
    assert [r["pos_scores"] for r in out] == [[2.0], [3.0, 1.0]] and [r["neg_scores"] for r in out] == [
        [1.0, 4.0],
        [2.0],
    ]
    assert rows[0]["pos_scores"] == [0.1]  # the input rows are left as they were
    assert (
        ROW_TEACHERS["inc"].rewrite(rows, Lengths(), 8) is rows
    )  # the paper's rows: unchanged, so their cache keys too


# --- weights chosen by dev Top-1 answers (preferences.select_on=dev_top1) -------------------------------------------


def test_dev_top1_is_the_share_of_questions_answered_right_under_their_top_candidate():
    from confrag.reranker.selection import dev_set

    dev = dev_set(["q1", "q2"], [["a", "bb", "c"], ["dd", "e"]], [[False, True, False], [False, True]])
    by_length = lambda qs, ps: np.array([len(p) for p in ps], dtype=float)  # noqa: E731
    assert dev.accuracy(by_length) == 0.5  # q1 picks "bb" (right), q2 picks "dd" (wrong)
    assert dev.accuracy(lambda qs, ps: -by_length(qs, ps)) == 0.5  # q1 picks "a" (wrong), q2 "e" (right)
    with pytest.raises(ValueError, match="2 passages for 1 answers"):
        dev_set(["q"], [["a", "b"]], [[True]])
    with pytest.raises(ValueError, match="dev set .* is empty"):
        dev_set([], [], [])


def test_the_selection_keeps_the_best_weights_the_bases_included():
    from types import SimpleNamespace

    from confrag.reranker.selection import DevTop1Selection, dev_set

    class Module:  # one weight w: scores are w * passage length, so w > 0 picks the long passage
        def __init__(self):
            self.w = 1.0

        def score(self, queries, passages, batch_size=32):
            return np.array([self.w * len(p) for p in passages], dtype=float)

        def state_dict(self):
            return {"w": self.w}

        def load_state_dict(self, state):
            self.w = state["w"]

    dev = dev_set(["q"], [["long passage", "x"]], [[True, False]])  # the long one is right
    module, trainer = Module(), SimpleNamespace(global_step=0, estimated_stepping_batches=4)
    selection = DevTop1Selection(dev, evaluations=2)
    selection.on_train_start(trainer, module)  # the base: right
    for step in (1, 2, 3, 4):  # training turns the weight around: wrong from step 1 on
        trainer.global_step, module.w = step, -1.0
        selection.on_train_batch_end(trainer, module, None, None, step - 1)
    selection.on_train_end(trainer, module)
    assert selection.history == [(0, 1.0), (2, 0.0), (4, 0.0)]
    assert module.w == 1.0 and selection.chosen["selected_step"] == 0  # the base's weights are kept


def test_a_reranker_that_kept_the_bases_weights_is_the_base_and_shares_its_scores():
    from types import SimpleNamespace

    from confrag.stages.rerank import as_trained, table1_systems

    calls = []

    class Counting:  # scores by passage length, counting the pairs it scored
        def scorer_for(self, query):
            return self

        def score(self, queries, passages, batch_size=32):
            calls.append(len(passages))
            return np.array([len(p) for p in passages], dtype=np.float32)

    base, trained = Counting(), Counting()
    holder = SimpleNamespace(module=base)
    assert as_trained(trained, {"selected_step": 0, "dev_top1": 0.4}, holder) is base  # the dev guard kept step 0
    assert as_trained(trained, {"selected_step": 20}, holder) is trained
    assert as_trained(trained, {"steps": 30}, holder) is trained  # no dev guard: the trained weights
    retrieval = SimpleNamespace(corpus=SimpleNamespace(passages=[]), bm25=None, dense=None)
    systems = table1_systems(retrieval, {"base": base, "confidence_ft.sign": base, "relevance_ft": trained}, 8)
    first = systems["base"]("q", ["aa", "b"])
    assert systems["confidence_ft.sign"]("q", ["aa", "b"]).tolist() == first.tolist() == [2.0, 1.0]
    systems["relevance_ft"]("q", ["aa", "b"])
    systems["base"]("q", ["aa", "c"])  # another candidate list: scored
    assert calls == [2, 2, 2]  # the base once per list, whichever of its rows asked; the other model on its own
    with pytest.raises(ValueError, match="read-only"):
        first[0] = 5.0  # shared between rows: no caller may change it

    # Cross-fitted: the fold whose dev guard kept the base scores with the base's module, and shares its scores.
    from confrag.stages.cross_fit import FoldedReranker

    calls.clear()
    folded = FoldedReranker([base, trained], {"q0": 0, "q1": 1}.get)
    systems = table1_systems(retrieval, {"base": base, "confidence_ft.rank": folded}, 8)
    for query in ("q0", "q1"):
        systems["base"](query, ["aa", "b"])
        assert systems["confidence_ft.rank"](query, ["aa", "b"]).tolist() == [2.0, 1.0]
    assert calls == [2, 2, 2]  # q0: the base once for both rows; q1: the base, then fold 1's own reranker


@pytest.mark.task
def test_each_folds_rerankers_keep_their_best_dev_top1_weights(cross_fitted):
    _, _, record = cross_fitted
    for fold in ("fold0", "fold1"):
        for name in ("sign", "relevance"):
            info = record["training"][fold][name]
            assert info["dev_questions"] >= 1 and info["dev_history"][0][0] == 0  # the base was a candidate
            assert info["dev_top1"] == max(acc for _, acc in info["dev_history"])
            assert info["selected_step"] in [step for step, _ in info["dev_history"]]
