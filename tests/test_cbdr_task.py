"""Task `cbdr` on the tiny llama end to end (report, tables, plot, the sweep's arithmetic recomputed from the
saved outcomes, held-out questions, no answer generated twice), and its settings and wiring in isolation."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from omegaconf import open_dict

from confrag.cbdr import SweepData, default_beta_grid
from confrag.cbdr.analysis import cbdr_results
from confrag.data.nq import load_questions_jsonl
from confrag.data.splits import plan_questions, select_questions, split_dev_test
from confrag.llm.prompted import PromptedLLM
from confrag.probe.module import ProbeMismatchError, SavedProbe
from confrag.rag import QuestionOutcome, load_outcomes_jsonl
from confrag.rag.answers import ScoredAnswer
from confrag.rag.pipeline import RagAnswer
from confrag.reports.cbdr_answers import gold_in_contexts, secondary_markdown
from confrag.stages.evaluation import chosen_scorers, confidence_gate
from confrag.tasks import cbdr as cbdr_task
from confrag.train import run_task

from helpers.modules import probe_module
from helpers.runs import check_cbdr_outputs, compose_cfg, read_only_copy
from helpers.wandb_records import artifacts_named


def check_settings(cfg):
    """The task's CBDR settings (every setting of the run checked on the way)."""
    return cbdr_task.check(cfg).cbdr


TINY = ["+experiment=cbdr_tiny_llama", "trainer.fast_dev_run=true", "logger=csv"]
# The runs that must reuse each other's answers train their rerankers for real (one epoch), so that the second
# run loads them from the cache: a fast_dev_run reranker is retrained every run, and its one step depends on
# the global RNG, which differs when the probe was trained in the same process (first run) or loaded (second).
CACHED = ["+experiment=cbdr_tiny_llama", "trainer.max_epochs=1"]


def tiny_run(folder: Path, cache: Path, overrides: list[str] = (), logger: str = "csv"):
    cfg = compose_cfg([*CACHED, f"logger={logger}", *overrides], folder)
    with open_dict(cfg):
        cfg.paths.cache_dir = str(cache)
    run_task(cfg)
    out = folder / "out"
    return cfg, out, json.loads((out / "metrics.json").read_text())


@pytest.fixture(scope="module")
def first(tmp_path_factory):
    root = tmp_path_factory.mktemp("cbdr")
    # A grid of step 0.001: the tiny probe's confidences lie within a few hundredths of each other.
    grid = "cbdr.betas=[" + ",".join(f"{i / 1000:.3f}" for i in range(1001)) + "]"
    cfg, out, record = tiny_run(root / "first", root / "cache", [grid])
    return SimpleNamespace(cfg=cfg, out=out, record=record, root=root)


def outcomes_of(first, reranker: str, split: str) -> list[QuestionOutcome]:
    qids = set(first.record["eval"][split])
    return [o for o in load_outcomes_jsonl(first.out / "outcomes" / "nq" / f"{reranker}.jsonl") if o.qid in qids]


def cbdr_scores(outcomes: list[QuestionOutcome], k: int, beta: float) -> tuple[np.ndarray, np.ndarray]:
    """Written out from the rule (β = 0: always retrieve; else retrieve iff Conf < β), not from the library."""
    retrieve = np.array([beta == 0 or o.confidence < beta for o in outcomes])
    scores = np.array([o.rag[k].has_answer if r else o.closed_book.has_answer for o, r in zip(outcomes, retrieve)])
    return scores.astype(float), retrieve


# --- end to end ----------------------------------------------------------------------------------


@pytest.mark.task
def test_report_holds_the_three_tables_the_plot_and_hotpotqa(first):
    check_cbdr_outputs(first.out)
    report = (first.out / "report.md").read_text()
    assert "HotpotQA Top-1" in report and "HotpotQA: n = 3" in report  # the three fixture questions
    assert "## Phase-difference analysis" in report and "## The gate run live" in report
    # A newcomer's report: own ¶ defined once, one p-value column (Holm), each table saying what it measures.
    assert report.count("**Own ¶**") == 1 and report.count("p vs base") == report.count("Holm p vs base") > 0
    assert "against the probe's labels" in report and "On average" in report and "upper bound" in report
    assert (first.out / "beta_curve.png").is_file() and (first.out / "beta_curve_full.png").is_file()
    assert first.record["chosen_beta"]["objective"] == "accuracy"
    # What the reranker never reads of the candidates it scores is counted (issue 34): data.passage_max_len=64.
    reranker = first.record["eval"]["retrieval"]["NQ"]["passage_lengths"]["reranker"]
    assert reranker["limit"] == 192 and 0 < reranker["passages"] and 0 <= reranker["over_limit"] <= reranker["passages"]
    assert f"passages cut by the reranker's budget: {reranker['over_limit']} of {reranker['passages']}" in report


@pytest.mark.task
def test_the_rows_planned_at_check_time_are_the_rows_the_run_built(first):
    """`planned_rows` (what the settings check refuses against) and the stage's rows cannot drift apart."""
    from confrag.stages.rerank import planned_rows

    planned = planned_rows(cbdr_task.check(first.cfg).recipe)
    assert planned == [row["id"] for row in first.record["table1"]]


@pytest.mark.task
def test_evaluation_questions_are_held_out_and_split(first):
    cfg = first.cfg
    probe_qids = {
        r.qid
        for r in select_questions(
            load_questions_jsonl(cfg.probe.data.questions_path), cfg.probe.data.num_questions, cfg.seed
        )
    }
    dev, test = set(first.record["eval"]["dev"]), set(first.record["eval"]["test"])
    assert len(dev) + len(test) == cfg.eval.num_questions and not dev & test
    assert not (dev | test) & probe_qids


@pytest.mark.task
def test_sweep_arithmetic_from_the_saved_outcomes(first):
    cfg, record = first.cfg, first.record
    test = outcomes_of(first, cfg.cbdr.reranker, "test")
    rows = record["sweep"]["rows"]
    assert len(test) == len(record["eval"]["test"]) and rows[0]["beta"] == 0.0
    for row in rows:
        for k in record["ks"]:
            scores, retrieve = cbdr_scores(test, k, row["beta"])
            assert row[f"top{k}"] == pytest.approx(scores.mean()) and row["retrieval_rate"] == pytest.approx(
                retrieve.mean()
            )
    # β = 0 is always retrieving: Table 2's accuracy of the same reranker on the same questions.
    table2 = next(r for r in record["table2"] if r["id"] == cfg.cbdr.reranker and r["dataset"] == "NQ")
    for k in record["ks"]:
        assert rows[0][f"top{k}"] == table2[f"top{k}"]["value"] == np.mean([o.rag[k].has_answer for o in test])
    assert any(0 < row["retrieval_rate"] < 1 for row in rows)  # some β splits the questions
    # cbdr.conf_quantiles=3: the quartiles of the dev split's confidences joined the grid.
    dev_conf = [o.confidence for o in outcomes_of(first, cfg.cbdr.reranker, "dev")]
    quartiles = np.round(np.quantile(dev_conf, [0.25, 0.5, 0.75]), 4)
    assert record["conf_quantiles"] == quartiles.tolist() and set(quartiles) <= {row["beta"] for row in rows}


@pytest.mark.task
def test_beta_is_chosen_on_dev_and_reported_on_test(first):
    cfg, chosen = first.cfg, first.record["chosen_beta"]
    k = cfg.cbdr.top_k
    dev, test = outcomes_of(first, cfg.cbdr.reranker, "dev"), outcomes_of(first, cfg.cbdr.reranker, "test")
    grid = [row["beta"] for row in first.record["sweep"]["rows"]]
    # Highest dev accuracy, then lowest dev retrieval rate, then smallest β.
    best = min(grid, key=lambda b: (-round(cbdr_scores(dev, k, b)[0].mean(), 12), cbdr_scores(dev, k, b)[1].mean(), b))
    assert chosen["beta"] == best
    scores, retrieve = cbdr_scores(test, k, best)
    assert chosen["test/accuracy"] == pytest.approx(scores.mean())
    assert chosen["test/retrieval_rate"] == pytest.approx(retrieve.mean())


@pytest.mark.slow  # make test-all: kept out of make test's 15 minutes
@pytest.mark.task
def test_another_k_and_beta_grid_generate_no_answer(first, monkeypatch):
    """Also, with W&B on (offline): the run links the reranker behind its Table 2 and the probe as artifacts."""
    assert first.record["answers"]["generated"] > 0
    for key in ("WANDB_DATA_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(key, str(first.root / "wandb_home"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg, out, record = tiny_run(
        first.root / "second",
        first.root / "cache",
        ["cbdr.top_k=1", "cbdr.betas=[0.0,0.3,0.6,1.0]", "cbdr.gate_check_questions=0"],
        logger="wandb",
    )
    names = {"reranker-tiny_llama", "probe-tiny_llama"}  # beside the W&B tables, also logged as artifacts
    found = artifacts_named(out, names)
    assert {name: kind for name, (kind, _) in found.items()} == {name: "model" for name in names}
    assert "model.safetensors" in found["reranker-tiny_llama"][1]
    assert (out / "reranker" / "config.json").is_file()  # cbdr.reranker's export, the artifact's folder
    assert record["answers"] == {
        "generated": 0,
        "reused": first.record["answers"]["reused"] + first.record["answers"]["generated"],
    }
    grid = sorted({0.0, 0.3, 0.6, 1.0} | set(record["conf_quantiles"]))  # the tiny experiment adds 3 quantiles
    assert [row["beta"] for row in record["sweep"]["rows"]] == grid and len(grid) == 7
    assert record["sweep"]["k"] == 1 and record["table2"] == first.record["table2"]


@pytest.mark.slow  # make test-all: kept out of make test's 15 minutes
@pytest.mark.task
def test_a_complete_cache_is_read_read_only_without_a_lock(first, monkeypatch):
    """On a read-only copy of a complete cache the rerank stage failed taking `<cache>/rerankers/.<key>.lock` before
    looking whether the reranker was there: now every whole result (probe, BM25 index, rerankers, answers, states)
    is read without a lock, and the run gives the first run's tables, generating nothing and writing nothing there."""
    grid = "cbdr.betas=[" + ",".join(f"{i / 1000:.3f}" for i in range(1001)) + "]"
    with read_only_copy(first.root / "cache", first.root / "read_only_cache", monkeypatch) as cache:
        _, _, record = tiny_run(first.root / "read_only", cache, [grid])
    assert record["answers"]["generated"] == 0 and record["table2"] == first.record["table2"]


@pytest.mark.slow  # make test-all: kept out of make test's 15 minutes
@pytest.mark.task
def test_a_rank_above_0_computes_but_writes_nothing_to_the_run_folder(first, monkeypatch):
    """Rank 1 of a two-process launch, on the first run's settings and cache: it runs the stage and the answers
    (every piece from the cache) and leaves its run folder untouched. The run record, NQ_Rerank's rows, the
    outcomes, metrics.json and report.md are rank 0's: all go through the one rank check, RunContext.on_main."""
    import lightning_utilities.core.rank_zero as rank_zero

    for name, value in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}.items():
        monkeypatch.setenv(name, value)
    # What Lightning reads from the environment at import in a launched rank (its loggers write on rank 0 only).
    monkeypatch.setattr(rank_zero.rank_zero_only, "rank", 1)
    evaluated, written = [], []
    evaluate = cbdr_task.evaluate
    monkeypatch.setattr(cbdr_task, "evaluate", lambda *args, **kw: evaluated.append(args[-1]) or evaluate(*args, **kw))
    monkeypatch.setattr(cbdr_task, "write", lambda *args: written.append(True))
    grid = "cbdr.betas=[" + ",".join(f"{i / 1000:.3f}" for i in range(1001)) + "]"
    cfg = compose_cfg([*CACHED, "logger=csv", grid], first.root / "rank1")
    with open_dict(cfg):
        cfg.paths.cache_dir = str(first.root / "cache")
    assert run_task(cfg) is None  # rank 0 reports the optimized metric
    assert [ctx.rank.rank for ctx in evaluated] == [1] and not written
    out = Path(cfg.paths.output_dir)
    assert not out.exists() or sorted(out.rglob("*")) == []


# --- settings and wiring -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "override, message",
    [
        ("cbdr.beta=1.5", r"cbdr\.beta must be a number in \[0, 1\]"),
        ("cbdr.betas=[0.5,-0.1]", r"cbdr\.betas must be a number in \[0, 1\]"),
        ("rag.top_k=[1,7]", r"rag\.top_k=\[1, 7\].*retrieval\.top_n=6"),
        ("cbdr.top_k=0", r"cbdr\.top_k must be an integer >= 1"),
        ("cbdr.objective=budget", r"cbdr\.objective=budget needs retrieval_budget"),
        ("cbdr.objective=speed", r"cbdr\.objective='speed' is not one of"),
        ("cbdr.metric=bleu", r"cbdr\.metric='bleu' is not one of"),
        ("eval.metric=f1", r"eval\.metric='f1' is not one of"),
        ("eval.dev_fraction=1.0", r"eval\.dev_fraction must be a number in \(0, 1\)"),
        ("cbdr.flip_betas=[0.9]", r"cbdr\.flip_betas must list at least two"),
        ("cbdr.metric=f1", r"cbdr\.metric=f1 has no right and wrong answers"),
        ("cbdr.beta_step=0", r"cbdr\.beta_step must be a number in \(0, 0\.9\]"),
        # Known ids of rows this run's settings do not build: refused before the stage runs, not after it.
        ("cbdr.reranker=bi_encoder", r"cbdr\.reranker='bi_encoder' is not a Table 1 row of this run.*retrieval\.bi_e"),
        ("cbdr.reranker=confidence_ft.utility", r"'confidence_ft\.utility' is not a Table 1 row.*preferences\.compare"),
        ("eval.rerankers=[bm25,confidence_ft.rank]", r"eval\.rerankers='confidence_ft\.rank' is not a Table 1 row"),
    ],
)
def test_bad_settings_are_refused_before_anything_runs(override, message, tmp_path):
    cfg = compose_cfg([*TINY, override], tmp_path)
    with pytest.raises(ValueError, match=message):
        check_settings(cfg)
    with pytest.raises(ValueError, match=message):
        run_task(cfg)
    assert not (tmp_path / "cache").exists()  # nothing computed, nothing half-written
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())  # no run_info / config files


def test_the_default_grid_is_the_papers_and_beta_step_refines_it(tmp_path):
    assert np.array_equal(check_settings(compose_cfg(TINY, tmp_path)).betas, default_beta_grid())
    fine = check_settings(compose_cfg([*TINY, "cbdr.beta_step=0.01"], tmp_path)).betas
    assert len(fine) == 101 and np.allclose(np.diff(fine), 0.01) and fine[0] == 0.0 and fine[-1] == 1.0


def test_a_row_this_run_does_not_build_is_named_with_the_runs_rows(tmp_path):
    # The rows the settings plan are known at check time; the rows built are checked again once the stage ran
    # (a compared rule that kept no preference row has no reranker).
    message = r"eval\.base_reranker='confidence_ft\.rank' is not a Table 1 row of this run; rows: \['bm25', 'base', "
    with pytest.raises(ValueError, match=message):
        check_settings(compose_cfg([*TINY, "eval.base_reranker=confidence_ft.rank"], tmp_path))
    settings = check_settings(
        compose_cfg([*TINY, "eval.base_reranker=confidence_ft.rank", "preferences.compare=[rank]"], tmp_path)
    )
    with pytest.raises(ValueError, match=message.replace("'base', ", "'confidence_ft\\.sign'")):
        chosen_scorers(settings, {"bm25": None, "confidence_ft.sign": None})
    settings = check_settings(compose_cfg([*TINY, "eval.rerankers=[bm25]"], tmp_path))
    rows = {"bm25": 1, "base": 2, "relevance_ft": 3, "confidence_ft.sign": 4}
    assert list(chosen_scorers(settings, rows)) == ["bm25", "base", "confidence_ft.sign"]


@pytest.mark.parametrize(
    "override, key",
    [
        ("cbdr.reranker=base reranker", "cbdr.reranker"),
        ("eval.base_reranker=BM25", "eval.base_reranker"),
        ("eval.rerankers=[bm25,confidence_ft.nope]", r"eval.rerankers\[1\]"),
        ("eval.base_reranker=probe", "eval.base_reranker"),  # a diagnostic row is not a reranker to choose
    ],
)
def test_a_reranker_that_is_not_a_known_id_is_refused_at_check_time(override, key, tmp_path):
    value = override.split("=", 1)[1].strip("[]").split(",")[-1]
    allowed = r"\('bm25', 'bi_encoder', 'base', 'relevance_ft', 'confidence_ft\.sign', 'confidence_ft\.rank', "
    with pytest.raises(ValueError, match=rf"{key}={value!r} is not one of {allowed}"):
        check_settings(compose_cfg([*TINY, override], tmp_path))


def test_evaluation_needs_questions_the_probe_did_not_use(tmp_path):
    cfg = compose_cfg(TINY, tmp_path)
    everything = load_questions_jsonl(cfg.probe.data.questions_path)
    with pytest.raises(ValueError, match=r"lower probe\.data\.num_questions"):
        plan_questions(everything, everything, 10, 10, cfg.seed, cfg.probe.data.questions_path)
    rows = load_questions_jsonl(cfg.probe.data.questions_path, limit=40)
    split = split_dev_test(rows, 0.25, seed=3)
    assert (len(split["dev"]), len(split["test"])) == (10, 30) and split == split_dev_test(rows, 0.25, seed=3)
    assert {r.qid for r in split["dev"]} | {r.qid for r in split["test"]} == {r.qid for r in rows}
    with pytest.raises(ValueError, match=r"eval\.dev_fraction=0\.01 of 40 .* empty dev"):
        split_dev_test(rows, 0.01, seed=3)


def test_the_gate_refuses_a_probe_of_another_llm(tiny_llama, tiny_qwen2, templates, tmp_path):
    cfg = compose_cfg(TINY, tmp_path)
    module = probe_module(input_dim=tiny_llama.model.config.hidden_size, layer=2)
    identity = {"llm": tiny_qwen2.identity, "prompts": templates.identity(tiny_qwen2.tokenizer), "layer": 2}
    stage = SimpleNamespace(
        probe=SavedProbe(module, {"activations": identity}), retrieval=None, scorers={cfg.cbdr.reranker: None}
    )
    with pytest.raises(ProbeMismatchError, match="llm: trained on"):
        confidence_gate(stage, check_settings(cfg), PromptedLLM(tiny_llama, templates))


def outcome(qid: str, confidence: float, closed: bool, rag: bool) -> QuestionOutcome:
    scored = lambda right: ScoredAnswer("x", right, right, float(right))  # noqa: E731
    return QuestionOutcome(
        qid,
        qid,
        ("x",),
        scored(closed),
        {1: RagAnswer(**scored(rag).to_dict()), 3: RagAnswer(**scored(rag).to_dict())},
        confidence,
    )


def test_gold_paragraph_share_counts_the_questions_own_passages():
    def with_contexts(qid, top1, top3):
        o = outcome(qid, 0.5, False, False)
        o.rag = {
            1: RagAnswer("x", False, False, 0.0, contexts=tuple(top1)),
            3: RagAnswer("x", False, False, 0.0, contexts=tuple(top3)),
        }
        return o

    # q1's own paragraph first; q2's only in its top 3 (chunk 2 of it); q10's id shares a prefix with q1's, not a match.
    rows = [
        with_contexts("q1", ["q1#0"], ["q1#0", "q2#0", "q5#1"]),
        with_contexts("q2", ["q7#0"], ["q7#0", "q9#3", "q2#2"]),
        with_contexts("q10", ["q1#0"], ["q1#0", "q100#0", "q3#0"]),
    ]
    assert gold_in_contexts(rows, 1) == pytest.approx(1 / 3) and gold_in_contexts(rows, 3) == pytest.approx(2 / 3)
    table = secondary_markdown({"NQ": {"bm25": rows}}, (1, 3), gold_known=True).splitlines()
    assert table[0].endswith("| own ¶ in Top-1 | own ¶ in Top-3 |") and table[2].endswith("| 33.3 | 66.7 |")
    assert table[2].startswith("| NQ | BM25 |")  # the row's label, from its id
    assert "gold" not in secondary_markdown({"NQ": {"bm25": rows}}, (1, 3))


def test_cbdr_results_choose_beta_on_dev_only(tmp_path):
    settings = check_settings(
        compose_cfg(
            [
                *TINY,
                "cbdr.betas=[0.0,0.5,0.8]",
                "cbdr.table_betas=[0.5]",
                "cbdr.flip_betas=[0.5,0.8]",
                "cbdr.conf_quantiles=0",
            ],
            tmp_path,
        )
    )
    # dev: skipping retrieval above 0.5 helps (the confident question is right closed-book, wrong with RAG).
    dev = [outcome("d1", 0.9, True, False), outcome("d2", 0.2, False, True)]
    # test: the opposite, so a β chosen on test would be 0.
    test = [outcome("t1", 0.9, False, True), outcome("t2", 0.6, False, True), outcome("t3", 0.1, True, True)]
    base = [outcome(o.qid, o.confidence, False, False) for o in test]
    data = lambda rows: SweepData.from_outcomes(rows, "has_answer", [1, 3])  # noqa: E731
    results = cbdr_results(settings, data(dev), data(test), data(base))
    assert results.chosen["beta"] == 0.5 and results.chosen["dev/accuracy"] == 1.0  # 0.8 ties: the smaller β
    # on test β = 0.5 skips t1 and t2 (both wrong closed-book) and retrieves for t3.
    assert results.chosen["test/accuracy"] == pytest.approx(1 / 3) and results.chosen[
        "test/retrieval_rate"
    ] == pytest.approx(1 / 3)
    assert results.chosen["test/always_retrieve_accuracy"] == 1.0
    lines = results.table3.splitlines()
    assert lines[2] == "| base reranker | 0.00 | 0.00 | 0 | 100.00 |"
    assert lines[3] == "| base + confidence FT (sign) | 100.00 | 100.00 | 0 | 100.00 |"
    assert lines[-3].endswith("β chosen on dev (accuracy) | 33.33 | 33.33 | 0.5 | 33.33 |")
    # flips 0.5 → 0.8: t2 (Conf 0.6) now retrieves and turns right;
    # 0 → 0.5 (always retrieve → chosen β): t1, t2 turn wrong.
    assert [(f.beta_a, f.beta_b, f.turned_right, f.turned_wrong) for f in results.flips] == [
        (0.5, 0.8, 1, 0),
        (0.0, 0.5, 0, 2),
    ]
    assert results.at_beta["test/accuracy_at_beta"] == 1.0  # cbdr.beta = 0.95: all three retrieve
    assert results.at_beta["dev/retrieval_rate_at_beta"] == 1.0


@pytest.mark.task
def test_compare_runs_gives_a_runs_own_table2_rows(first, capsys, monkeypatch):
    """experiments/compare_runs.py (one Table 2 over runs sharing a question plan) reads the outcome files back
    to the run's own numbers: accuracy, interval, paired difference, Holm p and own-paragraph share."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "experiments" / "compare_runs.py"
    spec = importlib.util.spec_from_file_location("compare_runs", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(sys, "argv", ["compare_runs.py", f"one={first.out}", f"again={first.out}"])
    module.main()
    printed = capsys.readouterr().out
    rows = [r for r in first.record["table2"] if r["dataset"] == "NQ"]
    assert printed.count("\n| ") == len(rows) + 2  # header, rule, one line a row: the second run's are the same
    for row in rows:
        top1 = row["top1"]
        # Rows keyed by run label and system; the second run answers alike, so each system is one:<id> only.
        cell = f"| one:{row['id']} | {100 * top1['value']:.2f} [{100 * top1['low']:.2f}, {100 * top1['high']:.2f}] |"
        line = next(line for line in printed.splitlines() if line.startswith(cell))
        assert f"| {100 * row['gold_top1']:.1f} |" in line
        # Own paragraph first, paired with the base's: the base's own cell is empty, every other row's counts the
        # questions only one of the two puts it first for, with the exact McNemar p.
        if row["id"] == "base":
            assert line.endswith(" — |")
        else:
            assert re.search(r"\| \d+ / \d+ · [01]\.\d{3} \|$", line), line
        if row["top1_p_holm"] is not None:
            assert f"· {row['top1_p_holm']:.3f} ·" in line
