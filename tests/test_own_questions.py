"""A question set without gold paragraphs (FlashRAG's `{id, question, golden_answers}`, no "ctxs") over a corpus of
its own: refused once, before any stage, naming every setting that reads gold paragraphs; run in one command by the
docs' PopQA command (docs/usage.md, "Step by step", item 4); and named by its dataset in every table, plot title,
log line and folder of the run, "unknown" where the question's own paragraph is unknown, no `nan` printed."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from confrag.data.jsonl import DataFormatError
from confrag.data.nq import default_questions_path, load_questions_jsonl
from confrag.tasks import cbdr as cbdr_task
from confrag.tasks import rerank as rerank_task
from confrag.train import run_task

from helpers.runs import ROOT, check_cbdr_outputs, compose_cfg

pytestmark = pytest.mark.usefixtures("one_thread")  # many small forwards of a tiny model: one thread each

QUESTIONS = 90  # cbdr_tiny_llama takes 48 (probe) + 24 (NQ_Rerank) + 12 (evaluation) of them
FAST = "trainer.fast_dev_run=true"


class Lines(logging.Handler):
    """The run's log lines (train.log is Hydra's, and run_task in a test has no Hydra job)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def own_files(folder: Path) -> tuple[Path, Path]:
    """NQ questions rewritten as FlashRAG's PopQA ships its questions (no "ctxs"), their paragraphs as a FlashRAG
    corpus ({id, contents}) that names no question's paragraph."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = load_questions_jsonl(default_questions_path(), limit=QUESTIONS)
    questions, corpus = folder / "popqa_test.jsonl", folder / "my_corpus.jsonl"
    docs: dict[tuple[str, str], str] = {}
    lines = []
    for r in rows:
        lines.append(json.dumps({"id": f"test_{r.qid}", "question": r.question, "golden_answers": list(r.answers)}))
        for c in r.contexts:
            docs.setdefault((c.title, c.text), f"doc-{len(docs)}")
    questions.write_text("\n".join(lines) + "\n")
    corpus.write_text("".join(json.dumps({"id": i, "contents": f"{t}\n{x}"}) + "\n" for (t, x), i in docs.items()))
    return questions, corpus


def docs_command(experiment: str, questions: Path, corpus: Path) -> list[str]:
    """The overrides of the docs' PopQA command for `experiment` (item 4 of "Step by step"), as written there, with
    this test's files in place of `popqa/test.jsonl` and `my_corpus.jsonl`."""
    text = (ROOT / "docs" / "usage.md").read_text()
    step = text[text.index("### Step by step: PopQA") : text.index("## Your corpus as given")]
    block = step.split("```bash", 1)[1].split("```", 1)[0].replace("\\\n", " ")
    line = next(c for c in block.splitlines() if f"+experiment={experiment} " in c)
    words = line.split()
    assert words[0] == "confrag-train", line
    files = {"dataset.questions_path=popqa/test.jsonl": questions, "dataset.corpus_path=my_corpus.jsonl": corpus}
    return [f"{w.split('=')[0]}={files[w]}" if w in files else w for w in words[1:]]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> tuple[Path, Path]:
    return own_files(tmp_path_factory.mktemp("own"))


def test_a_set_without_gold_paragraphs_is_refused_once_naming_every_setting_before_any_stage(
    files, tmp_path, nothing_runs
):
    questions, corpus = files
    cfg = compose_cfg(["+experiment=cbdr_tiny_llama", "dataset=popqa", f"dataset.questions_path={questions}"], tmp_path)
    with pytest.raises(DataFormatError, match=r'none of its 90 questions has a gold paragraph \("ctxs"\)') as err:
        cbdr_task.check(cfg)
    message = str(err.value)
    at_once = message.split("All at once: ", 1)[1]
    for fix in (
        "probe.data.ranking.top_n=null probe.monitor=val/auroc",
        "probe.data.train_states=qa",
        "dataset.corpus_path=<your corpus>",
        "base_reranker.train=false",
    ):
        assert fix in at_once, fix
    assert "+experiment=cbdr_own_questions" in message
    # The rerank task the same way; the perfect-relevance control, which reads them too, named with the rest.
    overrides = ["+experiment=reranker_tiny_llama", f"dataset.questions_path={questions}", "preferences.confidence"]
    cfg = compose_cfg([*overrides[:2], f"dataset.corpus_path={corpus}", f"{overrides[2]}=relevance"], tmp_path)
    with pytest.raises(DataFormatError) as err:
        rerank_task.check(cfg)
    assert "preferences.confidence=probe" in str(err.value) and "dataset.corpus_path" not in str(err.value)
    # The docs' commands pass the check (cbdr_smollm2's sizes are too large for this file: its budget is named).
    cbdr_task.check(compose_cfg(docs_command("cbdr_own_questions_tiny_llama", questions, corpus), tmp_path))
    with pytest.raises(ValueError, match="Too few questions"):
        cbdr_task.check(compose_cfg(docs_command("cbdr_own_questions", questions, corpus), tmp_path))
    cfg = compose_cfg(["+experiment=reranker_own_questions", f"dataset.questions_path={questions}"], tmp_path)
    with pytest.raises(DataFormatError) as err:  # only the corpus is left to name
        rerank_task.check(cfg)
    assert str(err.value).count(": set ") == 1 and "set dataset.corpus_path=<your corpus>" in str(err.value)


@pytest.fixture(scope="module")
def popqa_run(files, tmp_path_factory):
    """The docs' smoke-test command (`+experiment=cbdr_own_questions_tiny_llama ...`), as written there, on the file
    without "ctxs"."""
    questions, corpus = files
    folder = tmp_path_factory.mktemp("run")
    # One training step per reranker (their results are not what is tested): seconds instead of minutes.
    cfg = compose_cfg([*docs_command("cbdr_own_questions_tiny_llama", questions, corpus), FAST], folder)
    handler, logger = Lines(), logging.getLogger("confrag")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        run_task(cfg)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    out = folder / "out"
    return SimpleNamespace(
        log="\n".join(handler.lines),
        out=out,
        report=(out / "report.md").read_text(),
        record=json.loads((out / "metrics.json").read_text()),
    )


@pytest.mark.task
def test_the_docs_popqa_command_runs_on_questions_without_gold_paragraphs(popqa_run):
    check_cbdr_outputs(popqa_run.out, "PopQA")
    assert popqa_run.record["sweep"]["reranker_id"] == "confidence_ft.rank"


@pytest.mark.task
def test_one_dataset_name_through_every_table_plot_and_folder(popqa_run):
    report, out = popqa_run.report, popqa_run.out
    assert "| Reranker | PopQA Top-1 | PopQA Top-3 | β | RR (%) ↓ |" in report  # Table 3
    assert "| link | measured as | PopQA test |" in report  # From probe to answer
    assert "| ranker: base reranker | answers |" in report  # its rankers' lines, read from Table 2's PopQA rows
    assert not re.search(r"\bNQ\b(?!_)", report.split("## Config")[0])  # NQ_Rerank is the method's data, not a set
    assert sorted(p.name for p in (out / "outcomes").iterdir()) == ["popqa"]  # no NQ-default HotpotQA fixture
    assert "PopQA / base: " in popqa_run.log and "NQ / " not in popqa_run.log  # the answers' log lines
    table2 = [r for r in popqa_run.record["table2"] if r["dataset"] == "PopQA"]
    assert table2 and all(r["gold_top1"] is None for r in table2)  # unknown, not 0
    assert set(popqa_run.record["eval"]["retrieval"]) == {"PopQA"}


@pytest.mark.task
def test_unknown_stays_unknown_and_no_nan_is_printed(popqa_run):
    report = popqa_run.report
    header = next(line for line in report.splitlines() if line.startswith("| LLM | Reranker | PopQA Top-1"))
    column = header.strip("| ").split(" | ").index("PopQA own ¶ in Top-K (Top-1 / Top-3)")
    rows = [line for line in report.splitlines() if line.startswith("| tiny_llama | ")]
    assert rows and all(line.strip("| ").split(" | ")[column] == "unknown" for line in rows)
    assert "own ¶ ranked first by Conf(Q + C): unknown" in report
    assert not re.search(r"\bnan\b", report, re.IGNORECASE)
