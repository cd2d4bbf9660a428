"""Building NQ_Rerank rows: the naive loop (one full forward per prompt, the papers' way) against the engine.

The same 20 real NQ questions (SmolLM2-135M-Instruct, BM25 top-20 candidates over the shared NQ
paragraphs, layer 15 = Layer/2) go through both paths side by side in one run:

- naive: for every QA, empty-context RAG and candidate RAG prompt, one full forward with
  `output_hidden_states=True`, then the probe on the layer's last-token state;
- engine: `confrag.reranker.preferences.confidence_shifts` into a fresh cache (length-grouped batches, only the
  layers needed, the shared prompt prefix computed once).

Rows are built from both and compared (same positives and negatives, scores within 1e-5). The probe is
a seeded, untrained MLP with SmolLM2's identity: timing and equality do not depend on its quality.
The last line is `speedup_vs_naive:`.

    python benchmarks/preferences.py [--questions 20] [--top-n 20] [--layer 15] [--top-k 5]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf
from tqdm.auto import tqdm

from confrag.data.nq import default_questions_path, load_questions_jsonl
from confrag.infra.sharded import ShardedCache
from confrag.instantiators import shipped
from confrag.llm.hidden_states import HiddenStateEngine, naive_hidden_states
from confrag.llm.loading import load_llm
from confrag.llm.prompted import PromptedLLM
from confrag.llm.prompts import PromptTemplates, encode_prompts
from confrag.probe.module import SavedProbe
from confrag.reranker.preferences import ConfidenceShifts, build_rows, confidence_shifts
from confrag.retrieval import BM25Retriever, corpus_from_gold_paragraphs, retrieve_candidates

ROOT = Path(__file__).resolve().parents[1]


def naive_shifts(llm, templates, probe: SavedProbe, candidates, layer: int) -> ConfidenceShifts:
    tok = llm.tokenizer

    def conf(prompts: list[str]) -> np.ndarray:
        states = [naive_hidden_states(llm.model, ids, [layer])[0] for ids in encode_prompts(tok, prompts)]
        return probe.confidence(np.stack(states))

    reference = {
        "qa": conf([templates.qa_prompt(tok, c.question) for c in candidates]),
        "rag_empty": conf([templates.rag_prompt(tok, c.question, []) for c in candidates]),
    }
    per_question = [
        conf([templates.rag_prompt(tok, c.question, [p]) for p in c.passages])
        for c in tqdm(candidates, desc="naive candidates")
    ]
    return ConfidenceShifts(reference, per_question)


def same_rows(a: list[dict], b: list[dict], tol: float = 1e-5) -> bool:
    if [(r["qid"], r["pos"], r["neg"]) for r in a] != [(r["qid"], r["pos"], r["neg"]) for r in b]:
        return False
    return all(np.allclose(x[f], y[f], atol=tol) for x, y in zip(a, b) for f in ("pos_scores", "neg_scores"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, default=20)
    parser.add_argument("--top-n", type=int, default=20)
    parser.add_argument("--layer", type=int, default=15)
    parser.add_argument("--top-k", type=int, default=5)
    args = parser.parse_args()

    llm = load_llm(OmegaConf.to_container(OmegaConf.load(ROOT / "conf/llm/smollm2_135m.yaml")) | {"cache_dir": None})
    templates = PromptTemplates(**OmegaConf.to_container(OmegaConf.load(ROOT / "conf/prompts/paper.yaml")))
    all_rows = load_questions_jsonl(default_questions_path())
    corpus = corpus_from_gold_paragraphs(all_rows)
    candidates = retrieve_candidates(all_rows[: args.questions], corpus, BM25Retriever(corpus), top_n=args.top_n)
    torch.manual_seed(0)
    module = shipped("model/probe.yaml", input_dim=llm.model.config.hidden_size, layer=args.layer)
    module.set_standardization(np.zeros(module.hparams.input_dim), np.ones(module.hparams.input_dim))
    prompted = PromptedLLM(llm, templates)
    identity = {"llm": llm.identity, "prompts": prompted.prompts_identity, "layer": args.layer}
    probe = SavedProbe(module, {"activations": identity})
    prompts = sum(len(c.passages) + 2 for c in candidates)
    engine = HiddenStateEngine(llm.model, llm.tokenizer, batch_size=16, progress=False)
    naive_hidden_states(
        llm.model, encode_prompts(llm.tokenizer, [templates.qa_prompt(llm.tokenizer, "warm up")])[0], [args.layer]
    )

    start = time.perf_counter()
    naive = naive_shifts(llm, templates, probe, candidates, args.layer)
    naive_s = time.perf_counter() - start
    with tempfile.TemporaryDirectory() as cache:
        start = time.perf_counter()
        fast = confidence_shifts(prompted, probe, candidates, engine=engine, cache=ShardedCache(cache, progress=False))
        engine_s = time.perf_counter() - start

    rows_naive, _ = build_rows(candidates, naive, "qa", args.top_k, "sign")
    rows_fast, _ = build_rows(candidates, fast, "qa", args.top_k, "sign")
    max_diff = max(float(np.abs(a - b).max()) for a, b in zip(naive.candidates, fast.candidates))
    print(
        f"questions: {len(candidates)}  prompts: {prompts} (QA + empty-context RAG + {args.top_n} candidates each)  "
        f"layer {args.layer}  torch threads: {torch.get_num_threads()}"
    )
    print(f"naive  (full forward per prompt, all hidden states): {naive_s:.1f} s  {prompts / naive_s:.1f} prompts/s")
    print(f"engine (confidence_shifts, fresh cache):            {engine_s:.1f} s  {prompts / engine_s:.1f} prompts/s")
    print(
        f"rows: {len(rows_fast)} kept; identical selection and scores (|Δ| ≤ 1e-5): "
        f"{same_rows(rows_naive, rows_fast)}; "
        f"max |ΔConf| {max_diff:.2e}"
    )
    if not same_rows(rows_naive, rows_fast):
        raise SystemExit("the engine's rows differ from the naive loop's")
    print(f"speedup_vs_naive: {naive_s / engine_s:.2f}")


if __name__ == "__main__":
    main()
