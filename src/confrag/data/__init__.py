"""Question-answering data sets."""

from confrag.data.hotpotqa import hotpotqa_row, hotpotqa_rows_from_records, load_hotpotqa
from confrag.data.nq import (
    NQ_PATH_ENV,
    QUESTIONS_PATH_ENV,
    DataFormatError,
    Passage,
    QARow,
    default_nq_path,
    default_questions_path,
    load_nq_jsonl,
    load_questions_jsonl,
    rows_fingerprint,
    rows_from_hf,
)

# default_nq_path, load_nq_jsonl and NQ_PATH_ENV: the old names, kept one release (deprecated).
__all__ = [
    "NQ_PATH_ENV",
    "QUESTIONS_PATH_ENV",
    "DataFormatError",
    "Passage",
    "QARow",
    "default_nq_path",
    "default_questions_path",
    "hotpotqa_row",
    "hotpotqa_rows_from_records",
    "load_hotpotqa",
    "load_nq_jsonl",
    "load_questions_jsonl",
    "rows_fingerprint",
    "rows_from_hf",
]
