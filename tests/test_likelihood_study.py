"""The likelihood studies' own code (confrag.studies, what experiments/fair_student.py, likelihood_teacher.py and
likelihood_training.py run): the combined loss, the anchor on every student kind, the base's top k, the folds, the
rows that read ℓ, the utility labels, --picks-from, Holm across a study's rows, the verdict and the pre-check."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from confrag.data.nq import QARow
from confrag.rag.answers import ScoredAnswer
from confrag.rag.stats import holm, mcnemar_exact
from confrag.reranker.listwise_data import ListwiseData, list_batch
from confrag.reranker.listwise_student import STUDENTS, build_student
from confrag.retrieval.candidates import Candidates
from confrag.retrieval.corpus import CorpusPassage
from confrag.studies import fair_report, fair_student
from confrag.studies.fair_student import TRAINING, Choice
from confrag.studies.frozen_precheck import Shortlist, frozen_precheck
from confrag.studies.likelihood_study import Folds, Study, earlier_run, likelihood_choices, utility_labels

QUESTIONS = ["who wrote the origin of species", "what is the capital of france", "when did the berlin wall fall"]
PASSAGES = [
    ["Charles Darwin wrote On the Origin of Species in 1859.", "Paris is a city.", "Spiders are arachnids."],
    ["Paris is the capital and largest city of France.", "Lyon is in France.", "The Seine flows.", "Rome."],
    ["The Berlin Wall fell on 9 November 1989.", "Berlin is in Germany.", "Walls are built of stone."],
]


@pytest.fixture(scope="module")
def data() -> ListwiseData:
    from confrag.retrieval.dense import MeanPoolEncoder

    encoder = MeanPoolEncoder(device="cpu")
    return ListwiseData.from_lists(
        QUESTIONS, encoder.encode(QUESTIONS), [encoder.encode(p) for p in PASSAGES], passage_texts=PASSAGES
    )


def _perturbed(student) -> None:
    """Move every student kind away from the base, so that the anchor term is not zero."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in student.named_parameters():
            if name.startswith("head") or name.endswith("attention.output.dense.weight"):
                p.add_(0.05 * torch.randn(p.shape, generator=generator))


def _hand_kl(target_logits: torch.Tensor, scores: torch.Tensor, mask: torch.Tensor) -> float:
    rows = []
    for t, s, m in zip(target_logits, scores, mask):
        p = torch.softmax(t[m], 0)
        rows.append((p * (torch.log_softmax(t[m], 0) - torch.log_softmax(s[m], 0))).sum())
    return float(torch.stack(rows).mean())


@pytest.mark.parametrize("student", sorted(STUDENTS))
def test_the_combined_loss_is_kl_plus_lambda_anchor_at_a_temperature_other_than_one(data, student):
    """training_step's loss against a hand computation: KL(softmax(t) ‖ softmax(f/τ)) + λ·KL(softmax(base/τ) ‖
    softmax(f/τ)), τ = 4, λ = 0.7, over the base's top 2 (the rest of each list out of the loss)."""
    tau, anchor = 4.0, 0.7
    settings = replace(TRAINING, student=student, tau=tau, anchor=anchor)
    model = build_student(settings)
    _perturbed(model)
    top2 = data.top_k(2)
    targets = np.where(top2.mask, np.arange(top2.mask.shape[1])[None, :] * -0.5, -np.inf).astype(np.float32)
    batch = list_batch(top2, [0, 1, 2], targets)
    with torch.no_grad():
        loss = float(model.training_step(batch, 0))
        f = model.scores(batch).float()
    mask = batch["mask"]
    assert mask.sum(dim=1).tolist() == [2, 2, 2]
    want = _hand_kl(batch["target"], f / tau, mask) + anchor * _hand_kl(batch["base"] / tau, f / tau, mask)
    assert loss == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert _hand_kl(batch["base"] / tau, f / tau, mask) > 1e-6, "the perturbed student must differ from the base"


def test_top_k_keeps_the_base_top_k_and_students_choose_among_them(data):
    top2 = data.top_k(2)
    order = np.argsort(-data.base_scores, axis=1, kind="stable")
    for i in range(len(QUESTIONS)):
        assert set(np.flatnonzero(top2.mask[i])) == set(order[i, :2])
    scores = build_student(replace(TRAINING, student="residual_cross_encoder")).score(top2)
    assert np.isneginf(scores[~top2.mask]).all() and np.isfinite(scores[top2.mask]).all()
    assert data.top_k(None) is data
    with pytest.raises(ValueError, match="top_k"):
        data.top_k(0)


def test_frozen_word_embeddings_do_not_train(data):
    for kind in ("query_tower", "residual_cross_encoder"):
        frozen = build_student(replace(TRAINING, student=kind, train_embeddings=False))
        trained = build_student(replace(TRAINING, student=kind, train_embeddings=True))
        assert not frozen.encoder.get_input_embeddings().weight.requires_grad
        assert trained.encoder.get_input_embeddings().weight.requires_grad


def _candidates(qid: str, n: int = 4, gold: int | None = 0) -> Candidates:
    passages = [CorpusPassage(f"{qid}p{j}", "t", f"text {j}", source_id=f"{qid}-{j}") for j in range(n)]
    gold_source = f"{qid}-{gold}" if gold is not None else None
    return Candidates(
        qid, f"question {qid}?", ("a",), passages, [float(n - j) for j in range(n)], [False] * n, gold_source
    )


def _study(n: int = 30, dev: int = 6) -> Study:
    sets = [_candidates(f"q{i}") for i in range(n)]
    rows = [QARow(c.qid, c.question, c.answers, ()) for c in sets] + [QARow("other", "other?", ("b",), ())]
    dev_ids = frozenset(c.qid for c in sets[:dev])
    return Study(None, rows[:n], sets, dev_ids, frozenset(c.qid for c in sets[dev:]), 0, None, rows)


def test_folds_cover_the_test_questions_once_and_training_never_sees_its_fold_or_dev():
    study = _study()
    folds = Folds.of(study, 3)
    flat = [i for fold in folds.folds for i in fold]
    assert sorted(flat) == study.test_at and len(set(flat)) == len(flat)
    for k, fold in enumerate(folds.folds):
        rows = folds.training(k)
        assert not set(rows) & set(fold) and not set(rows) & set(study.dev_at)
        assert sorted(rows) == sorted(set(study.test_at) - set(fold))
        small = folds.training(k, at_most=5)
        assert len(small) == 5 and set(small) <= set(rows) and small == folds.training(k, at_most=5)
    assert Folds.of(study, 3).folds == folds.folds  # seeded: the same study gives the same folds
    leaking = Folds(study, [folds.folds[0], folds.folds[1] + study.dev_at[:1], folds.folds[2]])
    with pytest.raises(AssertionError, match="dev questions in training"):
        leaking.training(0)
    assert [r.qid for r in study.outside()] == ["other"]


def test_the_rows_that_read_the_likelihood_choose_as_documented():
    base = np.array([3.0, 2.9, 1.0, 0.5, 0.4])
    ell = np.array([-3.0, -1.0, -2.0, -0.1, -5.0])
    got = likelihood_choices(base, ell, 0.25)
    assert got["base"] == 0 and got["bm25"] == 0 and got["likelihood"] == 3
    assert got["base_top3_by_likelihood"] == 1  # among the base's top 3 (0, 1, 2), ℓ prefers 1
    z = lambda x: (x - x.mean()) / (x.std() + 1e-9)  # noqa: E731
    assert got["fusion"] == int(np.argmax(z(base) + 0.25 * z(ell))) == 1  # the near-tie broken by ℓ


class _FakeOutcomes:
    """Answers right exactly where (question, candidate) is in `right`; records every call."""

    def __init__(self, sets, right: set) -> None:
        self.sets, self.right, self.asked = sets, right, []
        self.store = type("Store", (), {"generated": 0})()

    def __call__(self, at, picks):
        self.asked.append(list(zip(at, picks)))
        return [ScoredAnswer("x", (i, j) in self.right, False, 0.0) for i, j in zip(at, picks)]


def test_utility_labels_map_each_rank_to_its_candidate_by_the_base_order():
    sets = [_candidates("a", 4), _candidates("b", 3)]
    base = np.array([[0.1, 0.9, 0.5, 0.3], [2.0, 1.0, 3.0, -np.inf]])
    outcomes = _FakeOutcomes(sets, right={(0, 2), (1, 0)})
    labels = utility_labels(outcomes, base, depth=2)
    # question a: base order 1, 2, 3, 0 -> ranks 1-2 are candidates 1 and 2; b: order 2, 0, 1 -> candidates 2 and 0
    np.testing.assert_array_equal(labels[0], [-1, 0, 1, -1])
    np.testing.assert_array_equal(labels[1], [1, -1, 0])
    assert outcomes.asked == [[(0, 1), (1, 2)], [(0, 2), (1, 0)]]  # rank by rank over every question


def test_picks_from_reads_an_earlier_run_of_the_same_questions_only(tmp_path):
    (tmp_path / "picks.json").write_text(json.dumps({"qids": ["q1", "q2"], "picks": {"base": [0, 1]}}))
    (tmp_path / "metrics.json").write_text(json.dumps({"chosen": {"lr": 1e-5}, "dev": []}))
    assert earlier_run(tmp_path, ["q1", "q2"])["picks"] == {"base": [0, 1]}
    with pytest.raises(ValueError, match="not this study's"):
        earlier_run(tmp_path, ["q2", "q1"])


def _answers(flags) -> list[ScoredAnswer]:
    return [ScoredAnswer("x", bool(f), False, float(f)) for f in flags]


def test_holm_runs_across_every_row_of_a_study():
    rng = np.random.default_rng(0)
    base = rng.random(200) < 0.35
    rows = {"base": base, "a": base | (rng.random(200) < 0.1), "b": base & (rng.random(200) < 0.9), "c": base.copy()}
    got = fair_report.compare(["a", "b", "c"], {k: _answers(v) for k, v in rows.items()})
    raw = [mcnemar_exact(rows[k].astype(float), base.astype(float)).pvalue for k in ("a", "b", "c")]
    assert [r.holm for r in got[1:]] == pytest.approx(holm(raw))
    assert got[1].only_base == 0 and got[1].only_row == int((rows["a"] & ~base).sum())
    assert got[3].diff[0] == 0.0 and got[0].name == "base" and got[0].diff is None


def test_the_verdict_checks_every_part_of_the_success_criterion():
    rows = [fair_report.RowResult("base", [0.35, 0.33, 0.37], 0.12)]
    good = fair_report.RowResult("residual_ce@0", [0.37, 0.35, 0.39], 0.125, [0.015, 0.008, 0.022], 30, 9, 0.01, 0.005)
    fits = [{"row": "residual_ce", "held_out": 0.84, "held_out_base": 0.80} for _ in range(3)]
    seeds = {"residual_ce@0": 0.015, "residual_ce@1": 0.012, "residual_ce@2": 0.011}
    met, lines = fair_report.verdict([*rows, good], seeds, fits, 0.80)
    assert met and all(line.lstrip("- (").startswith(("met", "the other reading")) for line in lines)
    assert lines[0] == "- met: held-out agreement with ℓ's top-1 ≥ 82.0 % (the base's 80.0 + 2) in every fold"
    fits[1] = {"row": "residual_ce", "held_out": 0.81, "held_out_base": 0.80}  # one fold short of +2 points
    assert not fair_report.verdict([*rows, good], seeds, fits, 0.80)[0]
    # the design's bar is the base's agreement over every test question + 2, whatever a fold's own base
    fits[1] = {"row": "residual_ce", "held_out": 0.825, "held_out_base": 0.81}
    met, lines = fair_report.verdict([*rows, good], seeds, fits, 0.80)
    assert met and lines[1] == "  (the other reading, each fold's own base + 2: not met)"
    assert not fair_report.verdict([*rows, good], seeds, fits, 0.81)[0]
    fits[1] = fits[0]
    assert not fair_report.verdict([*rows, good], {**seeds, "residual_ce@2": -0.001}, fits, 0.80)[0]
    assert not fair_report.verdict([*rows, good], {k: -0.01 for k in seeds}, fits, 0.80)[0]  # one direction: a loss
    assert not fair_report.verdict([*rows, good], {k: 0.0 for k in seeds}, fits, 0.80)[0]
    assert not fair_report.verdict([*rows, replace(good, holm=0.2)], seeds, fits, 0.80)[0]
    assert not fair_report.verdict([*rows, replace(good, f1_diff=-0.001)], seeds, fits, 0.80)[0]


def test_dev_choice_keeps_the_earlier_grid_point_on_a_tie(monkeypatch):
    a, b = replace(TRAINING, lr=1e-5), replace(TRAINING, lr=3e-5)
    scores = {1e-5: [(0.30, 0.5), (0.32, 1.0)], 3e-5: [(0.32, 0.5), (0.31, 1.0)]}
    monkeypatch.setattr(fair_student, "_dev", lambda inputs, row, settings, tau_t, weights: scores[settings.lr])
    got = fair_student.choose(None, "x", [(a, 2.0), (b, 2.0)], (0.5, 1.0))
    assert got == Choice(a, 2.0, 1.0, 0.32)  # the later 0.32 (lr 3e-5) ties and loses to the smaller change


def test_the_precheck_sees_a_preference_the_frozen_features_carry_and_not_one_they_do_not():
    rng = np.random.default_rng(0)
    n_q, k = 300, 3
    features, labels, owner, ranks = [], [], [], []
    for q in range(n_q):
        signal = rng.normal(size=k)
        choice = int(np.argmax(signal))
        for rank in range(k):
            control = [3.0 - rank, -float(rank), rank]
            features.append(np.concatenate([control, [signal[rank]], rng.normal(size=4)]))
            labels.append(int(rank == choice))
            owner.append(q)
            ranks.append(rank)
    sl = Shortlist(np.array(features), np.array(labels), np.array(owner), np.array(ranks))
    folds = [list(range(0, 100)), list(range(100, 200)), list(range(200, 300))]
    rows = {(r.model, r.features): r for r in frozen_precheck(sl, folds, resamples=50, models=("logistic",))}
    assert rows[("logistic", "frozen")].auroc > 0.85 > rows[("logistic", "control")].auroc + 0.2
    assert rows[("logistic", "frozen")].top1_is_ells > rows[("base", "control")].top1_is_ells + 0.3
    low, high = rows[("logistic", "frozen")].auroc_ci
    assert low < rows[("logistic", "frozen")].auroc < high


def test_holm_from_counts_recomputes_the_500_question_tables_column():
    """The 9 rows of the 500-question likelihood study (docs/results.md), Holm from their discordant counts."""
    counts = {"oracle": (15, 8), "r1_lsr": (4, 18), "r1_relevance": (2, 11), "r1_answer_bearing": (4, 12),
              "r1_residual": (0, 0), "r2_lsr": (2, 3), "r2_relevance": (0, 1), "r2_answer_bearing": (0, 3),
              "r2_residual": (0, 0)}  # fmt: skip
    got = {k: round(v[1], 3) for k, v in fair_report.holm_from_counts(counts).items()}
    assert got == {"oracle": 1.0, "r1_lsr": 0.039, "r1_relevance": 0.18, "r1_answer_bearing": 0.538,
                   "r1_residual": 1.0, "r2_lsr": 1.0, "r2_relevance": 1.0, "r2_answer_bearing": 1.0,
                   "r2_residual": 1.0}  # fmt: skip


def test_a_trained_student_is_read_back_by_its_training_and_scores_every_w_from_one_forward(data, tmp_path):
    """The study resumes from its store: the same settings, teacher, τ_T and questions read the student back (no
    second fit), anything else trains anew; a residual student's scores at w are base + w·(f₁ − base), as the
    student itself scores at w; a damaged scores file is trained again, not read."""
    from confrag.studies.trained_students import SCORES, StudentStore

    top2 = data.top_k(2)
    store = StudentStore.of(tmp_path, top2, [np.zeros(3, dtype=np.float32)] * 3, ["q0", "q1", "q2"])
    settings = replace(TRAINING, student="residual_head", steps=1)
    fits = []

    def fit():
        fits.append(1)
        student = build_student(settings)
        _perturbed(student)
        return student

    first = store.get(settings, "likelihood", 2.0, [0, 1], fit)
    again = store.get(settings, "likelihood", 2.0, [0, 1], fit)
    assert len(fits) == 1 and np.array_equal(first.scores, again.scores)
    student = again.load()
    for w in (0.5, 2.0):
        student.weight_at_scoring = w
        np.testing.assert_allclose(again.at([0, 2], w), student.score(top2)[[0, 2]], rtol=1e-5, atol=1e-5)
    assert np.isneginf(again.at([0, 1, 2], 0.5)[~top2.mask]).all()
    store.get(settings, "likelihood", 2.0, [0], fit)
    store.get(settings, "likelihood", 0.5, [0, 1], fit)
    store.get(replace(settings, lr=3e-3), "likelihood", 2.0, [0, 1], fit)
    other = StudentStore.of(tmp_path, top2, [np.ones(3, dtype=np.float32)] * 3, ["q0", "q1", "q2"])  # another ℓ
    other.get(settings, "likelihood", 2.0, [0, 1], fit)
    assert len(fits) == 5
    (first.folder / SCORES).write_bytes((first.folder / SCORES).read_bytes()[:-4] + b"\0\0\0\0")
    store.get(settings, "likelihood", 2.0, [0, 1], fit)
    assert len(fits) == 6


def test_agreement_reads_each_measure_as_its_teacher_sees_it_and_the_fair_study_uses_the_same():
    from confrag.reranker.listwise_fit import StudyParts, agreement, fit_lines

    sets = [_candidates("a", 3, gold=1), _candidates("b", 3, gold=None), _candidates("c", 3, gold=2)]
    ell = [np.array([-1.0, -3.0, -2.0]), np.array([-2.0, -0.5, -3.0]), np.array([-1.0, -2.0, -0.1])]
    utility = [np.array([1, 0, -1]), np.array([0, 0, 1]), np.array([-1, -1, 1])]
    base = np.array([[3.0, 2.0, 1.0], [1.0, 3.0, 2.0], [1.0, 2.0, 3.0]], dtype=np.float32)
    data = type("Data", (), {"base_scores": base})()
    parts = StudyParts(sets, ell, data, [], utility)
    rows = [0, 1, 2]
    # ℓ's top-1: 0, 1, 2; the base's: 0, 1, 2 -> all three agree
    assert agreement("likelihood", parts, rows, base) == 1.0
    moved = np.array([[1.0, 2.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])  # top-1s 1, 1, 2
    assert agreement("likelihood", parts, rows, moved) == pytest.approx(2 / 3)
    # relevance: over the questions whose own paragraph was retrieved (a, c; b has no known gold)
    assert agreement("relevance", parts, rows, moved) == 1.0 and agreement("relevance", parts, rows, base) == 0.5
    assert agreement("utility", parts, rows, base) == pytest.approx(2 / 3)  # right under a's 0 and c's 2
    # scores aligned with the rows they are given, not with the study's positions
    assert agreement("likelihood", parts, [2, 0], base[[2, 0]]) == 1.0
    fits = fit_lines(parts, {"lsr": [([0, 1], moved[[0, 1]])]}, {"lsr": [moved]}, [[2], [0, 1]])
    assert fits == [
        {
            "student": "lsr@0 fit",
            "measure": "= ℓ's top-1",
            "training_questions": 0.5,
            "training_questions_base": 1.0,
            "held_out": pytest.approx(2 / 3),
            "held_out_base": 1.0,
        }
    ]
    # the fair study's measure is the library's (one definition of "= ℓ's top-1" and "own ¶ first")
    inputs = type("Inputs", (), {"parts": parts})()
    for teacher in ("likelihood", "relevance"):
        assert fair_student.agreement(inputs, teacher, rows, moved) == agreement(teacher, parts, rows, moved)


def test_the_controls_loss_is_the_kl_the_student_trains_on_over_its_mask_at_its_temperatures():
    from confrag.reranker.listwise_fit import StudyParts, listwise_loss
    from confrag.reranker.listwise_teachers import TeacherInputs

    sets = [_candidates("a", 3, gold=1), _candidates("b", 3, gold=None), _candidates("c", 3, gold=2)]
    ell = [np.array([-1.0, -3.0, -2.0]), np.array([-2.0, -0.5, -3.0]), np.array([-1.0, -2.0, -0.1])]
    mask = np.array([[True, True, False], [True, True, True], [True, True, True]])
    data = ListwiseData(["a", "b", "c"], np.zeros((3, 0), np.float32), np.zeros((3, 3, 0), np.float32), mask)
    parts = StudyParts(sets, ell, data, [TeacherInputs(c, e) for c, e in zip(sets, ell)])
    scores = np.array([[3.0, 2.0, -np.inf], [1.0, 3.0, 2.0], [1.0, 2.0, 3.0]], dtype=np.float32)
    m = torch.from_numpy(mask)
    # ℓ / τ_T against f / τ over each question's mask, averaged over the three questions
    expected = _hand_kl(torch.tensor(np.stack(ell) / 0.5, dtype=torch.float32), torch.from_numpy(scores) / 4, m)
    assert listwise_loss("likelihood", 0.5, 4.0, parts, [0, 1, 2], scores) == pytest.approx(expected, rel=1e-5)
    # relevance: only the questions whose own paragraph lies inside the mask (a's candidate 1; c's 2), one-hot there
    # (−log softmax(f)[own]: a's log(e³ + e²) − 2, c's log(e + e² + e³) − 3; b has no own paragraph)
    expected = (np.log1p(np.exp(1.0)) + np.log(np.exp([1.0, 2.0, 3.0]).sum()) - 3.0) / 2
    assert listwise_loss("relevance", 2.0, 1.0, parts, [0, 1, 2], scores) == pytest.approx(expected, rel=1e-5)


def test_the_matched_teacher_tau_gives_the_teacher_the_base_top1_mass_at_the_students_tau():
    # ℓ = base / 2 on every candidate: softmax(ℓ / τ_T) is softmax(base / τ) exactly at τ_T = τ / 2
    rng = np.random.default_rng(0)
    base = rng.normal(size=(40, 6)).astype(np.float32) * 5
    data = ListwiseData.from_lists([f"q{i}" for i in range(40)], np.zeros((40, 0), np.float32),
                                   [np.zeros((6, 0), np.float32)] * 40, base_scores=list(base)).top_k(4)  # fmt: skip
    inputs = type("Inputs", (), {"data": data, "ell": list(base / 2)})()
    assert fair_student.matched_teacher_tau(inputs, list(range(40)), 1.0) == pytest.approx(0.5, rel=2e-3)
    assert fair_student.matched_teacher_tau(inputs, list(range(0, 40, 2)), 8.0) == pytest.approx(4.0, rel=2e-3)


def test_the_controls_are_the_designs_twelve_and_the_fit_checks_differ_only_in_their_temperatures():
    from confrag.studies.fair_student import CONTROL_LRS, CONTROLS, FIT_CHECKS, MATCHED, SMALL_TRAIN

    assert len(CONTROLS) == 12 and len(set(CONTROLS)) == 12
    for row in ("residual_ce", "tower"):
        mine = [c for c in CONTROLS if c.row == row]
        assert {(c.teacher, c.at_most, c.lr) for c in mine} == {
            (t, n, lr) for t, n in [("likelihood", None), ("likelihood", SMALL_TRAIN), ("relevance", None)]
            for lr in CONTROL_LRS
        }  # fmt: skip
        assert all(c.tau is None and c.teacher_tau is None for c in mine)  # the row's dev choice: the stored keys
    checks = [(c.teacher, c.tau, c.teacher_tau) for c in FIT_CHECKS]
    assert checks == [("relevance", 1.0, None), ("likelihood", 1.0, MATCHED)]
    assert {c.row for c in FIT_CHECKS} == {"residual_ce"} and {c.lr for c in FIT_CHECKS} == {3e-5}


def test_a_control_line_names_tau_t_only_for_a_teacher_that_divides_by_it():
    common = {"row": "residual_ce", "lr": 3e-5, "tau": 1.0, "teacher_tau": 0.321, "training_questions": 933,
              "trained": 0.95, "trained_base": 0.93, "held_out": 0.91, "held_out_base": 0.92, "loss_trained": 0.14,
              "loss_trained_base": 0.19, "loss_held_out": 0.2, "loss_held_out_base": 0.21,
              "moved_where_trained": 0.04, "mean_correction": 0.5}  # fmt: skip
    relevance, ell = fair_report.control_lines(
        [{**common, "teacher": "relevance", "name": "r"}, {**common, "teacher": "likelihood", "name": "l"}]
    )
    assert "τ 1, 933 questions" in relevance and "τ_T" not in relevance
    assert "τ 1, τ_T 0.321, 933 questions: 95.0 % where it trained (base 93.0 %), 91.0 % held out" in ell
    assert "loss 0.190 → 0.140 where it trained, 0.210 → 0.200 held out" in ell


def test_the_controls_train_the_designs_students_and_the_fit_checks_at_their_own_temperatures(monkeypatch):
    from confrag.studies.fair_student import CONTROLS, FIT_CHECKS, FairInputs, controls

    study = _study(30, 6)
    rng = np.random.default_rng(0)
    base = [rng.normal(size=4).astype(np.float32) * 4 for _ in study.candidate_sets]
    data = ListwiseData.from_lists([c.question for c in study.candidate_sets], np.zeros((30, 0), np.float32),
                                   [np.zeros((4, 0), np.float32)] * 30, base_scores=base).top_k(3)  # fmt: skip
    ell = [rng.normal(size=4).astype(np.float32) for _ in study.candidate_sets]
    inputs = FairInputs(study, ell, data, Folds.of(study, 3), None, None)
    calls = []

    def train(inputs, settings, teacher, tau_t, rows):
        calls.append((settings, teacher, tau_t, list(rows)))
        return type("Stored", (), {"at": lambda self, at, w: data.base_scores[at]})()

    monkeypatch.setattr(fair_student, "train", train)
    choice = Choice(replace(TRAINING, lr=3e-5, anchor=0.1, tau=8.0), 2.0, 1.0, 0.3)
    out = controls(inputs, {"residual_ce": choice, "tower": choice}, (*CONTROLS, *FIT_CHECKS), lambda _: None)
    assert len(out) == len(calls) == 14
    for spec, (settings, teacher, tau_t, rows) in zip(CONTROLS, calls):  # the stored students' keys, as designed
        assert settings == replace(choice.settings, lr=spec.lr, anchor=0.0, seed=0) and tau_t == 2.0
        assert teacher == spec.teacher and rows == inputs.folds.training(0, spec.at_most)
    (relevance, _, tau_r, _), (sharpened, teacher, tau_t, rows) = calls[-2:]
    assert relevance.tau == sharpened.tau == 1.0 and tau_r == 2.0 and teacher == "likelihood"
    assert tau_t == fair_student.matched_teacher_tau(inputs, rows, 1.0) != 2.0
    assert all(o["moved_where_trained"] == 0.0 and o["trained"] == o["trained_base"] for o in out)  # the base itself
