"""Composing the project's configs in tests, and checking what a task wrote into its run folder."""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import open_dict

import confrag.infra.paths  # noqa: F401  (registers the confrag_root resolver)

ROOT = Path(__file__).resolve().parents[2]
EXPERIMENTS = sorted(p.stem for p in (ROOT / "conf" / "experiment").glob("*.yaml"))
MODEL_DIR = str(ROOT / ".cache" / "models")


def compose_cfg(overrides: list[str], tmp_path: Path):
    """The `train` config with `overrides`, its run folder and caches under `tmp_path` (converted models shared)."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=overrides)
    with open_dict(cfg):
        cfg.paths.output_dir = str(tmp_path / "out")
        cfg.paths.cache_dir = str(tmp_path / "cache")
        cfg.paths.model_dir = MODEL_DIR
    return cfg


def check_gates_outputs(out: Path, names: list[str]) -> None:
    """gates.md with a table per context condition, the PNG it shows, every gate's row on both conditions."""
    report = (out / "gates.md").read_text()
    for heading in ("## Clean contexts", "## Conflicting contexts", "## Config"):
        assert heading in report
    assert "| Gate | n | Accuracy" in report and "![gates](gates.png)" in report
    assert (out / "gates.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = json.loads((out / "metrics.json").read_text())["table"]
    for condition in ("clean", "conflicting"):
        assert [r["gate"] for r in table if r["contexts"] == condition] == names


def check_rerank_outputs(out: Path) -> None:
    """NQ_Rerank rows (JSONL + Arrow), its report, Table 1 with the rows the issue names, an export."""
    rows = [json.loads(line) for line in (out / "nq_rerank" / "train.jsonl").read_text().splitlines()]
    assert rows and set(rows[0]) == {"qid", "query", "pos", "neg", "pos_scores", "neg_scores", "prompt"}
    assert all(min(r["pos_scores"]) > 0 > max(r["neg_scores"]) for r in rows)
    assert (out / "nq_rerank" / "test_arrow").is_dir()
    report = json.loads((out / "nq_rerank" / "report.json").read_text())
    assert set(report["by_reference"]) == {"qa", "rag_empty"} and report["examples"]
    assert {"sign", "rank"} <= set(report["by_selection"])
    record = json.loads((out / "metrics.json").read_text())
    table = record["table1"]
    # The main row's metrics, what the sweeper gets and the sweep summary reads (fractions of Table 1's percents).
    main = next(r for r in table if r["id"] == "confidence_ft.sign")
    assert record["metrics"] and record["metrics"]["test/MRR@5"] == main["MRR@5"] / 100
    # The paper's rows first; an experiment with the alignment node adds its rows after them (aligned.*, fusion).
    paper = [r for r in table if not (r["id"].startswith("aligned.") or r["id"] == "fusion")]
    assert table[: len(paper)] == paper
    assert [r["system"] for r in paper] == [
        "BM25",
        "base reranker",
        "base + relevance FT",
        "base + confidence FT (sign)",
    ]
    assert [r["id"] for r in paper] == ["bm25", "base", "relevance_ft", "confidence_ft.sign"]  # beside the labels
    assert all(0 <= r["MRR@5"] <= 100 for r in table)
    assert (out / "reranker" / "config.json").is_file() and (out / "table1.md").is_file()
    # What others load: the model card beside the weights, NQ_Rerank as parquet with its card.
    card = (out / "reranker" / "README.md").read_text()
    assert card.startswith("---\nlicense: apache-2.0\nbase_model: ") and "python train.py" in card
    assert "n = " in card and "| base + confidence FT (sign) |" in card
    assert len(list((out / "nq_rerank_dataset" / "data").glob("train-*.parquet"))) == 1  # named by its digest
    assert "configs:" in (out / "nq_rerank_dataset" / "README.md").read_text()


def check_cbdr_outputs(out: Path, questions: str = "NQ") -> None:
    """report.md with Tables 1-3, the β curve it shows, the chosen β and the config; per-question outcomes in
    `outcomes/<questions, lower case>/`. `questions`: the name the tables give the question set."""
    report = (out / "report.md").read_text()
    for heading in ("## Table 1", "## Table 2", "## Table 3", "## β chosen on dev", "## Config"):
        assert heading in report
    assert "| Reranker | P@1 |" in report and f"| LLM | Reranker | {questions} Top-1 |" in report
    assert f"| Reranker | {questions} Top-1 | {questions} Top-3 | β | RR (%) ↓ |" in report
    for image in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", report):
        assert (out / image).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "beta_curve_full.png" in report
    record = json.loads((out / "metrics.json").read_text())
    assert {"table1", "table2", "table3", "sweep", "chosen_beta", "flips", "answers"} <= set(record)
    assert set(record["stages"]) == {"stage", "answers"}  # wall seconds and peak GPU memory of each
    assert all(s["seconds"] > 0 and set(s) >= {"peak_gpu_memory_gib"} for s in record["stages"].values())
    assert sorted((out / "outcomes" / questions.lower()).glob("*.jsonl"))


def run_ctx(tmp_path: Path, seed: int = 0, progress: bool = False, rank: int = 0, world_size: int = 1):
    """A run context for calling a stage directly: cache `tmp_path/cache`, run folder `tmp_path/out`."""
    from confrag.infra.distributed import RankInfo
    from confrag.infra.run_context import RunContext

    return RunContext(
        cache_dir=tmp_path / "cache",
        seed=seed,
        progress=progress,
        output_dir=tmp_path / "out",
        rank=RankInfo(rank, world_size, rank, "torchrun" if world_size > 1 else "single"),
    )


def _tree(root: Path) -> dict[str, tuple[int, int, int]]:
    """Every path under `root` with its size, modification time (ns) and mode bits."""
    return {
        str(p.relative_to(root)): (p.lstat().st_size, p.lstat().st_mtime_ns, p.lstat().st_mode) for p in root.rglob("*")
    }


@contextlib.contextmanager
def read_only_copy(cache: Path, copy: Path, monkeypatch) -> Iterator[Path]:
    """A read-only copy of a complete cache, as a group's shared cache or a read-only mount gives it: `chmod -R
    a-w`. Tests may run as root, whom permissions do not stop, so taking any file lock under the copy raises
    EROFS (what a read-only mount gives even root), and on leaving, nothing under the copy may have been created,
    removed or changed (every path with its size, time and mode)."""
    import errno
    import os
    import shutil

    from filelock import BaseFileLock

    shutil.copytree(cache, copy)
    for path in [copy, *copy.rglob("*")]:
        path.chmod(path.stat().st_mode & ~0o222)
    before = _tree(copy)
    acquire = BaseFileLock.acquire

    def refuse_under_copy(lock, *args, **kwargs):
        if Path(lock.lock_file).resolve().is_relative_to(copy.resolve()):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), lock.lock_file)
        return acquire(lock, *args, **kwargs)

    monkeypatch.setattr(BaseFileLock, "acquire", refuse_under_copy)
    try:
        yield copy
        assert _tree(copy) == before, "the run wrote into the read-only cache"
    finally:
        monkeypatch.setattr(BaseFileLock, "acquire", acquire)
        for path in [copy, *copy.rglob("*")]:
            path.chmod(path.stat().st_mode | 0o200)  # so that the tmp folder can be removed
