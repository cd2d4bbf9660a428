"""One Table 2 over several cbdr runs on the same evaluation questions, paired with one base row: the installed
command `confrag-compare-runs` (confrag/reports/run_comparison.py has the code and the details).

    python experiments/compare_runs.py qarag=RUN_A cand=RUN_B
"""

from confrag.reports.run_comparison import main

if __name__ == "__main__":
    main()
