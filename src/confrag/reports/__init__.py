"""What each task writes into its run folder (summary.txt, table1.md, report.md, gates.md, metrics.json,
plots) and logs to its loggers (W&B tables and images)."""
