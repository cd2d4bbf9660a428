"""Rerankers trained on the LLM's likelihood (REPLUG LSR), cross-fitted, with the controls that locate a break.

The questions, candidates, ℓ and base are those of experiments/likelihood_teacher.py (same arguments, same cached
ℓ blocks): BM25's top 20 per NQ question, ℓ(q, c) the mean per-token log-probability of a gold answer after the
paper's RAG prompt holding c, the base all-MiniLM-L6-v2 scored as the bi-encoder it is (SCALE · cos).

Students (`confrag.reranker.listwise_student`), trained on KL(softmax(target) ‖ softmax(f / τ)) + λ KL(base ‖ f)
for the same number of steps, warmup and learning rate:

- `lsr` (primary): the query tower trained on the `likelihood` teacher, softmax(ℓ / τ_T) over the whole list;
- `relevance` (its control, same everything): the query tower trained on the perfect-relevance target (uniform over
  the own paragraph's passages): what the same training does with a target that knows relevance only;
- `answer_bearing`: the query tower on the candidates holding a gold answer string (multi-positive);
- `residual`: the base frozen, a head on q ⊙ p trained on the `likelihood` teacher, f = base + w · head;
- `utility` (with `--utility-depth N`): the query tower on the candidates the LLM answered right under (greedy,
  each of the base's top N alone), multi-positive, answer-bearing failures and unanswered candidates left out of
  the list; its own lr and λ chosen on dev over the same grid;
- `lsr_small` (diagnostic): `lsr`'s training on a seeded subset of `--small-train` of each fold's training
  questions, same steps: the learning curve that says whether a student short of questions is the broken link.

Diagnostic rows: `likelihood_oracle` (ℓ's own top-1, reads the gold answer: not deployable), and per row the share
of questions whose top-1 is ℓ's top-1 (did the student learn the teacher on unseen questions?), the own paragraph
first, and the mean ℓ of the top-1.

The dev choice over a grid, the fit of each row where it trained and held out, and the capacity curve are the
library's (`confrag.reranker.listwise_fit`); the questions, folds and answers the study's (`confrag.studies`).

Design, fixed before the run: primary comparison `lsr` (seed 0) vs `base`, Top-1 has_answer, exact McNemar; Holm
across every row compared with the base; detectable difference from the expected discordance 7 % (the
`eval.expected_discordance` default), not from each row's own; token F1 and EM beside it; the spread over
`--seeds` seeds beside `lsr` and `relevance`. Cross-fitting: the test questions fall into `--folds` folds; a fold's
students train on the other folds' test questions only (asserted disjoint); the dev questions are never trained
on or reported: lr, λ and τ_T (query tower) and w (residual head) are chosen on their Top-1 has_answer with the
students of fold 0's training questions, a tie going to the smaller change (lower lr, larger λ).

    python experiments/likelihood_training.py --questions 600 --dev 100 [--folds 5] [--seeds 3] [--small-train 400]
        [--utility-depth 20] [--out DIR]
        [--utility-depth 20 --answers-only --threads 1]   # fill the utility answers (one process per core)
        [--export-rows rows.jsonl]   # every question's graded ℓ list, FlagEmbedding's fields
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from confrag.infra.atomic import atomic_write_text
from confrag.infra.paths import project_root
from confrag.rag.stats import accuracy_ci, detectable_difference, holm, mcnemar_exact, paired_difference
from confrag.recipes import shipped_prompted_llm
from confrag.reranker.listwise_fit import StudyParts, capacity_curve, choose_on_dev, fit_lines, train
from confrag.reranker.listwise_student import ListwiseSettings
from confrag.reranker.listwise_teachers import TeacherInputs, likelihood_rows
from confrag.studies.likelihood_study import (
    Folds,
    Outcomes,
    earlier_run,
    likelihoods,
    listwise_data,
    load_study,
    top1,
    utility_labels,
)  # fmt: skip

log = logging.getLogger("likelihood_training")
EXPECTED_DISCORDANCE = 0.07
# The training every student gets (the rows differ only in teacher and student kind); what dev chooses is apart.
TOWER = ListwiseSettings(
    student="query_tower", lr=3e-5, steps=150, batch_size=16, warmup_ratio=0.1, weight_decay=0.01, tau=1.0,
    anchor=0.0, seed=0, train_embeddings=True, train_layers=None, precision="32-true",
)  # fmt: skip
HEAD = replace(TOWER, student="residual_head", lr=0.01, weight_decay=0.0)
# The dev grid, smallest change first: a tie keeps the earlier setting (lower lr, larger anchor), the one nearer
# the base, since 100 dev questions separate settings by a few questions at most.
LEARNING_RATES = (3e-6, 1e-5, 3e-5)
ANCHORS = (1.0, 0.0)
TEACHER_TAUS = (2.0, 0.5)
HEAD_WEIGHTS = (0.5, 1.0, 2.0)
ROWS = ("lsr", "lsr_small", "relevance", "answer_bearing", "residual", "utility")
# The rows that use the dev choice of the `likelihood` query tower (lr, λ, τ_T) and the residual head's w.
LSR_CHOICE_ROWS = {"lsr", "lsr_small", "relevance", "answer_bearing", "residual"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, default=600)
    parser.add_argument("--dev", type=int, default=100)
    parser.add_argument("--folds", type=int, default=5)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--block", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0, help="the study's question permutation")
    parser.add_argument("--cache", default=str(project_root() / ".cache"))
    parser.add_argument("--out", default=str(project_root() / "logs" / "likelihood_training"))
    parser.add_argument("--steps", type=int, default=TOWER.steps, help="optimizer steps of every student")
    parser.add_argument("--learning-rates", type=float, nargs="+", default=list(LEARNING_RATES))
    parser.add_argument(
        "--small-train", type=int, default=400,
        help="the `lsr_small` diagnostic row: the primary's training on this many of each fold's training questions "
        "(a seeded subset; 0 leaves the row out)",
    )  # fmt: skip
    parser.add_argument(
        "--utility-depth", type=int, default=0,
        help="label every question's top N candidates by the base with the LLM's greedy answer and train the "
        "`utility` row on them (0: no utility row)",
    )  # fmt: skip
    parser.add_argument("--answers-only", action="store_true", help="fill the utility answer cache and stop")
    parser.add_argument(
        "--capacity",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="fold 0's capacity curve for each teacher trained (ℓ and relevance with lsr, the labels with utility)",
    )
    parser.add_argument("--rows", nargs="+", choices=ROWS, default=list(ROWS), help="the cross-fitted rows to train")
    parser.add_argument(
        "--picks-from", default=None,
        help="an earlier run's output folder (same study): the rows not trained here are read from its picks.json, "
        "with its dev choices and diagnostics, so the report and Holm cover every row compared",
    )  # fmt: skip
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--export-rows", default=None, help="also write every question's ℓ list as FlagEmbedding rows")
    args = parser.parse_args()
    # The rows to train, checked before anything loads (the study's ℓ can take an hour to compute).
    if "utility" in args.rows and not args.utility_depth and args.rows != list(ROWS):
        parser.error("--rows utility needs --utility-depth N (the depth of the base's list the LLM answers under)")
    trained = set(args.rows) - ({"utility"} if not args.utility_depth else set())
    trained -= {"lsr_small"} if not args.small_train else set()
    if args.picks_from and trained & LSR_CHOICE_ROWS:
        parser.error(f"--picks-from adds rows to an earlier run: train only rows outside {sorted(LSR_CHOICE_ROWS)}")
    if not (trained >= LSR_CHOICE_ROWS - {"lsr_small"} or args.picks_from):
        parser.error(
            f"--rows {' '.join(args.rows)} leaves out rows that need the ℓ query tower's dev choice "
            f"({', '.join(sorted(LSR_CHOICE_ROWS - trained - {'lsr_small'}))}): train them too (leave --rows out), or "
            "add the rows to an earlier run of the same study with --picks-from ITS_OUT_FOLDER"
        )
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    start = time.time()
    if args.threads:
        torch.set_num_threads(args.threads)
    prompted = shipped_prompted_llm("smollm2_135m", "paper", str(Path(args.cache) / "models"), dtype="float32")
    study = load_study(prompted, args.questions, args.dev, args.seed, args.cache)
    tower0, head0 = replace(TOWER, steps=args.steps), replace(HEAD, steps=args.steps)
    sets = study.candidate_sets
    ell = likelihoods(study, args.cache, args.block)
    data = listwise_data(sets, args.cache)
    outcomes = Outcomes(study.prompted, sets, args.cache)
    if args.answers_only:
        utility_labels(outcomes, data.base_scores, args.utility_depth, log)
        return
    utility = utility_labels(outcomes, data.base_scores, args.utility_depth, log) if args.utility_depth else None
    inputs = [TeacherInputs(c, e, utility[i] if utility else None) for i, (c, e) in enumerate(zip(sets, ell))]
    parts = StudyParts(sets, ell, data, inputs, utility)
    if args.export_rows:
        keep = [i for i, c in enumerate(sets) if len(c.passages) >= 2]
        exported = likelihood_rows([sets[i] for i in keep], [ell[i] for i in keep])
        atomic_write_text(Path(args.export_rows), "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in exported))
    dev_at, test_at = study.dev_at, study.test_at
    cross = Folds.of(study, args.folds)
    folds = cross.folds
    log.info("%d dev, %d test questions in %d folds; ℓ and vectors ready (%.0f s)", len(dev_at), len(test_at),
             args.folds, time.time() - start)  # fmt: skip

    def fold_train(k: int, at_most: int | None = None) -> list[int]:
        return cross.training(k, at_most)

    # ---- dev: τ_T and λ of the query tower, then w of the residual head, on fold 0's students
    def dev_right(scores: np.ndarray) -> float:
        return float(np.mean([o.has_answer for o in outcomes(dev_at, top1(scores, dev_at))]))

    earlier = earlier_run(args.picks_from, [sets[i].qid for i in test_at]) if args.picks_from else None
    dev_log = [{"student": "base", "dev_has_answer": dev_right(data.base_scores)}]
    log.info("dev: base has_answer %.3f", dev_log[0]["dev_has_answer"])

    def tower_on_dev(point: tuple[float, float, float]) -> float:
        lr, anchor, tau_t = point
        student, _ = train(replace(tower0, lr=lr, anchor=anchor), "likelihood", tau_t, parts, fold_train(0))
        right = dev_right(student.score(data))
        dev_log.append({"student": "query_tower", "lr": lr, "tau_t": tau_t, "anchor": anchor, "dev_has_answer": right})
        log.info("dev: query tower lr=%g λ=%.1f τ_T=%.2f has_answer %.3f", lr, anchor, tau_t, right)
        return right

    if trained & LSR_CHOICE_ROWS:
        grid = itertools.product(args.learning_rates, ANCHORS, TEACHER_TAUS)
        (lr, anchor, tau_t), _ = choose_on_dev(grid, tower_on_dev)
    else:  # the ℓ rows come from the earlier run, with its choices and diagnostics
        c = earlier["chosen"]
        lr, anchor, tau_t = c["lr"], c["anchor"], c["tau_t"]
        dev_log += [e for e in earlier["dev"] if e["student"] != "base" and "utility" not in e["student"]]
    tower = replace(tower0, lr=lr, anchor=anchor)
    w = earlier["chosen"]["w"] if earlier else None
    if "residual" in trained:
        head, _ = train(replace(head0, anchor=anchor), "likelihood", tau_t, parts, fold_train(0))

        def head_on_dev(weight: float) -> float:
            head.weight_at_scoring = weight
            right = dev_right(head.score(data))
            dev_log.append({"student": "residual_head", "w": weight, "dev_has_answer": right})
            log.info("dev: residual head w=%.1f has_answer %.3f", weight, right)
            return right

        w, _ = choose_on_dev(HEAD_WEIGHTS, head_on_dev)
    log.info("dev chose lr=%g τ_T=%.2f λ=%.1f w=%.1f (%.0f s)", lr, tau_t, anchor, w, time.time() - start)
    # The utility row's own lr and λ (its target has no temperature), on the same dev questions and grid.
    utility_tower = None
    if "utility" in trained:

        def utility_on_dev(settings: ListwiseSettings) -> float:
            student, _ = train(settings, "utility", tau_t, parts, fold_train(0))
            right = dev_right(student.score(data))
            dev_log.append({"student": "utility query_tower", "lr": settings.lr, "anchor": settings.anchor,
                            "dev_has_answer": right})  # fmt: skip
            log.info("dev: utility query tower lr=%g λ=%.1f has_answer %.3f", settings.lr, settings.anchor, right)
            return right

        grid = (
            replace(tower0, lr=u_lr, anchor=u_anchor)
            for u_lr, u_anchor in itertools.product(args.learning_rates, ANCHORS)
        )
        utility_tower, _ = choose_on_dev(grid, utility_on_dev)

    capacity = []
    # The teachers whose fit is measured: ℓ and relevance with the ℓ rows, the utility labels with theirs.
    fitted_teachers = [("likelihood", "lsr"), ("relevance", "relevance")] if "lsr" in trained else []
    fitted_teachers += [("utility", "utility")] if "utility" in trained else []
    if fitted_teachers and args.capacity:
        capacity = capacity_curve(parts, tower0, tau_t, fold_train(0), folds[0], fitted_teachers)
        log.info("capacity curve done (%.0f s since the start)", time.time() - start)

    # ---- cross-fitted rows
    rows = {  # name -> (settings, teacher, seeds)
        "lsr": (tower, "likelihood", args.seeds),
        # The primary's training on fewer questions, same steps: does agreement with ℓ on unseen questions grow
        # with the training set (a student short of data), or stay where it is (a student that cannot carry ℓ)?
        **({"lsr_small": (tower, "likelihood", 1)} if args.small_train else {}),
        "relevance": (tower, "relevance", args.seeds),
        "answer_bearing": (tower, "answer_bearing", 1),
        "residual": (replace(head0, anchor=anchor), "likelihood", 1),
        **({"utility": (utility_tower, "utility", 1)} if utility else {}),
    }
    rows = {name: row for name, row in rows.items() if name in trained}
    scores = {name: [np.full(data.mask.shape, -np.inf, dtype=np.float32) for _ in range(n)]
              for name, (_, _, n) in rows.items()}  # fmt: skip
    missing = {name: 0 for name in rows}
    fitted: dict[str, list] = {name: [] for name in ("lsr", "relevance", "lsr_small", "utility") if name in rows}
    for k in range(args.folds):
        for name, (settings, teacher, n_seeds) in rows.items():
            train_rows = fold_train(k, args.small_train if name == "lsr_small" else None)
            for seed in range(n_seeds):
                student, lacking = train(replace(settings, seed=seed), teacher, tau_t, parts, train_rows)
                if name == "residual":
                    student.weight_at_scoring = w
                missing[name] += lacking if seed == 0 else 0
                scores[name][seed][folds[k]] = student.score(data.subset(folds[k]))
                if seed == 0 and name in fitted:  # the student on the questions it trained on
                    fitted[name].append((train_rows, student.score(data.subset(train_rows))))
        log.info("fold %d of %d trained (%.0f s since the start)", k + 1, args.folds, time.time() - start)

    picks = {"base": top1(data.base_scores, test_at), "likelihood_oracle": [int(np.argmax(ell[i])) for i in test_at]}
    if earlier:  # the rows not trained here, as the earlier run picked them
        picks |= {k: v for k, v in earlier["picks"].items() if k.split("@")[0] not in rows and k not in picks}
    for name, per_seed in scores.items():
        for seed, s in enumerate(per_seed):
            picks[f"{name}@{seed}"] = top1(s, test_at)
    results = {name: outcomes(test_at, p) for name, p in picks.items()}
    fit = fit_lines(parts, fitted, scores, folds)
    if "utility" in rows:
        chosen_utility = {"utility_lr": utility_tower.lr, "utility_anchor": utility_tower.anchor,
                          "utility_depth": args.utility_depth,
                          "utility_any_right": float(np.mean([(utility[i] == 1).any() for i in test_at]))}  # fmt: skip
    else:
        chosen_utility = {}
    chosen = {**chosen_utility, "lr": lr, "tau_t": tau_t, "anchor": anchor, "w": w,
              "train_questions": len(fold_train(0)),
              "small_train": len(fold_train(0, args.small_train)) if args.small_train else 0}  # fmt: skip
    report(args, study, ell, test_at, picks, results, missing, chosen, dev_log + fit + capacity, time.time() - start)


def report(args, study, ell, test_at, picks, results, missing, chosen, dev_log, seconds) -> None:
    sets = study.candidate_sets
    n = len(test_at)
    right = {name: np.array([o.has_answer for o in r], dtype=float) for name, r in results.items()}
    f1 = {name: np.array([o.f1 for o in r]) for name, r in results.items()}
    em = {name: np.array([o.em for o in r], dtype=float) for name, r in results.items()}
    oracle_pick = picks["likelihood_oracle"]
    shown = ["likelihood_oracle", "lsr@0", *(["lsr_small@0"] if "lsr_small@0" in picks else []), "relevance@0",
             "answer_bearing@0", "residual@0", *(["utility@0"] if "utility@0" in picks else [])]  # fmt: skip
    tests = {name: mcnemar_exact(right[name], right["base"]) for name in shown}
    adjusted = dict(zip(shown, holm([tests[name].pvalue for name in shown])))

    def seeds_cell(row: str) -> str:
        diffs = [100 * (right[k].mean() - right["base"].mean()) for k in right if k.split("@")[0] == row]
        if len(diffs) < 2:
            return ""
        return f"{', '.join(f'{d:+.1f}' for d in diffs)} (sd {np.std(diffs, ddof=1):.1f})"

    def diagnostics(name: str) -> tuple[float, float, float, float]:
        p = picks[name]
        own = [sets[i].from_gold[j] for i, j in zip(test_at, p) if sets[i].gold_retrieved]
        agree = np.mean([j == o for j, o in zip(p, oracle_pick)])
        mean_ell = np.mean([ell[i][j] for i, j in zip(test_at, p)])
        moved = np.mean([j != b for j, b in zip(p, picks["base"])])
        return float(np.mean(own)), float(agree), float(mean_ell), float(moved)

    lines = [
        f"# Rerankers trained on the LLM's likelihood: {n} test questions in {args.folds} cross-fitted folds",
        "",
        f"Dev ({len(study.dev_ids)} questions; base {100 * dev_log[0]['dev_has_answer']:.0f} %) chose lr = "
        f"{chosen['lr']}, τ_T = {chosen['tau_t']}, λ = {chosen['anchor']}, residual w = {chosen['w']}. Every "
        f"student: {args.steps} steps of {TOWER.batch_size} questions, warmup {TOWER.warmup_ratio}, the query "
        f"tower's lr for every query-tower row, {HEAD.lr} for the head. Each fold's students train on "
        f"{chosen['train_questions']} questions"
        + (f" (`lsr_small` on {chosen['small_train']} of them)." if chosen["small_train"] else "."),
        f"Primary (fixed before the run): `lsr@0` vs `base`, Top-1 has_answer, exact McNemar, Holm over the "
        f"{len(shown)} rows compared. Design's detectable difference at 80 % power: "
        f"{100 * detectable_difference(n, EXPECTED_DISCORDANCE):.1f} points (expected discordance "
        f"{100 * EXPECTED_DISCORDANCE:.0f} %, n = {n}).",
        "",
        "| row | Top-1 has_answer % [95 % CI] | vs base, points [95 % CI] | only row / only base | Holm p | seeds vs "
        "base (sd) | token F1 | EM | own ¶ first | = ℓ's top-1 | mean ℓ of top-1 | top-1 moved |",
        "| --- | --- | --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    metrics = {}
    for name in ["base", *shown]:
        own, agree, mean_ell, moved = diagnostics(name)
        row = {"has_answer": accuracy_ci(right[name]), "f1": float(f1[name].mean()), "em": float(em[name].mean())}
        diff = mc = holm_p = ""
        if name != "base":
            d = paired_difference(right[name], right["base"])
            diff, mc, holm_p = d.format(), f"{tests[name].only_a} / {tests[name].only_b}", f"{adjusted[name]:.3g}"
            row |= {"diff": d.value, "diff_ci": [d.low, d.high], "holm": adjusted[name]}
        row |= {"own_first": own, "agrees_with_ell": agree, "mean_ell": mean_ell, "moved": moved}
        lines.append(
            f"| {name} | {row['has_answer'].format(digits=1)} | {diff} | {mc} | {holm_p} | "
            f"{seeds_cell(name.split('@')[0])} | {100 * row['f1']:.1f} | {100 * row['em']:.1f} | {100 * own:.1f} | "
            f"{100 * agree:.1f} | {mean_ell:.2f} | {100 * moved:.1f} |"
        )
        row["has_answer"] = [row["has_answer"].value, row["has_answer"].low, row["has_answer"].high]
        metrics[name] = row
    for entry in (e for e in dev_log if e["student"].endswith(" fit") or " capacity " in e["student"]):
        lines.append(
            f"- {entry['student']}, {entry['measure']}: {100 * entry['training_questions']:.1f} % on its training "
            f"questions (base {100 * entry['training_questions_base']:.1f} %), {100 * entry['held_out']:.1f} % held "
            f"out (base {100 * entry['held_out_base']:.1f} %)."
        )
    utility_note = []
    if "utility_depth" in chosen:
        utility_note.append(
            f"Utility labels: the greedy answer under each of the base's top {chosen['utility_depth']} candidates; "
            f"dev chose lr = {chosen['utility_lr']}, λ = {chosen['utility_anchor']} for `utility`. The utility "
            f"oracle (some candidate answered right): {100 * chosen['utility_any_right']:.1f} % of the test questions."
        )
    lines += [
        "",
        f"Questions without a positive, left out of training (fold by fold, summed): {missing}.",
        *utility_note,
        f"Wall time: {seconds:.0f} s.",
    ]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text("\n".join(lines) + "\n")
    seeds = {k: float(right[k].mean()) for k in right if "@" in k}
    payload = {"n": n, "chosen": chosen, "dev": dev_log, "rows": metrics, "seeds": seeds, "missing": missing}
    (out / "metrics.json").write_text(json.dumps(payload, indent=2))
    # Every row's Top-1 per test question, so a report can be read again without training.
    qids = [sets[i].qid for i in test_at]
    (out / "picks.json").write_text(json.dumps({"qids": qids, "picks": picks}))
    print("\n".join(lines))
    print(f"\nWritten to {out}/: report.md, metrics.json, picks.json (the folder --picks-from reads).")


if __name__ == "__main__":
    main()
