"""What every stage of a run shares: the cache, the seed, progress reporting, the run folder and the rank.

Built once per run from the config (`confrag.instantiators.run_context`) and handed from the entry point to
the task and from the task to its stages, so these travel as one typed value instead of four parameters.

The ranks of a multi-process launch (torchrun, srun) share one run folder and one cache: every rank
computes (each fills its part of the shared caches), rank 0 alone writes the run folder. `on_main` is the
one place that rule is applied, as lightning-hydra-template's `RankedLogger(rank_zero_only=True)` is for
its log lines: the entry point's run record and each task's `write` step go through it, and so does every
file a stage writes into the run folder.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import ParamSpec, TypeVar

from confrag.infra.distributed import RankInfo

P = ParamSpec("P")
T = TypeVar("T")


@dataclass(frozen=True)
class RunContext:
    cache_dir: Path  # artifacts keyed by what produced them (`paths.cache_dir`), shared by runs and ranks
    seed: int  # the run's seed (`seed`): question samples, splits, folds, shuffles
    progress: bool  # progress bars of the long loops (`progress`)
    output_dir: Path  # the run folder (`paths.output_dir`), written by rank 0 only
    rank: RankInfo  # this process's place in a multi-process launch (one process: rank 0 of 1)

    @property
    def is_main(self) -> bool:
        """Rank 0: the process that writes the run folder."""
        return self.rank.is_main

    def on_main(self, write: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T | None:
        """`write(*args, **kwargs)` on rank 0; None on the other ranks, which write nothing to the run folder."""
        if not self.is_main:
            return None
        return write(*args, **kwargs)
