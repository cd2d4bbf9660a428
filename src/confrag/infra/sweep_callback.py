"""The Hydra callback that summarises a multirun (registered in conf/hydra/default.yaml as
`hydra.callbacks.sweep_summary`): after each job and at the end of the sweep, `sweep_summary.csv` and
`sweep_summary.md` in the sweep folder (confrag.infra.sweep_summary); for an Optuna sweep, the study prepared
before the sweeper opens it (its SQLite folder made, the trials it already holds counted) and each job's
trial number named (confrag.infra.optuna_study).

After each job, not only at the end: a job that fails stops a Hydra multirun before `on_multirun_end`, and a
killed sweep never reaches it; the table then still lists every job that ended, the failed one with its
exception. Parallel launchers (joblib, SLURM) run `on_job_end` in the job's process: each rewrite reads every
job folder, and the end of the sweep writes the whole table once more.

An interrupted sweep (SIGTERM from SLURM, `kill`, Ctrl-C) gets its table too: Hydra calls no callback for a job
stopped by SystemExit or KeyboardInterrupt, so for the sweep's duration SIGTERM raises SystemExit (where no one
else handles it; the job's `run_task` then writes its failure.json) and the table is written once more when the
process exits, listing every job that finished and the one that was stopped. SIGKILL leaves the table of the
jobs before (`confrag-sweep-summary` rebuilds it).
"""

from __future__ import annotations

import atexit
import logging
import signal
import threading
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from confrag.infra.optuna_study import prepare_study
from confrag.infra.sweep_summary import summarize

log = logging.getLogger(__name__)


def _multirun(config: DictConfig) -> bool:
    mode = config.hydra.get("mode")
    return getattr(mode, "name", str(mode)).endswith("MULTIRUN")


def _optuna(config: DictConfig) -> bool:
    return "optuna" in str(config.hydra.sweeper.get("_target_", "")).lower()


def _terminated(signum: int, frame: object) -> None:
    raise SystemExit(f"terminated by signal {signal.Signals(signum).name}")


class SweepSummary(Callback):
    def __init__(self) -> None:
        self._sweep_dir: str | None = None
        self._sigterm_set = False

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        if _optuna(config):
            sweeper = config.hydra.sweeper
            prepare_study(config.hydra.sweep.dir, sweeper.get("storage"), sweeper.get("study_name"))
        self._sweep_dir = str(config.hydra.sweep.dir)
        atexit.register(self._at_exit)
        in_main = threading.current_thread() is threading.main_thread()
        if in_main and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _terminated)
            self._sigterm_set = True

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        if _multirun(config):
            self._write(config.hydra.sweep.dir)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        atexit.unregister(self._at_exit)
        if self._sigterm_set:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            self._sigterm_set = False
        path = self._write(config.hydra.sweep.dir)
        if path is not None:
            log.info("Sweep summary: %s (and %s)", path, path.with_suffix(".csv"))

    def _at_exit(self) -> None:
        """The sweep stopped before its end (an interrupt, a failed job): its table, with the job that stopped it."""
        if self._sweep_dir is not None:
            self._write(self._sweep_dir)

    @staticmethod
    def _write(sweep_dir: str) -> Path | None:
        # A summary that cannot be written must not fail the sweep it describes: said, then the sweep goes on.
        try:
            return summarize(sweep_dir)[1]
        except Exception as err:
            log.warning("Could not write the sweep summary of %s: %s", sweep_dir, err)
            return None
