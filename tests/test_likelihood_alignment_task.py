"""The LLM's likelihood as teacher through `train.py` (issue 45): `+experiment=reranker_likelihood_tiny_llama` end to
end with its rows beside the paper's in Table 1 and its exports; a second run reading every student from the cache;
a multirun over `alignment.*` leaving its sweep summary; the cbdr task with `alignment=likelihood`, the rows in
Table 2. Slow (`make test-all`): the same cross-fitted, and the Llama-3 and Qwen2.5 likelihood experiments on random
weights of their shapes."""

from __future__ import annotations

import csv
import gzip
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from omegaconf import open_dict

from confrag.reranker.aligned import load_aligned
from confrag.train import run_task

from helpers.runs import MODEL_DIR, ROOT, check_rerank_outputs, compose_cfg

ROWS = ["aligned.likelihood", "aligned.base"]
SMALL = ["alignment.steps=2", "alignment.batch_size=4", "alignment.top_k=3"]


def run(overrides: list[str], folder: Path, cache: Path) -> tuple[Path, dict]:
    cfg = compose_cfg([*overrides, "logger=csv"], folder)
    with open_dict(cfg):
        cfg.paths.cache_dir = str(cache)
    run_task(cfg)
    out = folder / "out"
    return out, json.loads((out / "metrics.json").read_text())


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("likelihood")


@pytest.fixture(scope="module")
def rerank(root):
    return run(["+experiment=reranker_likelihood_tiny_llama"], root / "rerank", root / "cache")


@pytest.mark.task
def test_the_tiny_experiment_puts_its_rows_beside_the_papers_in_table_1(rerank, root):
    out, record = rerank
    check_rerank_outputs(out)  # everything a rerank run writes, the alignment rows after the paper's
    ids = [r["id"] for r in record["table1"]]
    assert ids == ["bm25", "base", "relevance_ft", "confidence_ft.sign", *ROWS, "fusion"]
    systems = {r["id"]: r["system"] for r in record["table1"]}
    assert systems["aligned.likelihood"] == "base aligned to likelihood (listwise)"
    assert systems["fusion"] == "fusion z(base) + w·z(ℓ) (reads the gold answer)"
    assert all(0 <= r["MRR@5"] <= 100 for r in record["table1"])
    table1 = (out / "table1.md").read_text()
    assert "base aligned to likelihood (listwise)" in table1 and "reads the gold answer" in table1
    info = record["training"]["aligned.likelihood"]
    assert info["teacher"] == "likelihood" and info["student"] == "residual_cross_encoder" and info["steps"] == 2
    assert len(list((root / "cache" / "likelihood").iterdir())) == 1  # the ℓ stage: one artifact, its shards
    # The exports: each listwise row a folder confrag loads, scoring as the run's row did (the base's top 3).
    loaded = load_aligned(out / "aligned" / "likelihood")
    scores = loaded.score(["who wrote hamlet"] * 4, ["Hamlet.", "Shakespeare wrote plays.", "Rome.", "Paris."])
    assert sorted(scores.tolist()) == [1.0, 2.0, 3.0, 4.0]
    assert "base + w · 20 · g(q, p)" in (out / "aligned" / "likelihood" / "README.md").read_text()


@pytest.mark.slow  # make test-all: kept out of make test's 15 minutes
@pytest.mark.task
def test_a_second_run_reads_every_student_and_the_likelihood_from_the_cache(rerank, root, monkeypatch):
    import confrag.stages.alignment as alignment

    def refuse(*args, **kwargs):
        raise AssertionError("a cached student was trained again")

    monkeypatch.setattr(alignment, "fit_listwise", refuse)
    _, record = run(["+experiment=reranker_likelihood_tiny_llama"], root / "again", root / "cache")
    assert [r["MRR@5"] for r in record["table1"]] == [r["MRR@5"] for r in rerank[1]["table1"]]


@pytest.mark.slow  # make test-all: kept out of make test's 15 minutes
@pytest.mark.subprocess
@pytest.mark.task
def test_a_multirun_over_the_alignment_node_leaves_its_sweep_summary(rerank, root):
    """Every job reads the probe, the base, the paper's rows and ℓ from the cache; only the students train."""
    logs = root / "logs"
    command = [
        sys.executable,
        "train.py",
        "-m",
        "+experiment=reranker_likelihood_tiny_llama",
        "alignment.tau=1.0,learned",
        "logger=csv",
        f"paths.cache_dir={root / 'cache'}",
        f"paths.model_dir={MODEL_DIR}",
        f"paths.log_dir={logs}",
    ]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    (sweep,) = list((logs / "rerank" / "multiruns").iterdir())
    with open(sweep / "sweep_summary.csv", newline="") as handle:
        table = list(csv.DictReader(handle))
    assert [(r["alignment.tau"], r["status"]) for r in table] == [("1.0", "finished"), ("learned", "finished")]
    assert all(r["test/MRR@5"] for r in table)


@pytest.fixture(scope="module")
def cbdr(rerank, root):
    """The cbdr smoke test with the alignment node: the rerank stage is the tiny experiment's (read from its cache)."""
    overrides = ["+experiment=cbdr_tiny_llama", "alignment=likelihood", *SMALL, "cbdr.reranker=aligned.likelihood"]
    return run(overrides, root / "cbdr", root / "cache")


@pytest.mark.slow  # make test-all: kept out of make test's 15 minutes
@pytest.mark.task
def test_the_cbdr_task_takes_the_alignment_node_with_its_rows_in_table_2(cbdr):
    out, record = cbdr
    assert [r["id"] for r in record["table1"]][-3:] == [*ROWS, "fusion"]
    table2 = {r["id"] for r in record["table2"]}
    assert {*ROWS, "fusion", "base", "confidence_ft.sign"} <= table2
    for row in (*ROWS, "fusion"):
        assert (out / "outcomes" / "nq" / f"{row}.jsonl").is_file()
    report = (out / "report.md").read_text()
    assert "base aligned to likelihood (listwise)" in report and "reads the gold answer" in report


@pytest.mark.slow
@pytest.mark.task
def test_cross_fitting_trains_each_folds_students_on_the_other_folds(root):
    source = ROOT / ".." / "shared" / "data" / "nq_open_gold.jsonl.gz"
    if not source.is_file():
        pytest.skip("the shared NQ data is not beside the project")
    with gzip.open(source, "rt", encoding="utf-8") as f:
        lines = [next(f) for _ in range(90)]
    small = root / "nq_small.jsonl"
    small.write_text("".join(lines), encoding="utf-8")
    overrides = [
        "+experiment=cbdr_tiny_llama",
        "alignment=likelihood",
        *SMALL,
        f"dataset.questions_path={small}",
        "preferences.cross_fit=2",
        "eval.num_questions=null",
        "eval.hotpotqa_path=null",
        "cbdr.gate_check_questions=0",
    ]
    out, record = run(overrides, root / "cross_fitted", root / "cache-cross-fitted")
    assert {*ROWS, "fusion"} <= {r["id"] for r in record["table2"]}
    folds = [set(f) for f in record["folds"]]
    for f, fold in enumerate(("fold0", "fold1")):  # each fold's students: the other fold's questions only
        assert 0 < record["training"][fold]["aligned.likelihood"]["train_questions"] <= len(folds[1 - f])


SHAPE = [
    "llm.device=cpu",
    "llm.dtype=float32",
    "llm.random.num_hidden_layers=1",
    "trainer=default",
    "probe/trainer=default",
    "model=reranker_minilm",
    "base_reranker.train=true",
    "probe.data.num_questions=32",
    "probe.data.splits.balance=false",
    "probe.data.splits.allow_one_class=true",
    "probe.data.answers.batch_size=8",
    "probe.data.extraction.batch_size=8",
    "probe.trainer.max_epochs=1",
    "preferences.num_questions=12",
    "preferences.extract_batch_size=8",
    "preferences.top_k=2",
    "base_reranker.num_questions=8",
    "retrieval.top_n=4",
    "retrieval.bi_encoder=false",
    "rag.batch_size=8",
    "data.batch_size=2",
    "data.group_size=3",
    "data.passage_max_len=64",
    "data.num_workers=0",
    "alignment.precision=32-true",
    *SMALL,
]


@pytest.mark.slow
@pytest.mark.task
@pytest.mark.parametrize(("experiment", "shape"), [("llama3", "llama3_8b_shape"), ("qwen2_5", "qwen2_5_7b_shape")])
def test_the_gpu_likelihood_experiments_run_on_random_weights_of_their_shapes(experiment, shape, root):
    """The experiments as composed (their alignment, the LLM's layer shapes) with one layer of the shape, in fp32
    on the CPU, on the tiny experiment's sizes: what a GPU run does, short of the GPU."""
    overrides = [f"+experiment=reranker_likelihood_{experiment}", f"llm={shape}", *SHAPE]
    out, record = run(overrides, root / shape, root / f"cache-{shape}")
    assert [r["id"] for r in record["table1"]][-3:] == [*ROWS, "fusion"]
    assert np.isfinite([r["MRR@5"] for r in record["table1"]]).all()
    assert (out / "aligned" / "likelihood" / "aligned.json").is_file()
