"""The alignment node's pieces (issue 45): its settings refused by key before anything loads, one registry of
teachers and one of students, the learned temperature, the students as rerankers of any candidate list (the base's
top k reordered), their exports (a cross-encoder student loads with sentence-transformers' `CrossEncoder`, a residual
one through confrag), and the fusion row."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from confrag.instantiators import settings_from
from confrag.reranker.aligned import AlignedReranker, load_aligned, shortlist_order
from confrag.reranker.listwise_data import ListwiseData, list_batch
from confrag.reranker.listwise_student import STUDENTS, ListwiseSettings, StudentBase, build_student, fit_listwise
from confrag.reranker.listwise_teachers import ALIGNMENT_TEACHERS, LISTWISE, TeacherInputs, teacher_targets
from confrag.reranker.pair_scorer import PairScorer
from confrag.reranker.systems import FUSION, TABLE1, aligned, check_reranker, label
from confrag.retrieval.candidates import Candidates
from confrag.retrieval.corpus import CorpusPassage
from confrag.stages.alignment import AlignmentSettings
from confrag.stages.diagnostics import fusion_scorer

from helpers.modules import reranker_module
from helpers.runs import compose_cfg
from helpers.settings import shipped_settings

pytestmark = pytest.mark.usefixtures("one_thread")

QUESTIONS = ["who wrote the origin of species", "what is the capital of france", "when did the berlin wall fall"]
PASSAGES = [
    ["Charles Darwin wrote On the Origin of Species in 1859.", "Paris is a city.", "Spiders are arachnids."],
    ["Paris is the capital and largest city of France.", "Lyon is in France.", "The Seine flows.", "Rome."],
    ["The Berlin Wall fell on 9 November 1989.", "Berlin is in Germany.", "Walls are built of stone."],
]


def settings(student: str, **changes) -> ListwiseSettings:
    return shipped_settings(AlignmentSettings, "alignment", teacher="likelihood", student=student, **changes).listwise(
        0
    )


@pytest.fixture(scope="module")
def cross_encoder() -> PairScorer:
    """A MiniLM cross-encoder with a fresh, seeded head: the rerank task's base kind."""
    return PairScorer.of(reranker_module(fresh_head=True))


def base_data(scorer: PairScorer, top_k: int = 2) -> ListwiseData:
    scores = [scorer.score([q] * len(ps), ps) for q, ps in zip(QUESTIONS, PASSAGES)]
    empty = [np.zeros((len(ps), 0), np.float32) for ps in PASSAGES]
    data = ListwiseData.from_lists(QUESTIONS, np.zeros((3, 0), np.float32), empty, PASSAGES, base_scores=scores)
    return data.top_k(top_k)


def candidate_sets() -> list[Candidates]:
    """QUESTIONS' candidate lists as a stage reads them (question ids q0, q1, q2)."""
    sets = []
    for i, (q, ps) in enumerate(zip(QUESTIONS, PASSAGES)):
        passages = [CorpusPassage(f"q{i}p{j}", "", p, source_id=f"q{i}-{j}") for j, p in enumerate(ps)]
        sets.append(Candidates(f"q{i}", q, ("a",), passages, [0.0] * len(ps), [False] * len(ps), None))
    return sets


def ell_targets(data: ListwiseData) -> list[np.ndarray]:
    """A target that prefers each list's last candidate in the top k: something to move toward."""
    return [np.where(m, np.arange(len(m), dtype=np.float32), -np.inf) for m in data.mask]


# --- settings and registries ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"teacher": "oracle"}, r"alignment\.teacher='oracle' is not one of \('inc', 'likelihood'"),
        ({"compare": ["inc"]}, r"alignment\.compare='inc' is not one of .*\(listwise teachers\)"),
        ({"student": "tower"}, r"alignment\.student='tower' is not one of"),
        ({"teacher": "inc", "student": "residual_cross_encoder"}, r"student must be one of cross_encoder with"),
        ({"teacher": "likelihood", "tau": 0}, r"alignment\.tau must be a number > 0 \(or 'learned'\); got 0"),
        ({"teacher": "likelihood", "top_k": 0}, r"alignment\.top_k must be an integer >= 1"),
        ({"teacher": "likelihood", "precision": "fp8"}, r"alignment\.precision='fp8' is not one of"),
        ({"teacher": "likelihood", "seed": -1}, r"alignment\.seed must be an integer >= 0 or null; got -1"),
    ],
)
def test_bad_alignment_settings_are_refused_by_key(changes, message):
    with pytest.raises(ValueError, match=message):
        shipped_settings(AlignmentSettings, "alignment", **changes)


def test_a_student_that_reads_vectors_needs_a_bi_encoder_base_before_anything_loads(tmp_path, nothing_runs):
    from confrag.tasks import rerank as rerank_task

    cfg = compose_cfg(["+experiment=reranker_likelihood_tiny_llama", "alignment.student=query_tower"], tmp_path)
    with pytest.raises(ValueError, match=r"alignment\.student=query_tower reads the base's query and passage vectors"):
        rerank_task.check(cfg)
    bi = ["model=reranker_minilm_bi", "base_reranker.train=false", "alignment.student=query_tower"]
    assert rerank_task.check(compose_cfg(["+experiment=reranker_likelihood_tiny_llama", *bi], tmp_path))


def test_one_registry_of_teachers_and_one_of_students_each_a_row():
    assert {"inc", "likelihood", "utility", "relevance", "base"} <= set(ALIGNMENT_TEACHERS)
    assert {"cross_encoder", "residual_cross_encoder", "query_tower"} <= set(STUDENTS)
    assert not ALIGNMENT_TEACHERS["inc"].listwise and "inc" not in LISTWISE  # the paper's rows, group InfoNCE
    for teacher in LISTWISE:
        assert aligned(teacher) in TABLE1 and check_reranker(aligned(teacher), "cbdr.reranker") == aligned(teacher)
        assert label(aligned(teacher)) == f"base aligned to {teacher} (listwise)"
    with pytest.raises(ValueError, match="a Table 1 row's id"):  # a diagnostic row reads the answer: never chosen
        check_reranker(FUSION, "cbdr.reranker")
    node = shipped_settings(AlignmentSettings, "alignment", teacher="likelihood", compare=["base", "likelihood"])
    assert node.teachers == ("likelihood", "base") and node.rows == ["aligned.likelihood", "aligned.base"]
    assert shipped_settings(AlignmentSettings, "alignment").rows == []  # the default: the paper's rows only


def test_the_base_teacher_is_the_base_scores_over_its_temperature():
    passages = [CorpusPassage(f"p{i}", "t", f"text {i}", source_id=f"s{i}") for i in range(3)]
    c = Candidates("q", "q?", ("a",), passages, [0.0] * 3, [False] * 3, None)
    base = np.array([1.0, 3.0, 2.0], dtype=np.float32)
    (target,), missing = teacher_targets("base", [TeacherInputs(c, None, None, base)], 2.0)
    np.testing.assert_allclose(target, base / 2.0)
    with pytest.raises(ValueError, match="no base scores"):
        teacher_targets("base", [TeacherInputs(c, None)], 2.0)
    with pytest.raises(ValueError, match="no ℓ"):
        teacher_targets("likelihood", [TeacherInputs(c, None)], 2.0)


# --- the students -----------------------------------------------------------------------------------------------


def test_a_learned_temperature_starts_at_one_and_moves(cross_encoder):
    data = base_data(cross_encoder)
    learned = build_student(settings("residual_cross_encoder", tau="learned", anchor=0.5))
    fixed = build_student(settings("residual_cross_encoder", tau=1.0, anchor=0.5))
    batch = list_batch(data, [0, 1, 2], np.stack([np.pad(t, (0, 4 - len(t)), constant_values=-np.inf)
                                                   for t in ell_targets(data)]))  # fmt: skip
    with torch.no_grad():
        assert float(learned.training_step(batch, 0)) == pytest.approx(float(fixed.training_step(batch, 0)))
    trained = fit_listwise(settings("residual_cross_encoder", tau="learned", steps=3, batch_size=3), data,
                           ell_targets(data))  # fmt: skip
    assert trained.temperature != pytest.approx(1.0, abs=1e-4)


def test_a_cross_encoder_student_starts_as_the_base_and_exports_a_crossencoder_folder(cross_encoder, tmp_path):
    from sentence_transformers import CrossEncoder

    data = base_data(cross_encoder)
    fresh = build_student(settings("cross_encoder"), StudentBase(reranker=cross_encoder))
    np.testing.assert_allclose(fresh.score(data)[data.mask], data.base_scores[data.mask], atol=1e-5)
    student = fit_listwise(settings("cross_encoder", steps=2, batch_size=3, lr=1e-3), data, ell_targets(data),
                           StudentBase(reranker=cross_encoder))  # fmt: skip
    row = AlignedReranker(student, cross_encoder, 2, None, {"teacher": "likelihood"})
    folder = row.export(tmp_path / "aligned")
    pairs = [(QUESTIONS[1], p) for p in PASSAGES[1]]
    by_st = CrossEncoder(str(folder)).predict(pairs)
    np.testing.assert_allclose(by_st, student.reranker.score(*zip(*pairs)), atol=1e-4)
    assert not np.allclose(by_st, cross_encoder.score(*zip(*pairs)), atol=1e-4)  # it trained
    again = load_aligned(folder)
    queries, passages = [QUESTIONS[1]] * 4, PASSAGES[1]
    np.testing.assert_array_equal(again.score(queries, passages), row.score(queries, passages))
    card = (folder / "README.md").read_text()
    assert "CrossEncoder" in card and "base + w" not in card  # not a residual student


def test_a_residual_student_exports_how_it_scores_and_loads_through_confrag(cross_encoder, tmp_path):
    data = base_data(cross_encoder, top_k=3)
    student = fit_listwise(settings("residual_cross_encoder", steps=3, batch_size=3, lr=1e-3, anchor=0.0), data,
                           ell_targets(data), StudentBase(reranker=cross_encoder))  # fmt: skip
    student.weight_at_scoring = 2.0
    row = AlignedReranker(student, cross_encoder, 3, None, {"teacher": "likelihood"})
    folder = row.export(tmp_path / "residual")
    card = (folder / "README.md").read_text()
    assert "base + w · 20 · g(q, p) with w = 2" in card and "load_aligned" in card
    assert json.loads((folder / "aligned.json").read_text())["weight"] == 2.0
    loaded = load_aligned(folder)
    assert loaded.student.weight_at_scoring == 2.0
    for q, ps in zip(QUESTIONS, PASSAGES):
        np.testing.assert_array_equal(loaded.score([q] * len(ps), ps), row.score([q] * len(ps), ps))
    base = cross_encoder.score([QUESTIONS[1]] * 4, PASSAGES[1])
    f = loaded.student.score(loaded.listwise([QUESTIONS[1]], [PASSAGES[1]], [base]))
    assert np.isfinite(f).sum() == 3  # the base's top 3 scored, the fourth left to the base's order
    # f pair by pair: the student's own scores over the base's top 3, NaN for the passage it never scores
    by_pair, scored = loaded.student_scores([QUESTIONS[1]] * 4, PASSAGES[1]), np.isfinite(f[0])
    np.testing.assert_allclose(by_pair[scored], f[0][scored], rtol=1e-5)
    assert np.isnan(by_pair[~scored]).all()


def test_a_student_reorders_the_base_top_k_and_leaves_the_rest_in_the_base_order(cross_encoder):
    base = np.array([0.1, 0.9, 0.5, 0.7, 0.3])
    f = np.array([9.0, 1.0, 3.0, 2.0, 8.0])  # f ranks 0 and 4 first, but they are outside the base's top 3
    order = np.argsort(-shortlist_order(f, base, 3), kind="stable")
    assert order.tolist() == [2, 3, 1, 4, 0]  # the top 3 {1, 3, 2} by f, then the rest by the base
    fresh = build_student(settings("residual_cross_encoder"), StudentBase(reranker=cross_encoder))
    row = AlignedReranker(fresh, cross_encoder, 2, None)
    for q, ps in zip(QUESTIONS, PASSAGES):  # a fresh student is the base: the base's order
        base_scores = cross_encoder.score([q] * len(ps), ps)
        assert (
            np.argsort(-row.score([q] * len(ps), ps), kind="stable").tolist()
            == np.argsort(-base_scores, kind="stable").tolist()
        )


def test_the_fusion_row_is_z_base_plus_w_z_likelihood():
    base, ell = np.array([1.0, 2.0, 3.0]), np.array([-3.0, -1.0, -2.0])
    score = fusion_scorer(lambda q, ps: base, lambda q, ps: ell, 0.5)("q", ["a", "b", "c"])
    z = lambda x: (x - x.mean()) / (x.std() + 1e-9)  # noqa: E731
    np.testing.assert_allclose(score, z(base) + 0.5 * z(ell))


def test_settings_from_the_node_and_the_listwise_settings_agree():
    node = shipped_settings(AlignmentSettings, "alignment", teacher="likelihood", tau="learned")
    listwise = node.listwise(7)
    assert listwise.seed == 7 and listwise.tau == "learned" and listwise.student == node.student
    fields = {f.name for f in dataclasses.fields(ListwiseSettings)} - {"seed"}
    assert fields <= {f.name for f in dataclasses.fields(AlignmentSettings)}
    with pytest.raises(ValueError, match=r"alignment: missing key"):
        settings_from(AlignmentSettings, {"teacher": "inc"}, "alignment")


def test_alignment_seed_sets_the_students_seed_and_key_and_null_is_the_runs():
    node = shipped_settings(AlignmentSettings, "alignment", teacher="likelihood")
    assert node.seed is None and node.listwise(7) == dataclasses.replace(node, seed=7).listwise(0)
    seeded = dataclasses.replace(node, seed=3)
    assert seeded.listwise(7).seed == seeded.listwise(0).seed == 3
    assert seeded.listwise(7).identity() != node.listwise(7).identity()  # another student, cached apart


def test_each_folds_students_train_on_the_other_folds_and_are_read_back_from_the_cache(cross_encoder, tmp_path):
    """What cross-fitting asks of the listwise rows (`with_listwise` per fold): fold f's students see only the
    questions they are given (the other folds'), and the same settings and questions read the student back."""
    import confrag.stages.alignment as alignment
    from confrag.reranker.aligned import student_base
    from confrag.stages.alignment import ListwiseMaterial, ListwiseRun, listwise_rerankers

    from helpers.runs import run_ctx

    sets = candidate_sets()
    base = [cross_encoder.score([q] * len(ps), ps) for q, ps in zip(QUESTIONS, PASSAGES)]
    ell = [np.linspace(-3.0, -1.0, len(ps)).astype(np.float32) for ps in PASSAGES]
    data = base_data(cross_encoder, top_k=2)
    inputs = [TeacherInputs(c, e, None, b) for c, e, b in zip(sets, ell, base)]
    material = ListwiseMaterial(sets, data, inputs, ell, "key", cross_encoder, student_base(cross_encoder, None), None)
    node = shipped_settings(
        AlignmentSettings, "alignment", teacher="likelihood", student="residual_cross_encoder", steps=1, batch_size=2
    )
    seen = []
    real = alignment.fit_listwise

    def recording(settings, fold_data, targets, *args):
        seen.append(list(fold_data.questions))
        return real(settings, fold_data, targets, *args)

    ctx = run_ctx(tmp_path)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(alignment, "fit_listwise", recording)
        for f, others in enumerate([{"q1", "q2"}, {"q0"}]):
            rows, info = listwise_rerankers(node, material, others, ListwiseRun(ctx, f"_fold{f}", "cpu", False))
            assert info["aligned.likelihood"]["train_questions"] == len(others)
        assert seen == [[QUESTIONS[1], QUESTIONS[2]], [QUESTIONS[0]]]
        listwise_rerankers(node, material, {"q0"}, ListwiseRun(ctx, "_fold1", "cpu", False))
    assert len(seen) == 2  # the same settings and questions: read back, not trained again
    scores = rows["aligned.likelihood"].score([QUESTIONS[0]] * 3, PASSAGES[0])
    assert sorted(scores.tolist()) == [1.0, 2.0, 3.0] and scores[int(np.argmin(base[0]))] == 1.0  # outside the top 2


@pytest.mark.heavy
def test_the_framework_trains_the_fair_studys_student_the_same_settings_questions_and_seed_giving_the_same_scores(
    cross_encoder, tmp_path
):
    """Issue 45's reproduction: the rerank task's listwise stage and the fair study (`listwise_fit.train`, what
    experiments/fair_student.py trains through) are one code path. `alignment=likelihood` is the study's dev-chosen
    primary (head lr, λ, τ, τ_T, lr, top k; its CPU compute is the study's `CROSS_ENCODER` overrides), and on the same
    questions and seed the two give the same student, score for score."""
    from omegaconf import OmegaConf

    from confrag.reranker.aligned import student_base
    from confrag.reranker.listwise_fit import StudyParts, train
    from confrag.stages.alignment import ListwiseMaterial, ListwiseRun, listwise_rerankers
    from confrag.studies import fair_student

    from helpers.runs import run_ctx
    from helpers.settings import SHIPPED_NODES

    nodes = [n if n != "+alignment=default" else "+alignment=likelihood" for n in SHIPPED_NODES]
    likelihood = OmegaConf.to_container(compose_cfg(nodes, tmp_path), resolve=True)["alignment"]
    node = settings_from(AlignmentSettings, likelihood, "alignment")
    study = {"student": "residual_cross_encoder", "lr": fair_student.CE_LR, "head_lr": 1e-3, "anchor": 1.0,
             "tau": 8.0, "teacher_tau": 2.0, "top_k": fair_student.TOP_K, "weight": 1.0}  # fmt: skip
    assert {key: getattr(node, key) for key in study} == study  # the study's dev choice (docs/results.md)
    for key in ("steps", "batch_size", "warmup_ratio", "weight_decay", "train_embeddings"):
        assert getattr(node, key) == getattr(fair_student.TRAINING, key), key

    node = dataclasses.replace(node, compare=[], steps=2, batch_size=2, **fair_student.CROSS_ENCODER)
    sets = candidate_sets()
    base = [cross_encoder.score([q] * len(ps), ps) for q, ps in zip(QUESTIONS, PASSAGES)]
    ell = [np.array([-3.0, -1.0, -2.0, -4.0][: len(ps)], np.float32) for ps in PASSAGES]  # ℓ prefers the 2nd
    data = base_data(cross_encoder, top_k=3)
    inputs = [TeacherInputs(c, e, None, b) for c, e, b in zip(sets, ell, base)]
    material = ListwiseMaterial(sets, data, inputs, ell, "key", cross_encoder, student_base(cross_encoder, None), None)
    ctx = run_ctx(tmp_path, seed=3)
    framework, _ = listwise_rerankers(node, material, {"q0", "q2"}, ListwiseRun(ctx, "", "cpu", False))
    parts = StudyParts(sets, ell, data, inputs)
    studied, missing = train(node.listwise(3), "likelihood", node.teacher_tau, parts, [0, 2])
    assert missing == 0
    ours = framework["aligned.likelihood"].student.score(data)
    assert np.array_equal(ours, studied.score(data))
    assert not np.allclose(ours, data.base_scores)  # trained: it moved (no test of two untouched copies)
