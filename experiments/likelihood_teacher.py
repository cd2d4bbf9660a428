"""The LLM's likelihood as a teacher, measured at size before any training spends on it (issue: the aligned reranker).

For each question: BM25's top 20 over the NQ paragraphs' passages (repeats removed), ℓ(q, c) for every candidate
(`confrag.reranker.likelihood_teacher`: the mean per-token log-probability of a gold answer after the paper's RAG
prompt holding c alone, best of up to 3 answers, SmolLM2 teacher-forced), and the base reranker's scores (the demo's
base: all-MiniLM-L6-v2 scored as the bi-encoder it was trained as, used as it comes, so it consumes no question).
Each row puts one candidate in the Top-1 RAG prompt; SmolLM2 answers greedily under it (answers cached):

- `bm25`, `base` (the comparison every row is paired with), `gold` (the question's own paragraph, whole);
- `likelihood`: the candidate with the highest ℓ (uses the gold answer: an oracle-like teacher, not a deployable
  reranker; it says whether ℓ's top choice is worth teaching);
- `base_top3_by_likelihood`: the base's top 3 reordered by ℓ;
- `fusion`: z(base) + w z(ℓ) per question, w chosen on the dev questions.

Design, fixed before the run: primary comparison `likelihood` vs `base`, Top-1 has_answer, exact McNemar, Holm
across every row compared with the base; token F1 and EM beside it. The detectable difference comes from the
design's expected discordance (6.7 % of questions answered right by exactly one of the two, the pilot's 4 of 60),
not from each row's own. The dev questions (the first `--dev` of a seeded permutation) choose w and are never
reported; the test questions are the rest, disjoint (asserted). Diagnostic: ℓ's AUROC against the greedy answer under
each candidate, on the first `--auroc-questions` test questions (every candidate answered).

    python experiments/likelihood_teacher.py --questions 1200 --dev 200 [--compute-only] [--fresh-from K]
        [--out logs/likelihood_teacher]

Resumable: ℓ is computed in blocks of `--block` questions (one cached artifact each), so a larger --questions reuses
every block already computed; `--compute-only` fills the caches and writes nothing else.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import numpy as np
from sklearn.metrics import roc_auc_score

from confrag.infra.paths import project_root
from confrag.llm.hidden_states import HiddenStateEngine
from confrag.rag.answers import AnswerStore, score_answer
from confrag.rag.stats import accuracy_ci, detectable_difference, holm, mcnemar_exact, paired_difference
from confrag.recipes import shipped_prompted_llm
from confrag.reranker.likelihood_teacher import candidate_likelihoods
from confrag.reranker.listwise_fit import choose_on_dev
from confrag.retrieval.corpus import document_text
from confrag.retrieval.dense import MeanPoolEncoder
from confrag.studies.likelihood_study import MAX_NEW_TOKENS, load_study
from confrag.studies.likelihood_study import likelihood_choices as choices

EXPECTED_DISCORDANCE = 4 / 60  # the pilot's: fixed before this run
FUSION_WEIGHTS = (0.25, 0.5, 1.0, 2.0, 4.0)
log = logging.getLogger("likelihood_teacher")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, default=1200, help="questions in all (dev + test)")
    parser.add_argument("--dev", type=int, default=200)
    parser.add_argument("--auroc-questions", type=int, default=30)
    parser.add_argument(
        "--fresh-from", type=int, default=0,
        help="also report, in OUT/fresh/, on the test questions after this position of the permutation alone (e.g. "
        "800: the questions a run over the first 800 never read; 0: no such report)",
    )  # fmt: skip
    parser.add_argument("--block", type=int, default=50, help="questions per cached ℓ artifact (keep it fixed)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--cache", default=str(project_root() / ".cache"))
    parser.add_argument("--out", default=str(project_root() / "logs" / "likelihood_teacher"))
    parser.add_argument("--compute-only", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if not (args.fresh_from == 0 or args.dev <= args.fresh_from < args.questions):
        parser.error(f"--fresh-from must be 0 or in [--dev, --questions) = [{args.dev}, {args.questions}), got "
                     f"{args.fresh_from}")  # fmt: skip
    start = time.time()

    prompted = shipped_prompted_llm("smollm2_135m", "paper", str(Path(args.cache) / "models"), dtype=args.dtype)
    study = load_study(prompted, args.questions, args.dev, args.seed, args.cache)
    prompted, picked, candidate_sets = study.prompted, study.picked, study.candidate_sets
    llm = prompted.llm
    dev_ids, test_ids = study.dev_ids, study.test_ids
    engine = HiddenStateEngine(llm.model, llm.tokenizer, progress=False)
    encoder = MeanPoolEncoder()
    store = AnswerStore(prompted, args.cache, max_new_tokens=MAX_NEW_TOKENS, progress=False)
    # Questions are in the permutation's order, dev first: position i is the i-th question drawn.
    test_at = [i for i, c in enumerate(candidate_sets) if c.qid in test_ids]
    auroc_at = set(test_at[: args.auroc_questions])
    ell: list[np.ndarray] = []
    base: list[np.ndarray] = []
    # Block by block (ℓ, base scores, then every answer the report reads), so that an interrupted run leaves whole
    # blocks and the report can be read over the blocks done.
    for b in range(0, len(candidate_sets), args.block):
        block = candidate_sets[b : b + args.block]
        ell += candidate_likelihoods(prompted, block, engine=engine, cache_dir=args.cache, progress=False).per_question
        base += [20 * encoder.cosine(c.question, [document_text(p) for p in c.passages]) for c in block]
        items = [(c.question, [r.contexts[0]]) for c, r in zip(block, picked[b : b + args.block])]  # gold
        for i in range(b, b + len(block)):
            c = candidate_sets[i]
            picks = {j for w in FUSION_WEIGHTS for j in choices(base[i], ell[i], w).values()}
            if i in auroc_at:
                picks = set(range(len(c.passages)))
            items += [(c.question, [c.passages[j]]) for j in sorted(picks)]
        store.answer(items)
        log.info("block done: %d of %d questions (%.0f s)", b + len(block), len(candidate_sets), time.time() - start)

    def outcomes(chosen: list[int]) -> list:
        items = [(c.question, [c.passages[j]]) for c, j in zip(candidate_sets, chosen)]
        return [score_answer(a, c.answers) for a, c in zip(store.answer(items), candidate_sets)]

    # w on dev: the weight whose fusion answers the most dev questions right (has_answer).
    dev_at = [i for i, c in enumerate(candidate_sets) if c.qid in dev_ids]

    def fusion_on_dev(w: float) -> float:
        picks = [choices(base[i], ell[i], w)["fusion"] for i in dev_at]
        items = [(candidate_sets[i].question, [candidate_sets[i].passages[j]]) for i, j in zip(dev_at, picks)]
        right = np.mean(
            [score_answer(a, candidate_sets[i].answers).has_answer for a, i in zip(store.answer(items), dev_at)]
        )
        log.info("fusion w=%.2f: dev has_answer %.3f", w, right)
        return right

    best_w, _ = choose_on_dev(FUSION_WEIGHTS, fusion_on_dev)
    per_row = {name: [] for name in choices(base[0], ell[0], best_w)}
    for i in range(len(candidate_sets)):
        for name, j in choices(base[i], ell[i], best_w).items():
            per_row[name].append(j)
    results = {name: outcomes(chosen) for name, chosen in per_row.items()}
    gold_items = [(c.question, [r.contexts[0]]) for c, r in zip(candidate_sets, picked)]
    results["gold"] = [score_answer(a, c.answers) for a, c in zip(store.answer(gold_items), candidate_sets)]
    auroc_at = sorted(auroc_at)
    flat_items = [(candidate_sets[i].question, [p]) for i in auroc_at for p in candidate_sets[i].passages]
    flat_right = [
        score_answer(a, candidate_sets[i].answers).has_answer
        for a, i in zip(store.answer(flat_items), [i for i in auroc_at for _ in candidate_sets[i].passages])
    ]
    if args.compute_only:
        log.info("caches filled in %.0f s", time.time() - start)
        return
    runs = [(Path(args.out), test_at, args.dev)]
    if args.fresh_from:  # the same rows on the questions after the first `fresh_from` alone
        runs.append((Path(args.out) / "fresh", [i for i in test_at if i >= args.fresh_from], args.fresh_from))
    for out, at, first in runs:
        seconds = time.time() - start
        report(args, out, first, candidate_sets, per_row, results, at, ell, auroc_at, flat_right, best_w, seconds)


# wide: one report's inputs, written twice (every test question, then the fresh ones) from main's locals.
def report(args, out, first, candidate_sets, per_row, results, test_at, ell, auroc_at, flat_right, w, seconds) -> None:
    n = len(test_at)
    base_right = np.array([results["base"][i].has_answer for i in test_at], dtype=float)
    table, compared = [], [name for name in results if name != "base"]
    pvalues = []
    for name in ["base", *compared]:
        right = np.array([results[name][i].has_answer for i in test_at], dtype=float)
        f1 = np.array([results[name][i].f1 for i in test_at])
        em = np.array([results[name][i].em for i in test_at], dtype=float)
        own = None
        if name in per_row:
            flags = [candidate_sets[i].from_gold[per_row[name][i]] for i in test_at if candidate_sets[i].gold_retrieved]
            own = float(np.mean(flags)) if flags else None
        entry = {
            "row": name,
            "has_answer": accuracy_ci(right),
            "f1": float(f1.mean()),
            "em": float(em.mean()),
            "own": own,
        }
        if name != "base":
            entry["diff"] = paired_difference(right, base_right)
            entry["f1_diff"] = float(f1.mean() - np.mean([results["base"][i].f1 for i in test_at]))
            entry["mcnemar"] = mcnemar_exact(right, base_right)
            pvalues.append(entry["mcnemar"].pvalue)
        table.append(entry)
    for entry, p in zip(table[1:], holm(pvalues)):
        entry["holm"] = p
    flat_ell = np.concatenate([ell[i] for i in auroc_at])
    auroc = roc_auc_score(flat_right, flat_ell) if 0 < sum(flat_right) < len(flat_right) else None
    lines = [
        f"# The likelihood teacher at size: {n} test questions ({args.dev} dev questions chose w = {w})",
        "",
        f"Test questions: positions {first + 1}-{args.questions} of the study's seeded "
        f"permutation (seed {args.seed}); the first {args.dev} are dev.",
        "",
        f"Primary comparison (fixed before the run): `likelihood` vs `base`, Top-1 has_answer, exact McNemar; "
        f"Holm across the {len(pvalues)} rows compared with the base. Design's detectable difference at 80 % power: "
        f"{100 * detectable_difference(n, EXPECTED_DISCORDANCE):.1f} points (expected discordance "
        f"{100 * EXPECTED_DISCORDANCE:.1f} %, n = {n}).",
        "",
        "| row | Top-1 has_answer % [95 % CI] | vs base, points [95 % CI] | only row / only base | Holm p | token F1 | "
        "EM | own ¶ first |",
        "| --- | --- | --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for e in table:
        diff = e["diff"].format() if "diff" in e else ""
        mc = f"{e['mcnemar'].only_a} / {e['mcnemar'].only_b}" if "mcnemar" in e else ""
        holm_p = f"{e['holm']:.3g}" if "holm" in e else ""
        own = f"{100 * e['own']:.1f}" if e["own"] is not None else "n/a"
        lines.append(
            f"| {e['row']} | {e['has_answer'].format(digits=1)} | {diff} | {mc} | {holm_p} | {100 * e['f1']:.1f} | "
            f"{100 * e['em']:.1f} | {own} |"
        )
    lines += [
        "",
        f"ℓ against the greedy answer under each candidate: AUROC {auroc if auroc is None else round(auroc, 3)} over "
        f"{len(flat_right)} candidates of the first {len(auroc_at)} test questions ({int(sum(flat_right))} answered "
        "right).",
        f"Wall time of this invocation: {seconds:.0f} s. Questions with the gold paragraph retrieved: "
        f"{sum(candidate_sets[i].gold_retrieved for i in test_at)} of {n}.",
    ]
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text("\n".join(lines) + "\n")
    metrics = {
        e["row"]: {
            "has_answer": e["has_answer"].value,
            "ci": [e["has_answer"].low, e["has_answer"].high],
            "f1": e["f1"],
            "em": e["em"],
            "own_first": e["own"],
            **(
                {
                    "diff": e["diff"].value,
                    "holm": e["holm"],
                    "only_row": e["mcnemar"].only_a,
                    "only_base": e["mcnemar"].only_b,
                }
                if "diff" in e
                else {}
            ),
        }
        for e in table
    }
    (out / "metrics.json").write_text(json.dumps({"n": n, "w": w, "auroc": auroc, "rows": metrics}, indent=2))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
