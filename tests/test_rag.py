"""RAG pipeline: answers cached per prompt (shared across K and rerankers, resumable), top-K selection,
outcome records, and the Table 2 statistics."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
from scipy.stats import binomtest, bootstrap

import confrag.rag.answers as answers_module
from confrag.data.qa_metrics import exact_match, has_answer, token_f1
from confrag.llm.generation import generate_greedy
from confrag.llm.prompted import PromptedLLM
from confrag.rag import (
    AnswerStore,
    QuestionOutcome,
    accuracy_ci,
    load_outcomes_jsonl,
    mcnemar_exact,
    run_rag,
    save_outcomes_jsonl,
    table2_markdown,
    table2_rows,
)
from confrag.rag.answers import ScoredAnswer
from confrag.rag.pipeline import RagAnswer
from confrag.rag.stats import SMALL_N, detectable_difference, holm, paired_difference, wilson
from confrag.retrieval.candidates import make_candidates
from confrag.retrieval.corpus import CorpusPassage

MAX_NEW = 6


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one intra-op thread


@pytest.fixture
def counted(monkeypatch):
    """generate_greedy as the store sees it, counting the prompts it is asked to answer."""
    calls: list[int] = []

    def counting(model, tokenizer, prompts, *args, **kwargs):
        calls.append(len(prompts))
        return generate_greedy(model, tokenizer, prompts, *args, **kwargs)

    monkeypatch.setattr(answers_module, "generate_greedy", counting)
    return calls


def store(llm, templates, cache, **kwargs):
    return AnswerStore(
        PromptedLLM(llm, templates),
        cache,
        max_new_tokens=kwargs.pop("max_new_tokens", MAX_NEW),
        progress=False,
        **kwargs,
    )


def candidates_for(rows, per_question=3):
    """Each question's own gold paragraph plus the next questions' ones, gold first."""
    out = []
    for i, row in enumerate(rows):
        picks = [rows[(i + j) % len(rows)] for j in range(per_question)]
        passages = [
            CorpusPassage(pid=f"{r.qid}#0", title=r.contexts[0].title, text=r.contexts[0].text, source_id=r.qid)
            for r in picks
        ]
        out.append(
            make_candidates(row.qid, row.question, row.answers, passages, [3.0, 2.0, 1.0][:per_question], row.qid)
        )
    return out


# ---------------------------------------------------------------- the answer cache


def test_store_answers_equal_plain_generation_and_a_second_store_generates_nothing(
    tiny_llama, templates, nq_rows, tmp_path, counted
):
    rows = nq_rows[:5]
    items = [(row.question, ()) for row in rows] + [(row.question, row.contexts[:1]) for row in rows]
    first = store(tiny_llama, templates, tmp_path)
    got = first.answer(items)
    prompts = [first.prompt(q, c) for q, c in items]
    assert prompts[0] == templates.qa_prompt(tiny_llama.tokenizer, rows[0].question)
    assert prompts[5] == templates.rag_prompt(tiny_llama.tokenizer, rows[0].question, rows[0].contexts[:1])
    assert got == generate_greedy(tiny_llama.model, tiny_llama.tokenizer, prompts, MAX_NEW, progress=False)
    assert sum(counted) == 10 and first.generated == 10
    again = store(tiny_llama, templates, tmp_path)  # a new process, same cache
    assert again.answer(list(reversed(items))) == list(reversed(got))
    assert sum(counted) == 10 and again.generated == 0 and again.reused == 10


def test_other_generation_settings_or_model_miss_the_cache(
    tiny_llama, tiny_qwen2, templates, nq_rows, tmp_path, counted
):
    items = [(row.question, ()) for row in nq_rows[:3]]
    store(tiny_llama, templates, tmp_path).answer(items)
    store(tiny_llama, templates, tmp_path, max_new_tokens=MAX_NEW + 1).answer(items)
    store(tiny_qwen2, templates, tmp_path).answer(items)
    assert counted == [3, 3, 3]


def test_killed_run_resumes_to_the_uninterrupted_result(tiny_llama, templates, nq_rows, tmp_path, monkeypatch):
    items = [(row.question, row.contexts[:1]) for row in nq_rows[:7]]
    reference = store(tiny_llama, templates, tmp_path / "clean", chunk_size=2).answer(items)

    calls = []

    def dies_on_third_chunk(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt  # the process is killed while generating
        return generate_greedy(*args, **kwargs)

    monkeypatch.setattr(answers_module, "generate_greedy", dies_on_third_chunk)
    with pytest.raises(KeyboardInterrupt):
        store(tiny_llama, templates, tmp_path / "killed", chunk_size=2).answer(items)
    monkeypatch.setattr(answers_module, "generate_greedy", generate_greedy)
    resumed = store(tiny_llama, templates, tmp_path / "killed", chunk_size=2)
    assert resumed.answer(items) == reference
    assert resumed.reused == 4 and resumed.generated == 3  # two whole chunks survived; 3 prompts were left


def test_damaged_chunk_is_regenerated(tiny_llama, templates, nq_rows, tmp_path, counted, caplog):
    items = [(row.question, ()) for row in nq_rows[:4]]
    reference = store(tiny_llama, templates, tmp_path, chunk_size=2).answer(items)
    shard = sorted(tmp_path.glob("answers/*/*/shard-00000.json"))[0]
    shard.write_text('["truncated')
    with caplog.at_level(logging.WARNING):
        assert store(tiny_llama, templates, tmp_path, chunk_size=2).answer(items) == reference
    assert counted == [2, 2, 2] and "damaged" in caplog.text


# ---------------------------------------------------------------- the pipeline


def test_k1_then_k3_and_a_second_reranker_reuse_answers(tiny_llama, templates, nq_rows, tmp_path, counted):
    rows = nq_rows[:4]
    cands = candidates_for(rows)
    answers = store(tiny_llama, templates, tmp_path)
    run_rag(rows, cands, answers, ks=[1])
    assert sum(counted) == 8  # closed book + top-1
    run_rag(rows, cands, answers, ks=[1, 3])
    assert sum(counted) == 12  # only the top-3 prompts are new
    # Another reranker with the same top-1 but a different order below it: only its top-3 prompts are new.
    demote_second = lambda question, passages: np.array([3.0, 1.0, 2.0])  # noqa: E731
    run = run_rag(rows, cands, answers, ks=[1, 3], reranker=demote_second)
    assert sum(counted) == 16
    assert [o.rag[3].contexts for o in run.outcomes][0] == (
        cands[0].passages[0].pid,
        cands[0].passages[2].pid,
        cands[0].passages[1].pid,
    )


def test_outcomes_hold_scored_answers_for_the_reranked_top_k(tiny_llama, templates, nq_rows, tmp_path):
    rows = nq_rows[:3]
    cands = candidates_for(rows)
    reverse = lambda question, passages: np.arange(len(passages), dtype=float)  # noqa: E731 (last first)
    run = run_rag(
        rows,
        cands,
        store(tiny_llama, templates, tmp_path),
        ks=(3, 1),
        reranker=reverse,
        confidences={row.qid: 0.25 * i for i, row in enumerate(rows)},
    )
    assert run.ks == (1, 3) and run.capped == {1: 0, 3: 0}
    plain = lambda prompts: generate_greedy(
        tiny_llama.model,
        tiny_llama.tokenizer,
        prompts,
        MAX_NEW,  # noqa: E731
        progress=False,
    )
    for i, (row, outcome, cand) in enumerate(zip(rows, run.outcomes, cands)):
        top = cand.passages[::-1]
        assert outcome.rag[1].contexts == (top[0].pid,) and outcome.rag[3].contexts == tuple(p.pid for p in top)
        expected = plain(
            [
                templates.qa_prompt(tiny_llama.tokenizer, row.question),
                templates.rag_prompt(tiny_llama.tokenizer, row.question, top[:1]),
                templates.rag_prompt(tiny_llama.tokenizer, row.question, top),
            ]
        )
        assert [outcome.closed_book.answer, outcome.rag[1].answer, outcome.rag[3].answer] == expected
        scored = outcome.rag[3]
        assert (scored.has_answer, scored.em, scored.f1) == (
            has_answer(scored.answer, row.answers),
            exact_match(scored.answer, row.answers),
            round(token_f1(scored.answer, row.answers), 6),
        )
        assert outcome.confidence == 0.25 * i


def test_k_beyond_the_candidates_is_capped_and_counted(tiny_llama, templates, nq_rows, tmp_path, caplog):
    rows = nq_rows[:3]
    cands = candidates_for(rows)
    cands[1] = candidates_for(rows, per_question=1)[1]
    with caplog.at_level(logging.WARNING):
        run = run_rag(rows, cands, store(tiny_llama, templates, tmp_path), ks=[1, 3])
    assert run.capped == {1: 0, 3: 1}
    assert "top-3: 1 of 3 questions have fewer than 3 candidates" in caplog.text
    assert run.outcomes[1].rag[3].contexts == run.outcomes[1].rag[1].contexts
    assert run.outcomes[1].rag[3].answer == run.outcomes[1].rag[1].answer  # the same prompt


def test_bad_inputs_are_named(tiny_llama, templates, nq_rows, tmp_path):
    rows = nq_rows[:2]
    answers = store(tiny_llama, templates, tmp_path)
    cands = candidates_for(rows)
    empty = make_candidates(rows[1].qid, rows[1].question, rows[1].answers, [], [], None)
    with pytest.raises(ValueError, match=f"question '{rows[1].qid}' has no retrieved context"):
        run_rag(rows, [cands[0], empty], answers)
    with pytest.raises(ValueError, match=f"question '{rows[1].qid}' has no candidates entry"):
        run_rag(rows, cands[:1], answers)
    for ks in ([], [0, 1], [1.5]):
        with pytest.raises(ValueError, match=r"^ks must be a non-empty list of integers >= 1"):
            run_rag(rows, cands, answers, ks=ks)
    with pytest.raises(ValueError, match="one finite score per passage"):
        run_rag(rows, cands, answers, reranker=lambda q, p: np.zeros(2))
    with pytest.raises(ValueError, match=f"question '{rows[1].qid}' has no confidence"):
        run_rag(rows, cands, answers, confidences={rows[0].qid: 0.5})
    with pytest.raises(ValueError, match="^max_new_tokens must be an integer >= 1"):
        AnswerStore(PromptedLLM(tiny_llama, templates), tmp_path, max_new_tokens=0)


def test_outcome_records_round_trip_through_jsonl(tmp_path):
    outcome = QuestionOutcome(
        qid="q1",
        question="who wrote it",
        answers=("Ann Lee",),
        confidence=0.875,
        closed_book=ScoredAnswer("I think Bob", False, False, 0.0),
        rag={
            3: RagAnswer("Ann Lee wrote it", True, False, 0.571429, contexts=("d1#0", "d2#0", "d3#1")),
            1: RagAnswer("Ann Lee", True, True, 1.0, contexts=("d1#0",)),
        },
    )
    record = outcome.to_dict()
    assert json.loads(json.dumps(record)) == record
    assert list(record["rag"]) == ["1", "3"] and record["rag"]["3"]["contexts"] == ["d1#0", "d2#0", "d3#1"]
    path = save_outcomes_jsonl([outcome, outcome], tmp_path / "outcomes.jsonl")
    assert load_outcomes_jsonl(path) == [outcome, outcome]
    path.write_text(path.read_text() + '{"qid": "broken"}\n')
    with pytest.raises(ValueError, match=r"outcomes.jsonl, line 3: not an outcome record"):
        load_outcomes_jsonl(path)


# ---------------------------------------------------------------- statistics


def test_bootstrap_ci_is_seeded_and_brackets_the_mean():
    correct = np.array([1] * 30 + [0] * 20)
    ci = accuracy_ci(correct, seed=3)
    assert ci == accuracy_ci(correct, seed=3) and ci.n == 50 and ci.value == 0.6
    assert ci.low < 0.6 < ci.high
    # The normal approximation's half-width is 1.96 * sqrt(.6 * .4 / 50) = 0.136; the bootstrap agrees closely.
    assert abs((ci.high - ci.low) / 2 - 0.136) < 0.02
    wider = accuracy_ci(correct[::5], seed=3)
    assert wider.high - wider.low > ci.high - ci.low
    assert accuracy_ci([True]).value == 1.0
    with pytest.raises(ValueError, match="0/1"):
        accuracy_ci([0.5, 1])
    # From SMALL_N outcomes on, with both outcomes present: the seeded percentile bootstrap, as before.
    expected = bootstrap(
        (correct.astype(float),), np.mean, n_resamples=10_000, method="percentile", rng=np.random.default_rng(3)
    ).confidence_interval
    assert (ci.low, ci.high) == (expected.low, expected.high)


def test_no_interval_has_zero_width_wilson_below_small_n_and_on_equal_outcomes():
    """Six equal outcomes printed `0.00 [0.00, 0.00]` (the bootstrap of a constant); below SMALL_N, and wherever
    every outcome is the same, the interval is scipy's Wilson."""
    six = accuracy_ci([0] * 6)
    assert six.format() == "0.00 [0.00, 39.03]" and (six.low, six.high) == wilson(0, 6)
    scipy_wilson = binomtest(6, 6).proportion_ci(method="wilson")
    assert (accuracy_ci([1] * 6).low, accuracy_ci([1] * 6).high) == (scipy_wilson.low, 1.0)
    assert (accuracy_ci([1, 0, 1, 1, 0]).low, accuracy_ci([1, 0, 1, 1, 0]).high) == wilson(3, 5)
    assert accuracy_ci([1]).high - accuracy_ci([1]).low > 0.7  # one outcome: an interval, not a point
    big = accuracy_ci([1] * 603)  # equal outcomes at any n: the bootstrap has nothing to resample
    assert big.value == 1.0 and big.high == 1.0 and 0.99 < big.low < 1.0
    assert SMALL_N == 30
    # The hand-written formula this replaced, to the last bit that matters.
    low, high = wilson(1, 8)
    assert (round(low, 3), round(high, 3)) == (0.022, 0.471)


def test_a_paired_difference_that_is_the_same_on_every_question_has_an_interval():
    same = paired_difference([1, 0, 1, 1, 0, 0], [1, 0, 1, 1, 0, 0])  # no discordant question
    share = wilson(6, 6)[0]  # Wilson's lower bound on the share of questions that agree
    assert (same.value, same.low, same.high) == (0.0, pytest.approx(-(1 - share)), pytest.approx(1 - share))
    assert same.format() == "+0.0 [-39.0, +39.0]"
    better = paired_difference([1] * 6, [0] * 6)  # every question right for a only
    assert (better.value, better.high) == (1.0, 1.0) and better.low == pytest.approx(1 - 2 * (1 - share))
    worse = paired_difference([0] * 6, [1] * 6)
    assert (worse.value, worse.low) == (-1.0, -1.0) and worse.high == pytest.approx(-1 + 2 * (1 - share))


def test_exact_mcnemar_counts_discordant_pairs():
    a = [1, 1, 1, 1, 1, 1, 0, 0, 1, 0]
    b = [0, 0, 0, 0, 0, 1, 0, 1, 1, 0]
    test = mcnemar_exact(a, b)
    assert (test.only_a, test.only_b) == (5, 1)
    assert test.pvalue == pytest.approx(2 * (1 + 6) / 2**6)  # two-sided binomial, 6 discordant, 1 minority
    assert test.pvalue == pytest.approx(binomtest(5, 6).pvalue)
    assert mcnemar_exact([1, 0], [1, 0]).pvalue == 1.0
    with pytest.raises(ValueError, match="equal length"):
        mcnemar_exact([1], [1, 0])


def test_holm_steps_down_and_keeps_order():
    assert holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert holm([0.5, 0.001]) == pytest.approx([0.5, 0.002])
    assert holm([0.9, 0.8]) == pytest.approx([1.0, 1.0])  # 2 × 0.8 capped at 1, then monotone
    assert holm([]) == []


def test_paired_difference_resamples_questions_not_systems():
    a, b = [1] * 30 + [0] * 70, [0] * 10 + [1] * 20 + [0] * 70  # a right on 30, b on 20, 10 discordant pairs
    diff = paired_difference(a, b, n_resamples=2000)
    assert diff.value == pytest.approx(0.1) and diff.n == 100
    assert 0.03 < diff.low < 0.1 < diff.high < 0.17  # only the 10 discordant questions vary: a narrow interval
    with pytest.raises(ValueError, match="equal length"):
        paired_difference([1], [1, 0])


def test_detectable_difference_shrinks_with_questions_and_grows_with_discordance():
    small, large = detectable_difference(150, 0.2), detectable_difference(600, 0.2)
    assert 0 < large < small < 0.2
    assert large == pytest.approx(0.051, abs=0.003)  # Connor's formula at n = 600, psi = 0.2
    assert detectable_difference(600, 0.3) > large
    assert detectable_difference(600, 0.0) is None
    # The formula inverted: that difference needs n = 600 questions.
    d, psi = large, 0.2
    z_a, z_b = 1.959964, 0.841621
    assert (z_a * psi**0.5 + z_b * (psi - d * d) ** 0.5) ** 2 / d**2 == pytest.approx(600, rel=1e-3)


def fake_outcomes(k_correct: dict[int, list[int]], qids=None) -> list[QuestionOutcome]:
    n = len(next(iter(k_correct.values())))
    qids = qids or [f"q{i}" for i in range(n)]
    return [
        QuestionOutcome(
            qid,
            f"question {qid}",
            ("x",),
            ScoredAnswer("", False, False, 0.0),
            {k: RagAnswer("", bool(v[i]), False, 0.0) for k, v in k_correct.items()},
        )
        for i, qid in enumerate(qids)
    ]


def test_table2_has_cis_and_paired_tests_against_the_base_row():
    base_nq = [1, 0, 0, 1, 0, 0, 1, 0, 0, 0]
    ft_nq = [1, 1, 1, 1, 1, 1, 1, 0, 0, 0]
    runs = {
        ("Llama3", "bge-base", "NQ"): fake_outcomes({1: base_nq, 3: base_nq}),
        ("Llama3", "bge-ft", "NQ"): fake_outcomes({1: ft_nq, 3: base_nq}),
        ("Llama3", "bge-base", "HotpotQA"): fake_outcomes({1: [1, 0], 3: [1, 1]}),
        ("Llama3", "bge-ft", "HotpotQA"): fake_outcomes({1: [0, 1], 3: [1, 1]}),
    }
    rows = table2_rows(runs, base_reranker="bge-base", n_resamples=2000, expected_discordance=0.07)
    ft = next(r for r in rows if r["reranker"] == "bge-ft" and r["dataset"] == "NQ")
    assert ft["top1"].value == 0.7 and (ft["top1_vs_base"].only_a, ft["top1_vs_base"].only_b) == (4, 0)
    assert ft["top1_vs_base"].pvalue == pytest.approx(0.125) and ft["top3_vs_base"].pvalue == 1.0
    table = table2_markdown(rows, base_reranker="bge-base", reranker_params={"bge-base": "568M", "bge-ft": "568M"})
    lines = table.splitlines()
    assert lines[0] == (
        "| LLM | Reranker | Params | NQ Top-1 | NQ Top-3 | NQ Holm p vs base (Top-1 / Top-3) | "
        "NQ Top-1 − base [95 % CI] · detectable | "
        "HotpotQA Top-1 | HotpotQA Top-3 | HotpotQA Holm p vs base (Top-1 / Top-3) | "
        "HotpotQA Top-1 − base [95 % CI] · detectable |"
    )
    assert all("Holm p" in column for column in lines[0].split(" | ") if " p " in column)  # no uncorrected p
    assert lines[2].startswith("| Llama3 | bge-base | 568M | 30.00 [") and "| base | — |" in lines[2]
    assert lines[3].startswith("| Llama3 | bge-ft | 568M | 70.00 [") and "| 0.125 / 1.000 | +40.0 [" in lines[3]
    # One row compared per dataset and K: Holm leaves its p as it is; the difference is paired.
    assert ft["top1_p_holm"] == pytest.approx(0.125) and ft["top1_diff"].value == pytest.approx(0.4)
    assert ft["top1_diff"].low > 0 and ft["top1_mde"] is not None
    # The detectable difference comes from the design's discordance, not the row's own (0.4 here): before, a row
    # that barely moved reported a small detectable difference.
    assert ft["top1_mde"] == pytest.approx(detectable_difference(10, 0.07)) and ft["top1_discordance"] == 0.4
    assert len({tuple(r) for r in rows}) == 1  # the same keys in every row (W&B tables are columns)
    base = next(r for r in rows if r["reranker"] == "bge-base" and r["dataset"] == "NQ")
    assert base["top1_diff"] is None and base["top1_p_holm"] is None and base["top1_vs_base"] is None
    assert "NQ: n = 10" in table and "HotpotQA: n = 2" in table
    with pytest.raises(ValueError, match="^base_reranker='other' names no run"):
        table2_rows(runs, base_reranker="other", expected_discordance=0.07)
    runs[("Llama3", "bge-ft", "NQ")] = fake_outcomes({1: ft_nq, 3: ft_nq}, qids=[f"z{i}" for i in range(10)])
    with pytest.raises(ValueError, match="answer different questions"):
        table2_rows(runs, base_reranker="bge-base", expected_discordance=0.07)


def test_rows_and_candidates_joined_by_qid_must_hold_the_same_question(tiny_llama, templates, nq_rows, tmp_path):
    rows = nq_rows[:3]
    cands = candidates_for(rows)
    # Candidates built from a file in which the rows sat one line further: same qids, other questions.
    shifted = [
        make_candidates(rows[i].qid, c.question, c.answers, c.passages, c.scores, c.gold_source)
        for i, c in enumerate(candidates_for(nq_rows[1:4]))
    ]
    with pytest.raises(ValueError, match=rf"the candidates: 3 of 3 questions differ .*qid '{rows[0].qid}'"):
        run_rag(rows, shifted, store(tiny_llama, templates, tmp_path))
    assert not (tmp_path / "answers").exists()  # refused before any answer was generated
    run_rag(rows, cands, store(tiny_llama, templates, tmp_path), ks=[1])


def test_table2_pairs_runs_only_on_the_same_questions():
    base = fake_outcomes({1: [1, 0, 1]})
    other = fake_outcomes({1: [1, 1, 1]})
    other[1].question = "a question from another file"
    runs = {("Llama3", "bge-base", "NQ"): base, ("Llama3", "bge-ft", "NQ"): other}
    with pytest.raises(ValueError, match=r"hold other questions under 1 qid\(s\), e.g. 'q1'"):
        table2_rows(runs, base_reranker="bge-base", ks=[1], n_resamples=100, expected_discordance=0.07)
    other[1].question = "Question Q1?"  # the same question up to case and punctuation
    assert len(table2_rows(runs, base_reranker="bge-base", ks=[1], n_resamples=100, expected_discordance=0.07)) == 2


def test_a_prompt_answered_in_two_chunks_reads_the_same_everywhere(tiny_llama, templates, nq_rows, tmp_path):
    # Two processes filling one cache may each generate a prompt, in different chunks (a rare near-tie
    # could even decode differently): every reader must take the same one.
    items = [(row.question, ()) for row in nq_rows[:2]]
    first = store(tiny_llama, templates, tmp_path)
    first.answer(items)
    prompt_hash = answers_module.prompt_hash(first.prompt(*items[0]))
    other = first._chunk({**first.spec, "prompt_hashes": [prompt_hash]}, 1)
    other.compute(lambda a, b: ["a different answer"], progress=False)  # the other process's chunk
    fresh = store(tiny_llama, templates, tmp_path)
    expected = fresh.answer(items[:1])
    first._refresh()
    assert first.answer(items[:1]) == expected
    first_chunk = min(p.name for p in fresh.dir.iterdir() if p.is_dir())
    assert (expected == ["a different answer"]) == (first_chunk == other.dir.name)
