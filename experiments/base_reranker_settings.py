"""How many steps, at which learning rate, a base reranker needs to rank: own paragraph first on held-out questions.

The embedded MiniLM is a bi-encoder; the base reranker puts a fresh scoring head on it and trains it on relevance
rows (gold paragraph vs BM25 hard negatives without an answer), as `confrag.stages.base_reranker` does. Each
setting given trains one base on `n` questions (seeded, disjoint from the 150 evaluated) and prints, as one JSON
line, its steps, training seconds and the share of evaluated questions whose own paragraph it ranks first among
their top-8 BM25 candidates, beside BM25's own share. The rerankers are cached under `--cache`.

    python experiments/base_reranker_settings.py lr=6e-5 lr=3e-4 lr=3e-4,neg=3,n=240 lr=3e-4,epochs=2
    python experiments/base_reranker_settings.py lr=1e-3,neg=3,n=240,warmup=0.1
    python experiments/base_reranker_settings.py lr=3e-4,neg=3,n=360,warmup=0.2,distill=1,dtau=0.05

`distill=w` adds w x KL toward the MiniLM bi-encoder's cosine scores of each row's candidates (its teacher
distribution softmax(cosine / dtau)) to the InfoNCE: the bi-encoder already ranks these candidates, the fresh head
does not.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from hydra import compose, initialize_config_dir
from omegaconf import open_dict

from confrag.data.nq import load_questions_jsonl
from confrag.infra.paths import register_resolvers
from confrag.instantiators import run_context
from confrag.recipes import rerank_recipe
from confrag.retrieval import document_text
from confrag.retrieval.dense import MeanPoolEncoder
from confrag.stages.base_reranker import relevance_training_rows
from confrag.stages.rerankers import ensure_reranker
from confrag.stages.retrieval import build_retrieval, question_candidates

ROOT = Path(__file__).resolve().parents[1]
KEYS = {
    "lr": float,
    "n": int,
    "neg": int,
    "epochs": int,
    "warmup": float,
    "distill": float,
    "dtau": float,
    "tau": float,
}


def setting(text: str) -> dict:
    pairs = dict(part.split("=", 1) for part in text.split(","))
    unknown = set(pairs) - set(KEYS)
    if unknown:
        raise SystemExit(f"{text!r}: unknown key(s) {sorted(unknown)}; allowed: {sorted(KEYS)}")
    return {k: KEYS[k](v) for k, v in pairs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "settings",
        nargs="+",
        type=setting,
        help="lr=..,n=..,neg=..,epochs=..,warmup=..,distill=..,dtau=..,tau=.. (n 120, neg 7, epochs 1; warmup: "
        "model.warmup_ratio; distill 0: InfoNCE only; tau: the InfoNCE temperature, model.tau)",
    )
    parser.add_argument("--cache", default=str(ROOT / ".cache" / "base_reranker_settings"))
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    register_resolvers()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=["+experiment=cbdr_smollm2"])
    with open_dict(cfg):
        cfg.paths.cache_dir = args.cache
        cfg.paths.output_dir = str(Path(args.cache) / "runs")
    recipe, ctx = rerank_recipe(cfg), run_context(cfg)
    retrieval = build_retrieval(recipe.retrieval, ctx.cache_dir)
    rows = load_questions_jsonl(cfg.probe.data.questions_path)
    order = np.random.default_rng(args.seed).permutation(len(rows))
    evaluated, _ = question_candidates(retrieval, [rows[i] for i in order[:150]], top_n=8)
    evaluated = [c for c in evaluated if any(c.from_gold)]  # the own paragraph among the candidates
    bm25 = float(np.mean([c.from_gold[0] for c in evaluated]))
    encoder = MeanPoolEncoder(device="cpu")  # the bi-encoder teacher: all-MiniLM-L6-v2

    def cosine(query: str, passages: list[str]) -> list[float]:
        return [float(v) for v in encoder.cosine(query, passages)]

    bi_encoder = float(
        np.mean(
            [c.from_gold[int(np.argmax(cosine(c.question, [document_text(p) for p in c.passages])))] for c in evaluated]
        )
    )
    for s in args.settings:
        n, negatives, epochs = s.get("n", 120), s.get("neg", 7), s.get("epochs", 1)
        questions = [rows[i] for i in order[150 : 150 + n]]
        candidates, _ = question_candidates(retrieval, questions, top_n=30)
        train, _ = relevance_training_rows(questions, candidates, negatives, int(recipe.retrieval.words_per_passage))
        if s.get("distill", 0) > 0:  # FlagEmbedding's teacher-score fields, as the preference rows carry them
            for row in train:
                scores = cosine(row["query"], row["pos"] + row["neg"])
                row["pos_scores"], row["neg_scores"] = scores[: len(row["pos"])], scores[len(row["pos"]) :]
        overrides = {
            "lora": None,
            **({"distill_weight": s["distill"], "distill_tau": s.get("dtau")} if s.get("distill", 0) > 0 else {}),
            **({"lr": s["lr"]} if "lr" in s else {}),
            **({"warmup_ratio": s["warmup"]} if "warmup" in s else {}),
            **({"tau": s["tau"]} if "tau" in s else {}),
        }
        start = time.perf_counter()
        module, info = ensure_reranker(
            recipe.reranker, ctx, train, "base", [], trainer_settings={"max_epochs": epochs}, **overrides
        )
        first = []
        for c in evaluated:
            scores = module.score([c.question] * len(c.passages), [document_text(p) for p in c.passages])
            first.append(bool(c.from_gold[int(np.argmax(scores))]))
        print(
            json.dumps(
                {
                    **s,
                    "steps": info["steps"],
                    "train_seconds": round(time.perf_counter() - start),
                    "own_first": round(float(np.mean(first)), 3),
                    "bm25_own_first": round(bm25, 3),
                    "bi_encoder_own_first": round(bi_encoder, 3),
                    "n_evaluated": len(evaluated),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
