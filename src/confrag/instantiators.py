"""Objects built from config nodes: a group's `_target_` nodes, the run's loggers, typed settings.

This module and the `*/settings.py` modules are where a Hydra / OmegaConf config is read; everything
else in the library takes typed arguments.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import shlex
import sys
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any, TypeVar

from hydra.errors import InstantiationException
from hydra.utils import get_class, instantiate
from lightning.pytorch.loggers import Logger
from omegaconf import DictConfig, OmegaConf

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


def check_node_keys(node: Any, given: Collection[str] = ()) -> None:
    """A `_target_` node checked against its class without building it: a key the class does not take, or a
    parameter without a default that neither the node nor the caller (`given`: what it fills in later) sets, is
    named (the caller's `checks.config_key` puts the node's key before the message)."""
    values = plain(node) or {}
    parameters = inspect.signature(get_class(str(values["_target_"]))).parameters
    keys = set(values) - {"_target_", "_partial_", "_convert_", "_recursive_"}
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    unknown = sorted(keys - set(parameters))
    if unknown and not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        raise ValueError(f"unknown key(s) {unknown}; allowed: {sorted(set(parameters) - set(given))}")
    missing = [
        n for n, p in parameters.items() if p.kind in named and p.default is p.empty and n not in {*keys, *given}
    ]
    if missing:
        raise ValueError(f"missing key(s) {missing}")


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


# The probe data node's keys that moved within it (its flat options into the groups of confrag.probe.data_options).
# The node is `data` in the probe task and `probe.data` in the others (`probe_data_node`).
PROBE_DATA_MOVED = {
    "nq_path": "questions_path",  # a question file of any set (NQ-open, a FlashRAG set, one's own), not only NQ's
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
# CCSK's options, once flat, now in the groups of `confrag.gates.ccsk` (`gate.*` too after `gate=ccsk`).
CCSK_MOVED = {
    "tau_pred": "thresholds.pred",
    "tau_conf": "thresholds.conf",
    "tau_single": "thresholds.single",
    "rouge_weight": "rqm.rouge_weight",
    "cosine_weight": "rqm.cosine_weight",
    "rqm_learning_rate": "rqm.learning_rate",
    "rqm_num_leaves": "rqm.num_leaves",
    "rqm_max_rounds": "rqm.max_rounds",
    "rqm_early_stopping": "rqm.early_stopping",
    "heads": "fusion.heads",
    "hidden": "fusion.hidden",
    "dropout": "fusion.dropout",
    "epochs": "fusion.epochs",
    "lr": "fusion.lr",
}
CCSK_NODE = "gates.configs.ccsk"
# Keys that moved, each with where it went (a line a key): a command line that names one is refused before Hydra
# reads it (`refuse_moved_arguments`, from the entry point), a config file's when the task checks its config
# (`refuse_moved_keys`), so that no setting is dropped in silence and the refusal names the key to set instead.
MOVED = {
    "preferences.max_new_tokens": "rag.max_new_tokens (the utility rule answers with the rag node's settings)",
    "preferences.answer_batch_size": "rag.batch_size (the utility rule answers with the rag node's settings)",
    "preferences.answer_chunk_size": "rag.chunk_size (the utility rule answers with the rag node's settings)",
    **{f"{node}.nq_path": f"{node}.questions_path" for node in ("paths", "retrieval", "base_reranker", "eval")},
    **{f"{node}.{old}": f"{node}.{new}" for node in ("data", "probe.data") for old, new in PROBE_DATA_MOVED.items()},
    **{f"{CCSK_NODE}.{old}": f"{CCSK_NODE}.{new}" for old, new in CCSK_MOVED.items()},
}
# Environment variables renamed likewise, refused by the entry point naming the new name.
MOVED_VARIABLES = {"CONFRAG_NQ_PATH": "CONFRAG_QUESTIONS_PATH"}


def probe_data_node(task: str) -> str:
    """Where the probe's data node sits in `task`'s config: the root's `data` in the probe task; `probe.data` in
    the tasks that train a probe first (their `data` is the reranker's batches)."""
    return "data" if task == "probe" else "probe.data"


def moved_to(key: str, task: str | None = None, gate: str | None = None) -> str | None:
    """Where `key` went (None: it did not move), a key under it included (`data.generation.static_cache` ->
    `data.answers.generation.static_cache`). With `task`, an old key of the probe data node (`data.balance`,
    `probe.data.balance`) is pointed at that task's own probe data node (`probe.data.splits.balance` in the rerank
    task, whose `data` is the reranker's). `gate`: the gate `gate=<name>` selected, whose node `gate` is."""
    if gate == "ccsk" and key.startswith("gate."):
        found = moved_to(f"{CCSK_NODE}.{key.removeprefix('gate.')}")
        return None if found is None else f"gate.{found.removeprefix(f'{CCSK_NODE}.')}"
    for old, new in MOVED.items():
        if key != old and not key.startswith(f"{old}."):
            continue
        field = next((old.removeprefix(f"{n}.") for n in ("probe.data", "data") if old.startswith(f"{n}.")), None)
        if task is not None and field in PROBE_DATA_MOVED:
            return f"{probe_data_node(task)}.{PROBE_DATA_MOVED[field]}{key[len(old) :]}"
        return new + key[len(old) :]
    return None


def _override_key(argument: str) -> tuple[str, str, str]:
    """(prefix `+`/`++`/`~`, key, `=value` or "") of a command-line override."""
    prefix = argument[: len(argument) - len(argument.lstrip("+~"))]
    key, equals, value = argument[len(prefix) :].partition("=")
    return prefix, key, equals + value


def command_line_task(arguments: list[str]) -> str | None:
    """The task a command line runs, read before Hydra composes it: its `task_name=`, else the `task_name` of its
    `+experiment=` (or of the experiment that one extends), else `conf/train.yaml`'s; None for a sweep over several
    tasks or experiments."""
    values = {key: value[1:] for _, key, value in map(_override_key, arguments) if value}
    if "task_name" in values:
        return None if "," in values["task_name"] else values["task_name"]
    experiment = values.get("experiment")
    while experiment is not None:
        path = config_dir() / "experiment" / f"{experiment}.yaml"
        if "," in experiment or not path.is_file():
            return None
        node = OmegaConf.load(path)
        if "task_name" in node:
            return str(node.task_name)
        extended = [d for d in node.get("defaults") or [] if isinstance(d, str) and d[0] not in "/_"]
        experiment = extended[0] if extended else None
    return str(OmegaConf.load(config_dir() / "train.yaml").task_name)


def refuse_moved_arguments(arguments: list[str], environment: Mapping[str, str]) -> None:
    """Refuse a command line (or environment) that sets a key that moved, naming where it went in the run's own
    task, before Hydra reads it: Hydra would only say the key is not in the config and advise adding it with `+`,
    to a node that would then ignore it. So is a key of the probe data node set under the `data` of the rerank, cbdr
    or gates task (the reranker's batches there): it is pointed at `probe.data`."""
    task = command_line_task(arguments)
    given = {key: value[1:] for _, key, value in map(_override_key, arguments) if value}
    problems = [f"{old} is now {new}" for old, new in MOVED_VARIABLES.items() if environment.get(old)]
    probe_only = _probe_data_only() if task not in (None, "probe") else set()
    for argument in arguments:
        key = _override_key(argument)[1]
        if argument.startswith("-"):
            continue
        new = moved_to(key, task, given.get("gate"))
        if new is not None:
            problems.append(f"{key} is now {new}")
        elif key.startswith("data.") and key.removeprefix("data.").partition(".")[0] in probe_only:
            problems.append(
                f"{key}: the {task} task's `data` is the reranker's batches, its probe's data node is probe.data: set "
                f"probe.{key}"
            )
    if problems:
        raise ValueError("; ".join(problems) + ": set the new key(s) instead")


def _probe_data_only() -> set[str]:
    """The keys of the probe data node (conf/data/nq_confidence.yaml) that the reranker's (preference_pairs.yaml)
    has not, and the old ones of PROBE_DATA_MOVED."""
    probe, reranker = (
        OmegaConf.load(config_dir() / "data" / f) for f in ("nq_confidence.yaml", "preference_pairs.yaml")
    )
    return (set(probe) | set(PROBE_DATA_MOVED)) - set(reranker)


def refuse_moved_keys(cfg: DictConfig) -> None:
    """Refuse a composed config that holds a key that moved (a config file of the user's own sets it), naming where
    it went: what a task's check runs first."""
    gate = cfg.get("gate")
    selected = "ccsk" if isinstance(gate, DictConfig) and str(gate.get("_target_", "")).endswith(".CCSKGate") else None
    olds = [*MOVED, *(f"gate.{old}" for old in CCSK_MOVED if selected)]
    problems = [
        f"{old} is now {moved_to(old, gate=selected)}"
        for old in olds
        if OmegaConf.select(cfg, old, default=_ABSENT, throw_on_missing=False) is not _ABSENT
    ]
    if problems:
        raise ValueError("; ".join(problems) + ": set the new key(s) instead")


_ABSENT = object()


def settings_from(cls: type[T], node: Any, key: str) -> T:
    """The dataclass `cls` from config node `key`: unknown keys are named with the ones `cls` takes (and, for a key
    that moved, where it went: `MOVED`), and so are missing ones (a settings dataclass has no default for what its
    YAML node provides: docs/architecture.md, "Settings pattern"); a value the dataclass refuses is reported under
    `key` (`checks.config_key`)."""
    values = dict(plain(node) or {})  # a copy: the caller's own dict is left as it is
    fields = {f.name for f in dataclasses.fields(cls)}
    moved = [f"{key}.{k} is now {new}" for k in sorted(set(values) - fields) if (new := moved_to(f"{key}.{k}"))]
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
