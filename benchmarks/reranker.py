"""Cross-encoder training throughput: the Lightning `RerankerModule` against a plain PyTorch loop.

Both train the same MiniLM cross-encoder (same seeded head) with group InfoNCE on the same batches
(preference rows built from real NQ questions: the gold paragraph as positive, other questions'
paragraphs as negatives; batch 4 × group 8 = 32 pairs per step), the same AdamW and schedule, for the
same number of steps, interleaved and best of N. Prints pairs per second of each and, last,
`throughput_ratio:` (module / plain loop; above 1 means the module is faster).

    python benchmarks/reranker.py [--steps 8] [--repeats 2] [--batch-size 4] [--group-size 8]
"""

from __future__ import annotations

import argparse
import time

import torch
from lightning import Trainer

from confrag.data.nq import default_questions_path, load_questions_jsonl
from confrag.instantiators import shipped
from confrag.reranker.data import PreferenceDataModule
from confrag.reranker.loss import group_infonce
from confrag.reranker.module import RerankerModule, build_optimizer
from confrag.retrieval.corpus import document_text, split_passages


def nq_rows(count: int, negatives: int) -> list[dict]:
    """Preference-shaped rows from real NQ paragraphs (first ~100-word passage of each)."""
    rows = load_questions_jsonl(default_questions_path(), limit=count + negatives)
    texts = [document_text(split_passages(r.contexts[0].title, r.contexts[0].text, r.qid)[0]) for r in rows]
    return [
        {
            "qid": r.qid,
            "query": r.question,
            "pos": [texts[i]],
            "neg": [texts[(i + 1 + j) % len(texts)] for j in range(negatives)],
            "prompt": "rank",
        }
        for i, r in enumerate(rows[:count])
    ]


def plain_loop(module: RerankerModule, loader, steps: int) -> float:
    model = module.model.train()
    optimizer, scheduler = build_optimizer(model, module.settings.lr, module.settings.weight_decay, 0.0, steps)
    start = time.perf_counter()
    for _, batch in zip(range(steps), loader):
        scores = model(**batch["features"]).logits.view(-1, batch["group_size"])
        loss = group_infonce(scores, module.settings.tau)
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def lightning_fit(module: RerankerModule, datamodule: PreferenceDataModule, steps: int) -> float:
    trainer = Trainer(
        max_steps=steps,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    start = time.perf_counter()
    trainer.fit(module, datamodule=datamodule)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    args = parser.parse_args()

    rows = nq_rows(args.steps * args.batch_size, args.group_size - 1)
    # The shipped nodes' settings (conf/data/preference_pairs.yaml, conf/model/reranker_minilm.yaml) with this run's.
    batching = shipped("data/preference_pairs.yaml", batch_size=args.batch_size, group_size=args.group_size, seed=0)
    datamodule = PreferenceDataModule(batching, train=rows)
    lengths = {"query_max_len": batching.query_max_len, "passage_max_len": batching.passage_max_len}

    def module() -> RerankerModule:
        return RerankerModule(shipped("model/reranker_minilm.yaml", seed=0, **lengths))

    datamodule.setup("fit")
    batches = list(datamodule.train_dataloader())
    pairs = args.steps * args.batch_size * args.group_size
    plain_times, module_times = [], []
    for _ in range(args.repeats):
        torch.manual_seed(0)
        # The same DataLoader (seeded sampler, tokenizing collator) as the module's: the same batches.
        plain_times.append(plain_loop(module(), datamodule.train_dataloader(), args.steps))
        torch.manual_seed(0)
        module_times.append(lightning_fit(module(), datamodule, args.steps))
    plain_s, module_s = min(plain_times), min(module_times)
    tokens = sum(int(b["features"]["attention_mask"].sum()) for b in batches[: args.steps])
    print(
        f"steps {args.steps} × {args.batch_size} queries × group {args.group_size} = {pairs} pairs, "
        f"{tokens} real tokens; torch threads {torch.get_num_threads()}"
    )
    print(
        f"plain loop runs (s): {[round(t, 2) for t in plain_times]}  "
        f"module runs (s): {[round(t, 2) for t in module_times]}"
    )
    print(f"plain loop: {pairs / plain_s:.1f} pairs/s   RerankerModule + Trainer: {pairs / module_s:.1f} pairs/s")
    print(f"throughput_ratio: {plain_s / module_s:.3f}")


if __name__ == "__main__":
    main()
