"""Holm across a table's rows from their discordant counts: `NAME=ROW_ALONE/BASE_ALONE` per row, each compared with
the same base on the same questions (exact McNemar), Holm across all of them. Recomputes a published table's Holm
column from the table itself, e.g. the 9 rows of the 500-question likelihood study (docs/results.md):

    python experiments/holm_from_counts.py oracle=15/8 run1_lsr=4/18 run1_relevance=2/11 run1_answer_bearing=4/12 \
        run1_residual=0/0 run2_lsr=2/3 run2_relevance=0/1 run2_answer_bearing=0/3 run2_residual=0/0
"""

from __future__ import annotations

import argparse
import re

from confrag.studies.fair_report import holm_from_counts

ROW = re.compile(r"([^=]+)=(\d+)/(\d+)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rows", nargs="+", metavar="NAME=ROW_ALONE/BASE_ALONE")
    args = parser.parse_args()
    counts = {}
    for text in args.rows:
        match = ROW.fullmatch(text)
        if not match:
            parser.error(f"{text!r}: each row is NAME=ROW_ALONE/BASE_ALONE with two counts, e.g. lsr=4/18")
        counts[match[1]] = (int(match[2]), int(match[3]))
    print("| row | row alone / base alone | exact McNemar p | Holm p |\n| --- | --- | ---: | ---: |")
    for name, (p, adjusted) in holm_from_counts(counts).items():
        print(f"| {name} | {counts[name][0]} / {counts[name][1]} | {p:.3g} | {adjusted:.3g} |")


if __name__ == "__main__":
    main()
