"""One Table 2 over several cbdr runs on the same evaluation questions, paired with one base row.

Runs of the same question plan (two settings of one rule: `model.tau=0.05` and `model.tau=1.0`; or
`cbdr_smollm2_full` and `cbdr_smollm2_full_candidates`: the same folds, base reranker and test questions, another
probe) each write their rows' per-question outcomes to `<run>/outcomes/<dataset>/<id>.jsonl`. This script reads
them, keeps the test questions of the first run's `metrics.json` (every run must hold exactly those), and prints one
table whose rows are keyed by run label and system id (`tau05:confidence_ft.rank`, `tau1:confidence_ft.rank`): Top-K
accuracy with its 95 % bootstrap interval, the paired difference to the base row with its interval (paired by
question), the exact McNemar p Holm-corrected across every row compared (all runs together), the smallest difference
the design detects at 80 % power, and the share of questions whose Top-1 context is a passage of their own paragraph,
paired with the base row's (the questions only one of the two puts it first, and the exact McNemar p, uncorrected),
when the corpus is the question file's own paragraphs (`retrieval.corpus_path` null: the columns are left out
otherwise). A system that answers every question the same in a later run as in an earlier one (the shared base,
BM25, the oracle...) is one row, under the first run's label, and named as shared below the table.

    confrag-compare-runs tau05=RUN_A tau1=RUN_B                  # base: the first run's `base` (tau05:base)
    confrag-compare-runs qarag=RUN_A cand=RUN_B --metric has_answer_dpr --base cand:base --dataset nq

(`python experiments/compare_runs.py ...` runs the same from a checkout.) `--dataset` defaults to the first run's
question set (its `metrics.json`; `nq` for a run written before it named one). The run folders'
`config_resolved.yaml` are read as plain YAML: the seed of the bootstrap and the corpus settings.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

import yaml

from confrag.data.nq import load_questions_jsonl
from confrag.rag.pipeline import load_outcomes_jsonl
from confrag.rag.stats import BINARY_METRICS, mcnemar_exact, paired_cell, table2_rows
from confrag.reports.cbdr_answers import own_paragraph_flags
from confrag.retrieval import corpus_from_gold_paragraphs


def run_arg(text: str) -> tuple[str, Path]:
    label, _, path = text.rpartition("=")
    folder = Path(path)
    if not label or not (folder / "metrics.json").is_file():
        raise argparse.ArgumentTypeError(f"{text!r}: give LABEL=RUN_DIR, a cbdr run folder with a metrics.json")
    return label, folder


def gold_sources(run: Path) -> dict[str, str] | None:
    """qid -> the document of the question's own paragraph in the run's corpus of NQ paragraphs (None: the run
    retrieved from a corpus file of its own, where the NQ paragraphs are not the documents)."""
    retrieval = run_config(run).get("retrieval") or {}
    if retrieval.get("corpus_path") or retrieval.get("words_per_passage") is None:
        return None
    rows = load_questions_jsonl(retrieval["questions_path"])
    return corpus_from_gold_paragraphs(rows, int(retrieval["words_per_passage"])).gold_source_of


def run_config(run: Path) -> dict:
    """The run's resolved config (`config_resolved.yaml`, which every run writes beside run_info.json)."""
    path = run / "config_resolved.yaml"
    try:
        config = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as err:
        raise SystemExit(f"{path}: not a run's resolved config ({err})") from err
    if not isinstance(config, dict):
        raise SystemExit(f"{path}: not a run's resolved config (a YAML mapping)")
    return config


def read_rows(
    runs: Sequence[tuple[str, Path]], dataset: str, test: set[str], k: int
) -> tuple[dict[tuple[str, str, str], list], dict[str, str]]:
    """Every run's outcome files of `dataset` as Table 2 runs keyed ("-", "<label>:<system>", dataset); a system
    answering exactly as the same system of an earlier run is kept once (its first label): the second mapping
    gives the row each such name is shown as."""
    labels = [label for label, _ in runs]
    if len(set(labels)) != len(labels):
        raise SystemExit(f"run labels must differ (they key the rows): {labels}")
    rows: dict[tuple[str, str, str], list] = {}
    first_of: dict[tuple[str, tuple], str] = {}
    shared: dict[str, str] = {}
    for label, folder in runs:
        paths = sorted((folder / "outcomes" / dataset).glob("*.jsonl"))
        if not paths:
            raise SystemExit(f"{folder / 'outcomes' / dataset}: no outcome files (--dataset names the folder)")
        for path in paths:
            outcomes = [o for o in load_outcomes_jsonl(path) if o.qid in test]
            if {o.qid for o in outcomes} != test:
                raise SystemExit(f"{path}: holds {len(outcomes)} of the first run's {len(test)} test questions")
            system = path.stem
            answers = [(o.qid, o.rag[k].answer) for o in sorted(outcomes, key=lambda o: o.qid)]
            earlier = first_of.get((system, tuple(answers)))
            if earlier is not None:  # the same system answering the same: one row
                shared[f"{label}:{system}"] = f"{earlier}:{system}"
                continue
            first_of[(system, tuple(answers))] = label
            rows[("-", f"{label}:{system}", dataset)] = outcomes
    return rows, shared


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="confrag-compare-runs", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("runs", nargs="+", type=run_arg, help="LABEL=RUN_DIR, the first one's test questions kept")
    parser.add_argument(
        "--base", default="base", help="the row every other is compared with: LABEL:SYSTEM, or SYSTEM of the first run"
    )
    parser.add_argument("--metric", default="has_answer", choices=BINARY_METRICS)
    parser.add_argument("--dataset", default=None, help="the outcomes folder (default: the first run's question set)")
    parser.add_argument("--k", type=int, default=1)
    parser.add_argument(
        "--expected-discordance", type=float, default=None, help="the design's (default: the first run's eval node)"
    )
    args = parser.parse_args(argv)

    first_label, first_run = args.runs[0]
    first = json.loads((first_run / "metrics.json").read_text())
    main_set = first["eval"].get("outcomes", "nq")  # the folder of the first run's question set (`nq` before)
    dataset = args.dataset or main_set
    test = set(first["eval"]["test"])
    rows, shared = read_rows(args.runs, dataset, test, args.k)
    named = args.base if ":" in args.base else f"{first_label}:{args.base}"
    base = shared.get(named, named)  # a shared row is shown under its first run's label
    if ("-", base, dataset) not in rows:
        raise SystemExit(f"--base {args.base!r} is not a row ({named}); rows: {[n for _, n, _ in rows]}")
    config = run_config(first_run)
    seed = int(config["seed"])  # the run's own bootstrap draws
    # The design's discordance (the detectable difference): the run's own setting, unless given.
    discordance = args.expected_discordance or (config.get("eval") or {}).get("expected_discordance")
    if discordance is None:
        raise SystemExit(f"{first_label}'s config has no eval.expected_discordance: pass --expected-discordance")
    table = table2_rows(rows, base, ks=[args.k], metric=args.metric, seed=seed, expected_discordance=float(discordance))
    print(f"{dataset}, Top-{args.k} {args.metric}, n = {len(test)} test questions; Holm over {len(rows) - 1} rows")
    sources = gold_sources(first_run) if dataset == main_set else None
    header = f"| row | Top-{args.k} [95 % CI] | − {base} [95 % CI] · Holm p · detectable |"
    own_header = f" own ¶ | own ¶: row alone / {base} alone · McNemar p |"
    print(header + (own_header if sources else ""))
    print("| --- | ---: | --- |" + (" ---: | --- |" if sources else ""))

    def own(name: str) -> list[bool]:  # in qid order, so that rows pair by question
        return own_paragraph_flags(sorted(rows[("-", name, dataset)], key=lambda o: o.qid), args.k, sources)

    for row in table:
        line = f"| {row['reranker']} | {row[f'top{args.k}'].format()} | {paired_cell(row, args.k)} |"
        if sources:
            flags = own(row["reranker"])
            line += f" {100 * sum(flags) / len(flags):.1f} |"
            if row["reranker"] == base:
                line += " — |"
            else:
                pair = mcnemar_exact(flags, own(base))
                line += f" {pair.only_a} / {pair.only_b} · {pair.pvalue:.3f} |"
        print(line)
    if shared:
        same = "; ".join(f"{name} = {row}" for name, row in shared.items())
        print(f"\nShown once (the same answers to every question): {same}")
