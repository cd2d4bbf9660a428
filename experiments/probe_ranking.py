"""Compare trained probes as rerankers on the same held-out questions, paired.

Each probe run of `data.ranking.test_questions=N` scores the candidates of the same N questions from outside
the probe's questions, whatever its recipe or splits (`heldout/*` in its metrics.json). This script reads the
probes those runs saved (`<run>/probe/`), scores those questions' candidates again (the states come from the
cache), and prints, per probe: the share of questions whose own paragraph comes first with its 95 % bootstrap
interval, the MRR, and the exact McNemar test against the first run given, Holm-corrected across the others.

    python experiments/probe_ranking.py RUN_DIR [RUN_DIR ...]     # the first run is the reference
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from omegaconf import OmegaConf

from confrag.infra.paths import register_resolvers
from confrag.probe.module import load_probe
from confrag.probe.ranking import gold_rank
from confrag.rag.stats import accuracy_ci, holm, mcnemar_exact
from confrag.recipes import probe_recipe

SAME_QUESTIONS = (
    "num_questions",
    "seed",
    "questions_path",
    "ranking.top_n",
    "ranking.test_questions",
    "candidates.words_per_passage",
)


def heldout_set(run: Path):
    """The run's held-out ranking questions with their candidates' states (from the cache)."""
    cfg = OmegaConf.load(run / "config_resolved.yaml")
    datamodule = probe_recipe(cfg).make_datamodule()  # the probe's layer resolved as the run resolved it
    if not datamodule.ranking_options.test_questions:
        raise SystemExit(f"{run}: data.ranking.test_questions is 0, so it has no held-out ranking questions")
    datamodule.progress = False
    datamodule.prepare_data()
    return cfg, datamodule.ranking["heldout"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="probe run folders; the first is the reference")
    args = parser.parse_args(argv)
    register_resolvers()
    cfg, ranking = heldout_set(args.runs[0])
    for run in args.runs[1:]:
        other = OmegaConf.load(run / "config_resolved.yaml")
        differ = [k for k in SAME_QUESTIONS if OmegaConf.select(other.data, k) != OmegaConf.select(cfg.data, k)]
        if differ:
            raise SystemExit(f"{run}: other held-out questions than {args.runs[0]} (data.{', data.'.join(differ)})")
    has_gold = [any(g) for g in ranking.gold]
    firsts = {}
    for run in args.runs:
        scores = ranking.split(load_probe(run / "probe").confidence(ranking.states))
        ranks = np.array([gold_rank(s, g) for s, g, ok in zip(scores, ranking.gold, has_gold) if ok], dtype=float)
        firsts[run] = (ranks == 1).astype(float), float(np.mean(1 / ranks))
    reference = firsts[args.runs[0]][0]
    tests = {run: mcnemar_exact(first, reference) for run, (first, _) in firsts.items() if run != args.runs[0]}
    adjusted = dict(zip(tests, holm([t.pvalue for t in tests.values()])))
    n = int(sum(has_gold))
    print(f"{len(ranking.candidates)} held-out questions, {n} with their own paragraph among the candidates")
    print("| probe run | own paragraph first [95 % CI] | MRR | vs first run: only this / only first | Holm p |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for run, (first, mrr) in firsts.items():
        test = tests.get(run)
        compared = "reference" if test is None else f"{test.only_a} / {test.only_b}"
        holm_p = "—" if test is None else (f"{adjusted[run]:.4f}" if adjusted[run] >= 1e-4 else "< 0.0001")
        name = f"{run.parent.name}/{run.name}"
        print(f"| {name} | {accuracy_ci(first).format(digits=1)} | {mrr:.3f} | {compared} | {holm_p} |")


if __name__ == "__main__":
    sys.exit(main())
