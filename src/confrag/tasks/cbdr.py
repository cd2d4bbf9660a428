"""Task `cbdr`: the rerank stage (cached) → RAG answers on held-out questions → Table 2 → the β sweep
(Table 3, β curve, β chosen on dev and reported on test, flips) → report.md.

Evaluation questions are NQ questions the probe never saw, and so neither did the preference data nor
the fine-tuned rerankers (their questions are a sample of the probe's). They are split by question into
dev (choosing β) and test (every table). Their candidates come from the stage's retriever over the NQ
paragraphs, which hold their own gold paragraphs, as for the preference questions.

HotpotQA (when `data.hotpotqa_path` is set) gets a corpus of its own: the supporting paragraphs of the
sampled questions, indexed by the same kind of retriever; a question's candidates are therefore its
gold paragraphs among the other questions' (the file's own distractor paragraphs are not used). It
appears in Table 2 only, over all sampled questions, as in the papers.

Every answer goes through one `AnswerStore`: another K, β grid or reranker subset, or a rerun,
generates nothing it has generated before, and the β sweep itself never calls the LLM.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
from lightning.pytorch.loggers import Logger, WandbLogger
from omegaconf import DictConfig, OmegaConf

from confrag.artifacts import atomic_write_text
from confrag.cbdr import (
    ConfidenceGate,
    SweepData,
    check_beta,
    check_betas,
    flip_analysis,
    flips_markdown,
    plot_beta_curve,
    question_confidences,
    report_beta,
    should_retrieve,
    sweep,
    table3_markdown,
)
from confrag.cbdr.sweep import METRICS, OBJECTIVES
from confrag.data.hotpotqa import load_hotpotqa
from confrag.data.nq import QARow, load_nq_jsonl
from confrag.llm.loading import LoadedLLM, load_llm
from confrag.llm.prompts import PromptTemplates
from confrag.probe.datamodule import select_questions
from confrag.rag import AnswerStore, QuestionOutcome, RagRun, accuracy_ci, run_rag, save_outcomes_jsonl
from confrag.rag import table2_markdown, table2_rows
from confrag.rag.pipeline import check_ks
from confrag.rag.stats import BINARY_METRICS
from confrag.retrieval import BM25Retriever, Candidates, DenseRetriever, corpus_from_nq
from confrag.retrieval.corpus import document_text
from confrag.tasks.probe import task_loggers
from confrag.tasks.rerank import (
    RerankStage,
    Scorer,
    markdown_table,
    question_candidates,
    rerank_stage,
    table1,
    table1_systems,
)

log = logging.getLogger(__name__)

NQ, HOTPOTQA = "NQ", "HotpotQA"
CURVE_RANGE = (0.90, 1.00)  # the papers' Figure 8


# --- settings --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Settings:
    """The validated `rag`, `cbdr` and `eval` sections; checked before anything expensive runs."""

    ks: tuple[int, ...]  # every K answered: rag.top_k plus cbdr.top_k
    k: int  # cbdr.top_k: the K of the gate, the chosen β and the flips
    beta: float
    betas: np.ndarray
    table_betas: tuple[float, ...]
    flip_pairs: tuple[tuple[float, float], ...]
    objective: str
    budget: float | None
    metric: str  # cbdr.metric (sweep)
    eval_metric: str  # eval.metric (Table 2)
    base: str
    reranker: str
    rerankers: tuple[str, ...] | None  # eval.rerankers: Table 2's rows (None = every Table 1 row)
    flip_examples: int
    gate_check_questions: int
    conf_quantiles: int  # cbdr.conf_quantiles: that many quantiles of the dev split's Conf join the grid


def _positive_int(value: Any, key: str, minimum: int = 1, allow_none: bool = False) -> int | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{key} must be an integer >= {minimum}{' or null' if allow_none else ''}; got {value!r}")
    return value


def _as_list(value: Any) -> list:
    return list(value) if isinstance(value, (list, tuple)) or OmegaConf.is_list(value) else [value]


def check_settings(cfg: DictConfig) -> Settings:
    """Every bad value of the task's own sections, named by its key, before the stage runs."""
    ks = check_ks(_as_list(cfg.rag.top_k))
    k = _positive_int(cfg.cbdr.top_k, "cbdr.top_k")
    top_n = int(cfg.data.top_n)
    if max(*ks, k) > top_n and not cfg.data.candidates_path:
        raise ValueError(f"rag.top_k={list(ks)} / cbdr.top_k={k} ask for more contexts than the data.top_n={top_n} "
                         "candidates retrieved per question; lower K or raise data.top_n")
    flip_betas = _as_list(cfg.cbdr.flip_betas or [])
    flip_betas = tuple(float(b) for b in check_betas(flip_betas, "cbdr.flip_betas")) if flip_betas else ()
    if len(flip_betas) == 1:
        raise ValueError(f"cbdr.flip_betas must list at least two thresholds (flips between consecutive ones), or "
                         f"none; got {list(flip_betas)}")
    if flip_betas and cfg.cbdr.metric == "f1":
        raise ValueError("cbdr.metric=f1 has no right and wrong answers to count flips with; set cbdr.flip_betas=[] "
                         "or cbdr.metric=has_answer / em")
    objective, budget = cfg.cbdr.objective, cfg.cbdr.retrieval_budget
    if objective not in OBJECTIVES:
        raise ValueError(f"cbdr.objective={objective!r} is not one of {OBJECTIVES}")
    if objective == "budget":
        if budget is None:
            raise ValueError("cbdr.objective=budget needs cbdr.retrieval_budget, a fraction in [0, 1]")
        budget = check_beta(budget, "cbdr.retrieval_budget")
    if cfg.cbdr.metric not in METRICS:
        raise ValueError(f"cbdr.metric={cfg.cbdr.metric!r} is not one of {METRICS}")
    if cfg.eval.metric not in BINARY_METRICS:
        raise ValueError(f"eval.metric={cfg.eval.metric!r} is not one of {BINARY_METRICS} (the tests need 0/1 outcomes)")
    fraction = cfg.eval.dev_fraction
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction < 1:
        raise ValueError(f"eval.dev_fraction must be a number in (0, 1), the share of evaluation questions used to "
                         f"choose β; got {fraction!r}")
    _positive_int(cfg.eval.num_questions, "eval.num_questions", minimum=2, allow_none=True)
    _positive_int(cfg.eval.hotpotqa_num_questions, "eval.hotpotqa_num_questions", minimum=2, allow_none=True)
    _positive_int(cfg.eval.n_resamples, "eval.n_resamples", minimum=100)
    rerankers = None if cfg.eval.rerankers is None else tuple(str(r) for r in cfg.eval.rerankers)
    return Settings(
        ks=tuple(sorted({*ks, k})), k=k, beta=check_beta(cfg.cbdr.beta, "cbdr.beta"),
        betas=beta_grid(cfg.cbdr.betas, cfg.cbdr.beta_step),
        table_betas=tuple(float(b) for b in check_betas(_as_list(cfg.cbdr.table_betas), "cbdr.table_betas")),
        flip_pairs=tuple(zip(flip_betas, flip_betas[1:])), objective=objective, budget=budget,
        metric=cfg.cbdr.metric, eval_metric=cfg.eval.metric, base=str(cfg.eval.base_reranker),
        reranker=str(cfg.cbdr.reranker), rerankers=rerankers,
        flip_examples=_positive_int(cfg.cbdr.flip_examples, "cbdr.flip_examples", minimum=0),
        gate_check_questions=_positive_int(cfg.cbdr.gate_check_questions, "cbdr.gate_check_questions", minimum=0),
        conf_quantiles=_positive_int(cfg.cbdr.conf_quantiles, "cbdr.conf_quantiles", minimum=0))


def beta_grid(betas: Any, step: Any) -> np.ndarray:
    """`cbdr.betas` when it lists thresholds; else 0 to 0.90 by `cbdr.beta_step`, then 0.90 to 1.00 by 0.01
    (with step 0.05, the papers' range and `default_beta_grid()`)."""
    if betas is not None:
        return check_betas(_as_list(betas), "cbdr.betas")
    if isinstance(step, bool) or not isinstance(step, (int, float)) or not 0 < step <= 0.9:
        raise ValueError(f"cbdr.beta_step must be a number in (0, 0.9] (the grid's step below 0.90), or set "
                         f"cbdr.betas; got {step!r}")
    coarse = np.arange(0.0, 0.9 - 1e-9, step)
    return np.unique(np.round(np.concatenate([coarse, 0.90 + np.arange(11) * 0.01]), 6))


def with_conf_quantiles(grid: np.ndarray, dev_confidence: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray]:
    """The grid plus `count` evenly spaced quantiles of the dev split's Conf(H(Q)) (rounded to 1e-4), and those
    quantiles. A probe may squeeze every confidence into a band narrower than the grid's step; its quantiles
    put thresholds inside the band. Only dev confidences are read, and no label, so test stays unseen."""
    if count == 0:
        return grid, np.zeros(0)
    quantiles = np.round(np.quantile(dev_confidence, np.arange(1, count + 1) / (count + 1)), 4)
    return np.unique(np.concatenate([grid, quantiles])), quantiles


def chosen_scorers(settings: Settings, scorers: dict[str, Scorer]) -> dict[str, Scorer]:
    """Table 2's rows: `eval.rerankers` (or every Table 1 row); the base and CBDR's reranker always."""
    names = list(scorers) if settings.rerankers is None else list(settings.rerankers)
    for key, name in [("eval.base_reranker", settings.base), ("cbdr.reranker", settings.reranker)] + \
                     [("eval.rerankers", n) for n in names]:
        if name not in scorers:
            raise ValueError(f"{key}={name!r} is not a Table 1 row; rows: {list(scorers)}")
    keep = set(names) | {settings.base, settings.reranker}
    return {name: score for name, score in scorers.items() if name in keep}


# --- evaluation questions --------------------------------------------------------------------------

@dataclass
class EvalSet:
    dataset: str
    rows: list[QARow]
    candidates: list[Candidates]
    scorers: dict[str, Scorer]
    retrieval: dict[str, Any]


def evaluation_rows(cfg: DictConfig, probe_rows: Sequence[QARow]) -> list[QARow]:
    """A seeded sample of the NQ questions the probe was not built from."""
    used = {row.qid for row in probe_rows}
    rows = load_nq_jsonl(cfg.data.nq_path)
    pool = [row for row in rows if row.qid not in used]
    if len(pool) < 2:
        raise ValueError(f"{cfg.data.nq_path}: the probe uses {len(used)} of its {len(rows)} questions, leaving "
                         f"{len(pool)} for evaluation; lower probe.data.num_questions")
    return select_questions(pool, cfg.eval.num_questions, cfg.seed)


def split_dev_test(rows: Sequence[QARow], dev_fraction: float, seed: int) -> dict[str, list[QARow]]:
    """Seeded split by question, each part kept in file order."""
    n_dev = int(round(len(rows) * dev_fraction))
    if not 0 < n_dev < len(rows):
        raise ValueError(f"eval.dev_fraction={dev_fraction} of {len(rows)} evaluation questions leaves an empty dev or "
                         "test split; raise eval.num_questions")
    dev = set(np.random.default_rng(seed).permutation(len(rows))[:n_dev].tolist())
    return {"dev": [r for i, r in enumerate(rows) if i in dev], "test": [r for i, r in enumerate(rows) if i not in dev]}


def nq_eval_set(cfg: DictConfig, stage: RerankStage, rows: list[QARow], scorers: dict[str, Scorer]) -> EvalSet:
    candidates, stats = question_candidates(cfg.data, rows, stage.corpus, stage.retriever)
    return EvalSet(NQ, rows, candidates, scorers, stats)


def hotpotqa_eval_set(cfg: DictConfig, stage: RerankStage, settings: Settings) -> EvalSet | None:
    """HotpotQA questions with candidates retrieved from their pooled supporting paragraphs (see the
    module docstring), scored by the same systems (BM25 / bi-encoder rebuilt over that corpus)."""
    if not cfg.data.get("hotpotqa_path"):
        return None
    rows = select_questions(load_hotpotqa(cfg.data.hotpotqa_path), cfg.eval.hotpotqa_num_questions, cfg.seed)
    corpus = corpus_from_nq(rows, words_per_passage=int(cfg.data.words_per_passage))
    bm25 = BM25Retriever(corpus, cache_dir=cfg.paths.cache_dir)
    dense = DenseRetriever(corpus, cache_dir=cfg.paths.cache_dir) if (
        cfg.data.retriever == "dense" or cfg.data.bi_encoder) else None
    retriever = dense if cfg.data.retriever == "dense" else bm25
    # The NQ candidates file (data.candidates_path) does not cover HotpotQA questions: always retrieve.
    data_cfg = OmegaConf.merge(cfg.data, {"candidates_path": None})
    candidates, stats = question_candidates(data_cfg, rows, corpus, retriever)
    scorers = chosen_scorers(settings, table1_systems(cfg, candidates, corpus, bm25, dense, stage.rerankers))
    return EvalSet(HOTPOTQA, rows, candidates, scorers, {**stats, "corpus_passages": len(corpus)})


def answer_set(eval_set: EvalSet, store: AnswerStore, ks: Sequence[int],
               confidences: dict[str, float] | None = None) -> dict[str, RagRun]:
    """Closed-book and top-K RAG answers of every question under every reranker (one store for all)."""
    runs = {}
    for name, scorer in eval_set.scorers.items():
        before = store.generated
        runs[name] = run_rag(eval_set.rows, eval_set.candidates, store, ks, scorer, confidences)
        log.info("%s / %s: %d answers generated, the rest from the cache", eval_set.dataset, name,
                 store.generated - before)
    return runs


def only(outcomes: Sequence[QuestionOutcome], rows: Sequence[QARow]) -> list[QuestionOutcome]:
    qids = {row.qid for row in rows}
    return [o for o in outcomes if o.qid in qids]


# --- Table 2 ---------------------------------------------------------------------------------------

def table2(llm_name: str, runs: dict[str, dict[str, list[QuestionOutcome]]], settings: Settings, n_resamples: int,
           seed: int) -> tuple[list[dict], str]:
    keyed = {(llm_name, reranker, dataset): outcomes for dataset, by_reranker in runs.items()
             for reranker, outcomes in by_reranker.items()}
    rows = table2_rows(keyed, settings.base, settings.ks, settings.eval_metric, n_resamples, seed)
    return rows, table2_markdown(rows, settings.base, settings.ks)


def closed_book_line(runs: dict[str, dict[str, list[QuestionOutcome]]], settings: Settings, n_resamples: int,
                     seed: int) -> str:
    """The LLM alone (QA prompt) on the same questions: the floor retrieval has to beat."""
    parts = []
    for dataset, by_reranker in runs.items():
        outcomes = next(iter(by_reranker.values()))
        acc = accuracy_ci([getattr(o.closed_book, settings.eval_metric) for o in outcomes], n_resamples=n_resamples,
                          seed=seed)
        parts.append(f"{dataset} {acc.format()}")
    return f"Closed-book (QA prompt, no retrieval) {settings.eval_metric}: " + ", ".join(parts) + "."


def secondary_markdown(runs: dict[str, dict[str, list[QuestionOutcome]]], ks: Sequence[int],
                       gold_known: bool = False) -> str:
    """has_answer beside exact match and token F1 (means, %), per dataset, reranker and K; with `gold_known`
    (passages cut from the questions' own paragraphs, ids `<qid>#<n>`) also how often the question's own
    paragraph is among the K contexts."""
    header = [f"Top-{k} has_answer / EM / F1" for k in ks] + ([f"gold ¶ in Top-{k}" for k in ks] if gold_known else [])
    lines = ["| Dataset | Reranker | " + " | ".join(header) + " |", "|" + " --- |" * (2 + len(header))]
    for dataset, by_reranker in runs.items():
        for reranker, outcomes in by_reranker.items():
            cells = [" / ".join(f"{100 * np.mean([float(getattr(o.rag[k], m)) for o in outcomes]):.1f}"
                                for m in ("has_answer", "em", "f1")) for k in ks]
            if gold_known:
                cells += [f"{100 * gold_in_contexts(outcomes, k):.1f}" for k in ks]
            lines.append(f"| {dataset} | {reranker} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def gold_in_contexts(outcomes: Sequence[QuestionOutcome], k: int) -> float:
    """Share of questions whose own paragraph (a passage id `<qid>#<n>`) is among their Top-k contexts."""
    return float(np.mean([any(c.rsplit("#", 1)[0] == o.qid for c in o.rag[k].contexts) for o in outcomes]))


def plain(value: Any) -> Any:
    """Table 2 rows (Accuracy / McNemar dataclasses inside) as JSON-ready values."""
    if dataclasses.is_dataclass(value):
        return dataclasses.asdict(value)
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


# --- CBDR: the β sweep, Table 3, β choice, flips ---------------------------------------------------

@dataclass
class CBDRResults:
    grid: Any  # SweepResult on test, every β of cbdr.betas
    chosen: dict[str, Any]  # report_beta: β chosen on dev, reported on test
    at_beta: dict[str, float]  # cbdr.beta on dev and test
    table3: str
    table3_rows: list[dict[str, Any]]
    flips: list[Any]  # FlipReport
    quantiles: np.ndarray  # the dev-Conf quantiles added to the grid (empty when none)
    confidence: dict[str, list[float]]  # split -> Conf(H(Q)) min, median, max


def cbdr_results(settings: Settings, dev: SweepData, test: SweepData, base_test: SweepData) -> CBDRResults:
    """Everything about β from cached outcomes alone: no LLM call."""
    betas, quantiles = with_conf_quantiles(settings.betas, dev.confidence, settings.conf_quantiles)
    grid = sweep(test, betas)
    chosen = report_beta(dev, test, settings.k, settings.objective, settings.budget, betas)
    at_beta = {}
    for split, data in (("dev", dev), ("test", test)):
        result = sweep(data, [settings.beta], [settings.k])
        at_beta[f"{split}/accuracy_at_beta"] = float(result.accuracy[settings.k][0])
        at_beta[f"{split}/retrieval_rate_at_beta"] = float(result.retrieval_rate[0])
    entries = [(settings.base, base_test, 0.0)] if settings.base != settings.reranker else []
    entries += [(settings.reranker, test, beta) for beta in (0.0, *settings.table_betas)]
    entries.append((f"{settings.reranker}, β chosen on dev ({settings.objective})", test, chosen["beta"]))
    # Beside the configured pairs: always retrieving against the chosen β (whenever flips are counted at all).
    pairs = [*settings.flip_pairs, *([(0.0, chosen["beta"])] if chosen["beta"] > 0 else [])] \
        if settings.flip_pairs else []
    flips = [flip_analysis(test, settings.k, a, b, settings.flip_examples) for a, b in pairs]
    rows = [{"reranker": name, "beta": beta, **{k: v for k, v in sweep(data, [beta], settings.ks).rows()[0].items()
                                                 if k != "beta"}} for name, data, beta in entries]
    confidence = {split: [float(np.min(d.confidence)), float(np.median(d.confidence)), float(np.max(d.confidence))]
                  for split, d in (("dev", dev), ("test", test))}
    return CBDRResults(grid, chosen, at_beta, table3_markdown(entries, settings.ks), rows, flips, quantiles,
                       confidence)


# --- the gate on live questions ----------------------------------------------------------------------

def stage_retrieve_fn(stage: RerankStage, top_n: int) -> Callable[[str], list]:
    """question -> the stage retriever's top-N passages (repeated texts removed), as for the batch runs."""
    def retrieve(question: str) -> list:
        texts: dict[str, Any] = {}
        for index, _ in stage.retriever.search([question], top_n)[0]:
            passage = stage.corpus.passages[index]
            texts.setdefault(document_text(passage), passage)
        return list(texts.values())
    return retrieve


def make_gate(cfg: DictConfig, stage: RerankStage, llm: LoadedLLM, templates: PromptTemplates,
              beta: float | None = None) -> ConfidenceGate:
    """CBDR for one question at a time: the stage's probe, retriever and `cbdr.reranker`, at `cbdr.beta`
    (or `beta`). Refuses a probe trained on another LLM, prompt template or layer."""
    if cfg.cbdr.reranker not in stage.scorers:
        raise ValueError(f"cbdr.reranker={cfg.cbdr.reranker!r} is not a Table 1 row; rows: {list(stage.scorers)}")
    return ConfidenceGate(llm, templates, stage.probe, cfg.cbdr.beta if beta is None else beta,
                          retrieve_fn=stage_retrieve_fn(stage, int(cfg.data.top_n)),
                          rerank_fn=stage.scorers[cfg.cbdr.reranker], top_k=int(cfg.cbdr.top_k),
                          max_new_tokens=int(cfg.cbdr.max_new_tokens), batch_size=int(cfg.cbdr.batch_size),
                          progress=False)


def cbdr_gate(cfg: DictConfig, workdir: str | Path) -> ConfidenceGate:
    """The Python API on one question: `cbdr_gate(cfg, dir).answer("who ...")` -> (answer, retrieved, Conf).
    Runs the rerank stage (cheap once a run of the same experiment has filled the cache)."""
    stage = rerank_stage(cfg, Path(workdir), [])
    llm = load_llm(OmegaConf.to_container(cfg.llm, resolve=True))
    return make_gate(cfg, stage, llm, PromptTemplates(**OmegaConf.to_container(cfg.prompts, resolve=True)))


def gate_check(gate: ConfidenceGate, rows: Sequence[QARow], outcomes: Sequence[QuestionOutcome],
               k: int) -> dict[str, Any]:
    """The gate run live on `rows` against what the sweep assumes from the cached outcomes at the same β:
    its decision (from its own Conf) and its answer (closed-book or top-K RAG)."""
    if not rows:
        return {}
    by_qid = {o.qid: o for o in outcomes}
    results = gate.answer_batch([row.question for row in rows])
    records = []
    for row, result in zip(rows, results):
        cached = by_qid[row.qid]
        expect_retrieve = bool(should_retrieve(cached.confidence, gate.beta))
        expected = cached.rag[k].answer if expect_retrieve else cached.closed_book.answer
        records.append({"qid": row.qid, "confidence_live": result.confidence, "confidence_batch": cached.confidence,
                        "decision_agrees": result.retrieved == expect_retrieve, "answer_agrees": result.answer == expected})
    return {"questions": len(records), "beta": gate.beta, "k": k,
            "decisions_agree": sum(r["decision_agrees"] for r in records),
            "answers_agree": sum(r["answer_agrees"] for r in records),
            "max_confidence_difference": max(abs(r["confidence_live"] - r["confidence_batch"]) for r in records),
            "records": records}


# --- the task --------------------------------------------------------------------------------------

def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


@dataclass
class Evaluation:
    """Everything generated for the evaluation questions (the only part of the task that runs the LLM)."""

    splits: dict[str, list[QARow]]  # NQ dev / test
    sets: list[EvalSet]
    runs: dict[str, dict[str, RagRun]]  # dataset -> reranker -> outcomes
    answers: dict[str, int]  # AnswerStore counts: generated, reused
    gate_check: dict[str, Any]
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)  # wall time by part of the run

    def tables(self) -> dict[str, dict[str, list[QuestionOutcome]]]:
        """Table 2's outcomes: NQ test; HotpotQA (Table 2 only) all its sampled questions."""
        tables = {NQ: {name: only(r.outcomes, self.splits["test"]) for name, r in self.runs[NQ].items()}}
        tables.update({d: {name: r.outcomes for name, r in by.items()} for d, by in self.runs.items() if d != NQ})
        return tables

    def sweep_data(self, settings: Settings) -> tuple[SweepData, SweepData, SweepData]:
        """CBDR's reranker on dev and test, and the base reranker on test."""
        ours = self.runs[NQ][settings.reranker].outcomes
        dev, test = (SweepData.from_outcomes(only(ours, self.splits[s]), settings.metric, settings.ks)
                     for s in ("dev", "test"))
        base = SweepData.from_outcomes(only(self.runs[NQ][settings.base].outcomes, self.splits["test"]),
                                       settings.metric, settings.ks)
        return dev, test, base


def evaluate(cfg: DictConfig, settings: Settings, stage: RerankStage, out: Path) -> Evaluation:
    """Held-out questions → candidates → Conf(H(Q)) → answers under every reranker and K (cached per prompt),
    saved as outcomes; then the live gate on a few test questions."""
    eval_rows = evaluation_rows(cfg, stage.probe_data.data.rows)
    splits = split_dev_test(eval_rows, float(cfg.eval.dev_fraction), cfg.seed)
    sets = [nq_eval_set(cfg, stage, eval_rows, chosen_scorers(settings, stage.scorers))]
    hotpot = hotpotqa_eval_set(cfg, stage, settings)
    sets += [hotpot] if hotpot else []
    llm = load_llm(OmegaConf.to_container(cfg.llm, resolve=True))
    try:
        templates = PromptTemplates(**OmegaConf.to_container(cfg.prompts, resolve=True))
        store = AnswerStore(llm, templates, cfg.paths.cache_dir, max_new_tokens=int(cfg.rag.max_new_tokens),
                            batch_size=int(cfg.rag.batch_size), chunk_size=int(cfg.rag.chunk_size),
                            progress=bool(cfg.data.progress))
        confidence = question_confidences(llm, templates, stage.probe, [r.question for r in eval_rows],
                                          cfg.paths.cache_dir, batch_size=int(cfg.data.extract_batch_size),
                                          progress=bool(cfg.data.progress))
        confidences = {row.qid: float(c) for row, c in zip(eval_rows, confidence)}
        runs = {s.dataset: answer_set(s, store, settings.ks, confidences if s.dataset == NQ else None) for s in sets}
        log.info("answers: %d generated, %d from the cache", store.generated, store.reused)
        answers = {"generated": store.generated, "reused": store.reused}
        check = gate_check(make_gate(cfg, stage, llm, templates), splits["test"][:settings.gate_check_questions],
                           runs[NQ][settings.reranker].outcomes, settings.k) if settings.gate_check_questions else {}
    finally:
        del llm
        gc.collect()
    for dataset, by_reranker in runs.items():
        for name, rag_run in by_reranker.items():
            save_outcomes_jsonl(rag_run.outcomes, out / "outcomes" / slug(dataset) / f"{slug(name)}.jsonl")
    return Evaluation(splits, sets, runs, answers, check)


def run(cfg: DictConfig) -> dict[str, float]:
    from confrag.train import output_dir

    start = time.perf_counter()
    settings = check_settings(cfg)
    out = output_dir(cfg)
    run_config, loggers = task_loggers(cfg)
    stage = rerank_stage(cfg, out, loggers, run_config)
    rows1 = table1(stage.scorers, stage.preferences.splits["test"], cfg.seed)
    stage_seconds = time.perf_counter() - start
    evaluation = evaluate(cfg, settings, stage, out)
    evaluation.seconds = {"stage": stage_seconds, "answers": time.perf_counter() - start - stage_seconds}
    tables, n_resamples = evaluation.tables(), int(cfg.eval.n_resamples)
    rows2, table2_md = table2(cfg.llm.name, tables, settings, n_resamples, cfg.seed)
    results = cbdr_results(settings, *evaluation.sweep_data(settings))
    plots = write_plots(cfg, out, results, settings)
    record = run_record(settings, evaluation, rows1, rows2, results, time.perf_counter() - start)
    atomic_write_text(out / "metrics.json", json.dumps(record, indent=2, ensure_ascii=False, default=float))
    gold_known = not cfg.data.get("corpus_path") and not cfg.data.get("candidates_path")
    secondary = [closed_book_line(tables, settings, n_resamples, cfg.seed),
                 secondary_markdown(tables, settings.ks, gold_known)]
    atomic_write_text(out / "report.md", report_markdown(cfg, stage, settings, rows1, table2_md, *secondary, results,
                                                         plots, record))
    log_results(loggers, record["metrics"], rows1, rows2, results, plots)
    print(f"CBDR report: {out / 'report.md'}\n\n{table2_md}\n\n{results.table3}", flush=True)
    return record["metrics"]


def run_record(settings: Settings, evaluation: Evaluation, rows1: list[dict], rows2: list[dict],
               results: CBDRResults, seconds: float) -> dict[str, Any]:
    """metrics.json: the scalar metrics (also returned to sweepers and loggers) and every table's data."""
    chosen = results.chosen
    metrics = {**results.at_beta, "chosen/beta": chosen["beta"], "chosen/test_accuracy": chosen["test/accuracy"],
               "chosen/test_retrieval_rate": chosen["test/retrieval_rate"],
               "test/always_retrieve_accuracy": chosen["test/always_retrieve_accuracy"],
               "answers/generated": float(evaluation.answers["generated"])}
    return {
        "metrics": metrics, "table1": rows1, "table2": plain(rows2), "table3": results.table3_rows,
        "sweep": {"reranker": settings.reranker, "k": settings.k, "metric": settings.metric, "split": "test",
                  "rows": results.grid.rows()},
        "chosen_beta": chosen, "flips": [f.to_dict() for f in results.flips], "answers": evaluation.answers,
        "confidence": results.confidence, "conf_quantiles": results.quantiles.tolist(),
        "gate_check": evaluation.gate_check, "ks": list(settings.ks),
        "eval": {"dev": [r.qid for r in evaluation.splits["dev"]], "test": [r.qid for r in evaluation.splits["test"]],
                 "retrieval": {s.dataset: s.retrieval for s in evaluation.sets},
                 "capped": {d: {n: r.capped for n, r in by.items()} for d, by in evaluation.runs.items()},
                 "hotpotqa_questions": sum(len(s.rows) for s in evaluation.sets if s.dataset == HOTPOTQA)},
        "wall_seconds": seconds, "seconds": evaluation.seconds}


def write_plots(cfg: DictConfig, out: Path, results: CBDRResults, settings: Settings) -> dict[str, Path]:
    """Figure 8's range (0.90-1.00), the whole [0, 1], and (with cbdr.conf_quantiles) the probe's band."""
    title = f"{cfg.llm.name}: CBDR on NQ test (n = {results.grid.n})"  # the reranker is named in the report
    plots = {}
    if ((results.grid.betas >= CURVE_RANGE[0] - 1e-12) & (results.grid.betas <= CURVE_RANGE[1] + 1e-12)).any():
        plots["beta_curve"] = plot_beta_curve(results.grid, out / "beta_curve.png", CURVE_RANGE, title)
    plots["beta_curve_full"] = plot_beta_curve(results.grid, out / "beta_curve_full.png", (0.0, 1.0), title)
    if results.quantiles.size:  # the band of the probe's confidences, where the dev quantiles lie
        band = (max(0.0, float(results.quantiles.min()) - 0.01), min(1.0, float(results.quantiles.max()) + 0.01))
        plots["beta_curve_band"] = plot_beta_curve(results.grid, out / "beta_curve_band.png", band, title)
    return plots


# --- report and logging ----------------------------------------------------------------------------

def report_markdown(cfg: DictConfig, stage: RerankStage, settings: Settings, rows1: list[dict], table2_md: str,
                    closed_line: str, secondary_md: str, results: CBDRResults, plots: dict[str, Path],
                    record: dict[str, Any]) -> str:
    chosen, ev = results.chosen, record["eval"]
    n_pref = len(stage.preferences.splits["test"])
    capped = {f"{d} / {n}": {k: c for k, c in caps.items() if c} for d, by in ev["capped"].items()
              for n, caps in by.items() if any(caps.values())}
    budget = f", budget {chosen['budget']:.2f}" if chosen["budget"] is not None else ""
    lines = [
        f"# CBDR report — {cfg.llm.name}", "",
        f"Run folder: `{Path(cfg.paths.output_dir).name}`; wall time {record['wall_seconds']:.0f} s (probe, "
        f"preference data, rerankers and Table 1: {record['seconds']['stage']:.0f} s; evaluation answers: "
        f"{record['seconds']['answers']:.0f} s); answers generated {record['answers']['generated']}, read from "
        f"the cache {record['answers']['reused']}.", "",
        f"Evaluation questions: {len(ev['dev']) + len(ev['test'])} NQ questions not used by the probe (nor, so, by "
        f"the preference data or the rerankers): dev {len(ev['dev'])} (choosing β), test {len(ev['test'])} (the "
        f"tables). Candidates: top-{cfg.data.top_n} by {cfg.data.retriever} over the NQ paragraphs; "
        f"{retrieval_line(ev['retrieval'][NQ])}.",
        *([f"HotpotQA: {ev['hotpotqa_questions']} questions (all in Table 2), candidates from the "
           f"{ev['retrieval'][HOTPOTQA]['corpus_passages']} passages of their pooled supporting paragraphs; "
           f"{retrieval_line(ev['retrieval'][HOTPOTQA])}."] if HOTPOTQA in ev["retrieval"] else []),
        f"K larger than a question's candidates is capped to what it has: {capped or 'no question concerned'}.", "",
        stage_line(stage), "",
        "## Table 1 — reranking on the NQ_Rerank test split", "",
        markdown_table(rows1, f"{cfg.llm.name}, {n_pref} questions (P/R/MRR @K, %)"), "",
        "## Table 2 — end-to-end accuracy (has_answer unless eval.metric says otherwise)", "",
        table2_md, "", closed_line, "", "has_answer / exact match / token F1 (%), same questions; gold ¶: the question's own paragraph among the "
        "contexts (%), when the corpus is cut from the questions' paragraphs:", "", secondary_md, "",
        f"## Table 3 — CBDR on NQ test ({cfg.cbdr.metric}, {settings.reranker} retrieving when it does)", "",
        results.table3, "",
        "## β curve", "",
        f"Conf(H(Q)) min / median / max: dev {conf_summary(results.confidence['dev'])}, test "
        f"{conf_summary(results.confidence['test'])}. Grid: {len(results.grid.betas)} thresholds"
        + (f", with {results.quantiles.size} quantiles of the dev confidences" if results.quantiles.size else "")
        + ".", "",
        *[f"![{name}]({path.name})" for name, path in plots.items()], "",
        f"## β chosen on dev, reported on test (Top-{settings.k}, objective {chosen['objective']}{budget})", "",
        f"β = {chosen['beta']:g}: dev accuracy {100 * chosen['dev/accuracy']:.2f} % at retrieval rate "
        f"{100 * chosen['dev/retrieval_rate']:.2f} %; test accuracy {100 * chosen['test/accuracy']:.2f} % at "
        f"retrieval rate {100 * chosen['test/retrieval_rate']:.2f} % against {100 * chosen['test/always_retrieve_accuracy']:.2f}"
        f" % always retrieving (n = {chosen['test/n']}).",
        f"At cbdr.beta = {settings.beta:g}: test accuracy {100 * results.at_beta['test/accuracy_at_beta']:.2f} %, "
        f"retrieval rate {100 * results.at_beta['test/retrieval_rate_at_beta']:.2f} %.", "",
        "## Phase-difference analysis (appendix F), NQ test", "",
        *[flips_markdown(f) for f in results.flips],
    ]
    check = record["gate_check"]
    if check:
        lines += ["## The gate run live", "",
                  f"`ConfidenceGate` at β = {check['beta']:g}, Top-{check['k']}, on the first {check['questions']} test "
                  f"questions: {check['decisions_agree']} decisions and {check['answers_agree']} answers agree with "
                  f"the sweep's (largest |Conf live − Conf batch| = {check['max_confidence_difference']:.2e}).", ""]
    lines += ["## Config", "", "```yaml", OmegaConf.to_yaml(cfg, resolve=True).rstrip(), "```", ""]
    return "\n".join(lines)


def stage_line(stage: RerankStage) -> str:
    """What the cached stage was built from: the probe's data and test scores, NQ_Rerank's size."""
    meta, report = stage.probe.meta, stage.preferences.report
    data, metrics = meta.get("nq_confidence", {}), meta.get("metrics", {})
    scores = ", ".join(f"{k.split('/')[1]} {metrics[k]:.3f}" for k in ("test/acc", "test/auroc") if k in metrics)
    return (f"Stage: probe on layer {stage.probe.layer} from {data.get('questions', '?')} questions "
            f"(balanced examples train {data.get('train/examples', '?')} / dev {data.get('dev/examples', '?')} / "
            f"test {data.get('test/examples', '?')}; test {scores}); NQ_Rerank from {report['questions']} of its "
            f"questions: {report['rows']['train']} train / {report['rows']['test']} test rows.")


def conf_summary(values: Sequence[float]) -> str:
    return " / ".join(f"{v:.3f}" for v in values)


def retrieval_line(stats: dict[str, Any]) -> str:
    return (f"the question's gold paragraph is among them for {100 * stats['gold_retrieved']:.0f} % of questions, "
            f"a gold answer string for {100 * stats['answer_in_candidates']:.0f} %")


def log_results(loggers: list[Logger], metrics: dict[str, float], rows1: list[dict], rows2: list[dict],
                results: CBDRResults, plots: dict[str, Path]) -> None:
    for logger in loggers:
        logger.log_metrics(metrics)
        logger.save()
        if not isinstance(logger, WandbLogger):
            continue
        logger.log_table("table1", columns=list(rows1[0]), data=[list(r.values()) for r in rows1])
        flat2 = [{"llm": r["llm"], "reranker": r["reranker"], "dataset": r["dataset"], "n": r["n"],
                  **{k: r[k].value for k in r if k.startswith("top") and not k.endswith("_vs_base")}} for r in rows2]
        logger.log_table("table2", columns=list(flat2[0]), data=[list(r.values()) for r in flat2])
        logger.log_table("table3", columns=list(results.table3_rows[0]),
                         data=[list(r.values()) for r in results.table3_rows])
        sweep_rows = results.grid.rows()
        logger.log_table("beta_sweep", columns=list(sweep_rows[0]), data=[list(r.values()) for r in sweep_rows])
        for name, path in plots.items():
            logger.log_image(name, [str(path)])
