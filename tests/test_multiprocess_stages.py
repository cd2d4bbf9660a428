"""The heavy stages split across processes: `torchrun --nproc_per_node=2` runs tests/rank_worker.py
(NQ_Confidence answers and hidden states, RAG answers through the AnswerStore) on 2 CPU processes
sharing one cache. Each rank takes unclaimed shards; both end with the arrays and answers of a
single-process run, and every shard / answer chunk is computed by exactly one of them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

from confrag.data.nq import default_questions_path
from confrag.infra.paths import default_cache_dir

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "rank_worker.py"
sys.path.insert(0, str(ROOT / "tests"))
from rank_worker import NUM_ROWS, RAG_ROWS  # noqa: E402

KINDS = 3  # qa, rag_gold, rag_other


def environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_NTASKS")}
    # The converted SmolLM2 tokenizer lives in <cache>/models: reuse the repo's copy, never convert again.
    env.update(
        CONFRAG_CACHE=str(default_cache_dir()),
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
        CUDA_VISIBLE_DEVICES="",
    )
    return env


def run(command: list[str], out: Path) -> None:
    out.mkdir(parents=True)
    done = subprocess.run(command, env=environment(), capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]


def args(out: Path, cache: Path, counter: Path) -> list[str]:
    return [str(WORKER), str(ROOT), str(out), str(cache), str(default_questions_path()), str(counter)]


def llm_calls(counter: Path) -> dict[str, list[tuple[int, str]]]:
    calls = defaultdict(list)
    for line in counter.read_text().splitlines():
        stage, prompts, pid = line.split()
        calls[stage].append((int(prompts), pid))
    return calls


@pytest.mark.slow  # make test-all: kept out of make test's 15 minutes
@pytest.mark.subprocess
@pytest.mark.skipif(shutil.which("torchrun", path=str(Path(sys.executable).parent)) is None, reason="needs torchrun")
def test_two_torchrun_ranks_split_the_heavy_stages_and_match_one_process(tmp_path):
    single, double = tmp_path / "single", tmp_path / "double"
    run([sys.executable, *args(single, tmp_path / "cache1", tmp_path / "count1")], single)
    torchrun = str(Path(sys.executable).parent / "torchrun")
    run(
        [torchrun, "--standalone", "--nproc_per_node=2", *args(double, tmp_path / "cache2", tmp_path / "count2")],
        double,
    )

    reference = np.load(single / "rank0.npz")
    reference_record = json.loads((single / "rank0.json").read_text())
    records = [json.loads((double / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [(r["rank"], r["world_size"], r["device"]) for r in records] == [(0, 2, "cpu"), (1, 2, "cpu")]
    for rank, record in enumerate(records):
        arrays = np.load(double / f"rank{rank}.npz")
        assert sorted(arrays.files) == sorted(reference.files)
        for name in reference.files:  # bit for bit: every shard came from the same slice of prompts
            np.testing.assert_array_equal(arrays[name], reference[name], err_msg=f"rank {rank}: {name}")
        assert record["responses"] == reference_record["responses"]
        assert record["rag"] == reference_record["rag"]

    # Every shard of every state artifact computed once, by one rank or the other.
    for kind, computed in reference_record["states_computed"].items():
        assert sorted(records[0]["states_computed"][kind] + records[1]["states_computed"][kind]) == sorted(computed)
    # Every greedy answer generated once: as many prompts as a single process generates, split over the ranks.
    alone, split = llm_calls(tmp_path / "count1"), llm_calls(tmp_path / "count2")
    assert sum(n for n, _ in alone["nq_confidence"]) == KINDS * NUM_ROWS
    assert sum(n for n, _ in split["nq_confidence"]) == KINDS * NUM_ROWS
    assert sum(n for n, _ in alone["answers"]) == RAG_ROWS
    assert sum(n for n, _ in split["answers"]) == RAG_ROWS
