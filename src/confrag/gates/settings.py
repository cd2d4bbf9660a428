"""The validated `gates` node (and `gate=<name>`): which gates run, each gate's `_target_` config, the
threshold curves, the answer and timing settings. Every gate is built once here, so a bad value fails
before anything expensive runs, named by its key: a gate's constructor names its parameter (`k`), and
`gate_from_config` puts it under the node the user wrote (`gates.configs.ccsk.k`, or `gate.k` after `gate=ccsk`)."""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf

from confrag.gates import GATES, Gate
from confrag.infra import checks
from confrag.instantiators import built, node_parameters, settings_from
from confrag.rag.stats import BINARY_METRICS
from confrag.reranker.systems import check_reranker


@dataclass(frozen=True)
class CurveSpec:
    param: str  # the constructor parameter swept (cbdr: beta; dragin, ctrla, skr_knn: threshold)
    values: tuple[float, ...] | None  # None: quantiles of the gate's own score on the test questions


@dataclass(frozen=True)
class GateSettings:
    names: tuple[str, ...]
    configs: dict[str, dict[str, Any]]  # gates.configs.<name>: the `_target_` node of conf/gate/<name>.yaml
    top_k: int
    reranker: str  # the id of the Table 1 row that orders the clean contexts (`confrag.reranker.systems`)
    metric: str
    curves: dict[str, CurveSpec]
    curve_points: int
    timing_questions: int
    draft_max_new_tokens: int
    internal_max_new_tokens: int
    batch_size: int
    n_resamples: int
    selected: str | None = None  # the gate of `gate=<name>`, whose values the user wrote as `gate.<key>`

    def key(self, name: str) -> str:
        """The config node gate `name` was built from, as the user wrote it."""
        return gate_key(name, self.selected)

    def build(self, name: str, **overrides: Any) -> Gate:
        return gate_from_config(name, self.configs[name], self.key(name), **overrides)

    def fitting(self, name: str) -> AbstractContextManager[None]:
        """Where gate `name` is fitted: a refusal of one of its parameters (`heads=3 must divide ...`) reads as
        that node's key; any other error passes as it is."""
        return checks.config_key(self.key(name), node_parameters(self.configs[name]), others=False)


def gate_key(name: str, selected: str | None = None) -> str:
    return "gate" if name == selected else f"gates.configs.{name}"


def gate_from_config(name: str, config: dict[str, Any], key: str | None = None, **overrides: Any) -> Gate:
    """The gate of `gates.configs.<name>` (with `overrides`); a bad value is reported under that node's key
    (`key`: `gate` for the gate of `gate=<name>`)."""
    key = key or gate_key(name)
    gate = built({**config, **overrides}, key)
    if not isinstance(gate, Gate):
        raise ValueError(
            f"{key} builds a {type(gate).__name__}, not a gate; its _target_ must be one "
            f"of {', '.join(f'{c.__module__}.{c.__name__}' for c in GATES.values())}"
        )
    return gate


def selected_gate(gate_node: DictConfig, configs: dict[str, dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    """The gate chosen with `gate=<name>` (conf/gate/<name>.yaml, plus any `gate.<key>=` overrides), named as
    in gates.configs by its _target_; a gate of the user's own by its id (`Gate.name`), as its rows, metrics
    and `gates.curves.<id>` name it."""
    node = OmegaConf.to_container(gate_node, resolve=True)
    target = node.get("_target_") if isinstance(node, dict) else None
    if not target:
        raise ValueError(
            f"gate: expected a gate config with a _target_ (gate=<name>, one of "
            f"{', '.join(sorted(configs))}); got {node!r}"
        )
    same = [name for name, config in configs.items() if config.get("_target_") == target]
    if same:
        return same[0], node
    try:
        cls = get_class(str(target))  # imports the gate's module, which registers it
    except Exception as err:  # noqa: BLE001 - Hydra raises several kinds for a bad path
        raise ValueError(f"gate._target_={target!r} cannot be imported: {err}") from None
    if not (isinstance(cls, type) and issubclass(cls, Gate)):
        raise ValueError(f"gate._target_={target!r} is not a Gate subclass")
    return cls.name, node


@dataclass(frozen=True)
class GatesNode:
    """The `gates` node as written (conf/gates/default.yaml, which says what each key means), its values checked
    one by one (each named by its key: `gates.top_k must be ...`); `gate_settings` checks them together."""

    names: list[str]
    configs: dict[str, dict[str, Any]]  # one `_target_` node per gate, from conf/gate/<name>.yaml
    reranker: str
    top_k: int
    metric: str
    curves: dict[str, dict[str, Any]] | None
    curve_points: int
    timing_questions: int
    draft_max_new_tokens: int
    internal_max_new_tokens: int
    batch_size: int
    n_resamples: int

    def __post_init__(self) -> None:
        problems: list[str] = []
        checks.collect(problems, checks.integer, self.top_k, "top_k", 1)
        checks.collect(problems, checks.choice, self.metric, "metric", BINARY_METRICS)
        checks.collect(problems, check_reranker, self.reranker, "reranker")
        checks.collect(problems, checks.integer, self.curve_points, "curve_points", 2)
        for key in ("timing_questions", "draft_max_new_tokens", "internal_max_new_tokens", "batch_size"):
            checks.collect(problems, checks.integer, getattr(self, key), key, 1)
        checks.collect(problems, checks.integer, self.n_resamples, "n_resamples", 100)
        checks.refuse(problems)


def gate_settings(
    section: DictConfig | None, gate_node: DictConfig | None, top_n: int, candidates_file: bool
) -> GateSettings:
    """Every bad value of the `gates` section, named by its key, before anything expensive runs."""
    if section is None:
        raise ValueError(
            "task gates needs a `gates` section: compose conf/gates/default.yaml (see "
            "conf/experiment/gates_smollm2.yaml)"
        )
    node = settings_from(GatesNode, section, "gates")
    configs = dict(node.configs)
    selected = None
    names = [str(n) for n in node.names]
    if gate_node is not None:  # `gate=<name>` on the command line: that gate between the two bounds
        name, configs[name] = selected_gate(gate_node, configs)
        selected = name
        names = list(dict.fromkeys(["always", "never", name]))
    if not names:
        raise ValueError(f"gates.names is empty; available gates: {', '.join(sorted(configs))}")
    for name in names:
        if name not in configs:
            raise ValueError(
                f"unknown gate {name!r} in gates.names; available gates: {', '.join(sorted(configs))} "
                f"(each gates.configs.<name>, from conf/gate/<name>.yaml)"
            )
    if len(set(names)) != len(names):
        raise ValueError(f"gates.names lists a gate twice: {names}")
    gates = {name: gate_from_config(name, configs[name], gate_key(name, selected)) for name in names}
    curves = {}
    for name, spec in (node.curves or {}).items():
        if name not in gates:
            if name in configs or name in GATES:  # a curve of a gate that is not run this time
                continue
            raise ValueError(f"gates.curves.{name}: no gate has the id {name!r}; gates: {', '.join(sorted(configs))}")
        if gates[name].curve_refusal is not None:
            curved = sorted(n for n, g in gates.items() if g.retrieves_below is not None and g.curve_refusal is None)
            raise ValueError(f"gates.curves.{name}: {gates[name].curve_refusal}; curves are for {', '.join(curved)}")
        param = spec.get("param")
        if param not in configs[name] or param == "_target_":
            raise ValueError(
                f"gates.curves.{name}.param={param!r} is not a parameter of gates.configs.{name}; "
                f"parameters: {sorted(k for k in configs[name] if k != '_target_')}"
            )
        values = spec.get("values")
        if values is not None:
            values = tuple(float(v) for v in values)
            for value in values:  # out-of-range thresholds fail here, named by the gate's config key
                gate_from_config(name, configs[name], gate_key(name, selected), **{param: value})
        curves[name] = CurveSpec(param, values)
    if node.top_k > top_n and not candidates_file:
        raise ValueError(f"gates.top_k={node.top_k} asks for more contexts than the retrieval.top_n={top_n} retrieved")
    return GateSettings(
        names=tuple(names),
        configs=configs,
        top_k=node.top_k,
        reranker=node.reranker,
        metric=node.metric,
        curves=curves,
        curve_points=node.curve_points,
        timing_questions=node.timing_questions,
        draft_max_new_tokens=node.draft_max_new_tokens,
        internal_max_new_tokens=node.internal_max_new_tokens,
        batch_size=node.batch_size,
        n_resamples=node.n_resamples,
        selected=selected,
    )
