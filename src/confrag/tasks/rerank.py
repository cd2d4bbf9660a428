"""Task `rerank`: probe (cached) → retrieved candidates → confidence shifts → NQ_Rerank → rerankers → Table 1.

Every step reads the artifacts of the steps before it from the cache: the probe and its QA states
(trained / extracted by the probe stage), the retrieval index, the candidate states (a resumable
activation artifact), and the fine-tuned rerankers (keyed by their rows and settings). A sweep over
τ or K therefore recomputes only the rows (cheap, from cached confidences) and the training they reach.
"""

from __future__ import annotations

import gc
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import torch
from hydra.utils import instantiate
from tqdm.auto import tqdm
from lightning import Trainer
from lightning.pytorch.loggers import Logger, WandbLogger
from omegaconf import DictConfig, OmegaConf

from confrag.artifacts import atomic_write_text, fingerprint
from confrag.data.nq import load_nq_jsonl
from confrag.llm.hidden_states import HiddenStateEngine
from confrag.llm.loading import load_llm
from confrag.llm.prompts import PromptTemplates
from confrag.preferences import (
    REFERENCES,
    RERANK_INSTRUCTION,
    build_rows,
    confidence_shifts,
    dataset_report,
    save_rows,
    split_by_question,
)
from confrag.probe.datamodule import select_questions
from confrag.reranker.data import PreferenceDataModule, candidate_lists
from confrag.reranker.metrics import ranking_table
from confrag.reranker.module import RerankerModule
from confrag.retrieval import (
    BM25Retriever,
    Candidates,
    Corpus,
    DenseRetriever,
    corpus_from_nq,
    document_text,
    load_candidates_jsonl,
    load_corpus_jsonl,
    retrieve_candidates,
)
from confrag.retrieval.candidates import make_candidates
from confrag.tasks.probe import ensure_probe, instantiate_list, task_loggers

log = logging.getLogger(__name__)

RETRIEVERS = ("bm25", "dense")
KS = (1, 3, 5)
UNTUNED = "cross-encoder (untuned)"
RELEVANCE_FT = "cross-encoder + relevance FT"
CONFIDENCE_FT = "cross-encoder + confidence-shift FT (ours)"


@dataclass
class PreferenceStage:
    candidates: list[Candidates]  # every preference question, retrieval order, duplicates removed
    splits: dict[str, list[dict]]  # NQ_Rerank rows by split
    report: dict[str, Any]
    key: str  # identity of the rows: everything that produced them


# --- retrieval -------------------------------------------------------------------------------------

def check_settings(cfg: DictConfig) -> None:
    """Settings checked before anything runs: a typo must not surface after an hour of probe training."""
    data = cfg.data
    problems = []
    if data.retriever not in RETRIEVERS:
        problems.append(f"data.retriever={data.retriever!r} is not one of {RETRIEVERS}")
    if data.pref_reference not in REFERENCES:
        problems.append(f"data.pref_reference={data.pref_reference!r} is not one of {REFERENCES}")
    if not int(data.pref_top_k) >= 1:
        problems.append(f"data.pref_top_k must be >= 1 (got {data.pref_top_k})")
    if not 0 < float(data.pref_test_fraction) < 1:
        problems.append(f"data.pref_test_fraction must be in (0, 1) (got {data.pref_test_fraction})")
    if not int(data.group_size) >= 2:
        problems.append(f"data.group_size must be >= 2: one positive and at least one negative (got {data.group_size})")
    if not int(data.top_n) >= 2:
        problems.append(f"data.top_n must be >= 2 candidates per question (got {data.top_n})")
    if not float(cfg.model.tau) > 0:
        problems.append(f"model.tau must be > 0 (got {cfg.model.tau})")
    if problems:
        raise ValueError("; ".join(problems))


def build_retrieval(data_cfg, cache_dir: str) -> tuple[Corpus, BM25Retriever, DenseRetriever | None]:
    """The corpus (every gold paragraph of the NQ file, or `data.corpus_path`, a JSONL of documents),
    its BM25 index, and (when asked for, or for Table 1's bi-encoder row) the dense MiniLM index; all cached."""
    words = int(data_cfg.words_per_passage)
    if data_cfg.get("corpus_path"):
        corpus = load_corpus_jsonl(data_cfg.corpus_path, words_per_passage=words)
    else:
        corpus = corpus_from_nq(load_nq_jsonl(data_cfg.nq_path), words_per_passage=words)
    bm25 = BM25Retriever(corpus, cache_dir=cache_dir)
    dense = DenseRetriever(corpus, cache_dir=cache_dir) if (data_cfg.retriever == "dense" or data_cfg.bi_encoder) else None
    log.info("Corpus: %d passages from %d documents", len(corpus), len({p.source_id for p in corpus.passages}))
    return corpus, bm25, dense


def without_duplicates(candidates: Candidates) -> tuple[Candidates, int]:
    """The same candidates with repeated passage texts removed (first kept), and how many went."""
    seen: set[str] = set()
    keep = []
    for j, passage in enumerate(candidates.passages):
        text = document_text(passage)
        if text not in seen:
            seen.add(text)
            keep.append(j)
    if len(keep) == len(candidates.passages):
        return candidates, 0
    return make_candidates(candidates.qid, candidates.question, candidates.answers,
                           [candidates.passages[j] for j in keep], [candidates.scores[j] for j in keep],
                           candidates.gold_source), len(candidates.passages) - len(keep)


def question_candidates(data_cfg, rows, corpus: Corpus, retriever) -> tuple[list[Candidates], dict[str, Any]]:
    """Top-N candidates per question: retrieved, or read from `data.candidates_path` (a prebuilt list)."""
    if data_cfg.candidates_path:
        by_qid = {c.qid: c for c in load_candidates_jsonl(data_cfg.candidates_path)}
        missing = [r.qid for r in rows if r.qid not in by_qid]
        if missing:
            raise ValueError(f"data.candidates_path={data_cfg.candidates_path}: no candidates for {len(missing)} "
                             f"questions, e.g. {missing[:3]}")
        found = [by_qid[r.qid] for r in rows]
    else:
        found = retrieve_candidates(rows, corpus, retriever, top_n=int(data_cfg.top_n))
    cleaned, removed = zip(*(without_duplicates(c) for c in found)) if found else ((), ())
    empty = [c.qid for c in cleaned if not c.passages]
    if empty:
        raise ValueError(f"questions without any retrieved context: {empty[:5]}")
    stats = {"questions": len(cleaned), "duplicate_passages_removed": int(sum(removed)),
             "gold_retrieved": float(np.mean([c.gold_retrieved for c in cleaned])),
             "answer_in_candidates": float(np.mean([any(c.has_answer) for c in cleaned]))}
    return list(cleaned), stats


# --- preference data -------------------------------------------------------------------------------

def preference_stage(cfg: DictConfig, probe, probe_dm, corpus: Corpus, retriever, out: Path) -> PreferenceStage:
    """NQ_Rerank for a seeded sample of the probe's questions (so H(Q) comes from the probe's cache)."""
    data_cfg = cfg.data
    top_k = int(data_cfg.pref_top_k)
    if top_k < 1:
        raise ValueError(f"data.pref_top_k must be >= 1 (got {top_k})")
    probe_rows = probe_dm.data.rows
    rows = select_questions(probe_rows, data_cfg.num_questions, cfg.seed)
    candidates, retrieval_stats = question_candidates(data_cfg, rows, corpus, retriever)
    position = {row.qid: i for i, row in enumerate(probe_rows)}
    qa_states = probe_dm.data.stores["qa"].take(probe.layer, [position[r.qid] for r in rows])

    llm = load_llm(OmegaConf.to_container(cfg.llm, resolve=True))
    templates = PromptTemplates(**OmegaConf.to_container(cfg.prompts, resolve=True))
    engine = HiddenStateEngine(llm.model, llm.tokenizer, batch_size=int(data_cfg.extract_batch_size),
                               progress=bool(data_cfg.progress))
    try:
        shifts = confidence_shifts(llm, templates, probe, candidates, engine=engine, cache_dir=cfg.paths.cache_dir,
                                   qa_states=qa_states, progress=bool(data_cfg.progress))
    finally:
        del engine, llm
        gc.collect()
    rows_all, drops = build_rows(candidates, shifts, data_cfg.pref_reference, top_k)
    splits = split_by_question(rows_all, float(data_cfg.pref_test_fraction), cfg.seed)
    report = {**dataset_report(candidates, shifts, top_k, splits, data_cfg.pref_reference, drops),
              "retrieval": retrieval_stats}
    key = fingerprint({"rows": splits, "probe": probe.meta.get("activations", {}).get("key")})
    save_rows(splits, out / "nq_rerank")
    atomic_write_text(out / "nq_rerank" / "report.json", json.dumps(report, indent=2, ensure_ascii=False))
    return PreferenceStage(candidates, splits, report, key)


def relevance_rows(candidates: Sequence[Candidates], qids: set[str], top_k: int) -> list[dict]:
    """The ablation's labels: passages holding a gold answer are positives, the others negatives (the
    top-K of each in retrieval order); questions lacking either are left out."""
    rows = []
    for c in candidates:
        if c.qid not in qids:
            continue
        pos = [document_text(p) for p, hit in zip(c.passages, c.has_answer) if hit][:top_k]
        neg = [document_text(p) for p, hit in zip(c.passages, c.has_answer) if not hit][:top_k]
        if pos and neg:
            rows.append({"qid": c.qid, "query": c.question, "pos": pos, "neg": neg, "prompt": RERANK_INSTRUCTION})
    return rows


# --- rerankers -------------------------------------------------------------------------------------

def reranker_cache_dir(cfg: DictConfig, train_rows: list[dict]) -> Path:
    """Where a reranker fine-tuned on exactly these rows with these settings is kept."""
    data_keys = ("group_size", "batch_size", "query_max_len", "passage_max_len")
    key = fingerprint({
        "rows": fingerprint(train_rows),
        "model": OmegaConf.to_container(cfg.model, resolve=True),
        "data": {k: cfg.data[k] for k in data_keys},
        "trainer": {k: cfg.trainer.get(k) for k in ("max_epochs", "max_steps", "accumulate_grad_batches", "precision")},
        "seed": cfg.seed,
    })
    return Path(cfg.paths.cache_dir) / "rerankers" / key


def ensure_reranker(cfg: DictConfig, train_rows: list[dict], name: str, loggers: list[Logger],
                    run_config: dict | None = None) -> tuple[RerankerModule, dict[str, Any]]:
    """A cross-encoder fine-tuned with group InfoNCE on `train_rows`: loaded from the cache when the same
    rows and settings trained one before, else trained now and exported there."""
    directory = reranker_cache_dir(cfg, train_rows)
    if (directory / "confrag_training.json").is_file() and not cfg.trainer.get("fast_dev_run"):
        log.info("Reranker %s: cached at %s", name, directory)
        info = json.loads((directory / "confrag_training.json").read_text())
        return load_reranker(cfg.model, directory), info
    model: RerankerModule = instantiate(cfg.model, _convert_="all")
    model.run_config = run_config
    datamodule = PreferenceDataModule(
        train=train_rows, tokenizer=model.hparams.backbone, kind=model.hparams.kind, query_max_len=int(cfg.data.query_max_len),
        passage_max_len=int(cfg.data.passage_max_len), batch_size=int(cfg.data.batch_size),
        eval_batch_size=int(cfg.data.eval_batch_size), group_size=int(cfg.data.group_size),
        num_workers=int(cfg.data.num_workers), seed=cfg.seed)
    datamodule.setup("fit")
    trainer: Trainer = instantiate(cfg.trainer, callbacks=instantiate_list(cfg.get("callbacks")),
                                   logger=loggers or False, default_root_dir=str(Path(cfg.paths.output_dir) / name))
    trainer.fit(model, datamodule=datamodule)
    info = {"name": name, "train_rows": len(train_rows), "steps": int(trainer.global_step),
            "train_loss": float(trainer.callback_metrics.get("train/loss", float("nan"))),
            "truncation": datamodule.truncation.get("train", {})}
    if not cfg.trainer.get("fast_dev_run"):
        model.export(directory)
        atomic_write_text(directory / "confrag_training.json", json.dumps(info, indent=2))
    return model, info


def place_on_training_device(cfg: DictConfig, modules: Iterable[RerankerModule]) -> None:
    """Score where the run trains: Lightning hands a module back on the CPU after `fit`, and a cached or
    untuned reranker is built there, so with the GPU trainer Table 1 and every later stage would otherwise
    score each candidate of each question on the CPU."""
    if cfg.trainer.get("accelerator") in ("gpu", "cuda") and torch.cuda.is_available():
        for module in modules:
            module.to("cuda")


def load_reranker(model_cfg, directory: Path) -> RerankerModule:
    """A RerankerModule over an exported fine-tuned cross-encoder (its head included, no LoRA)."""
    settings = {**OmegaConf.to_container(model_cfg, resolve=True), "backbone": str(directory), "fresh_head": False,
                "lora": None}
    return instantiate(settings, _convert_="all")


# --- Table 1 ---------------------------------------------------------------------------------------

Scorer = Callable[[str, list[str]], np.ndarray]


def table1_systems(cfg: DictConfig, candidates: list[Candidates], corpus: Corpus, bm25: BM25Retriever,
                   dense: DenseRetriever | None, rerankers: dict[str, RerankerModule]) -> dict[str, Scorer]:
    """The rows of Table 1 as scoring functions (query, passages) → scores."""
    index_of = {document_text(p): i for i, p in enumerate(corpus.passages)}

    def corpus_indices(passages: list[str]) -> list[int]:
        missing = [p[:60] for p in passages if p not in index_of]
        if missing:
            raise ValueError(f"passages not in the retrieval corpus (BM25/bi-encoder rows need them): {missing[:2]}")
        return [index_of[p] for p in passages]

    systems: dict[str, Scorer] = {"BM25": lambda q, ps: bm25.scores(q)[corpus_indices(ps)]}
    if dense is not None:
        systems["bi-encoder (MiniLM cosine)"] = (
            lambda q, ps: dense.passage_embeddings[corpus_indices(ps)] @ dense.encode([q])[0])
    for name, module in rerankers.items():  # insertion order: the tuned rows last
        systems[name] = lambda q, ps, m=module: m.score([q] * len(ps), ps, batch_size=int(cfg.data.eval_batch_size))
    return systems


def table1(systems: dict[str, Scorer], test_rows: list[dict], seed: int, progress: bool = True) -> list[dict]:
    lists = candidate_lists(test_rows, seed)
    labels = [c["labels"] for c in lists]
    scores = {name: [np.asarray(score(c["query"], c["passages"]), dtype=np.float64).tolist()
                     for c in tqdm(lists, desc=f"Table 1: {name}", unit="query", disable=not progress)]
              for name, score in systems.items()}
    return ranking_table(scores, labels, KS)


def markdown_table(rows: list[dict], title: str) -> str:
    columns = [k for k in rows[0] if k != "system"]
    lines = [f"**{title}**", "", "| Reranker | " + " | ".join(columns) + " |",
             "|---|" + "---:|" * len(columns)]
    lines += ["| " + r["system"] + " | " + " | ".join(f"{r[c]:.2f}" for c in columns) + " |" for r in rows]
    return "\n".join(lines)


# --- the task --------------------------------------------------------------------------------------

@dataclass
class RerankStage:
    """Everything the later stages (RAG evaluation, CBDR) take from this one."""

    probe: Any  # SavedProbe
    probe_data: Any  # the probe's NQConfidenceDataModule (its questions are not evaluation questions)
    corpus: Corpus
    retriever: Any  # the retriever the candidates came from (BM25Retriever or DenseRetriever)
    preferences: PreferenceStage
    rerankers: dict[str, RerankerModule]  # Table 1's cross-encoder rows, the fine-tuned ones last
    scorers: dict[str, Scorer]  # every Table 1 row as (query, passages) -> scores
    training: dict[str, Any]


def rerank_stage(cfg: DictConfig, out: Path, loggers: list[Logger], run_config: dict | None = None) -> RerankStage:
    """Probe (cached) → candidates → NQ_Rerank → the untuned, relevance-tuned and confidence-shift-tuned
    cross-encoders (cached), with the BM25 and bi-encoder scorers beside them."""
    check_settings(cfg)
    probe, probe_dm = ensure_probe(cfg.probe, cfg.paths.cache_dir, cfg.seed, workdir=out / "probe_stage")
    corpus, bm25, dense = build_retrieval(cfg.data, cfg.paths.cache_dir)
    retriever = dense if cfg.data.retriever == "dense" else bm25
    stage = preference_stage(cfg, probe, probe_dm, corpus, retriever, out)
    train_rows, test_rows = stage.splits["train"], stage.splits["test"]
    if not train_rows or not test_rows:
        raise ValueError(f"NQ_Rerank has {len(train_rows)} train and {len(test_rows)} test rows after dropping "
                         f"{stage.report['dropped']}; raise data.num_questions or data.top_n, or try "
                         f"data.pref_reference (qa / rag_empty)")

    rerankers: dict[str, RerankerModule] = {}
    training: dict[str, Any] = {}
    base_settings = {**OmegaConf.to_container(cfg.model, resolve=True), "lora": None}
    rerankers[UNTUNED] = instantiate(base_settings, _convert_="all")
    if cfg.data.relevance_baseline:
        relevance = relevance_rows(stage.candidates, {r["qid"] for r in train_rows}, int(cfg.data.pref_top_k))
        rerankers[RELEVANCE_FT], training["relevance"] = ensure_reranker(cfg, relevance, "relevance", [], run_config)
    rerankers[CONFIDENCE_FT], training["confidence_shift"] = ensure_reranker(cfg, train_rows, "confidence_shift",
                                                                             loggers, run_config)
    place_on_training_device(cfg, rerankers.values())
    scorers = table1_systems(cfg, stage.candidates, corpus, bm25, dense, rerankers)
    return RerankStage(probe, probe_dm, corpus, retriever, stage, rerankers, scorers, training)


def run(cfg: DictConfig) -> dict[str, float]:
    from confrag.train import output_dir

    out = output_dir(cfg)
    run_config, loggers = task_loggers(cfg)
    result = rerank_stage(cfg, out, loggers, run_config)
    result.rerankers[CONFIDENCE_FT].export(out / "reranker")
    rows = table1(result.scorers, result.preferences.splits["test"], cfg.seed)
    _report(cfg, out, result.preferences, rows, result.training, loggers)
    return {f"test/{k}": v / 100 for k, v in rows[-1].items() if k != "system"}


def _report(cfg, out: Path, stage: PreferenceStage, rows: list[dict], training: dict, loggers: list[Logger]) -> None:
    report = stage.report
    title = (f"Table 1 — {cfg.llm.name}, NQ_Rerank test split ({len(stage.splits['test'])} questions; "
             f"reference {report['reference']}, K={report['top_k']})")
    table = markdown_table(rows, title)
    by_ref = "\n".join(
        f"  reference {ref:9}: kept {r['kept']:4} rows, Inc>0 for {100 * r['share_positive']:.1f}% of contexts, "
        f"gold passage in pos {100 * r['gold']['gold_in_pos_rate']:.1f}% / neg {100 * r['gold']['gold_in_neg_rate']:.1f}% "
        f"(of {r['gold']['questions_with_gold']} questions with gold retrieved)"
        for ref, r in report["by_reference"].items())
    lines = [f"NQ_Rerank — {report['questions']} questions, rows train {report['rows']['train']} / test "
             f"{report['rows']['test']}, dropped {report['dropped']}",
             "  retrieval: gold passage retrieved for {:.1f} % of questions, an answer-bearing passage for {:.1f} %, "
             "{} duplicate passages removed".format(100 * report["retrieval"]["gold_retrieved"],
                                                  100 * report["retrieval"]["answer_in_candidates"],
                                                  report["retrieval"]["duplicate_passages_removed"]),
             by_ref, "", table]
    text = "\n".join(lines)
    atomic_write_text(out / "table1.md", table + "\n")
    atomic_write_text(out / "summary.txt", text + "\n")
    atomic_write_text(out / "metrics.json", json.dumps({"table1": rows, "training": training,
                                                        "nq_rerank": report}, indent=2, ensure_ascii=False))
    print(text, flush=True)
    for logger in loggers:
        if isinstance(logger, WandbLogger):
            columns = list(rows[0])
            logger.log_table("table1", columns=columns, data=[[r[c] for c in columns] for r in rows])
