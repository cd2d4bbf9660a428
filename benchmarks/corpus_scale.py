"""A corpus of Wikipedia's size on one machine: what BM25 (memory-mapped) and FAISS cost per passage.

The corpus is synthetic, in FlashRAG's `{"id", "contents": "title\\ntext"}` JSONL, with Wikipedia's shape:

- article lengths (words) drawn from a log-normal with median 300 and sigma 1.0 (mean ~495 words, so an
  article gives ~5 passages, as the 21M passages of DPR's wiki-2018 come from ~6M articles), each split
  by confrag into 100-word passages (a tail under 20 words joins the passage before it);
- words drawn from a Zipf law (s = 1) over 500,000 ranks, the first ranks being bm25s' English stopwords
  (so ~40 % of the words are stopwords, as in English text) and the rest synthetic terms.

Each phase runs in a process of its own, so that its peak memory (ru_maxrss) is its own:

1. bm25: the corpus file streamed through `iter_passages` into `build_bm25`, then `save_bm25`: build
   time, peak memory, index size on disk;
2. bm25-query: `load_bm25(mmap=True)` (digests checked), then 1,000 queries of 5 words of a random
   passage each, one at a time as the pipeline asks them (top 20): latency, and how often the passage a
   query was drawn from comes first;
3. faiss: MiniLM (all-MiniLM-L6-v2) encoding timed on a sample of the passages (encoding the whole
   corpus on CPU would take hours), then flat and IVF-SQ8 indexes built on random unit vectors of
   MiniLM's 384 dimensions (`FaissIndex`, as DenseRetriever builds them): build time, size on disk, time
   per query of 1,000 queries sent in one batch (as DenseRetriever sends them), how often the vector a
   query was drawn near comes first, and IVF's top-20 overlap with flat (random vectors have no cluster
   structure: the worst case for IVF, so this overlap is a floor, not what real embeddings get).

The last lines extrapolate linearly from the measured per-passage figures to 21M passages.

    nice python benchmarks/corpus_scale.py [--passages 200000] [--faiss-passages 200000] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

WIKI_PASSAGES = 21_000_000
VOCAB = 500_000
QUERY_WORDS = 5
TOP_N = 20


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def folder_mb(path: Path) -> float:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file()) / 2**20


def passages_of(words: int) -> int:
    """How many passages confrag's splitter makes of an article of `words` words (100 per passage, a tail
    under 20 joined to the one before)."""
    chunks = math.ceil(words / 100)
    return chunks - 1 if chunks > 1 and words % 100 and words % 100 < 20 else chunks


def generate(out: Path, passages: int, queries: int, seed: int) -> dict:
    from bm25s.stopwords import STOPWORDS_EN

    rng = np.random.default_rng(seed)
    stop = sorted(set(STOPWORDS_EN))
    stop_set = set(stop)
    vocab = np.array(stop + [f"t{r}" for r in range(VOCAB - len(stop))], dtype=object)
    cdf = np.cumsum(1.0 / np.arange(1, VOCAB + 1))
    cdf /= cdf[-1]
    corpus, made, docs, query_list = out / "corpus.jsonl", 0, 0, []
    query_docs = set(rng.choice(passages // 6, size=queries, replace=False).tolist())  # articles to ask about
    with open(corpus, "w", encoding="utf-8") as handle:
        while made < passages:
            length = max(5, int(rng.lognormal(math.log(300), 1.0)))
            words = vocab[np.searchsorted(cdf, rng.random(length))]
            handle.write(json.dumps({"id": str(docs), "contents": f"Article {docs}\n" + " ".join(words)}) + "\n")
            if docs in query_docs:
                start = int(rng.integers(0, passages_of(length))) * 100  # a random passage of the article
                content = [w for w in words[start : start + 100] if w not in stop_set]
                picked = rng.choice(content, size=min(QUERY_WORDS, len(content)), replace=False)
                query_list.append({"query": " ".join(picked), "passage": made + start // 100})
            made += passages_of(length)
            docs += 1
    (out / "queries.json").write_text(json.dumps(query_list[:queries]))
    return {"documents": docs, "passages": made, "corpus_mb": corpus.stat().st_size / 2**20}


def phase_bm25(out: Path) -> dict:
    from confrag.retrieval.bm25 import build_bm25, save_bm25
    from confrag.retrieval.corpus import document_text, iter_passages

    baseline = peak_mb()  # the interpreter and imports, before any passage is read
    start = time.perf_counter()
    model = build_bm25(document_text(p) for p in iter_passages(out / "corpus.jsonl"))
    built = time.perf_counter() - start
    save_bm25(model, out / "bm25")
    return {
        "passages": int(model.scores["num_docs"]),
        "build_s": built,
        "save_s": time.perf_counter() - start - built,
        "baseline_mb": baseline,
        "peak_mb": peak_mb(),
        "index_mb": folder_mb(out / "bm25"),
    }


def phase_bm25_query(out: Path) -> dict:
    from confrag.retrieval.bm25 import _tokenize, load_bm25
    from confrag.retrieval.ranking import top_n_hits

    start = time.perf_counter()
    model = load_bm25(out / "bm25", mmap=True)
    loaded = time.perf_counter() - start
    rss_after_load = peak_mb()
    queries = json.loads((out / "queries.json").read_text())
    latencies, first = [], 0
    for q in queries:
        t = time.perf_counter()
        scores = model.get_scores_from_ids(model.get_tokens_ids(_tokenize([q["query"]])[0]))
        hits = top_n_hits(scores, TOP_N)
        latencies.append(time.perf_counter() - t)
        first += hits[0][0] == q["passage"]
    ms = np.array(latencies) * 1000
    return {
        "load_s": loaded,
        "queries": len(queries),
        "mean_ms": float(ms.mean()),
        "p50_ms": float(np.percentile(ms, 50)),
        "p95_ms": float(np.percentile(ms, 95)),
        "own_passage_first": first / len(queries),
        "peak_mb_after_load": rss_after_load,
        "peak_mb": peak_mb(),
    }


def phase_faiss(out: Path, count: int, encode_sample: int, queries: int) -> dict:
    import torch

    from confrag.retrieval import Corpus, DenseRetriever
    from confrag.retrieval.corpus import iter_passages
    from confrag.retrieval.faiss_index import FaissIndex, FaissKey

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    sample = []
    for passage in iter_passages(out / "corpus.jsonl"):
        sample.append(passage)
        if len(sample) == encode_sample:
            break
    encoder = DenseRetriever(Corpus(sample[:1], {}, "bench"), progress=False, index="exact")
    texts = [f"{p.title}\n{p.text}" for p in sample]
    encoder.encode(texts[:32])  # warm-up
    start = time.perf_counter()
    encoder.encode(texts)
    encode_s = (time.perf_counter() - start) / len(texts)
    del encoder

    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((count, 384), dtype=np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    shards = [vectors[i : i + 8192] for i in range(0, count, 8192)]
    picks = rng.choice(count, size=queries, replace=False)
    q = vectors[picks] + 0.3 * rng.standard_normal((queries, 384), dtype=np.float32) / math.sqrt(384)
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    result: dict = {"encode_ms_per_passage": encode_s * 1000, "encode_sample": len(texts), "vectors": count}
    found = {}
    for kind in ("flat", "ivf"):
        start = time.perf_counter()
        index = FaissIndex.build(shards, FaissKey(corpus="bench", encoder="random"), kind)
        built = time.perf_counter() - start
        index.save(out / f"faiss-{kind}")
        # One batch, as DenseRetriever.search sends them (up to 1,024 queries per call).
        start = time.perf_counter()
        hits = index.search(q, TOP_N)
        per_query = (time.perf_counter() - start) / len(q)
        found[kind] = [{i for i, _ in h} for h in hits]
        result[kind] = {
            "build_s": built,
            "index_mb": folder_mb(out / f"faiss-{kind}"),
            "ms_per_query": per_query * 1000,
            "planted_first": float(np.mean([h[0][0] == pick for h, pick in zip(hits, picks)])),
        }
        del index
    result["ivf"]["recall_at_20_vs_flat"] = float(
        np.mean([len(a & b) / len(a) for a, b in zip(found["flat"], found["ivf"])])
    )
    result["peak_mb"] = peak_mb()
    return result


def run_phase(args: argparse.Namespace, phase: str) -> dict:
    command = [sys.executable, __file__, "--phase", phase, "--workdir", str(args.workdir)]
    command += ["--faiss-passages", str(args.faiss_passages), "--encode-sample", str(args.encode_sample)]
    command += ["--queries", str(args.queries)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"phase {phase} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def report(gen: dict, bm25: dict, query: dict, dense: dict | None) -> None:
    n = bm25["passages"]
    scale = WIKI_PASSAGES / n
    per_passage_kb = (bm25["peak_mb"] - bm25["baseline_mb"]) * 1024 / n
    b, q = bm25, query
    print(f"corpus: {n:,} passages from {gen['documents']:,} articles, {gen['corpus_mb']:.0f} MB of JSONL")
    print(
        f"bm25 build (stream -> index): {b['build_s']:.1f} s ({b['build_s'] / n * 1e6:.1f} µs/passage), "
        f"save {b['save_s']:.1f} s, peak memory {b['peak_mb']:.0f} MB ({b['baseline_mb']:.0f} MB before the "
        f"first passage: {per_passage_kb:.2f} KB/passage), index {b['index_mb']:.0f} MB on disk"
    )
    print(
        f"bm25 load (mmap, digests checked): {q['load_s']:.2f} s, memory after load {q['peak_mb_after_load']:.0f} MB; "
        f"{q['queries']} queries one at a time: mean {q['mean_ms']:.1f} ms, p50 {q['p50_ms']:.1f} ms, "
        f"p95 {q['p95_ms']:.1f} ms; own passage first for {q['own_passage_first']:.1%}; peak {q['peak_mb']:.0f} MB"
    )
    if dense:
        per_passage = dense["encode_ms_per_passage"]
        print(f"MiniLM encoding (CPU, sample of {dense['encode_sample']}): {per_passage:.1f} ms/passage")
        for kind in ("flat", "ivf"):
            d = dense[kind]
            extra = f", top-20 overlap with flat {d['recall_at_20_vs_flat']:.3f}" if kind == "ivf" else ""
            print(
                f"faiss {kind} over {dense['vectors']:,} random 384-d unit vectors: build {d['build_s']:.1f} s, "
                f"{d['index_mb']:.0f} MB on disk, {d['ms_per_query']:.2f} ms/query ({q['queries']} in one batch), "
                f"planted neighbour first {d['planted_first']:.1%}{extra}"
            )
        print(f"faiss phase peak memory {dense['peak_mb']:.0f} MB")
    print(f"extrapolated to {WIKI_PASSAGES:,} passages (x{scale:.0f}, linear in passages):")
    peak_gb = (b["baseline_mb"] + per_passage_kb * WIKI_PASSAGES / 1024) / 1024
    print(
        f"  bm25: build {b['build_s'] * scale / 3600:.1f} h, index {b['index_mb'] * scale / 1024:.1f} GB on disk, "
        f"build peak memory {peak_gb:.0f} GB, query ~{q['mean_ms'] * scale / 1000:.2f} s "
        "(postings grow with the corpus)"
    )
    if dense:
        m = WIKI_PASSAGES / dense["vectors"]
        flat, ivf = dense["flat"], dense["ivf"]
        print(
            f"  dense: encoding {dense['encode_ms_per_passage'] * WIKI_PASSAGES / 1000 / 86400:.1f} days on this CPU; "
            f"flat index {flat['index_mb'] * m / 1024:.1f} GB, ~{flat['ms_per_query'] * m:.0f} ms/query; "
            f"IVF-SQ8 index {ivf['index_mb'] * m / 1024:.1f} GB, build ~{ivf['build_s'] * m / 60:.0f} min"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--passages", type=int, default=200_000)
    parser.add_argument("--faiss-passages", type=int, default=200_000, help="0 skips the FAISS phase")
    parser.add_argument("--encode-sample", type=int, default=256)
    parser.add_argument("--queries", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--phase", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase:
        out = args.workdir
        result = {
            "bm25": lambda: phase_bm25(out),
            "bm25-query": lambda: phase_bm25_query(out),
            "faiss": lambda: phase_faiss(out, args.faiss_passages, args.encode_sample, args.queries),
        }[args.phase]()
        print(json.dumps(result))
        return
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[name] = str(args.threads)
    with tempfile.TemporaryDirectory(prefix="corpus_scale-", dir=args.workdir) as tmp:
        args.workdir = Path(tmp)
        start = time.perf_counter()
        gen = generate(args.workdir, args.passages, args.queries, args.seed)
        print(f"generated in {time.perf_counter() - start:.0f} s", flush=True)
        bm25 = run_phase(args, "bm25")
        print(json.dumps({"bm25": bm25}), flush=True)
        query = run_phase(args, "bm25-query")
        print(json.dumps({"bm25-query": query}), flush=True)
        dense = run_phase(args, "faiss") if args.faiss_passages > 0 else None
        if dense:
            print(json.dumps({"faiss": dense}), flush=True)
        report(gen, bm25, query, dense)


if __name__ == "__main__":
    main()
