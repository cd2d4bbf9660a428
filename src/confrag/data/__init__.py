"""Question-answering data sets."""

from confrag.data.hotpotqa import hotpotqa_row, hotpotqa_rows_from_records, load_hotpotqa
from confrag.data.nq import (
    QUESTIONS_PATH_ENV,
    DataFormatError,
    Passage,
    QARow,
    default_questions_path,
    load_questions_jsonl,
    rows_fingerprint,
    rows_from_hf,
)

__all__ = [
    "QUESTIONS_PATH_ENV",
    "DataFormatError",
    "Passage",
    "QARow",
    "default_questions_path",
    "hotpotqa_row",
    "hotpotqa_rows_from_records",
    "load_hotpotqa",
    "load_questions_jsonl",
    "rows_fingerprint",
    "rows_from_hf",
]
