"""What a run exported, logged as W&B Artifacts of that run (lineage: the run that made each one), when the
run has a W&B logger (`logger: wandb`, offline by default: the artifacts wait in the run folder until
`wandb sync`). The folders are logged whole, their digest file included, so a downloaded artifact is
verified like the export it came from."""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning.pytorch.loggers import Logger

from confrag.reports.tables import wandb_loggers

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExportKind:
    """One kind of export: its artifact name prefix and W&B type."""

    prefix: str
    type: str


# The exports of the tasks, by what they are (`log_exports(..., {"probe": folder, ...})`).
EXPORTS = {
    "reranker": ExportKind("reranker", "model"),
    "probe": ExportKind("probe", "model"),
    "nq_rerank": ExportKind("nq_rerank", "dataset"),
    "aligned": ExportKind("aligned", "model"),  # the alignment node's listwise rows, a folder each
}


def artifact_name(kind: str, llm: str) -> str:
    """`<kind>-<llm>`, in the characters W&B allows in an artifact name (letters, digits, - _ .)."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{EXPORTS[kind].prefix}-{llm}")


def log_exports(
    loggers: Sequence[Logger], folders: Mapping[str, Path | str], llm: str, metadata: Mapping[str, Any] | None = None
) -> list[Any]:
    """Log each export folder (`{kind: folder}`, kinds from EXPORTS) as an artifact of every W&B logger's run;
    returns the logged `wandb.Artifact`s (none without a W&B logger)."""
    unknown = sorted(set(folders) - set(EXPORTS))
    if unknown:
        raise ValueError(f"unknown export kind(s) {unknown}; known: {sorted(EXPORTS)}")
    targets = wandb_loggers(loggers)
    if not targets:
        return []
    import wandb

    logged = []
    for logger in targets:
        run = logger.experiment
        for kind, folder in folders.items():
            folder = Path(folder)
            if not folder.is_dir():
                raise FileNotFoundError(f"the {kind} export {folder} does not exist; nothing to log to W&B")
            artifact = wandb.Artifact(
                artifact_name(kind, llm),
                type=EXPORTS[kind].type,
                description=f"confrag {kind} export ({llm})",
                metadata={"llm": llm, "kind": kind, **(metadata or {})},
            )
            artifact.add_dir(str(folder))
            run.log_artifact(artifact)
            logged.append(artifact)
            log.info("Logged %s as W&B artifact %s (%s)", folder, artifact.name, artifact.type)
    return logged


def log_table_exports(
    loggers: Sequence[Logger],
    reranker: Any,
    reranker_id: str,
    probe_directory: Path | None,
    out: Path,
    llm: str,
) -> list[Any]:
    """The cbdr and gates runs' W&B lineage, as the rerank task's: the reranker behind their tables (`reranker_id`,
    `cbdr.reranker` / `gates.reranker`; exported into `<run>/reranker/`, one folder per fold when cross-fitted) and
    the probe whose confidence labelled its rows (the cached folder this run read), as artifacts of the run. Only
    with a W&B logger: otherwise nothing is exported (a reranker's export is the size of its weights). A row
    without a model of its own (`bm25`, `bi_encoder` as it comes) logs the probe alone."""
    if not wandb_loggers(loggers):
        return []
    folders: dict[str, Path] = {}
    if reranker is not None and hasattr(reranker, "export"):
        folders["reranker"] = reranker.export(out / "reranker")
    if probe_directory is not None:
        folders["probe"] = Path(probe_directory)
    return log_exports(loggers, folders, llm, {"reranker": reranker_id})
