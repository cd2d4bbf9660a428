"""What bf16 changes on real data: SmolLM2-135M-Instruct in fp32 and in bf16 on the same NQ prompts.

On `--rag` RAG prompts (question + its gold paragraph) and `--closed-book` QA prompts of other questions (the
shared NQ file, in file order), both dtypes answer greedily (24 new tokens, answers cached per dtype) and give
their Layer/2 states at the last prompt token. Printed:

- the share of greedy answers identical to fp32's and of has_answer labels identical (each with a Wilson 95 %
  interval), per prompt kind;
- the largest and the median relative error of a Layer/2 state (|bf16 - fp32| over the state's largest entry);
- a probe's test AUROC on fp32 states against bf16 states: the same probe (trained on fp32 states and labels) and a
  probe retrained on bf16 states and labels, with bootstrap intervals. The probe here is the project's MLP
  architecture trained by a short seeded loop (`train_probe` below) on 60 % of the prompts, tested on the rest;
  its ranking metrics over retrieved candidates are not measured here.

The rule (docs/results.md): bf16 becomes the default only if its labels agree with fp32's on >= 99 % of prompts,
the probe's metrics stay within their intervals, and it is faster on the machine (benchmarks/cpu_llm.py).

    python benchmarks/bf16_agreement.py [--rag 500] [--closed-book 300]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf
from scipy.stats import binomtest
from sklearn.metrics import roc_auc_score

from confrag.data.nq import default_questions_path, load_questions_jsonl
from confrag.data.qa_metrics import has_answer
from confrag.infra.paths import default_cache_dir
from confrag.llm.hidden_states import HiddenStateEngine
from confrag.llm.loading import load_llm
from confrag.llm.prompted import PromptedLLM
from confrag.llm.prompts import PromptTemplates
from confrag.probe.network import ProbeNetwork
from confrag.rag.answers import AnswerStore

ROOT = Path(__file__).resolve().parents[1]


def wilson(k: int, n: int) -> str:
    low, high = binomtest(k, n).proportion_ci(method="wilson")
    return f"{100 * k / n:.1f} % [{100 * low:.1f}, {100 * high:.1f}] ({k} of {n})"


def train_probe(x: np.ndarray, y: np.ndarray, seed: int = 0, epochs: int = 60) -> ProbeNetwork:
    """The project's probe network, trained with class-weighted cross-entropy over its two logits (full batch,
    Adam, seeded), inputs standardized with the training states' mean and std as the project's probe is."""
    torch.manual_seed(seed)
    standardization = {"mean": x.mean(0).tolist(), "std": (x.std(0) + 1e-6).tolist()}
    net = ProbeNetwork(input_dim=x.shape[1], standardization=standardization)
    xs, ys = torch.tensor(x), torch.tensor(y, dtype=torch.long)
    positive = max(float(y.sum()), 1.0)
    weight = torch.tensor([len(y) / (2 * max(len(y) - positive, 1.0)), len(y) / (2 * positive)])
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-3)
    for _ in range(epochs):
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(xs), ys, weight=weight)
        loss.backward()
        optimizer.step()
    return net.eval()


def auroc(net: ProbeNetwork, x: np.ndarray, y: np.ndarray, seed: int = 0) -> str:
    scores = net.confidence(x)
    value = roc_auc_score(y, scores)
    rng = np.random.default_rng(seed)
    boots = []
    for _ in range(1000):
        i = rng.integers(0, len(y), len(y))
        if 0 < y[i].sum() < len(i):
            boots.append(roc_auc_score(y[i], scores[i]))
    low, high = np.percentile(boots, [2.5, 97.5])
    return f"{value:.3f} [{low:.3f}, {high:.3f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rag", type=int, default=500)
    parser.add_argument("--closed-book", type=int, default=300)
    args = parser.parse_args()
    start = time.time()
    rows = load_questions_jsonl(default_questions_path(), limit=args.rag + args.closed_book)
    templates = PromptTemplates(**OmegaConf.to_container(OmegaConf.load(ROOT / "conf/prompts/paper.yaml")))
    cfg = OmegaConf.to_container(OmegaConf.load(ROOT / "conf/llm/smollm2_135m.yaml")) | {"cache_dir": None}
    found = {}
    for dtype in ("float32", "bfloat16"):
        llm = load_llm(cfg | {"dtype": dtype})
        items = [(r.question, list(r.contexts[:1])) for r in rows[: args.rag]]
        items += [(r.question, []) for r in rows[args.rag :]]
        store = AnswerStore(PromptedLLM(llm, templates), default_cache_dir(), max_new_tokens=24, progress=False)
        answers = store.answer(items)
        prompts = [store.prompt(q, c) for q, c in items]
        layer = llm.mid_layer
        states = HiddenStateEngine(llm.model, llm.tokenizer, progress=False).extract(prompts, [layer])[0]
        labels = np.array([has_answer(a, r.answers) for a, r in zip(answers, rows)], dtype=np.float32)
        found[dtype] = (answers, states, labels)
        print(f"{dtype}: answers and states in {time.time() - start:.0f} s")
    (a32, s32, y32), (a16, s16, y16) = found["float32"], found["bfloat16"]
    kinds = {"RAG": slice(0, args.rag), "closed-book": slice(args.rag, None)}
    for name, part in kinds.items():
        same = sum(x == y for x, y in zip(a32[part], a16[part]))
        same_labels = int((y32[part] == y16[part]).sum())
        n = len(a32[part])
        print(f"{name:11s}: answers identical {wilson(same, n)}; has_answer identical {wilson(same_labels, n)}")
    total = len(y32)
    print(f"all prompts: has_answer identical {wilson(int((y32 == y16).sum()), total)}")
    err = np.abs(s16 - s32).max(-1) / np.abs(s32).max(-1)
    print(f"Layer/2 state relative error: largest {err.max():.2e}, median {np.median(err):.2e}")
    order = np.random.default_rng(0).permutation(total)
    train, test = order[: int(0.6 * total)], order[int(0.6 * total) :]
    same_probe = train_probe(s32[train], y32[train])
    retrained = train_probe(s16[train], y16[train])
    print(f"probe test AUROC ({len(test)} prompts, {int(y32[test].sum())} positive in fp32):")
    print(f"  fp32 probe on fp32 states: {auroc(same_probe, s32[test], y32[test])}")
    print(f"  fp32 probe on bf16 states: {auroc(same_probe, s16[test], y16[test])}")
    print(f"  bf16 probe on bf16 states: {auroc(retrained, s16[test], y16[test])}")
    print(f"wall time: {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
