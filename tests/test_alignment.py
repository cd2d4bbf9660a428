"""Issue 11's pieces on hand-made inputs: the label rules (rank, utility), the base reranker's rows and
cache key, the question plan (disjoint, asserted), the diagnostic rankers, and bad settings."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from confrag.data.nq import Passage, QARow
from confrag.data.splits import check_disjoint, plan_questions
from confrag.reranker.label_rules import select_by_rank, select_by_utility
from confrag.reranker.preferences import ConfidenceShifts, build_rows, dataset_report
from confrag.reranker.systems import ORACLE, PROBE
from confrag.retrieval.candidates import make_candidates
from confrag.retrieval.corpus import CorpusPassage
from confrag.stages.base_reranker import BASE_MODEL_SETTINGS, BaseRerankerSettings, relevance_training_rows
from confrag.stages.diagnostics import CandidateDiagnostics, lookup_scorer
from confrag.stages.nq_rerank import PreferenceSettings, candidate_utility
from confrag.stages.rerankers import RerankerRecipe, reranker_cache_dir
from confrag.train import run_task

from helpers.runs import compose_cfg
from helpers.settings import shipped_settings


def passage(source: str, text: str, index: int = 0) -> CorpusPassage:
    return CorpusPassage(f"{source}#{index}", f"title {source}", text, source)


def question(qid: str, n: int, gold_at: int | None = None, answers=("paris",)):
    passages = [passage(f"{qid}-d{j}", f"text {qid} {j}") for j in range(n)]
    gold = passages[gold_at].source_id if gold_at is not None else None
    return make_candidates(qid, f"question {qid}?", answers, passages, [float(n - j) for j in range(n)], gold)


# --- label rules -------------------------------------------------------------------------------------


def test_rank_rule_takes_the_highest_and_lowest_confidences_whatever_the_reference():
    # Inc matrix of three questions (rows) over their candidates; the reference shifts every Inc of a row.
    conf = [np.array([0.50, 0.90, 0.10, 0.70, 0.30]), np.array([0.2, 0.2, 0.1]), np.array([0.6, 0.4])]
    sets = [question("a", 5), question("b", 3), question("c", 2)]
    for reference in (0.0, 0.95):  # every context raises / lowers confidence: sign keeps nothing, rank the same
        shifts = ConfidenceShifts({"qa": np.full(3, reference), "rag_empty": np.zeros(3)}, conf)
        rows, drops = build_rows(sets, shifts, "qa", top_k=2, selection="rank")
        assert [r["qid"] for r in rows] == ["a", "b", "c"] and drops == {
            "no_positive": 0,
            "no_negative": 0,
            "neither": 0,
        }
        assert rows[0]["pos"] == ["title a-d1\ntext a 1", "title a-d3\ntext a 3"]  # 0.9, 0.7
        assert rows[0]["neg"] == ["title a-d2\ntext a 2", "title a-d4\ntext a 4"]  # 0.1, 0.3
        assert len(rows[1]["pos"]) == len(rows[1]["neg"]) == 1  # at most half of three candidates a side
        assert rows[1]["pos"] == ["title b-d0\ntext b 0"]  # a tie keeps the retrieval order
        assert np.allclose(rows[0]["pos_scores"], [0.9 - reference, 0.7 - reference])
    sign_rows, _ = build_rows(
        sets, ConfidenceShifts({"qa": np.zeros(3), "rag_empty": np.zeros(3)}, conf), "qa", 2, "sign"
    )
    assert sign_rows == []  # every Inc > 0: the paper's rule finds no negative
    assert select_by_rank(np.array([0.3]), 5) == ([], [])


def test_utility_labels_come_from_the_answers_under_each_candidate():
    sets = [question("a", 4), question("b", 2)]

    class FakeStore:  # the AnswerStore's interface: (question, contexts) items -> answers
        def __init__(self):
            self.items = []

        def answer(self, items):
            self.items.extend(items)
            return ["it is paris", "no idea", "Paris, France", "rome", "london", "paris!"]

    store = FakeStore()
    utility = candidate_utility(store, sets)
    # one single-context prompt per candidate, in candidate order: exactly the Top-1 prompts of Table 2
    assert [(q, [p.pid for p in ctx]) for q, ctx in store.items] == [
        ("question a?", [p.pid]) for p in sets[0].passages
    ] + [("question b?", [p.pid]) for p in sets[1].passages]
    assert [u.tolist() for u in utility] == [[True, False, True, False], [False, True]]
    shifts = ConfidenceShifts({"qa": np.zeros(2), "rag_empty": np.zeros(2)}, [np.zeros(4), np.zeros(2)])
    rows, _ = build_rows(sets, shifts, "qa", top_k=5, selection="utility", utility=utility)
    assert rows[0]["pos"] == ["title a-d0\ntext a 0", "title a-d2\ntext a 2"]
    assert rows[0]["neg"] == ["title a-d1\ntext a 1", "title a-d3\ntext a 3"]
    assert select_by_utility([True, True, True], 2) == ([0, 1], [])
    with pytest.raises(ValueError, match="needs the LLM's answer under every candidate"):
        build_rows(sets, shifts, "qa", 5, selection="utility")
    report = dataset_report(sets, shifts, 5, {"train": rows, "test": []}, "qa", {}, "utility", utility)
    assert set(report["by_selection"]) == {"sign", "rank", "utility"}
    assert report["utility"]["correct_share"] == pytest.approx(3 / 6)


@pytest.mark.parametrize(
    "values, message",
    [
        ({"selection": "vote"}, r"preferences\.selection='vote' is not one of \('sign', 'rank', 'utility'\)"),
        ({"compare": ["sign", "best"]}, r"preferences\.compare='best' is not one of"),
        ({"top_k": 0}, r"preferences\.top_k must be an integer >= 1"),
    ],
)
def test_preference_settings_name_the_allowed_values(values, message):
    with pytest.raises(ValueError, match=message):
        shipped_settings(PreferenceSettings, "preferences", **values)
    assert shipped_settings(PreferenceSettings, "preferences", selection="rank", compare=("sign", "rank")).rules == (
        "rank",
        "sign",
    )


# --- the base reranker ---------------------------------------------------------------------------


def nq_row(qid: str, text: str, answer: str) -> QARow:
    return QARow(qid, f"who {qid}?", (answer,), (Passage(f"Doc {qid}", text),))


def test_base_rows_take_the_gold_passage_and_hard_negatives_without_an_answer():
    rows = [nq_row("q1", "the answer is Paris of course", "Paris"), nq_row("q2", "nothing here", "Rome")]
    retrieved = [
        make_candidates(
            "q1",
            "who q1?",
            ("Paris",),
            [passage("x", "Paris too"), passage("y", "unrelated"), passage("z", "also unrelated")],
            [3.0, 2.0, 1.0],
            None,
        ),
        make_candidates("q2", "who q2?", ("Rome",), [passage("w", "Rome is here")], [1.0], None),
    ]
    out, dropped = relevance_training_rows(rows, retrieved, negatives=1, words_per_passage=100)
    assert out == [
        {
            "qid": "q1",
            "query": "who q1?",
            "pos": ["Doc q1\nthe answer is Paris of course"],
            "neg": ["title y\nunrelated"],
            "prompt": out[0]["prompt"],
        }
    ]
    assert dropped == {"no_gold_paragraph": 0, "no_hard_negative": 1}  # q2's only candidate holds the answer


def test_the_base_reranker_key_changes_with_its_questions(tmp_path):
    recipe = RerankerRecipe(
        make_model=None,
        make_datamodule=None,
        make_trainer=None,
        identity={"model": {"backbone": "minilm"}, "seed": 0},
    )
    rows_a, _ = relevance_training_rows(
        [nq_row("q1", "Paris text", "Paris")],
        [make_candidates("q1", "who q1?", ("Paris",), [passage("y", "other")], [1.0], None)],
        3,
        100,
    )
    rows_b, _ = relevance_training_rows(
        [nq_row("q9", "Paris text", "Paris")],
        [make_candidates("q9", "who q9?", ("Paris",), [passage("y", "other")], [1.0], None)],
        3,
        100,
    )
    settings = {"max_epochs": 1}
    assert reranker_cache_dir(recipe, tmp_path, rows_a, trainer_settings=settings) != reranker_cache_dir(
        recipe, tmp_path, rows_b, trainer_settings=settings
    )
    assert reranker_cache_dir(recipe, tmp_path, rows_a, trainer_settings=settings) == reranker_cache_dir(
        recipe, tmp_path, list(rows_a), trainer_settings=dict(settings)
    )
    assert reranker_cache_dir(recipe, tmp_path, rows_a) != reranker_cache_dir(
        recipe, tmp_path, rows_a, start_from=Path("abc")
    )
    # A model override that changes a setting changes the key (a reranker trained at another lr is another one);
    # one that restates the model node's value does not.
    recipe.identity["model"].update(lr=6e-5, lora=None)
    plain = reranker_cache_dir(recipe, tmp_path, rows_a)
    assert reranker_cache_dir(recipe, tmp_path, rows_a, model_overrides={"lr": 3e-4}) != plain
    assert reranker_cache_dir(recipe, tmp_path, rows_a, model_overrides={"lora": None, "lr": 6e-5}) == plain


def test_the_base_ignores_the_alignment_options_in_its_model_and_its_key(tmp_path):
    """model.distill_weight / model.lora are the aligned rerankers' options: trying one must neither hand the base
    a distillation it has no teacher scores for nor change (and so retrain) the base."""
    made = []
    rows = [{"query": "who?", "pos": ["a"], "neg": ["b"]}]
    model = {"backbone": "minilm", "lr": 6e-5, "lora": None, "distill_weight": 0.0, "distill_tau": None}

    def recipe(**model_settings):
        return RerankerRecipe(
            make_model=lambda **kw: made.append(kw),
            make_datamodule=None,
            make_trainer=None,
            identity={"model": {**model, **model_settings}, "seed": 0},
        )

    plain = recipe()
    aligned = recipe(distill_weight=1.0, distill_tau=0.05, lora={"r": 16})
    assert reranker_cache_dir(plain, tmp_path, rows) != reranker_cache_dir(aligned, tmp_path, rows)
    base_plain = plain.with_model_settings(**BASE_MODEL_SETTINGS)
    base_aligned = aligned.with_model_settings(**BASE_MODEL_SETTINGS)
    # The same base whatever the alignment options, and the key the base had before they were fixed.
    assert reranker_cache_dir(base_aligned, tmp_path, rows) == reranker_cache_dir(plain, tmp_path, rows)
    assert reranker_cache_dir(base_plain, tmp_path, rows, model_overrides={"lr": 3e-4}) == reranker_cache_dir(
        base_aligned, tmp_path, rows, model_overrides={"lr": 3e-4}
    )
    base_aligned.make_model(backbone="dir", lr=3e-4)
    assert made == [{**BASE_MODEL_SETTINGS, "backbone": "dir", "lr": 3e-4}]
    assert aligned.identity["model"]["distill_weight"] == 1.0  # the aligned recipe itself is left as it was


def test_base_settings_refuse_bad_values():
    with pytest.raises(ValueError, match=r"base_reranker\.negatives must be an integer >= 1"):
        shipped_settings(BaseRerankerSettings, "base_reranker", negatives=0)
    with pytest.raises(ValueError, match=r"base_reranker\.lr must be a number > 0 or null"):
        shipped_settings(BaseRerankerSettings, "base_reranker", lr=-1e-4)
    with pytest.raises(ValueError, match=r"base_reranker\.warmup_ratio must be a number in \[0, 1\) or null; got 1.0"):
        shipped_settings(BaseRerankerSettings, "base_reranker", warmup_ratio=1.0)


# --- the question plan ---------------------------------------------------------------------------


def rows_named(prefix: str, n: int) -> list[QARow]:
    return [QARow(f"{prefix}{i}", f"question {prefix} number {i}", ("a",), ()) for i in range(n)]


def test_the_question_plan_is_disjoint_and_ordered():
    rows = rows_named("q", 40)
    plan = plan_questions(rows, rows[:10], 8, 12, seed=0, where="file")
    assert len(plan.preference) == 8 and len(plan.base) == 12 and len(plan.held_out) == 10
    qids = [{r.qid for r in part} for part in (plan.probe, plan.preference, plan.base, plan.held_out)]
    assert sum(map(len, qids)) == 40 and len(set().union(*qids)) == 40
    # the preference questions do not depend on how many base questions are asked for
    assert plan_questions(rows, rows[:10], 8, 5, seed=0, where="file").preference == plan.preference
    with pytest.raises(ValueError, match=r"leave 0 of 40 for evaluation"):
        plan_questions(rows, rows[:10], 8, None, seed=0, where="file")


def test_base_questions_from_another_file_that_overlap_the_held_out_ones_are_refused_with_the_count():
    rows = rows_named("q", 30)
    # another file numbers its questions differently: the same question under another qid is still caught
    other = [QARow(f"other{i}", r.question, r.answers, ()) for i, r in enumerate(rows[25:])]
    with pytest.raises(ValueError, match=r"5 of the held-out questions are also in the base reranker's questions"):
        plan_questions(rows, rows[:10], 5, 5, seed=0, where="file", base_rows=other)
    ok = plan_questions(rows, rows[:10], 5, 3, seed=0, where="file", base_rows=rows_named("t", 3))
    assert len(ok.held_out) == 15
    with pytest.raises(ValueError, match=r"1 of the evaluation questions are also in the probe's questions"):
        check_disjoint(rows[9:12], {"the probe's questions": rows[:10]})


def test_settings_refuse_k_larger_than_the_candidates(tmp_path):
    cfg = compose_cfg(["+experiment=reranker_tiny_llama", "preferences.top_k=7", "logger=csv"], tmp_path)
    with pytest.raises(ValueError, match=r"preferences\.top_k=7 is larger than the retrieval\.top_n=6 candidates"):
        run_task(cfg)
    assert not (tmp_path / "cache").exists()


# --- diagnostic rankers --------------------------------------------------------------------------


def test_probe_and_oracle_rankers_read_the_per_candidate_values():
    sets = [question("a", 4, gold_at=2), question("b", 3, gold_at=0)]
    diag = CandidateDiagnostics(
        sets,
        [np.array([0.1, 0.2, 0.9, 0.3]), np.array([0.2, 0.5, 0.4])],
        [np.array([False, False, True, False]), np.array([False, True, False])],
    )
    scorers = diag.scorers()
    texts = [f"title a-d{j}\ntext a {j}" for j in range(4)]
    assert scorers[PROBE]("question a?", texts).tolist() == [0.1, 0.2, 0.9, 0.3]
    assert scorers[ORACLE]("question a?", texts).tolist() == [0.0, 0.0, 1.0, 0.0]
    summary = diag.summary()
    # correct candidates: confidences 0.9 and 0.5 rank above every wrong one except 0.4 < 0.5: AUROC 1.0
    assert summary["probe_auroc_on_candidates"] == pytest.approx(1.0)
    # a's gold passage has the top confidence (rank 1), b's the lowest of three (rank 3)
    assert summary["probe_gold_first"] == pytest.approx(0.5) and summary["probe_gold_mean_rank"] == pytest.approx(2.0)
    assert summary["chance_gold_first"] == pytest.approx((1 / 4 + 1 / 3) / 2)
    with pytest.raises(ValueError, match="no diagnostic value"):
        lookup_scorer(sets, diag.confidence)("question a?", ["unknown passage"])
    one_class = CandidateDiagnostics(sets[:1], diag.confidence[:1], [np.zeros(4, bool)])
    assert one_class.summary()["probe_auroc_on_candidates"] is None
