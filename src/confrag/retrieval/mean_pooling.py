"""The sentence-transformers mean-pooling bi-encoder (Transformer → mean Pooling → Normalize), read and written
with plain `transformers`: one place for what the dense retriever (`confrag.retrieval.dense`) and the
bi-encoder reranker (`confrag.reranker.bi_encoder`) both need, so that their embeddings equal
`SentenceTransformer(model_dir).encode(...)` and an exported folder loads back in sentence-transformers.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

__all__ = ["check_mean_pooling", "max_seq_length", "mean_pool", "write_sentence_transformers_files"]

# What sentence-transformers reads to assemble the pipeline, as all-MiniLM-L6-v2 ships it.
_MODULES = [
    {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
    {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
]


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: unreadable sentence-transformers config ({err})") from err


def max_seq_length(model_dir: str | Path, tokenizer) -> int:
    """The token budget of one text. sentence-transformers truncates at sentence_bert_config.json's
    max_seq_length (256 for MiniLM), not at the tokenizer's 512; using 512 would change long passages'
    embeddings."""
    config = Path(model_dir) / "sentence_bert_config.json"
    if config.is_file():
        value = _read_json(config).get("max_seq_length")
        if isinstance(value, int) and value > 0:
            return value
    return min(int(tokenizer.model_max_length), 512)


def check_mean_pooling(model_dir: str | Path, needed_by: str) -> None:
    """Refuse a sentence-transformers folder whose pooling is not mean pooling (a plain transformers folder,
    with no pooling config, is pooled by mean)."""
    pooling = Path(model_dir) / "1_Pooling" / "config.json"
    if not pooling.is_file():
        return
    config = _read_json(pooling)
    other_modes = [
        k for k, v in config.items() if k.startswith("pooling_mode_") and k != "pooling_mode_mean_tokens" and v
    ]
    if not config.get("pooling_mode_mean_tokens") or other_modes:
        raise ValueError(
            f"{pooling}: {needed_by} implements mean pooling only (pooling_mode_mean_tokens: true and no "
            f"other mode); this model asks for {other_modes or 'no mean pooling'}"
        )


def mean_pool(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """L2-normalized mean of the real tokens' states: (batch, length, dim) → (batch, dim)."""
    mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
    # The clamp mirrors sentence-transformers for an all-padding row.
    pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
    return torch.nn.functional.normalize(pooled, p=2, dim=1)


def write_sentence_transformers_files(directory: str | Path, dimension: int, max_length: int) -> None:
    """Beside a saved transformers encoder, the files that make `SentenceTransformer(directory)` load it as
    Transformer → mean Pooling → Normalize with `max_length` tokens per text."""
    directory = Path(directory)
    (directory / "modules.json").write_text(json.dumps(_MODULES, indent=2))
    (directory / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": int(max_length), "do_lower_case": False}, indent=2)
    )
    (directory / "1_Pooling").mkdir(exist_ok=True)
    pooling = {
        "word_embedding_dimension": int(dimension),
        "pooling_mode_cls_token": False,
        "pooling_mode_mean_tokens": True,
        "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False,
    }
    (directory / "1_Pooling" / "config.json").write_text(json.dumps(pooling, indent=2))
    (directory / "2_Normalize").mkdir(exist_ok=True)
