"""Small shared pieces of the reports: Markdown tables of metric rows, JSON-ready values, W&B tables."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lightning.pytorch.loggers import Logger, WandbLogger


@dataclass(frozen=True)
class RunHeader:
    """What a task's report says about the run beside its results: the LLM, the run folder, the retrieval
    and the resolved config."""

    llm_name: str
    run_folder: str
    retriever: str
    top_n: int
    config_yaml: str


def metric_columns(row: Mapping[str, Any]) -> list[str]:
    """The metric columns of a Table 1 row {"system": label, "id": id, metric: value in %}."""
    return [k for k in row if k not in ("system", "id")]


def markdown_table(rows: list[dict], title: str) -> str:
    """Table 1 rows ({"system": label, "id", metric: value in %}) as a bold title over a Markdown table (two
    decimals), one line per label."""
    columns = metric_columns(rows[0])
    lines = [f"**{title}**", "", "| Reranker | " + " | ".join(columns) + " |", "|---|" + "---:|" * len(columns)]
    lines += ["| " + r["system"] + " | " + " | ".join(f"{r[c]:.2f}" for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def plain(value: Any) -> Any:
    """Dataclasses (Accuracy, McNemar, ...) inside dicts and lists as JSON-ready values."""
    if dataclasses.is_dataclass(value):
        return dataclasses.asdict(value)
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def wandb_loggers(loggers: Sequence[Logger]) -> list[WandbLogger]:
    return [logger for logger in loggers if isinstance(logger, WandbLogger)]


def log_rows(logger: WandbLogger, key: str, rows: Sequence[dict]) -> None:
    """A list of same-keyed dicts as one W&B table."""
    if rows:
        logger.log_table(key, columns=list(rows[0]), data=[list(r.values()) for r in rows])
