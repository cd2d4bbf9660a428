"""Listwise students' training speed: each kind in fp32 against bf16 autocast, side by side in one run.

The residual cross-encoder reads every (question, candidate) pair of the base's top k, so its step costs k pairs a
question; the query tower encodes the questions alone. This times `--steps` optimizer steps of each kind on real NQ
questions (each question's candidates: its own gold paragraph's passages and other questions', the base's top
`--top-k` kept), interleaved, best of `--repeats`, and prints seconds per step of each precision and, last,
`bf16_speedup:` per kind (fp32 time / bf16 time; above 1 means bf16 is faster; on a CPU with AMX bf16 runs the
encoder 2-3x faster, without it often slower). It also prints how many questions' top-1 the two precisions' trained
students agree on: bf16 is an approximation, chosen per study and named in its report.

    python benchmarks/listwise_students.py [--steps 6] [--repeats 2] [--questions 64] [--top-k 5]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

import numpy as np

from confrag.data.nq import default_questions_path, load_questions_jsonl
from confrag.reranker.listwise_data import ListwiseData
from confrag.reranker.listwise_student import fit_listwise
from confrag.retrieval.corpus import document_text, split_passages
from confrag.retrieval.dense import MeanPoolEncoder
from confrag.studies.fair_student import TRAINING


def listwise(count: int, top_k: int) -> ListwiseData:
    rows = load_questions_jsonl(default_questions_path(), limit=count)
    own = [[document_text(p) for p in split_passages(r.contexts[0].title, r.contexts[0].text, r.qid)] for r in rows]
    texts = [(own[i] + [own[(i + j) % count][0] for j in range(1, 8)])[:8] for i in range(count)]
    encoder = MeanPoolEncoder(device="cpu")
    vectors = [encoder.encode(t) for t in texts]
    questions = [r.question for r in rows]
    return ListwiseData.from_lists(questions, encoder.encode(questions), vectors, passage_texts=texts).top_k(top_k)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--questions", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=5)
    parser.add_argument("--train-layers", type=int, default=None, help="the encoders' top layers that train")
    args = parser.parse_args()
    data = listwise(args.questions, args.top_k)
    # A target that prefers each question's second candidate by the base: something to move toward.
    order = np.argsort(-data.base_scores, axis=1, kind="stable")
    targets = [np.where(np.arange(len(m)) == order[i, 1], 0.0, -np.inf) for i, m in enumerate(data.mask)]
    speedups = {}
    for kind in ("residual_cross_encoder", "query_tower", "residual_head"):
        best = {"32-true": float("inf"), "bf16-mixed": float("inf")}
        top1 = {}
        for _ in range(args.repeats):
            for precision in best:
                settings = replace(
                    TRAINING,
                    student=kind,
                    steps=args.steps,
                    precision=precision,
                    lr=3e-5,
                    train_layers=args.train_layers,
                )
                start = time.perf_counter()
                student = fit_listwise(settings, data, targets)
                best[precision] = min(best[precision], (time.perf_counter() - start) / args.steps)
                top1[precision] = np.argmax(student.score(data), axis=1)
        agree = float(np.mean(top1["32-true"] == top1["bf16-mixed"]))
        speedups[kind] = best["32-true"] / best["bf16-mixed"]
        print(f"{kind}: fp32 {best['32-true']:.2f} s/step, bf16 {best['bf16-mixed']:.2f} s/step "
              f"({TRAINING.batch_size} questions × top {args.top_k}); trained students' top-1 agree on "
              f"{100 * agree:.0f} % of {args.questions} questions")  # fmt: skip
    print("bf16_speedup: " + ", ".join(f"{k} {v:.2f}" for k, v in speedups.items()))


if __name__ == "__main__":
    main()
