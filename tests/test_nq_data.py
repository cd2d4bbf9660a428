"""Question files (NQ-open, any other set): file formats, validation messages, fingerprints and the shared data file."""

from __future__ import annotations

import gzip
import json
import os
import re
from pathlib import Path

import pytest

from confrag.data import (
    DataFormatError,
    Passage,
    QARow,
    default_questions_path,
    load_questions_jsonl,
    rows_fingerprint,
    rows_from_hf,
)
from confrag.infra.paths import project_root

NOBEL = {
    "question": "who got the first nobel prize in physics",
    "answers": ["Wilhelm Conrad Röntgen"],
    "ctxs": [{"title": "Nobel laureates", "text": "The first Nobel Prize in Physics was awarded in 1901 ..."}],
}
DEADPOOL = {"question": "when is the next deadpool movie being released", "answer": ["May 18, 2018"]}


def write_lines(path: Path, lines: list[str]) -> Path:
    data = "".join(line + "\n" for line in lines).encode("utf-8")
    if path.name.endswith(".gz"):
        path.write_bytes(gzip.compress(data))
    else:
        path.write_bytes(data)
    return path


def write_rows(path: Path, rows: list[object]) -> Path:
    return write_lines(path, [json.dumps(row, ensure_ascii=False) for row in rows])


# ---------------------------------------------------------------- reading


def test_loads_shared_format_and_hf_style_rows(tmp_path: Path) -> None:
    path = write_rows(tmp_path / "nq.jsonl", [NOBEL, DEADPOOL])
    rows = load_questions_jsonl(path)
    assert rows == [
        QARow(
            qid="nq-00000",
            question="who got the first nobel prize in physics",
            answers=("Wilhelm Conrad Röntgen",),
            contexts=(
                Passage(title="Nobel laureates", text="The first Nobel Prize in Physics was awarded in 1901 ..."),
            ),
        ),
        QARow(
            qid="nq-00001",
            question="when is the next deadpool movie being released",
            answers=("May 18, 2018",),
            contexts=(),
        ),
    ]


def test_reads_gzip_file_by_suffix(tmp_path: Path) -> None:
    plain = load_questions_jsonl(write_rows(tmp_path / "nq.jsonl", [NOBEL, DEADPOOL]))
    gzipped = load_questions_jsonl(write_rows(tmp_path / "nq.jsonl.gz", [NOBEL, DEADPOOL]))
    assert gzipped == plain


def test_blank_lines_skipped_and_qids_count_non_blank_lines(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "nq.jsonl", ["", json.dumps(NOBEL), "   ", json.dumps(DEADPOOL), ""])
    assert [row.qid for row in load_questions_jsonl(path)] == ["nq-00000", "nq-00001"]


def test_id_field_becomes_qid(tmp_path: Path) -> None:
    path = write_rows(tmp_path / "nq.jsonl", [{**NOBEL, "id": 17}, {**DEADPOOL, "id": "dev-3"}])
    assert [row.qid for row in load_questions_jsonl(path)] == ["17", "dev-3"]


def test_extra_fields_ignored(tmp_path: Path) -> None:
    ctx = {"title": "T", "text": "x", "score": 1.5, "hasanswer": True}
    path = write_rows(tmp_path / "nq.jsonl", [{**NOBEL, "ctxs": [ctx], "extra": 1}])
    assert load_questions_jsonl(path)[0].contexts == (Passage("T", "x"),)


def test_answers_preferred_over_answer_when_both_present(tmp_path: Path) -> None:
    path = write_rows(tmp_path / "nq.jsonl", [{**NOBEL, "answer": ["other"]}])
    assert load_questions_jsonl(path)[0].answers == ("Wilhelm Conrad Röntgen",)


def test_utf8_byte_order_mark_accepted(tmp_path: Path) -> None:
    path = tmp_path / "nq.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(NOBEL).encode("utf-8") + b"\n")
    assert load_questions_jsonl(path)[0].question == NOBEL["question"]


def test_limit_keeps_first_rows_and_stops_reading(tmp_path: Path) -> None:
    # The broken third line is never parsed when only two rows are wanted.
    path = write_lines(tmp_path / "nq.jsonl", [json.dumps(NOBEL), "", json.dumps(DEADPOOL), "{broken"])
    rows = load_questions_jsonl(path, limit=2)
    assert [row.qid for row in rows] == ["nq-00000", "nq-00001"]
    assert load_questions_jsonl(path, limit=1) == rows[:1]


@pytest.mark.parametrize("limit", [0, -1, True, 1.5])
def test_invalid_limit_rejected(tmp_path: Path, limit: object) -> None:
    path = write_rows(tmp_path / "nq.jsonl", [NOBEL])
    with pytest.raises(ValueError, match=r"limit must be an integer >= 1 or None"):
        load_questions_jsonl(path, limit=limit)  # type: ignore[arg-type]


# ---------------------------------------------------------------- file-level errors


def test_missing_file_names_path_and_how_to_configure(tmp_path: Path) -> None:
    missing = tmp_path / "absent.jsonl.gz"
    with pytest.raises(DataFormatError) as info:
        load_questions_jsonl(missing)
    message = str(info.value)
    assert str(missing) in message
    assert "not found" in message
    assert "paths.questions_path" in message and "CONFRAG_QUESTIONS_PATH" in message


def test_directory_rejected(tmp_path: Path) -> None:
    folder = tmp_path / "nq.jsonl"
    folder.mkdir()
    with pytest.raises(DataFormatError, match="is a directory"):
        load_questions_jsonl(folder)


def test_unsupported_suffix_rejected(tmp_path: Path) -> None:
    path = write_rows(tmp_path / "nq.json", [NOBEL])
    expected = r"nq\.json: unsupported file name; allowed suffixes are \.jsonl, \.jsonl\.gz"
    with pytest.raises(DataFormatError, match=expected):
        load_questions_jsonl(path)


def test_gz_file_that_is_not_gzip_rejected(tmp_path: Path) -> None:
    path = tmp_path / "nq.jsonl.gz"
    path.write_text(json.dumps(NOBEL) + "\n", encoding="utf-8")
    with pytest.raises(DataFormatError, match=r"nq\.jsonl\.gz: not a complete gzip file"):
        load_questions_jsonl(path)


def test_truncated_gzip_rejected(tmp_path: Path) -> None:
    path = tmp_path / "nq.jsonl.gz"
    full = gzip.compress(("\n".join(json.dumps(NOBEL) for _ in range(50)) + "\n").encode("utf-8"))
    path.write_bytes(full[: len(full) - 12])  # drop the trailer (CRC and size)
    with pytest.raises(DataFormatError, match=r"nq\.jsonl\.gz: not a complete gzip file"):
        load_questions_jsonl(path)


def test_invalid_utf8_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "nq.jsonl"
    path.write_bytes(json.dumps(NOBEL).encode("utf-8") + b"\n" + b'{"question": "caf\xe9"}\n')
    with pytest.raises(DataFormatError, match=r"nq\.jsonl, line 2: not valid UTF-8"):
        load_questions_jsonl(path)


# ---------------------------------------------------------------- row-level errors


# Each case: the bad third line, and a regex the message must match after "<file>, line 3: ".
def row_line(**fields: object) -> str:
    return json.dumps(fields)


CTX = {"title": "t", "text": "x"}
BAD_ROWS = [
    ("{not json", r"malformed JSON .*each line must be one JSON object"),
    ('["a", "list"]', r'each row must be a JSON object with "question" and "answers"; got list'),
    ('"just a string"', r"each row must be a JSON object.*got str"),
    (row_line(answers=["x"]), r'field "question" must be a non-empty string; got None'),
    (row_line(question="  ", answers=["x"]), r'field "question" must be a non-empty string'),
    (row_line(question=3, answers=["x"]), r'field "question" must be a non-empty string; got 3'),
    (row_line(question="q"), r'missing field "answers" \(or "answer"\): a non-empty list of strings'),
    (row_line(question="q", answers=[]), r'field "answers" must be a non-empty list of strings; got \[\]'),
    (row_line(question="q", answers="x"), r'field "answers" must be a non-empty list of strings'),
    (row_line(question="q", answer=None), r'field "answer" must be a non-empty list of strings; got None'),
    (row_line(question="q", answers=["x", 1901]), r'field "answers\[1\]" must be a non-empty string; got 1901'),
    (row_line(question="q", answers=["x", ""]), r'field "answers\[1\]" must be a non-empty string'),
    (row_line(question="q", answers=["x"], ctxs=CTX), r'field "ctxs" must be a list of .*objects; got dict'),
    (
        row_line(question="q", answers=["x"], ctxs=["text"]),
        r'field "ctxs\[0\]" must be an object with string "title" and "text"; got str',
    ),
    (
        row_line(question="q", answers=["x"], ctxs=[CTX, {"text": "x"}]),
        r'field "ctxs\[1\]\.title" must be a string; got None',
    ),
    (
        row_line(question="q", answers=["x"], ctxs=[{"title": "t", "text": 5}]),
        r'field "ctxs\[0\]\.text" must be a string; got 5',
    ),
    (row_line(question="q", answers=["x"], id=True), r'field "id" must be a non-empty string or an integer; got True'),
    (row_line(question="q", answers=["x"], id=""), r'field "id" must be a non-empty string or an integer'),
]


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz"])
@pytest.mark.parametrize(("bad_line", "expected"), BAD_ROWS)
def test_bad_row_message_names_file_and_line(tmp_path: Path, suffix: str, bad_line: str, expected: str) -> None:
    # A blank line 2 checks that reported numbers are physical lines, blank ones included.
    path = write_lines(tmp_path / f"broken{suffix}", [json.dumps(NOBEL), "", bad_line, json.dumps(DEADPOOL)])
    with pytest.raises(DataFormatError) as info:
        load_questions_jsonl(path)
    message = str(info.value)
    assert message.startswith(f"{path}, line 3: "), message
    assert f"broken{suffix}" in message and "line 3" in message
    assert re.search(expected, message), message


def test_duplicate_id_names_both_lines(tmp_path: Path) -> None:
    path = write_rows(tmp_path / "nq.jsonl", [{**NOBEL, "id": "a"}, {**DEADPOOL, "id": "a"}])
    with pytest.raises(DataFormatError, match=r"nq\.jsonl, line 2: duplicate id 'a' \(first at .*nq\.jsonl, line 1\)"):
        load_questions_jsonl(path)


def test_data_format_error_is_a_value_error() -> None:
    assert issubclass(DataFormatError, ValueError)


# ---------------------------------------------------------------- in-memory records


def test_rows_from_hf_matches_file_loader(tmp_path: Path) -> None:
    records = [{"question": "q one", "answer": ["a1", "a2"]}, {"question": "q two", "answer": ["b"]}]
    rows = rows_from_hf(records)
    assert rows == [
        QARow(qid="nq-00000", question="q one", answers=("a1", "a2"), contexts=()),
        QARow(qid="nq-00001", question="q two", answers=("b",), contexts=()),
    ]
    assert rows == load_questions_jsonl(write_rows(tmp_path / "hf.jsonl", records))


def test_rows_from_hf_accepts_a_generator() -> None:
    rows = rows_from_hf({"question": f"q{i}", "answer": ["x"]} for i in range(3))
    assert [row.question for row in rows] == ["q0", "q1", "q2"]


def test_rows_from_hf_errors_name_the_record() -> None:
    records = [{"question": "q", "answer": ["x"]}, {"question": "q2", "answer": []}]
    expected = r'^record 1 \(0-based\): field "answer" must be a non-empty list of strings'
    with pytest.raises(DataFormatError, match=expected):
        rows_from_hf(records)
    with pytest.raises(DataFormatError, match=r"^record 0 \(0-based\): each row must be a JSON object"):
        rows_from_hf(["not a mapping"])  # type: ignore[list-item]


# ---------------------------------------------------------------- fingerprints


def test_fingerprint_is_stable_sha256_hex() -> None:
    rows = rows_from_hf([{"question": "q", "answer": ["x"]}])
    fingerprint = rows_fingerprint(rows)
    assert len(fingerprint) == 64 and int(fingerprint, 16) >= 0
    assert rows_fingerprint(list(rows)) == fingerprint
    assert rows_fingerprint([QARow("nq-00000", "q", ("x",), ())]) == fingerprint


def test_fingerprint_changes_with_any_field_and_order() -> None:
    base = QARow("nq-00000", "q", ("x",), (Passage("t", "p"),))
    other = QARow("nq-00001", "q2", ("y",), ())
    fingerprints = {
        rows_fingerprint([base, other]),
        rows_fingerprint([other, base]),
        rows_fingerprint([base]),
        rows_fingerprint([]),
        rows_fingerprint([QARow("nq-9", "q", ("x",), (Passage("t", "p"),)), other]),
        rows_fingerprint([QARow("nq-00000", "Q", ("x",), (Passage("t", "p"),)), other]),
        rows_fingerprint([QARow("nq-00000", "q", ("x", "z"), (Passage("t", "p"),)), other]),
        rows_fingerprint([QARow("nq-00000", "q", ("x",), (Passage("T", "p"),)), other]),
        rows_fingerprint([QARow("nq-00000", "q", ("x",), (Passage("t", "p2"),)), other]),
        rows_fingerprint([QARow("nq-00000", "q", ("x",), ()), other]),
    }
    assert len(fingerprints) == 10


def test_fingerprint_does_not_confuse_field_boundaries() -> None:
    # Naive concatenation would make these two identical ("ab" + "c" == "a" + "bc").
    first = QARow("nq-00000", "q", ("ab", "c"), ())
    second = QARow("nq-00000", "q", ("a", "bc"), ())
    assert rows_fingerprint([first]) != rows_fingerprint([second])


# ---------------------------------------------------------------- default path and the shared file


def test_default_questions_path_from_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CONFRAG_QUESTIONS_PATH", str(tmp_path / "mine.jsonl"))
    assert default_questions_path() == tmp_path / "mine.jsonl"


def test_default_questions_path_next_to_project(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CONFRAG_QUESTIONS_PATH", raising=False)
    assert default_questions_path() == project_root().parent / "shared" / "data" / "nq_open_gold.jsonl.gz"
    assert (project_root() / "pyproject.toml").is_file()


def test_shared_nq_open_gold_file(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CONFRAG_QUESTIONS_PATH", raising=False)
    path = default_questions_path()
    if not path.is_file():
        # CI always has ../shared beside the clone: there a missing file is a failure, not a skip.
        if os.environ.get("CI"):
            pytest.fail(f"shared NQ-open file not present at {path} (CI expects ../shared/data beside the clone)")
        pytest.skip(f"shared NQ-open file not present at {path}")
    rows = load_questions_jsonl(path)
    assert len(rows) == 2155
    assert len({row.question for row in rows}) == 2155
    assert len({row.qid for row in rows}) == 2155
    assert all(len(row.answers) >= 1 and len(row.contexts) >= 1 for row in rows)
    assert all(passage.text.strip() for row in rows for passage in row.contexts)
    assert rows[0].question == "who got the first nobel prize in physics"
    assert rows[0].answers == ("Wilhelm Conrad Röntgen",)
    assert load_questions_jsonl(path, limit=5) == rows[:5]
