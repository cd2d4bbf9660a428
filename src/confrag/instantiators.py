"""Objects built from config nodes: a group's `_target_` nodes, the run's loggers, typed settings.

This module and the `*/settings.py` modules are where a Hydra / OmegaConf config is read; everything
else in the library takes typed arguments.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import shlex
import sys
from pathlib import Path
from typing import Any, TypeVar

from hydra.errors import InstantiationException
from hydra.utils import get_class, instantiate
from lightning.pytorch.loggers import Logger
from omegaconf import DictConfig, OmegaConf, open_dict

from confrag.data.nq import questions_path_from_env
from confrag.infra import checks
from confrag.infra.distributed import rank_info
from confrag.infra.paths import config_dir
from confrag.infra.run_context import RunContext

T = TypeVar("T")
log = logging.getLogger(__name__)


def plain(node: Any) -> Any:
    """A config node as plain Python values (interpolations resolved); plain values pass through."""
    if OmegaConf.is_config(node):
        return OmegaConf.to_container(node, resolve=True)
    return node


def instantiate_list(section: DictConfig | None) -> list[Any]:
    """Instantiate every `_target_` node of a config group such as `callbacks` or `logger`."""
    if not section:
        return []
    return [instantiate(node) for node in section.values() if isinstance(node, DictConfig) and "_target_" in node]


def task_loggers(cfg: DictConfig) -> tuple[dict[str, Any], list[Logger]]:
    """The resolved config and the run's loggers, each already holding that config as hyperparameters."""
    run_config = OmegaConf.to_container(cfg, resolve=True)
    loggers: list[Logger] = instantiate_list(cfg.get("logger"))
    for logger in loggers:
        logger.log_hyperparams(run_config)
    return run_config, loggers


def output_dir(cfg: DictConfig) -> Path:
    """The run folder (`paths.output_dir`: Hydra's run or job folder, or what a caller composed in)."""
    return Path(cfg.paths.output_dir)


def run_context(cfg: DictConfig, output: str | Path | None = None) -> RunContext:
    """The run's context (cache, seed, progress reporting, run folder, this process's rank), built once per run
    by the entry point. `output`: a run folder other than `paths.output_dir` (the Python API's work folder)."""
    return RunContext(
        cache_dir=Path(cfg.paths.cache_dir),
        seed=checks.integer(cfg.seed, "seed"),
        progress=checks.flag(cfg.get("progress", True), "progress"),
        output_dir=Path(output) if output is not None else output_dir(cfg),
        rank=rank_info(),
    )


def shipped(path: str, **values: Any) -> Any:
    """The object the shipped `_target_` node conf/<path> builds, `values` over the node's own: how code outside a
    run (tests, benchmarks, notebooks) builds a class that YAML instantiates, whose defaults live in that node only
    (docs/architecture.md, "Settings pattern"). E.g. `shipped("gate/ccsk.yaml", k=3)`, `shipped("model/probe.yaml",
    input_dim=576, layer=15)`. A key the node takes from the rest of a run's config (`seed: ${seed}`) must be given;
    it is named otherwise. A `_partial_` node is built at once: `values` hold what the stage fills in. Errors of the
    class itself come through as they are (no Hydra wrapper)."""
    file = config_dir() / path
    node = OmegaConf.load(file)
    if isinstance(node, DictConfig) and "defaults" in node:
        raise ValueError(f"conf/{path} extends another node (its `defaults` list): compose it with Hydra instead")
    if not isinstance(node, DictConfig) or "_target_" not in node:
        raise ValueError(f"conf/{path} is not a `_target_` node")
    renamed_in(node, Path(path).parent.as_posix())  # a renamed key's old name (null as shipped) is left out
    raw = OmegaConf.to_container(node, resolve=False)
    borrowed = {k: raw[k] for k in raw if k not in values and OmegaConf.is_interpolation(node, k)}
    if borrowed:
        raise ValueError(
            f"conf/{path} takes {', '.join(f'{k}: {v}' for k, v in borrowed.items())} from a run's config: give "
            f"{', '.join(f'{k}=...' for k in borrowed)} to shipped()"
        )
    # The YAML's own values as plain Python; the caller's pass through as they are (rows, paths, objects).
    settings = OmegaConf.to_container(OmegaConf.create({k: v for k, v in raw.items() if k not in values}), resolve=True)
    cls = get_class(str(settings.pop("_target_")))
    settings.pop("_partial_", None)
    return cls(**settings, **values)


def node_parameters(node: Any) -> set[str]:
    """The keys a `_target_` node sets and the parameters its class takes (one the YAML leaves at its default)."""
    values = plain(node) or {}
    target = values.get("_target_") if isinstance(values, dict) else None
    try:  # a node without a `_target_` (a plain settings node) has only its own keys
        params = set(inspect.signature(get_class(str(target))).parameters) if target else set()
    except Exception:  # noqa: BLE001 - a bad _target_ is named by the instantiation itself
        params = set()
    return (set(values) | params) - {"_target_", "_partial_", "_convert_", "self"}


def built(node: Any, key: str, **kwargs: Any) -> Any:
    """`instantiate(node, **kwargs)` at the config boundary: the constructor's refusal, Hydra's wrapper taken off,
    is reported under the node's key (`k must be ...` reads `gate.k must be ...`: `checks.config_key`)."""
    with checks.config_key(key, node_parameters(node)):
        try:
            return instantiate(node, **kwargs, _convert_="all")
        except InstantiationException as err:
            if isinstance(err.__cause__, ValueError):
                raise err.__cause__ from None
            raise ValueError(str(err.__cause__ or err)) from err


# Keys that moved, so that an old command line is told where its key went (not only that it is unknown).
MOVED = {
    "preferences.max_new_tokens": "rag.max_new_tokens (the utility rule answers with the rag node's settings)",
    "preferences.answer_batch_size": "rag.batch_size (the utility rule answers with the rag node's settings)",
    "preferences.answer_chunk_size": "rag.chunk_size (the utility rule answers with the rag node's settings)",
}
# Keys renamed but still read for one release (`renamed_keys`): old key -> new key, in the same node. The shipped
# YAML keeps each old key at null, so that an override of it (`eval.nq_path=FILE`) still composes.
RENAMED = {
    # A question file of any set (NQ-open, a FlashRAG set, one's own), not only NQ's.
    f"{node}.nq_path": f"{node}.questions_path"
    for node in ("paths", "data", "probe.data", "retrieval", "base_reranker", "eval")
}

# The probe data node's options, once flat, now in groups (`data.splits`, `data.extraction`, `data.answers`,
# `data.candidates`, `data.ranking`; confrag.probe.data_options): old key -> its place in the same node, read for one
# release. A command line is rewritten before Hydra reads it (`grouped_overrides`: Hydra refuses an override of a
# key the YAML no longer holds; an old key beside its new one there is refused); a config file's old key is moved by
# `renamed_in`: its value wins over what the config files give the new key, the command line wins over both.
GROUPED = {
    "layers": "extraction.layers",
    "extract_batch_size": "extraction.batch_size",
    "extract_threads": "extraction.threads",
    "extract_compile": "extraction.compile",
    "max_new_tokens": "answers.max_new_tokens",
    "gen_batch_size": "answers.batch_size",
    "generation": "answers.generation",
    "split_sizes": "splits.sizes",
    "balance": "splits.balance",
    "question_splits": "splits.proportions",
    "allow_one_class": "splits.allow_one_class",
    "candidates_top_n": "candidates.top_n",
    "words_per_passage": "candidates.words_per_passage",
    "ranking_top_n": "ranking.top_n",
    "ranking_test_questions": "ranking.test_questions",
}
GROUPED_NODES = ("data", "probe.data")


def grouped_key(key: str) -> str | None:
    """The new place of an old probe-data key (`data.balance` -> `data.splits.balance`, `probe.data.generation.x`
    -> `probe.data.answers.generation.x`); None for any other key."""
    for node in GROUPED_NODES:
        for old, new in GROUPED.items():
            full = f"{node}.{old}"
            if key == full or key.startswith(f"{full}."):
                return f"{node}.{new}{key[len(full) :]}"
    return None


def _override_key(argument: str) -> tuple[str, str, str]:
    """(prefix `+`/`++`/`~`, key, `=value` or "") of a command-line override."""
    prefix = argument[: len(argument) - len(argument.lstrip("+~"))]
    key, equals, value = argument[len(prefix) :].partition("=")
    return prefix, key, equals + value


def grouped_overrides(arguments: list[str]) -> list[str]:
    """Command-line arguments with every override of an old probe-data key rewritten to its group, each with a
    warning (`data.balance=false` -> `data.splits.balance=false`; a `+` that added a key the YAML then lacked is
    dropped, as the YAML now holds it). Every other argument, Hydra's own included, passes unchanged. An old key
    and its new one both given are refused naming both (Hydra would silently keep the last)."""
    given = {_override_key(a)[1]: a for a in arguments if not a.startswith("-")}
    out = []
    for argument in arguments:
        prefix, key, value = _override_key(argument)
        new = grouped_key(key) if not argument.startswith("-") else None
        if new is None:
            out.append(argument)
            continue
        if new in given:
            raise ValueError(
                f"{argument} and {given[new]} are both set: {key} is the old name of {new} (read for one "
                f"release); set {new} only"
            )
        prefix = "" if prefix == "+" else prefix
        # `data.` is the probe's node in the probe task only; the tasks that train a probe first hold it under `probe.`
        later = "" if key.startswith("probe.") else f" (probe.{new} in the rerank, cbdr and gates tasks)"
        log.warning("%s is deprecated (read for one release): it is now %s; set %s%s%s", key, new, new, value, later)
        out.append(f"{prefix}{new}{value}")
    return out


def _command_line_keys() -> set[str]:
    """The keys this run's command line sets (Hydra's record of its overrides; none outside a Hydra run)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return set()
    return {_override_key(a)[1] for a in HydraConfig.get().overrides.task}


def renamed_keys(cfg: DictConfig, warn: bool = True) -> DictConfig:
    """`cfg` with every old key of RENAMED read into its new one, in place (and returned; `renamed_in` on each
    node that has one): what reads the config then sees the new names only, and a second call changes nothing.
    A task's `check` calls it first, so that `paths.nq_path` reaches `dataset.questions_path` before any node is
    read. The old environment variable `CONFRAG_NQ_PATH` is checked the same way. `warn=False`: an old run's saved
    config, read quietly."""
    if warn:
        questions_path_from_env()  # warns about, or refuses, the old variable beside the new one
    for parent in dict.fromkeys([*(old.rpartition(".")[0] for old in RENAMED), *GROUPED_NODES]):
        node = OmegaConf.select(cfg, parent, default=None)
        if isinstance(node, DictConfig):
            renamed_in(node, parent, warn)
    return cfg


def renamed_in(node: DictConfig | dict, key: str, warn: bool = True) -> None:
    """The old keys of RENAMED in config node `key` (e.g. "eval"), read into their new ones in place: an old key
    set (not null) moves to its new key, with a warning naming both; if the new key holds a value of its own
    (neither null nor an interpolation: a shipped default such as `${dataset.questions_path}`) that differs,
    the node is refused naming both keys. Each old key is then removed."""
    for old, new in RENAMED.items():
        parent, _, old_key = old.rpartition(".")
        new_key = new.rpartition(".")[2]
        if parent != key or old_key not in node:
            continue
        value = node[old_key]
        with open_dict(node) if isinstance(node, DictConfig) else contextlib.nullcontext():
            if value is not None:
                if _holds_own_value(node, new_key) and node[new_key] != value:
                    raise ValueError(
                        f"{old}={value} and {new}={node[new_key]} are both set: {old} is the old name of {new} "
                        f"(read for one release); set {new} only"
                    )
                if warn:
                    log.warning(
                        "%s is deprecated (read for one release): it is now %s; set %s=%s", old, new, new, value
                    )
                node[new_key] = value
            del node[old_key]
    if key in GROUPED_NODES:
        _grouped_in(node, key, warn)


def _grouped_in(node: DictConfig | dict, key: str, warn: bool) -> None:
    """GROUPED's old keys in probe-data node `key` (set in a config file), moved into their groups in place: the
    old value wins over what the config files give the new key, and the command line wins over both."""
    command_line = _command_line_keys() if any(k in node for k in GROUPED) else set()
    for old_key in [k for k in GROUPED if k in node]:
        group, _, field = GROUPED[old_key].partition(".")
        value, new = node[old_key], f"{key}.{group}.{field}"
        with open_dict(node) if isinstance(node, DictConfig) else contextlib.nullcontext():
            if node.get(group) is None:
                node[group] = {}
            before = node[group].get(field)
            if new in command_line:
                if warn:
                    log.warning(
                        "%s.%s=%s (a config file's, deprecated: it is now %s) is not read: the command line sets %s=%s",
                        key, old_key, value, new, new, before,
                    )  # fmt: skip
                del node[old_key]
                continue
            if warn:
                replaced = f" (it replaces {new}={before} of the config files)" if before not in (None, value) else ""
                log.warning(
                    "%s.%s is deprecated (read for one release): it is now %s; set %s=%s%s",
                    key, old_key, new, new, value, replaced,
                )  # fmt: skip
            node[group][field] = value
            del node[old_key]


def _holds_own_value(node: DictConfig | dict, key: str) -> bool:
    interpolated = isinstance(node, DictConfig) and key in node and OmegaConf.is_interpolation(node, key)
    return key in node and not interpolated and node[key] is not None


def settings_from(cls: type[T], node: Any, key: str) -> T:
    """The dataclass `cls` from config node `key`: unknown keys are named with the ones `cls` takes, and so are
    missing ones (a settings dataclass has no default for what its YAML node provides: docs/architecture.md,
    "Settings pattern"); a value the dataclass refuses is reported under `key` (`checks.config_key`). A renamed key
    under its old name is read into its new one first (`renamed_in`; a DictConfig node in place)."""
    if isinstance(node, DictConfig):
        renamed_in(node, key)
    values = dict(plain(node) or {})  # a copy: the caller's own dict is left as it is
    renamed_in(values, key)  # a plain node: its interpolations are already resolved
    fields = {f.name for f in dataclasses.fields(cls)}
    moved = [f"{key}.{k} is now {MOVED[f'{key}.{k}']}" for k in sorted(set(values) - fields) if f"{key}.{k}" in MOVED]
    with checks.config_key(key, fields):  # the dataclass names its field (`top_k`); the user reads `key.top_k`
        try:
            return checks.dataclass_from(cls, values, key, f"compose the group's shipped node (conf/{key}/)")
        except ValueError as err:
            if moved:  # an unknown key that moved elsewhere: say where
                raise ValueError(f"{err} ({'; '.join(moved)})") from None
            raise


def run_command(cfg: DictConfig) -> str:
    """The command that reproduces this run: `python train.py` with the run's command-line overrides (Hydra's
    record of them; the process arguments when the config was composed without Hydra's launcher)."""
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        arguments = list(HydraConfig.get().overrides.task)
    else:
        arguments = sys.argv[1:]
    return " ".join(["python train.py", *(shlex.quote(a) for a in arguments)])


def config_yaml(cfg: DictConfig) -> str:
    """The resolved config as YAML, for reports."""
    return OmegaConf.to_yaml(cfg, resolve=True)


def question_set_label(cfg: DictConfig) -> str:
    """How the reports name the evaluation's question set: the evaluation file's name (`eval.questions_path`), else the
    dataset's label (`dataset.label`: NQ, PopQA, ...); never the HotpotQA set's name beside it."""
    evaluation, dataset = cfg.get("eval") or {}, cfg.get("dataset") or {}
    if evaluation.get("questions_path"):
        return Path(str(evaluation.questions_path)).name
    label = str(dataset.get("label") or dataset.get("name") or "NQ")
    return f"{label} (dataset)" if label == "HotpotQA" and evaluation.get("hotpotqa_path") else label
