"""Question-answering data sets."""

from confrag.data.hotpotqa import hotpotqa_row, hotpotqa_rows_from_records, load_hotpotqa
from confrag.data.nq import (
    NQ_PATH_ENV,
    DataFormatError,
    Passage,
    QARow,
    default_nq_path,
    load_nq_jsonl,
    rows_fingerprint,
    rows_from_hf,
)

__all__ = [
    "NQ_PATH_ENV",
    "DataFormatError",
    "Passage",
    "QARow",
    "default_nq_path",
    "hotpotqa_row",
    "hotpotqa_rows_from_records",
    "load_hotpotqa",
    "load_nq_jsonl",
    "rows_fingerprint",
    "rows_from_hf",
]
