"""Training on your own FlagEmbedding rows on a CPU: `+experiment=reranker_rows` (passages cut to 256 tokens, 2 groups
at once, gradients accumulated to 4 groups a step) against the paper's batches it replaced (512 tokens, 4 groups at
once), side by side in one run: seconds per optimizer step and the process's peak memory, with every pair at its
token cap (the worst case), and the time 300 rows take at each.

    python benchmarks/own_rows.py [--rows 40] [--steps 4]

The rows only need to fill the steps (a step's cost and the peak do not depend on how many rows there are); the
time of 300 rows is extrapolated from the measured time a step.

Each setting runs `train.py` in a process of its own (its peak RSS is its own); both train the same rows for the
same number of optimizer steps (the same groups a step).
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GROUP = 8  # data.group_size: 1 positive and 7 negatives a group
SETTINGS = {
    "reranker_rows (256 tokens, 2 groups x 2 accumulated)": [],
    "the paper's batches (512 tokens, 4 groups)": [
        "data.passage_max_len=512", "data.batch_size=4", "trainer.accumulate_grad_batches=1",
    ],
}  # fmt: skip


def rows_file(path: Path, n: int) -> Path:
    """`n` rows whose every passage is longer than 512 MiniLM tokens (each pair reaches its cap)."""
    rng = random.Random(0)
    words = [f"word{i}" for i in range(2000)]

    def passage() -> str:
        return " ".join(rng.choice(words) for _ in range(700))

    with path.open("w") as handle:
        for i in range(n):
            row = {"query": f"question number {i} about {rng.choice(words)}?", "pos": [passage()],
                   "neg": [passage() for _ in range(GROUP - 1)]}  # fmt: skip
            handle.write(json.dumps(row) + "\n")
    return path


# The child's peak RSS measured in a wrapper process of its own, so that each setting's peak is its own.
WRAPPER = (
    "import resource, subprocess, sys; code = subprocess.run(sys.argv[1:]).returncode; "
    "print('PEAK_KB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(code)"
)


def run(rows: Path, changes: list[str], steps: int, folder: Path) -> dict:
    command = [sys.executable, "train.py", "+experiment=reranker_rows", f"preferences.rows_path={rows}",
               f"+trainer.max_steps={steps}", "logger=csv", f"paths.log_dir={folder}",
               f"paths.cache_dir={folder / 'cache'}", *changes]  # fmt: skip
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", WRAPPER, *command], cwd=ROOT, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    peak_kb = int(done.stdout.split("PEAK_KB")[-1].split()[0])
    # FitProgress's last line in train.log: "<what>: trained, N steps in 1 min 05 s" (the whole fit, its first step
    # with the data loader's start included: an upper bound on a step)
    log_lines = next(folder.rglob("train.log")).read_text().splitlines()
    line = [x for x in log_lines if "reranker" in x and ": trained, " in x]
    steps, spent = line[-1].split(": trained, ")[1].split(" steps in ")
    parts = spent.replace("min", "").replace("s", "").split()
    fit_seconds = float(parts[-1]) + (60 * float(parts[0]) if len(parts) == 2 else 0.0)
    return {"wall_seconds": round(seconds, 1), "seconds_a_step": fit_seconds / int(steps), "peak_gb": peak_kb / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=40)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = rows_file(Path(tmp) / "rows.jsonl", args.rows)
        results = {}
        for name, changes in SETTINGS.items():
            results[name] = run(rows, changes, args.steps, Path(tmp) / str(len(results)))
            print(f"{name}: {results[name]}", flush=True)
    train_rows = 240  # 300 rows: the split by query keeps 4 of 5 for training
    steps_300 = train_rows / 4  # 4 groups a step in both settings
    print(f"\nRows of {GROUP} passages each at the cap, {args.steps} optimizer steps each:")
    for name, r in results.items():
        per_step = r["seconds_a_step"]
        print(f"  {name}: {per_step:.1f} s a step (one epoch of {train_rows} training rows: "
              f"{steps_300 * per_step / 60:.1f} min), peak {r['peak_gb']:.1f} GB")  # fmt: skip
    new, old = results.values()
    time_ratio, memory_ratio = old["seconds_a_step"] / new["seconds_a_step"], old["peak_gb"] / new["peak_gb"]
    print(f"  ratio (the paper's / reranker_rows): {time_ratio:.2f}x the time a step, {memory_ratio:.2f}x the peak")


if __name__ == "__main__":
    main()
