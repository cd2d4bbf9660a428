"""The listwise teacher's loss, its teachers and its students (the aligned reranker of the likelihood teacher)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from confrag.infra.finite import NonFiniteError
from confrag.reranker.listwise_data import ListTarget, ListwiseData, padded_targets
from confrag.reranker.listwise_student import ListwiseSettings, build_student, fit_listwise
from confrag.reranker.listwise_teachers import TeacherInputs, teacher_targets
from confrag.reranker.loss import listwise_kl
from confrag.retrieval.candidates import Candidates
from confrag.retrieval.corpus import CorpusPassage, document_text
from confrag.retrieval.dense import MeanPoolEncoder

NEG = float("-inf")


def test_listwise_kl_is_the_kl_over_the_valid_candidates():
    scores = torch.tensor([[1.0, 2.0, 0.5, 9.0], [0.0, -1.0, 3.0, 7.0]])
    target = torch.tensor([[0.3, 0.1, 2.0, 5.0], [1.0, 0.0, 0.0, -3.0]])
    mask = torch.tensor([[True, True, True, False], [True, True, True, True]])
    got = listwise_kl(scores, target, mask, temperature=2.0)
    want = []
    for s, t, m in zip(scores, target, mask):
        p = torch.softmax(t[m], 0)
        q = torch.log_softmax(s[m] / 2.0, 0)
        want.append((p * (p.log() - q)).sum())
    assert torch.allclose(got, torch.stack(want).mean(), atol=1e-6)
    # padding never counts: changing a padded entry changes nothing
    scores2 = scores.clone()
    scores2[0, 3] = -50.0
    assert torch.allclose(listwise_kl(scores2, target, mask, 2.0), got)


def test_listwise_kl_is_zero_at_the_target_and_finite_with_zero_probability_targets():
    target = torch.tensor([[0.0, NEG, 0.0, NEG]])
    mask = torch.ones(1, 4, dtype=torch.bool)
    at_target = torch.tensor([[5.0, -30.0, 5.0, -30.0]], requires_grad=True)
    loss = listwise_kl(at_target, target, mask)
    assert loss.item() == pytest.approx(0.0, abs=1e-9)
    away = torch.tensor([[1.0, 3.0, 0.0, 2.0]], requires_grad=True)
    loss = listwise_kl(away, target, mask)
    loss.backward()
    assert torch.isfinite(loss) and loss.item() > 0
    assert torch.isfinite(away.grad).all()
    # the gradient raises the two positives and lowers the two others
    assert (away.grad[0, [0, 2]] < 0).all() and (away.grad[0, [1, 3]] > 0).all()


def test_listwise_kl_refuses_a_row_without_target_and_mismatched_shapes():
    mask = torch.ones(1, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="no candidate with a finite logit"):
        listwise_kl(torch.zeros(1, 3), torch.full((1, 3), NEG), mask)
    with pytest.raises(ValueError, match="share one"):
        listwise_kl(torch.zeros(1, 3), torch.zeros(1, 4), mask)
    with pytest.raises(ValueError, match="must be > 0"):
        listwise_kl(torch.zeros(1, 3), torch.zeros(1, 3), mask, temperature=0.0)


def _candidates(qid: str, own: list[bool], answer: list[bool]) -> Candidates:
    passages = [
        CorpusPassage(f"p{i}", "t", f"text {i}", source_id="gold" if o else f"other{i}") for i, o in enumerate(own)
    ]
    return Candidates(qid, "q?", ("a",), passages, [0.0] * len(own), list(answer), gold_source="gold")


def test_teachers_give_each_its_target_and_none_without_positive():
    c = _candidates("q1", [False, True, True], [True, False, False])
    ell = np.array([-1.0, -2.0, -0.5], dtype=np.float32)
    (lik,), none = teacher_targets("likelihood", [TeacherInputs(c, ell)], temperature=0.5)
    np.testing.assert_allclose(lik, ell / 0.5)
    assert none == 0
    (rel,), _ = teacher_targets("relevance", [TeacherInputs(c, ell)], 1.0)
    np.testing.assert_array_equal(rel, [NEG, 0.0, 0.0])
    (ans,), _ = teacher_targets("answer_bearing", [TeacherInputs(c, ell)], 1.0)
    np.testing.assert_array_equal(ans, [0.0, NEG, NEG])
    lacking = _candidates("q2", [False, False], [False, False])
    targets, none = teacher_targets("relevance", [TeacherInputs(lacking, ell[:2])], 1.0)
    assert targets == [None] and none == 1
    with pytest.raises(ValueError, match="teacher must be one of"):
        teacher_targets("oracle", [], 1.0)
    with pytest.raises(ValueError, match="2 likelihoods|\\(2,\\) likelihoods"):
        teacher_targets("likelihood", [TeacherInputs(c, ell[:2])], 1.0)
    with pytest.raises(NonFiniteError, match="question q1's candidates"):
        teacher_targets("likelihood", [TeacherInputs(c, np.array([0.0, np.nan, 1.0]))], 1.0)


def test_utility_teacher_is_multi_positive_and_leaves_out_what_it_cannot_call():
    # candidates: right / wrong without answer / wrong with the answer string / never answered / right
    c = _candidates("q1", [False] * 5, [True, False, True, False, False])
    ell = np.zeros(5, dtype=np.float32)
    labels = np.array([1, 0, 0, -1, 1], dtype=np.int8)
    (target,), none = teacher_targets("utility", [TeacherInputs(c, ell, labels)], 1.0)
    assert isinstance(target, ListTarget) and none == 0
    np.testing.assert_array_equal(target.logits, [0.0, NEG, NEG, NEG, 0.0])
    # the answer-bearing failure and the unanswered candidate are out of the list, not negatives
    np.testing.assert_array_equal(target.in_list, [True, True, False, False, True])
    targets, none = teacher_targets("utility", [TeacherInputs(c, ell, np.array([0, 0, -1, 0, 0]))], 1.0)
    assert targets == [None] and none == 1
    with pytest.raises(ValueError, match="no answer labels"):
        teacher_targets("utility", [TeacherInputs(c, ell)], 1.0)
    with pytest.raises(ValueError, match=r"one label in \{-1, 0, 1\}"):
        teacher_targets("utility", [TeacherInputs(c, ell, np.array([2, 0, 0, 0, 0]))], 1.0)
    with pytest.raises(ValueError, match="no candidate in the list"):
        ListTarget(np.array([NEG, 0.0]), np.array([True, False]))


QUESTIONS = [
    "who wrote the origin of species",
    "what is the capital of france",
    "when did the berlin wall fall",
    "how many legs does a spider have",
]
PASSAGES = [
    ["Charles Darwin wrote On the Origin of Species in 1859.", "Paris is a city.", "Spiders are arachnids."],
    ["Paris is the capital and largest city of France.", "Lyon is in France.", "The Seine flows."],
    ["The Berlin Wall fell on 9 November 1989.", "Berlin is in Germany.", "Walls are built of stone.", "Cold war."],
    ["Spiders have eight legs.", "Insects have six legs.", "A spider spins webs."],
]


@pytest.fixture(scope="module")
def data() -> ListwiseData:
    encoder = MeanPoolEncoder(device="cpu")
    return ListwiseData.from_lists(
        QUESTIONS, encoder.encode(QUESTIONS), [encoder.encode(p) for p in PASSAGES], passage_texts=PASSAGES
    )


def _settings(student: str, **changes) -> ListwiseSettings:
    values = dict(
        student=student,
        lr=1e-3,
        steps=12,
        batch_size=2,
        warmup_ratio=0.1,
        weight_decay=0.0,
        tau=1.0,
        anchor=0.0,
        seed=3,
        train_embeddings=True,
        train_layers=None,
        precision="32-true",
    )
    values.update(changes)
    return ListwiseSettings(**values)


@pytest.mark.parametrize("student", ["query_tower", "residual_head", "residual_cross_encoder", "cross_encoder"])
def test_a_fresh_student_is_the_base(data, student):
    scores = build_student(_settings(student)).score(data)
    np.testing.assert_allclose(scores[data.mask], data.base_scores[data.mask], atol=1e-4)
    assert np.isneginf(scores[~data.mask]).all()


def _last_first(data: ListwiseData) -> list[np.ndarray]:
    """A target that wants each question's last candidate first: the base puts the first one first."""
    return [np.where(np.arange(m.sum()) == m.sum() - 1, 0.0, -np.inf) for m in data.mask]


@pytest.mark.heavy  # trains each student kind twice (about a minute on 2 cores)
@pytest.mark.parametrize(
    "student,lr", [("query_tower", 2e-4), ("residual_head", 0.05), ("residual_cross_encoder", 1e-3)]
)
def test_training_moves_the_student_to_the_target_and_repeats_with_its_seed(data, student, lr):
    targets = _last_first(data)
    table, _ = padded_targets(targets, data.mask.shape[1])
    mask = torch.from_numpy(data.mask)

    def kl(scores: np.ndarray) -> float:
        return listwise_kl(torch.from_numpy(np.where(data.mask, scores, 0.0)), torch.from_numpy(table), mask).item()

    settings = _settings(student, lr=lr)
    trained = fit_listwise(settings, data, targets)
    after = trained.score(data)
    assert kl(after) < kl(data.base_scores) - 0.05
    again = fit_listwise(settings, data, targets).score(data)
    np.testing.assert_array_equal(after, again)


def test_the_anchor_keeps_the_student_nearer_the_base(data):
    targets = _last_first(data)
    mask = torch.from_numpy(data.mask)
    base = torch.from_numpy(np.where(data.mask, data.base_scores, 0.0))

    def from_base(scores: np.ndarray) -> float:  # KL(base ‖ student): what the anchor penalises
        return listwise_kl(torch.from_numpy(np.where(data.mask, scores, 0.0)), base, mask).item()

    free = fit_listwise(_settings("residual_head", lr=0.05, steps=40, anchor=0.0), data, targets).score(data)
    anchored = fit_listwise(_settings("residual_head", lr=0.05, steps=40, anchor=5.0), data, targets).score(data)
    assert from_base(anchored) < 0.5 * from_base(free)


def test_questions_without_target_are_left_out_and_none_at_all_refused(data):
    targets: list = [None, None, None, None]
    with pytest.raises(ValueError, match="no question has a target"):
        fit_listwise(_settings("residual_head"), data, targets)
    with pytest.raises(ValueError, match="4 questions"):
        fit_listwise(_settings("residual_head"), data, targets[:3])


def test_a_fresh_head_trains_at_its_own_rate_and_the_cache_key_keeps_its_old_form(data):
    """The residual cross-encoder's zero-initialised head at the encoder's lr barely moves (the encoder gets no
    gradient while the head is zero): `head_lr` gives the head its own rate on the same schedule."""
    student = build_student(_settings("residual_cross_encoder", lr=1e-5, head_lr=1e-2, weight_decay=0.01))
    student.trainer = type("T", (), {})()  # configure_optimizers reads only the settings
    optimizer = student.configure_optimizers()["optimizer"]
    head = {id(p) for p in student.head.parameters()}
    rates = {id(p): (g["initial_lr"], g["weight_decay"]) for g in optimizer.param_groups for p in g["params"]}
    assert {rates[i] for i in head} == {(1e-2, 0.01), (1e-2, 0.0)}  # the weight decayed, the bias not
    assert {r for i, r in rates.items() if i not in head} <= {(1e-5, 0.01), (1e-5, 0.0)}
    assert sum(p.numel() for p in student.parameters() if p.requires_grad) == sum(
        p.numel() for g in optimizer.param_groups for p in g["params"]
    )  # every trainable weight in exactly one group
    plain = _settings("residual_cross_encoder")
    assert "head_lr" not in plain.identity() and plain.identity() == {
        k: v for k, v in dataclasses.asdict(plain).items() if k not in ("head_lr", "dropout")
    }  # students trained before the settings existed keep their keys
    assert _settings("residual_cross_encoder", head_lr=1e-3).identity()["head_lr"] == 1e-3
    with pytest.raises(ValueError, match="head_lr is for a student with a fresh head \\(residual_cross_encoder\\)"):
        _settings("query_tower", head_lr=1e-3)


@pytest.mark.heavy  # trains the residual cross-encoder twice
def test_the_residual_cross_encoder_moves_with_a_head_rate_and_not_without(data):
    targets = _last_first(data)

    def correction(**changes) -> float:
        settings = _settings("residual_cross_encoder", lr=1e-5, steps=20, train_layers=1, train_embeddings=False)
        scores = fit_listwise(dataclasses.replace(settings, **changes), data, targets).score(data)
        return float(np.abs(scores[data.mask] - data.base_scores[data.mask]).max())

    assert correction() < 0.5  # the study's finding at this scale: a zero head at lr 1e-5 stays near zero
    assert correction(head_lr=1e-2) > 10 * correction()


def test_settings_refuse_an_unknown_student_and_bad_numbers():
    with pytest.raises(ValueError, match="listwise student must be one of"):
        _settings("tower")
    with pytest.raises(ValueError, match="steps"):
        _settings("query_tower", steps=0)
    with pytest.raises(ValueError, match="tau"):
        _settings("query_tower", tau=0.0)


def test_likelihood_rows_carry_the_graded_list_in_flagembedding_fields():
    from confrag.reranker.listwise_teachers import likelihood_rows
    from confrag.reranker.rows import validate_row

    c = _candidates("q1", [False, True, False], [False, True, False])
    (row,) = likelihood_rows([c], [np.array([-2.0, -0.25, -1.0])])
    assert row["pos"] == [document_text(c.passages[1])]
    assert row["neg"] == [document_text(c.passages[0]), document_text(c.passages[2])]
    assert row["pos_scores"] == [-0.25] and row["neg_scores"] == [-2.0, -1.0]
    assert validate_row(row, "row") == row
    with pytest.raises(ValueError, match="3 candidates, 2"):
        likelihood_rows([c], [np.array([-2.0, -0.25])])


def test_a_candidate_left_out_of_the_list_is_not_pushed_down(data):
    """The same target (each question's last candidate first) with the base's own top candidate once a negative
    and once left out of the list: only as a negative is it pushed below where the base had it."""
    targets = _last_first(data)
    top = [int(np.argmax(data.base_scores[i])) for i in range(len(targets))]
    left_out = [ListTarget(t, np.arange(len(t)) != j) for t, j in zip(targets, top)]
    settings = _settings("residual_head", lr=0.05, steps=30)
    as_negative = fit_listwise(settings, data, targets).score(data)
    out_of_list = fit_listwise(settings, data, left_out).score(data)

    def top_margin(scores: np.ndarray) -> float:  # the base's top candidate against the target's positive
        return float(np.mean([scores[i, j] - scores[i, data.mask[i].sum() - 1] for i, j in enumerate(top)]))

    base_margin = top_margin(data.base_scores)
    assert top_margin(as_negative) < base_margin - 1.0
    # left out, it gets no gradient of its own (it moves only as far as the shared head moves it)
    assert top_margin(out_of_list) > top_margin(as_negative) + 0.5


@pytest.mark.parametrize("dropout", [False, True])
def test_the_students_encoder_trains_with_dropout_only_when_asked_and_the_key_says_so(
    data, monkeypatch, recwarn, dropout
):
    from confrag.reranker.listwise_student import ResidualCrossEncoderStudent

    seen = []
    step = ResidualCrossEncoderStudent.training_step

    def recording(self, batch, batch_idx):
        seen.append({m.training for m in self.encoder.modules()})
        return step(self, batch, batch_idx)

    monkeypatch.setattr(ResidualCrossEncoderStudent, "training_step", recording)
    settings = _settings(
        "residual_cross_encoder", steps=2, train_layers=1, train_embeddings=False, head_lr=1e-3, dropout=dropout
    )
    student = fit_listwise(settings, data, _last_first(data))
    assert seen and all(modes == {dropout} for modes in seen)  # every encoder module in the mode asked for
    assert not student.training  # and scoring in eval mode after the fit
    assert not [w for w in recwarn if "in eval mode" in str(w.message)]  # eval mode as asked is no warning
    assert ("dropout" in settings.identity()) == dropout  # off: the key of every student trained before the setting
