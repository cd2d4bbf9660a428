"""CBDR latency: the gate's two paths against the plain pipelines they replace, on real NQ questions.

- Skip path (Conf ≥ β): the gate's one pass (prefill + probe + greedy decoding from the same KV cache)
  against plain greedy generation (`generate_greedy`) of the same QA prompt; the answers, and so their
  lengths, are checked to be equal.
- Retrieval path (Conf < β): the gate (QA prefill + probe, then BM25 → top-K → RAG answer) against plain
  RAG (BM25 → top-K → RAG answer) for the same question.

SmolLM2-135M-Instruct on CPU, BM25 over the gold paragraphs of the shared NQ file. Runs are interleaved
(the two sides alternate, first side swapped every repeat) and each question keeps its best of N, so
the machine's other load hits both sides alike. The probe is freshly initialised (seeded) with the
model's activation identity unless `--probe DIR` names a trained one: its weights do not change the
cost of one small MLP on one vector, and β is set to force each path (1e-6: skip; 1.0: retrieve).
The last two lines are `retrieval_path_overhead:` and `skip_path_overhead:` (ratios, gate / plain).

    python benchmarks/cbdr_latency.py [--questions 20] [--repeats 3] [--max-new-tokens 32] [--top-k 3] [--threads N]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf

from confrag.cbdr.gate import ConfidenceGate
from confrag.data.nq import default_questions_path, load_questions_jsonl
from confrag.instantiators import shipped
from confrag.llm.generation import generate_greedy
from confrag.llm.loading import load_llm
from confrag.llm.prompted import PromptedLLM
from confrag.llm.prompts import PromptTemplates
from confrag.probe.module import SavedProbe, load_probe
from confrag.retrieval.bm25 import BM25Retriever
from confrag.retrieval.corpus import corpus_from_gold_paragraphs

ROOT = Path(__file__).resolve().parents[1]
SKIP_BETA, RETRIEVE_BETA = 1e-6, 1.0


def seeded_probe(prompted: PromptedLLM) -> SavedProbe:
    llm = prompted.llm
    with torch.random.fork_rng():
        torch.manual_seed(0)
        module = shipped("model/probe.yaml", input_dim=llm.model.config.hidden_size, layer=llm.mid_layer)
    meta = {"activations": {"llm": llm.identity, "prompts": prompted.prompts_identity, "layer": llm.mid_layer}}
    return SavedProbe(module, meta)


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def interleaved(questions, side_a, side_b, repeats):
    """Best-of-`repeats` seconds per question for both sides, alternating which side runs first."""
    best_a, best_b = np.full(len(questions), np.inf), np.full(len(questions), np.inf)
    results_a, results_b = [None] * len(questions), [None] * len(questions)
    for repeat in range(repeats):
        for i, question in enumerate(questions):
            order = ((side_a, best_a, results_a), (side_b, best_b, results_b))
            for side, best, results in order if (repeat + i) % 2 == 0 else order[::-1]:
                seconds, results[i] = timed(lambda: side(question))
                best[i] = min(best[i], seconds)
    return best_a, best_b, results_a, results_b


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=3)
    parser.add_argument("--probe", type=str, default=None, help="a trained probe directory (default: seeded init)")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads (default: torch's); 1 avoids oversubscription on a machine under other load",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    llm = load_llm(OmegaConf.to_container(OmegaConf.load(ROOT / "conf/llm/smollm2_135m.yaml")) | {"cache_dir": None})
    templates = PromptTemplates(**OmegaConf.to_container(OmegaConf.load(ROOT / "conf/prompts/paper.yaml")))
    all_rows = load_questions_jsonl(default_questions_path())
    questions = [row.question for row in all_rows[: args.questions]]
    corpus = corpus_from_gold_paragraphs(all_rows)
    bm25 = BM25Retriever(corpus)
    retrieve = lambda q: [corpus.passages[i] for i, _ in bm25.search([q], args.top_k)[0]]  # noqa: E731
    prompted = PromptedLLM(llm, templates)
    probe = load_probe(args.probe) if args.probe else seeded_probe(prompted)
    gate_kwargs = dict(
        retrieve_fn=retrieve,
        rerank_fn=None,
        top_k=args.top_k,
        max_new_tokens=args.max_new_tokens,
        batch_size=1,
        progress=False,
    )
    skip_gate = ConfidenceGate(prompted, probe, beta=SKIP_BETA, **gate_kwargs)
    rag_gate = ConfidenceGate(prompted, probe, beta=RETRIEVE_BETA, **gate_kwargs)
    generate = lambda prompt: generate_greedy(
        llm.model,
        llm.tokenizer,
        [prompt],
        args.max_new_tokens,  # noqa: E731
        batch_size=1,
        progress=False,
    )[0]
    plain_qa = lambda q: generate(templates.qa_prompt(llm.tokenizer, q))  # noqa: E731
    plain_rag = lambda q: generate(templates.rag_prompt(llm.tokenizer, q, retrieve(q)))  # noqa: E731

    for warm in (
        lambda: skip_gate.answer(questions[0]),
        lambda: plain_qa(questions[0]),
        lambda: rag_gate.answer(questions[0]),
        lambda: plain_rag(questions[0]),
    ):
        warm()

    gate_s, plain_s, gate_out, plain_out = interleaved(questions, skip_gate.answer, plain_qa, args.repeats)
    skipped = sum(not out.retrieved for out in gate_out)
    same = sum(out.answer == ref for out, ref in zip(gate_out, plain_out))
    tokens = [len(llm.tokenizer(ref, add_special_tokens=False)["input_ids"]) for ref in plain_out]
    rag_gate_s, rag_plain_s, rag_gate_out, rag_plain_out = interleaved(
        questions, rag_gate.answer, plain_rag, args.repeats
    )
    retrieved = sum(out.retrieved for out in rag_gate_out)
    rag_same = sum(out.answer == ref for out, ref in zip(rag_gate_out, rag_plain_out))

    print(
        f"questions: {len(questions)}  repeats: {args.repeats} (interleaved, best of N per question)  "
        f"max_new_tokens: {args.max_new_tokens}  top_k: {args.top_k}  torch threads: {torch.get_num_threads()}"
    )
    print(
        f"skip path: {skipped}/{len(questions)} skipped retrieval; answers equal to plain generation: "
        f"{same}/{len(questions)}; answer tokens mean {np.mean(tokens):.1f}"
    )
    print(
        f"  plain greedy (QA prompt): {plain_s.mean() * 1e3:.1f} ms/question   gate skip path: "
        f"{gate_s.mean() * 1e3:.1f} ms/question   median per-question ratio {np.median(gate_s / plain_s):.3f}"
    )
    print(
        f"retrieval path: {retrieved}/{len(questions)} retrieved; answers equal to plain RAG: "
        f"{rag_same}/{len(questions)}"
    )
    print(
        f"  plain RAG (BM25 + RAG answer): {rag_plain_s.mean() * 1e3:.1f} ms/question   gate retrieval path: "
        f"{rag_gate_s.mean() * 1e3:.1f} ms/question   extra: {(rag_gate_s - rag_plain_s).mean() * 1e3:+.1f} ms/question"
    )
    print(f"retrieval_path_overhead: {rag_gate_s.sum() / rag_plain_s.sum():.3f}")
    print(f"skip_path_overhead: {gate_s.sum() / plain_s.sum():.3f}")


if __name__ == "__main__":
    main()
