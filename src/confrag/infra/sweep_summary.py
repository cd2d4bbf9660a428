"""One table of a sweep: every job of a Hydra multirun folder with its overrides, its status and its metrics.

A multirun writes one folder per job (`<sweep>/<job>/`), each holding `.hydra/overrides.yaml` (what the job
changed) and, once the task has written its report, `metrics.json` (the task's scalar metrics under `metrics`,
the values sweepers read), or `failure.json` when it failed (confrag.infra.run_info). `write_summary` puts them
side by side in `<sweep>/sweep_summary.csv` (every override and metric) and `sweep_summary.md` (the overrides
that vary, the optimized metric first); the Hydra callback `confrag.infra.sweep_callback.SweepSummary` writes
them after each job and at the end of the multirun, and `confrag-sweep-summary SWEEP_DIR` rebuilds them (for a
sweep killed before its callback ran). A job with neither file is `incomplete`: still running, or killed.

Knows no Hydra: it reads the files Hydra leaves (YAML) and the metrics files the tasks write.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import io
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from confrag.infra.atomic import atomic_write_text
from confrag.infra.optuna_study import assign_trials
from confrag.infra.run_info import FAILURE_FILE

SUMMARY_CSV = "sweep_summary.csv"
SUMMARY_MD = "sweep_summary.md"
MARKDOWN_METRICS = 12  # metric columns the Markdown table shows; the CSV has them all


@dataclass(frozen=True)
class SweepJob:
    folder: Path
    num: int | None  # hydra.job.num
    overrides: dict[str, str]  # key -> value as given on the command line (or by the sweeper)
    status: str  # finished (metrics.json), failed (failure.json) or incomplete (neither: running or killed)
    metrics: dict[str, float | None] = field(default_factory=dict)
    error: str = ""  # the failure's exception and message
    optimized_metric: str | None = None  # the job's `optimized_metric` (what a sweeper optimizes)
    trial: int | None = None  # the Optuna trial that ran this job (set by the sweep callback)


def parse_override(text: str) -> tuple[str, str]:
    """`+model.lr=0.1` -> ("model.lr", "0.1"); a deletion `~key` keeps its `~` in the value."""
    key, _, value = text.partition("=")
    if key.startswith("~"):
        return key[1:], "~" + value
    return key.lstrip("+"), value


def _scalar(value: object) -> bool:
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))


def job_metrics(folder: Path) -> dict[str, float | None]:
    """The scalar metrics of a job's metrics.json (its `metrics` object; null: a metric undefined on the run)."""
    record = json.loads((folder / "metrics.json").read_text())
    metrics = record.get("metrics") if isinstance(record, dict) else None
    if not isinstance(metrics, dict):
        return {}
    return {str(k): (None if v is None else float(v)) for k, v in metrics.items() if _scalar(v)}


def _yaml(path: Path) -> object:
    try:
        return yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return None


def read_job(folder: Path) -> SweepJob:
    overrides = _yaml(folder / ".hydra" / "overrides.yaml") or []
    parsed = dict(parse_override(str(o)) for o in overrides)
    hydra = _yaml(folder / ".hydra" / "hydra.yaml")
    num = (hydra or {}).get("hydra", {}).get("job", {}).get("num") if isinstance(hydra, dict) else None
    if num is None and folder.name.isdigit():
        num = int(folder.name)
    config = _yaml(folder / ".hydra" / "config.yaml")
    optimized = config.get("optimized_metric") if isinstance(config, dict) else None
    common = {"folder": folder, "num": num, "overrides": parsed, "optimized_metric": optimized}
    if (folder / FAILURE_FILE).is_file():
        failure = json.loads((folder / FAILURE_FILE).read_text())
        message = str(failure.get("message", "")).strip().splitlines()
        error = f"{failure.get('exception', '?')}: {message[0] if message else ''}"
        return SweepJob(status="failed", error=error, **common)
    if (folder / "metrics.json").is_file():
        return SweepJob(status="finished", metrics=job_metrics(folder), **common)
    return SweepJob(status="incomplete", **common)


def read_sweep(sweep_dir: Path | str) -> list[SweepJob]:
    """Every job folder of a multirun folder (a folder with `.hydra/overrides.yaml`), in job order."""
    sweep_dir = Path(sweep_dir)
    folders = [p.parent.parent for p in sweep_dir.glob("**/.hydra/overrides.yaml")]
    jobs = [read_job(f) for f in folders if f != sweep_dir]
    return sorted(jobs, key=lambda j: (j.num is None, j.num if j.num is not None else 0, str(j.folder)))


def _columns(jobs: Sequence[SweepJob]) -> tuple[list[str], list[str], list[str]]:
    """(override keys, metric names with the optimized metric first, optimized metrics)"""
    keys = list(dict.fromkeys(k for j in jobs for k in j.overrides))
    optimized = list(dict.fromkeys(j.optimized_metric for j in jobs if j.optimized_metric))
    names = sorted({m for j in jobs for m in j.metrics})
    metrics = [m for m in optimized if m in names] + [m for m in names if m not in optimized]
    return keys, metrics, optimized


def _number(value: float | None) -> str:
    if value is None:
        return "null"
    return "nan" if math.isnan(value) else f"{value:.4g}"


def summary_csv(sweep_dir: Path, jobs: Sequence[SweepJob]) -> str:
    keys, metrics, _ = _columns(jobs)
    with_trials = any(j.trial is not None for j in jobs)
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["job", *(["trial"] if with_trials else []), "status", *keys, *metrics, "error", "folder"])
    for j in jobs:
        writer.writerow(
            [
                j.num,
                *([j.trial] if with_trials else []),
                j.status,
                *(j.overrides.get(k, "") for k in keys),
                *("" if j.metrics.get(m) is None else repr(j.metrics[m]) for m in metrics),
                j.error,
                str(j.folder.relative_to(sweep_dir)) if j.folder.is_relative_to(sweep_dir) else str(j.folder),
            ]
        )
    return out.getvalue()


def summary_markdown(sweep_dir: Path, jobs: Sequence[SweepJob], notes: Sequence[str] = ()) -> str:
    keys, metrics, optimized = _columns(jobs)
    varying = [k for k in keys if len({j.overrides.get(k) for j in jobs}) > 1]
    fixed = [f"`{k}={jobs[0].overrides[k]}`" for k in keys if k not in varying and k in jobs[0].overrides]
    shown = metrics[:MARKDOWN_METRICS]
    with_trials = any(j.trial is not None for j in jobs)
    counts = {s: sum(j.status == s for j in jobs) for s in ("finished", "failed", "incomplete")}
    lines = [
        f"# Sweep {sweep_dir.name}",
        "",
        f"{len(jobs)} jobs: " + ", ".join(f"{n} {s}" for s, n in counts.items() if n) + ".",
    ]
    if optimized:
        lines.append(f"Optimized metric: {', '.join(f'`{m}`' for m in optimized)}.")
    if fixed:
        lines.append("Every job: " + " ".join(fixed) + ".")
    lines += list(notes)
    if len(metrics) > len(shown):
        lines.append(f"{len(metrics) - len(shown)} more metric columns in {SUMMARY_CSV}.")
    header = ["job", *(["trial"] if with_trials else []), "status", *varying, *shown]
    lines += ["", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for j in jobs:
        status = j.status if not j.error else f"failed: {j.error}".replace("|", "/")
        cells = [
            str(j.num),
            *([str(j.trial) if j.trial is not None else "?"] if with_trials else []),
            status,
            *(j.overrides.get(k, "") for k in varying),
            *(_number(j.metrics[m]) if m in j.metrics else "" for m in shown),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "null: a metric undefined on the job (e.g. AUROC of a one-class split); empty: not logged."]
    return "\n".join(lines) + "\n"


def write_summary(sweep_dir: Path | str, jobs: Sequence[SweepJob], notes: Sequence[str] = ()) -> tuple[Path, Path]:
    """`<sweep>/sweep_summary.csv` and `sweep_summary.md`, each written atomically."""
    sweep_dir = Path(sweep_dir)
    csv_path, md_path = sweep_dir / SUMMARY_CSV, sweep_dir / SUMMARY_MD
    atomic_write_text(csv_path, summary_csv(sweep_dir, jobs))
    atomic_write_text(md_path, summary_markdown(sweep_dir, jobs, notes))
    return csv_path, md_path


def summarize(sweep_dir: Path | str) -> tuple[list[SweepJob], Path]:
    """Read every job of the sweep folder, name the Optuna trial of each (an Optuna sweep), write the tables;
    the jobs and the Markdown table's path."""
    jobs = read_sweep(sweep_dir)
    trials, notes = assign_trials(sweep_dir, [(j.num, j.overrides) for j in jobs])
    if trials:
        jobs = [dataclasses.replace(j, trial=trials.get(j.num)) for j in jobs]
    _, md_path = write_summary(sweep_dir, jobs, notes)
    return jobs, md_path


def main(argv: Sequence[str] | None = None) -> None:
    """confrag-sweep-summary SWEEP_DIR: (re)write the summary of a multirun folder and print it."""
    parser = argparse.ArgumentParser(prog="confrag-sweep-summary", description=main.__doc__)
    parser.add_argument("sweep_dir", type=Path, help="a multirun folder (logs/<task>/multiruns/<time>)")
    args = parser.parse_args(argv)
    if not read_sweep(args.sweep_dir):
        parser.error(f"{args.sweep_dir}: no job folder (<job>/.hydra/overrides.yaml) in it")
    _, md_path = summarize(args.sweep_dir)
    print(md_path.read_text(), end="")
