"""The field's formats: FlashRAG's question sets ({id, question, golden_answers}) and corpora ({id, contents})
beside confrag's own, in JSONL and parquet, chosen by a config value or detected; and the dataset configs."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from datasets import Dataset

from confrag.data.nq import DataFormatError, QARow, load_questions_jsonl, rows_from_hf
from confrag.retrieval.corpus import iter_documents, iter_passages, load_corpus_jsonl
from confrag.stages.retrieval import RetrievalSettings, build_retrieval

from helpers.runs import compose_cfg
from helpers.settings import shipped_settings

FLASHRAG_QUESTIONS = [
    {"id": "test_0", "question": "What is George Rankin's occupation?", "golden_answers": ["politician"]},
    {"id": "test_1", "question": "In what city was Pasquale Tuccimei born?", "golden_answers": ["Rome", "Roma"]},
]
CONFRAG_QUESTIONS = [
    {"question": "What is George Rankin's occupation?", "answers": ["politician"], "id": "test_0"},
    {"question": "In what city was Pasquale Tuccimei born?", "answers": ["Rome", "Roma"], "id": "test_1"},
]
EXPECTED_ROWS = [
    QARow("test_0", "What is George Rankin's occupation?", ("politician",), ()),
    QARow("test_1", "In what city was Pasquale Tuccimei born?", ("Rome", "Roma"), ()),
]
WORDS = " ".join(f"w{i}" for i in range(130))
FLASHRAG_CORPUS = [
    {"id": "0", "contents": '"George Rankin"\nGeorge Rankin was an Australian politician. ' + WORDS},
    {"id": "1", "contents": "Rome\nRome is the capital city of Italy."},
]
CONFRAG_CORPUS = [
    {"id": "0", "title": "George Rankin", "text": "George Rankin was an Australian politician. " + WORDS},
    {"id": "1", "title": "Rome", "text": "Rome is the capital city of Italy."},
]


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def write_parquet(path: Path, records: list) -> Path:
    Dataset.from_list(records).to_parquet(str(path))
    return path


WRITERS = {"jsonl": write_jsonl, "parquet": write_parquet}


# ---------------------------------------------------------------- questions


@pytest.mark.parametrize("suffix", ["jsonl", "parquet"])
@pytest.mark.parametrize(("records", "fmt"), [(FLASHRAG_QUESTIONS, "flashrag"), (CONFRAG_QUESTIONS, "confrag")])
def test_both_question_formats_read_the_same_rows(tmp_path: Path, suffix: str, records: list, fmt: str) -> None:
    path = WRITERS[suffix](tmp_path / f"q.{suffix}", records)
    assert load_questions_jsonl(path) == EXPECTED_ROWS  # auto
    assert load_questions_jsonl(path, questions_format=fmt) == EXPECTED_ROWS
    assert load_questions_jsonl(path, limit=1, questions_format=fmt) == EXPECTED_ROWS[:1]


def test_in_memory_records_in_either_format() -> None:
    assert rows_from_hf(FLASHRAG_QUESTIONS) == rows_from_hf(iter(CONFRAG_QUESTIONS)) == EXPECTED_ROWS
    with pytest.raises(DataFormatError, match=r"record 0 \(0-based\): this record is in none of the known formats"):
        rows_from_hf([{"query": "q"}])


def test_a_question_file_in_neither_format_names_both_and_the_line(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "q.jsonl", [{"query": "who?", "answer_list": ["me"]}, FLASHRAG_QUESTIONS[0]])
    with pytest.raises(DataFormatError) as info:
        load_questions_jsonl(path)
    message = str(info.value)
    assert message.startswith(f"{path}, line 1: ")
    assert '{"question", "answers", "ctxs"}' in message and '{"id", "question", "golden_answers"}' in message
    assert "questions_format" in message


def test_a_row_outside_the_detected_format_names_it_and_where_it_was_detected(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "q.jsonl", [FLASHRAG_QUESTIONS[0], CONFRAG_QUESTIONS[1]])
    with pytest.raises(DataFormatError, match=r'line 2: missing field "golden_answers".*format flashrag .*line 1'):
        load_questions_jsonl(path)
    # Named explicitly, a file in the other format fails on its first line, the format named.
    with pytest.raises(DataFormatError, match=r'line 1: missing field "answers".*questions_format=confrag'):
        load_questions_jsonl(write_jsonl(tmp_path / "f.jsonl", FLASHRAG_QUESTIONS), questions_format="confrag")


def test_bad_parquet_rows_are_named_by_row(tmp_path: Path) -> None:
    records = [FLASHRAG_QUESTIONS[0], {**FLASHRAG_QUESTIONS[1], "golden_answers": []}]
    path = write_parquet(tmp_path / "q.parquet", records)
    with pytest.raises(DataFormatError, match=re.escape(f"{path}, row 2: ") + r'field "golden_answers" must be'):
        load_questions_jsonl(path)
    broken = tmp_path / "broken.parquet"
    broken.write_text("not parquet")
    with pytest.raises(DataFormatError, match="not a readable parquet file"):
        load_questions_jsonl(broken)


def test_unknown_question_format_value_is_refused(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "q.jsonl", FLASHRAG_QUESTIONS)
    with pytest.raises(ValueError, match=r"questions_format='dpr' is not one of \('auto', 'confrag', 'flashrag'\)"):
        load_questions_jsonl(path, questions_format="dpr")


# ---------------------------------------------------------------- corpora


@pytest.mark.parametrize("suffix", ["jsonl", "parquet"])
@pytest.mark.parametrize(("records", "fmt"), [(FLASHRAG_CORPUS, "flashrag"), (CONFRAG_CORPUS, "confrag")])
def test_both_corpus_formats_give_the_same_corpus(tmp_path: Path, suffix: str, records: list, fmt: str) -> None:
    path = WRITERS[suffix](tmp_path / f"c.{suffix}", records)
    reference = load_corpus_jsonl(write_jsonl(tmp_path / "ref.jsonl", CONFRAG_CORPUS), corpus_format="confrag")
    corpus = load_corpus_jsonl(path, corpus_format=fmt)
    assert corpus.passages == reference.passages and corpus.fingerprint == reference.fingerprint
    assert load_corpus_jsonl(path).fingerprint == reference.fingerprint  # auto
    assert [p.pid for p in corpus.passages] == ["0#0", "0#1", "1#0"]
    assert corpus.passages[0].title == "George Rankin"  # wiki-18's quotes around the title are dropped
    assert list(iter_passages(path)) == corpus.passages


def test_corpus_is_read_one_record_at_a_time(tmp_path: Path) -> None:
    # A bad record after the first one is only met when reading gets there: nothing is read ahead.
    path = write_jsonl(tmp_path / "c.jsonl", [FLASHRAG_CORPUS[0], {"id": "x"}])
    documents = iter_documents(path)
    assert next(documents)[0] == "0"
    with pytest.raises(DataFormatError, match=r'line 2: field "contents" must be a non-empty string'):
        next(documents)


@pytest.mark.parametrize("suffix", ["jsonl", "parquet"])
def test_a_corpus_whose_ids_repeat_is_refused_at_the_first_repeat(tmp_path: Path, suffix: str) -> None:
    records = [FLASHRAG_CORPUS[0], FLASHRAG_CORPUS[1], {"id": "1", "contents": "A\nb"}, {"id": "0", "contents": "C\nd"}]
    path = WRITERS[suffix](tmp_path / f"c.{suffix}", records)
    unit = "line" if suffix == "jsonl" else "row"
    with pytest.raises(DataFormatError, match=rf"{unit} 3: duplicate id '1' \(first at {unit} 2\)"):
        load_corpus_jsonl(path)


def test_a_corpus_in_neither_format_names_both(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "c.jsonl", [{"id": "0", "body": "text"}])
    with pytest.raises(DataFormatError) as info:
        load_corpus_jsonl(path)
    message = str(info.value)
    assert message.startswith(f"{path}, line 1: ") and "retrieval.corpus_format" in message
    assert 'confrag {"id": str, "title": str, "text": str}' in message and 'flashrag {"id": str, "contents"' in message


def test_flashrag_questions_over_a_flashrag_corpus_retrieve(tmp_path: Path) -> None:
    settings = shipped_settings(
        RetrievalSettings,
        "retrieval",
        questions_path=str(write_jsonl(tmp_path / "q.jsonl", FLASHRAG_QUESTIONS)),
        corpus_path=str(write_jsonl(tmp_path / "c.jsonl", FLASHRAG_CORPUS)),
        retriever="bm25",
        top_n=2,
        bi_encoder=False,
    )
    settings.check_files()
    retrieval = build_retrieval(settings, tmp_path / "cache")
    best = retrieval.bm25.search(["capital city of Italy"], top_n=2)[0][0][0]
    assert retrieval.corpus.passages[best].source_id == "1"
    with pytest.raises(ValueError, match=r"retrieval.corpus_format='tsv' is not one of"):
        shipped_settings(RetrievalSettings, "retrieval", questions_path="q.jsonl", corpus_format="tsv")


# ---------------------------------------------------------------- dataset configs


def test_the_default_dataset_is_the_shared_nq_sample(tmp_path: Path) -> None:
    cfg = compose_cfg(["+experiment=probe_tiny_llama"], tmp_path)
    assert cfg.dataset.name == "nq" and cfg.data.questions_path == cfg.paths.questions_path
    assert cfg.data.questions_format == "auto"


@pytest.mark.parametrize(
    ("name", "split"),
    [("nq", None), ("triviaqa", "test"), ("popqa", "test"), ("2wikimultihopqa", "dev"), ("hotpotqa", "dev")],
)
def test_dataset_configs_point_every_task_at_the_users_files(tmp_path: Path, name: str, split: str | None) -> None:
    overrides = [f"dataset={name}", f"paths.data_dir={tmp_path}/data", f"paths.corpus_path={tmp_path}/wiki.jsonl"]
    cfg = compose_cfg(["+experiment=cbdr_tiny_llama", *overrides], tmp_path)
    if split is not None:
        assert cfg.probe.data.questions_path == cfg.retrieval.questions_path == f"{tmp_path}/data/{name}/{split}.jsonl"
        assert cfg.retrieval.corpus_path == f"{tmp_path}/wiki.jsonl"
        assert cfg.probe.data.questions_format == cfg.retrieval.questions_format == "flashrag"
    assert cfg.retrieval.corpus_format == "auto"


def test_reports_name_where_the_candidates_come_from() -> None:
    """The cbdr report said "over the NQ paragraphs" whatever the corpus; it names the file now (no folders)."""
    from dataclasses import replace

    from confrag.stages.retrieval import RetrievalSettings

    from helpers.settings import shipped_settings

    settings = shipped_settings(RetrievalSettings, "retrieval", questions_path="q.jsonl", corpus_path=None)
    assert settings.source == "the NQ paragraphs"
    assert replace(settings, corpus_path="/data/wiki/my_corpus.jsonl").source == "the corpus my_corpus.jsonl"
    assert replace(settings, candidates_path="/x/cands.jsonl").source == "the candidates file cands.jsonl"


def test_an_empty_parquet_file_is_named_as_empty(tmp_path: Path) -> None:
    """A 0-byte file and a parquet file of no rows were "not a readable parquet file (ArrowInvalid ...)"."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from confrag.retrieval.corpus import validate_corpus_jsonl

    blank = tmp_path / "blank.parquet"
    blank.write_bytes(b"")
    no_rows = tmp_path / "no_rows.parquet"
    pq.write_table(pa.table({"question": pa.array([], pa.string())}), no_rows)
    for path, what in ((blank, r"the file is empty \(0 bytes\)"), (no_rows, r"the parquet file is empty \(0 rows\)")):
        with pytest.raises(DataFormatError, match=re.escape(str(path)) + ": " + what):
            load_questions_jsonl(path)
        with pytest.raises(DataFormatError, match=what):
            validate_corpus_jsonl(path)
