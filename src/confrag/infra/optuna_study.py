"""The Optuna study of a `hparams_search` sweep: its record in the sweep folder, which trial ran which job, and
every trial of the study in one CSV.

hydra-optuna-sweeper asks the study for trials in order and launches them as jobs numbered in the same order,
so in one sweep job `j` ran trial `first_trial + j`, where `first_trial` is the number of trials the study held
before the sweep started (0 for a new study; more when the sweep resumes a study from its SQLite storage). The
sweep callback records `first_trial` at the start (`optuna_study.json`); the summary then reads the study back
and checks each job's overrides against its trial's parameters before it names the trial (a mismatch leaves the
trial unnamed and says so). Knows no Hydra.
"""

from __future__ import annotations

import csv
import io
import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

from confrag.infra.atomic import atomic_write_text

log = logging.getLogger(__name__)

STUDY_FILE = "optuna_study.json"
TRIALS_CSV = "optuna_trials.csv"
SQLITE = "sqlite:///"


def absolute_storage(storage: str | None) -> str | None:
    """A SQLite URL with an absolute path (the summary may be rebuilt from another folder); others unchanged."""
    if not storage or not storage.startswith(SQLITE):
        return storage
    return SQLITE + str(Path(storage.removeprefix(SQLITE)).absolute())


def _load(storage: str, study_name: str):
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.load_study(study_name=study_name, storage=storage)


def prepare_study(sweep_dir: Path | str, storage: str | None, study_name: str | None) -> dict[str, object]:
    """Before the sweeper opens the study: the SQLite file's folder made (Optuna does not make it), the trials the
    study already holds counted, and `optuna_study.json` written into the sweep folder."""
    sweep_dir = Path(sweep_dir)
    storage = absolute_storage(storage)
    first = 0
    if storage:
        if storage.startswith(SQLITE):
            Path(storage.removeprefix(SQLITE)).parent.mkdir(parents=True, exist_ok=True)
        import optuna

        names = {s.study_name for s in optuna.study.get_all_study_summaries(storage)}
        if study_name in names:
            first = len(_load(storage, study_name).trials)
            log.info("Optuna study %r resumed from %s: %d trials so far", study_name, storage, first)
    record = {"storage": storage, "study_name": study_name, "first_trial": first}
    sweep_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(sweep_dir / STUDY_FILE, json.dumps(record, indent=2))
    return record


def _matches(params: Mapping[str, object], overrides: Mapping[str, str]) -> bool:
    return all(overrides.get(name) == str(value) for name, value in params.items())


def assign_trials(
    sweep_dir: Path | str, jobs: Sequence[tuple[int | None, Mapping[str, str]]]
) -> tuple[dict[int, int | None], list[str]]:
    """{job number: trial number} for the sweep's jobs, and lines for the summary (the best trial, mismatches);
    writes `optuna_trials.csv` (every trial of the study, with the job of this sweep that ran it). Nothing when
    the sweep folder has no study record (not an Optuna sweep)."""
    sweep_dir = Path(sweep_dir)
    try:
        record = json.loads((sweep_dir / STUDY_FILE).read_text())
    except FileNotFoundError:
        return {}, []
    first, storage, name = int(record["first_trial"]), record["storage"], record["study_name"]
    numbered = [num for num, _ in jobs if num is not None]
    if not storage:  # an in-memory study lives in the sweeper's process only: numbered in job order, unchecked
        notes = ["Optuna study in memory (hydra.sweeper.storage null): trial = job number, not resumable."]
        return {num: first + num for num in numbered}, notes
    study = _load(storage, name)
    trials = {t.number: t for t in study.trials}
    assigned, notes = {}, []
    for num, overrides in jobs:
        if num is None:
            continue
        trial = trials.get(first + num)
        if trial is not None and _matches(trial.params, overrides):
            assigned[num] = trial.number
        else:
            assigned[num] = None
            notes.append(f"Job {num}: its overrides are not the parameters of trial {first + num}; trial unknown.")
    ran = {trial: num for num, trial in assigned.items() if trial is not None}
    atomic_write_text(sweep_dir / TRIALS_CSV, trials_csv(study.trials, ran))
    complete = [t for t in study.trials if t.state.name == "COMPLETE"]
    where = f"study `{name}` in `{storage}`"
    notes.insert(0, f"Optuna {where}: {len(study.trials)} trials ({len(complete)} complete), all in {TRIALS_CSV}.")
    if complete and len(study.directions) == 1:
        best = study.best_trial
        job = f"job {ran[best.number]} of this sweep" if best.number in ran else "an earlier sweep"
        notes.insert(1, f"Best trial: {best.number} ({job}), value {best.value:.4g}, params {best.params}.")
    return assigned, notes


def trials_csv(trials: Sequence[object], ran: Mapping[int, int]) -> str:
    names = list(dict.fromkeys(p for t in trials for p in t.params))
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["trial", "state", "value", *names, "started", "completed", "job"])
    for t in trials:
        writer.writerow(
            [
                t.number,
                t.state.name,
                "" if t.values is None else " ".join(repr(v) for v in t.values),
                *(t.params.get(n, "") for n in names),
                t.datetime_start or "",
                t.datetime_complete or "",
                ran.get(t.number, ""),
            ]
        )
    return out.getvalue()
