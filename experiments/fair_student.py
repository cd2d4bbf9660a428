"""A fair student of the LLM's likelihood: can a reranker learn what ℓ adds to the base without reading the answer?

The design is written in docs/results.md ("A fair student of ℓ"), fixed before any student was trained; its code is
`confrag.studies` (the study, the pre-check, the students, the report). The questions, candidates, ℓ and base are
those of experiments/likelihood_teacher.py (the same arguments read the same cached blocks):

    python experiments/fair_student.py --questions 1500 --dev 100 --folds 3 --seeds 3 --out logs/fair_student
        [--eval-questions FILE]        # the chosen students on new NQ-format questions with their paragraphs
        [--write-outside FILE]         # write the question file's questions outside the study (NQ format) and stop
        [--precheck-only]              # the frozen-feature pre-check alone (no student trained)
        [--fit-checks]                 # amendment 2's fit checks after the controls (docs/results.md)
        [--cross-encoder-layers 2] [--cross-encoder-precision bf16-mixed]   # the cross-encoder's training
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np

from confrag.data.nq import load_questions_jsonl
from confrag.infra.atomic import atomic_write_text
from confrag.infra.paths import project_root
from confrag.rag.stats import detectable_difference
from confrag.recipes import shipped_prompted_llm
from confrag.reranker.listwise_student import PRECISIONS
from confrag.studies import fair_report as report
from confrag.studies.fair_student import (
    CONTROLS,
    CROSS_ENCODER,
    FIT_CHECKS,
    FUSION_WEIGHT,
    SEEDS,
    TOP_K,
    TRAINING,
    FairInputs,
    choose_all,
    controls,
    cross_fit,
)  # fmt: skip
from confrag.studies.frozen_precheck import frozen_precheck, shortlist
from confrag.studies.likelihood_study import (
    Folds,
    Outcomes,
    likelihood_choices,
    likelihoods,
    listwise_data,
    load_study,
    top1,
)  # fmt: skip
from confrag.studies.trained_students import StudentStore

log = logging.getLogger("fair_student")


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, default=1500, help="the study's questions (dev included), drawn "
                        "from the shared NQ file by a seeded permutation (the likelihood teacher study's)")  # fmt: skip
    parser.add_argument("--dev", type=int, default=100, help="the first questions of the draw: they choose settings")
    parser.add_argument("--folds", type=int, default=3, help="cross-fitted folds of the test questions")
    parser.add_argument("--seeds", type=int, default=SEEDS, help="training seeds of the cross-encoder and the tower")
    parser.add_argument("--seed", type=int, default=0, help="the study's question permutation")
    parser.add_argument("--steps", type=int, default=TRAINING.steps, help="optimizer steps of every student")
    parser.add_argument(
        "--cross-encoder-layers", type=int, default=CROSS_ENCODER["train_layers"],
        help="the residual cross-encoder's top layers that train (0: all, with the word embeddings frozen)",
    )  # fmt: skip
    parser.add_argument("--cross-encoder-precision", choices=PRECISIONS, default=CROSS_ENCODER["precision"])
    parser.add_argument("--train-embeddings", action="store_true", help="train the encoders' word embeddings too")
    parser.add_argument("--eval-questions", default=None,
                        help="an NQ-format file of new questions with paragraphs: fold 0's chosen students score "
                             "them, paired against the base (nothing chosen on them)")  # fmt: skip
    parser.add_argument("--write-outside", default=None, metavar="FILE",
                        help="write the shared NQ file's questions this study (same --questions, --dev, --seed) never "
                             "draws to FILE, in NQ format (a ready --eval-questions file), and stop")  # fmt: skip
    parser.add_argument("--precheck-only", action="store_true", help="the frozen-feature pre-check alone")
    parser.add_argument("--no-controls", dest="controls", action="store_false", help="skip the design's 12 controls")
    parser.add_argument("--fit-checks", action="store_true", help="amendment 2's fit checks after the controls")
    parser.add_argument("--cache", default=str(project_root() / ".cache"), help="the cache (ℓ, answers, students)")
    parser.add_argument("--out", default=str(project_root() / "logs" / "fair_student"), help="the report's folder")
    args = parser.parse_args()
    if not 0 < args.dev < args.questions:
        parser.error(f"--dev must be in [1, questions - 1] (--questions {args.questions}); got {args.dev}")
    if not 2 <= args.folds <= args.questions - args.dev:
        parser.error(f"--folds must be in [2, questions - dev]; got {args.folds}")
    if args.seeds < 1 or args.steps < 1:
        parser.error("--seeds and --steps must be ≥ 1")
    if args.train_embeddings and args.cross_encoder_layers:
        parser.error("--train-embeddings trains the layers below every other: it needs --cross-encoder-layers 0 (all)")
    if args.eval_questions and not Path(args.eval_questions).is_file():
        parser.error(f"--eval-questions {args.eval_questions}: no such file")
    if args.precheck_only and (args.fit_checks or args.eval_questions):
        parser.error("--precheck-only trains no student: it takes neither --fit-checks nor --eval-questions")
    return args


def write_outside(study, path: str) -> None:
    rows = study.outside()
    lines = [
        json.dumps({"id": r.qid, "question": r.question, "answers": list(r.answers),
                    "ctxs": [{"title": c.title, "text": c.text} for c in r.contexts]}, ensure_ascii=False)
        for r in rows
    ]  # fmt: skip
    atomic_write_text(Path(path), "\n".join(lines) + "\n")
    print(f"Wrote the {len(rows)} questions outside the study to {path}")


def main() -> None:
    args = arguments()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    start = time.time()
    prompted = shipped_prompted_llm("smollm2_135m", "paper", str(Path(args.cache) / "models"), dtype="float32")
    study = load_study(prompted, args.questions, args.dev, args.seed, args.cache)
    if args.write_outside:
        return write_outside(study, args.write_outside)
    ell = likelihoods(study, args.cache)
    full = listwise_data(study.candidate_sets, args.cache)
    data = full.top_k(TOP_K)
    folds = Folds.of(study, args.folds)
    sets, test_at, dev_at = study.candidate_sets, study.test_at, study.dev_at
    precheck = frozen_precheck(shortlist(full, sets, ell, test_at), folds.folds)
    lines = [f"# A fair student of ℓ: {len(test_at)} test questions in {args.folds} cross-fitted folds", "",
             "## Pre-check: frozen features predicting ℓ's choice among the base's top 3", "",
             *report.precheck_lines(precheck), ""]  # fmt: skip
    payload = {"precheck": [asdict(r) for r in precheck]}
    log.info("pre-check done (%.0f s)", time.time() - start)
    if args.precheck_only:
        return report.write(Path(args.out), lines, payload)

    outcomes = Outcomes(study.prompted, sets, args.cache)
    training = replace(TRAINING, steps=args.steps, train_embeddings=args.train_embeddings)
    cross_encoder = {"train_layers": args.cross_encoder_layers or None, "precision": args.cross_encoder_precision}
    store = StudentStore.of(Path(args.cache) / "fair_student", data, ell, [c.qid for c in sets])
    inputs = FairInputs(study, ell, data, folds, outcomes, store, training, cross_encoder)
    dev_base = float(np.mean([o.has_answer for o in outcomes(dev_at, top1(data.base_scores, dev_at))]))
    chosen = choose_all(inputs)
    log.info("dev chose %s (%.0f s)", chosen, time.time() - start)
    crossed = cross_fit(inputs, chosen, args.seeds)

    picks = {"base": top1(data.base_scores, test_at)}
    for row, per_seed in crossed.scores.items():
        picks |= {f"{row}@{seed}": top1(s, test_at) for seed, s in enumerate(per_seed)}
    top5 = [np.flatnonzero(data.mask[i]) for i in test_at]
    picks["likelihood_top5"] = [int(t[np.argmax(ell[i][t])]) for i, t in zip(test_at, top5)]
    picks["fusion"] = [likelihood_choices(full.base_scores[i][: len(sets[i].passages)], ell[i], FUSION_WEIGHT)["fusion"]
                       for i in test_at]  # fmt: skip
    answered = {name: outcomes(test_at, p) for name, p in picks.items()}
    names = ["residual_ce@0", "tower@0", "residual_head@0", "likelihood_top5", "fusion"]
    rows = report.compare(names, answered)
    right = {k: np.mean([o.has_answer for o in v]) for k, v in answered.items()}
    seeds = {k: float(right[k] - right["base"]) for k in right if "@" in k}
    ell_top = {i: int(np.argmax(ell[i])) for i in test_at}
    extra = {
        name: {
            "seeds − base": ", ".join(f"{100 * v:+.1f}" for k, v in seeds.items() if k.split("@")[0] == name[:-2])
            if name.endswith("@0") else "",
            "= ℓ's top-1": f"{100 * np.mean([j == ell_top[i] for i, j in zip(test_at, picks[name])]):.1f}",
            "top-1 moved": f"{100 * np.mean([a != b for a, b in zip(picks[name], picks['base'])]):.1f}",
        }
        for name in ["base", *names]
    }  # fmt: skip
    base_agreement = float(np.mean([j == ell_top[i] for i, j in zip(test_at, picks["base"])]))
    met, verdict_lines = report.verdict(rows, seeds, crossed.fits, base_agreement)
    n = len(test_at)
    lines += [
        "## Rows against the base", "", *report.choices_lines(chosen, dev_base), "",
        f"Primary: `residual_ce@0` vs `base`, Top-1 has_answer, exact McNemar, Holm across the {len(names)} rows. "
        f"Detectable difference {100 * detectable_difference(n, report.EXPECTED_DISCORDANCE):.1f} points "
        f"(discordance {100 * report.EXPECTED_DISCORDANCE:.1f} %, n = {n}). `likelihood_top5` and `fusion` read the "
        "gold answer through ℓ (not rerankers).", "",
        *report.table_lines(rows, extra), "",
        "Held-out agreement with ℓ's top-1, per fold (seed 0; the base's beside it):", "",
        *[f"- `{f['row']}` fold {f['fold']}: {100 * f['held_out']:.1f} % (base {100 * f['held_out_base']:.1f} %); "
          f"where it trained {100 * f['trained']:.1f} % (base {100 * f['trained_base']:.1f} %)" for f in crossed.fits],
        "", f"Verdict: the success criterion is {'met' if met else 'not met'}.", *verdict_lines,
    ]  # fmt: skip
    payload |= {"chosen": {k: asdict(v) for k, v in chosen.items()}, "dev": inputs.dev_log, "dev_base": dev_base,
                "rows": [asdict(r) for r in rows], "seeds": seeds, "fits": crossed.fits, "met": met}  # fmt: skip
    if args.eval_questions:
        students = {f"{row}@0": (crossed.students[row].load(), chosen[row].weight) for row in chosen}
        outside_lines, payload["outside"] = report.outside_eval(
            study, load_questions_jsonl(args.eval_questions), students, args.cache
        )
        lines += ["", "## Questions outside the study", "", *outside_lines]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "picks.json", json.dumps({"qids": [sets[i].qid for i in test_at], "picks": picks}))
    # The table is written before the controls run (an hour of cross-encoders on a CPU) and again after them.
    report.write(out, [*lines, "", f"Wall time so far: {time.time() - start:.0f} s (the controls follow)."], payload)
    specs = [*(CONTROLS if args.controls else ()), *(FIT_CHECKS if args.fit_checks else ())]
    if specs:
        control_rows = payload["controls"] = controls(inputs, chosen, specs)
        heading = {
            (True, False): "The design's controls (fold 0, λ = 0):",
            (False, True): "Amendment 2's fit checks (fold 0, λ = 0):",
        }.get(  # fmt: skip
            (args.controls, args.fit_checks), "The design's controls, then amendment 2's fit checks (fold 0, λ = 0):"
        )
        lines += ["", heading, "", *report.control_lines(control_rows)]
    lines += ["", f"Wall time: {time.time() - start:.0f} s."]
    report.write(out, lines, payload)
    print("\n".join(lines))
    print(f"\nWritten to {out}/: report.md, metrics.json, picks.json")


if __name__ == "__main__":
    main()
