"""What every study of the likelihood teacher shares: its questions, their split, candidates, ℓ, vectors and folds.

A study is the first `questions` of a seeded permutation of an NQ question file (repeats dropped), the first `dev`
of them the dev questions (they choose settings and are never trained on or reported) and the rest the test
questions; BM25's top 20 over the file's gold paragraphs (100-word passages, repeats removed) are each question's
candidates; ℓ(q, c) is the LLM's mean per-token log-probability of a gold answer after the RAG prompt holding c
(`confrag.reranker.likelihood_teacher`, cached in blocks of `BLOCK` questions, so a larger study reuses every block
a smaller one computed); the base is all-MiniLM-L6-v2 scored as the bi-encoder it is (SCALE · cos). The same
arguments give the same study, so every script reading it reads the same cached blocks and answers.

Cross-fitting (`Folds`): the test questions fall into folds; a fold's students train on the other folds' test
questions only, never on dev; both asserted each time a training set is drawn.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from confrag.data.nq import QARow, default_questions_path, load_questions_jsonl
from confrag.data.splits import drop_duplicate_questions
from confrag.llm.hidden_states import HiddenStateEngine
from confrag.llm.prompted import PromptedLLM
from confrag.rag.answers import AnswerStore, score_answer
from confrag.reranker.likelihood_teacher import candidate_likelihoods
from confrag.reranker.listwise_data import ListwiseData
from confrag.retrieval import BM25Retriever, corpus_from_gold_paragraphs, retrieve_candidates
from confrag.retrieval.candidates import Candidates, without_duplicates
from confrag.retrieval.corpus import Corpus, document_text
from confrag.retrieval.dense import MeanPoolEncoder

TOP_N = 20  # BM25 candidates a question
BLOCK = 50  # questions per cached ℓ artifact: keep it fixed, or the blocks computed before are not found again
MAX_NEW_TOKENS = 24  # the greedy answer's length under a Top-1 passage


@dataclass(frozen=True)
class Study:
    """The questions of a study and what each reads: the LLM with its prompts, BM25's candidates over `corpus`."""

    prompted: PromptedLLM
    picked: list[QARow]  # the questions, dev first, in the permutation's order
    candidate_sets: list[Candidates]  # aligned with picked
    dev_ids: frozenset[str]
    test_ids: frozenset[str]
    seed: int
    corpus: Corpus
    rows: list[QARow]  # every question of the file (repeats dropped): the corpus's and the outside questions' source

    @property
    def dev_at(self) -> list[int]:
        return [i for i, c in enumerate(self.candidate_sets) if c.qid in self.dev_ids]

    @property
    def test_at(self) -> list[int]:
        return [i for i, c in enumerate(self.candidate_sets) if c.qid in self.test_ids]

    def outside(self) -> list[QARow]:
        """The file's questions this study never draws (neither dev nor test): questions for a check it never read."""
        drawn = {r.qid for r in self.picked}
        return [r for r in self.rows if r.qid not in drawn]


def load_study(
    prompted: PromptedLLM, questions: int, dev: int, seed: int, cache: str | Path, questions_path=None
) -> Study:
    """The first `questions` of a seeded permutation of the question file (repeats dropped), the first `dev` of
    them the dev questions; BM25's top `TOP_N` of each, repeats removed."""
    rows = drop_duplicate_questions(load_questions_jsonl(questions_path or default_questions_path()))
    if not 0 < dev < questions <= len(rows):
        raise ValueError(f"a study needs 0 < dev < questions <= {len(rows)} (the file's questions); got dev={dev}, "
                         f"questions={questions}")  # fmt: skip
    corpus = corpus_from_gold_paragraphs(rows)
    order = np.random.default_rng(seed).permutation(len(rows))[:questions]
    picked = [rows[i] for i in order]
    dev_ids, test_ids = frozenset(r.qid for r in picked[:dev]), frozenset(r.qid for r in picked[dev:])
    assert not dev_ids & test_ids, "dev and test questions overlap"
    candidate_sets = candidates_for(picked, corpus, cache)
    return Study(prompted, picked, candidate_sets, dev_ids, test_ids, seed, corpus, rows)


def candidates_for(rows: Sequence[QARow], corpus: Corpus, cache: str | Path) -> list[Candidates]:
    """BM25's top `TOP_N` passages of `corpus` for each row, repeats removed."""
    retriever = BM25Retriever(corpus, cache_dir=cache)
    return [without_duplicates(c)[0] for c in retrieve_candidates(rows, corpus, retriever, TOP_N)]


def likelihoods(study: Study, cache: str | Path, block: int = BLOCK) -> list[np.ndarray]:
    """ℓ per question, block by block through the cache (computed where a block is missing)."""
    llm = study.prompted.llm
    engine = HiddenStateEngine(llm.model, llm.tokenizer, progress=False)
    out: list[np.ndarray] = []
    for b in range(0, len(study.candidate_sets), block):
        chunk = study.candidate_sets[b : b + block]
        out += candidate_likelihoods(study.prompted, chunk, engine=engine, cache_dir=cache, progress=False).per_question
    return out


def listwise_data(candidate_sets: Sequence[Candidates], cache: str | Path) -> ListwiseData:
    """The base's vectors of every question and candidate (cached), with the candidates' texts."""
    encoder = MeanPoolEncoder(device="cpu")
    queries = encoder.encode_cached([c.question for c in candidate_sets], cache)
    texts = [[document_text(p) for p in c.passages] for c in candidate_sets]
    flat = encoder.encode_cached([t for per in texts for t in per], cache)
    bounds = np.cumsum([0] + [len(t) for t in texts])
    passages = [flat[a:b] for a, b in zip(bounds, bounds[1:])]
    return ListwiseData.from_lists([c.question for c in candidate_sets], queries, passages, passage_texts=texts)


class Outcomes:
    """Top-1 answers of chosen candidates, through the answer cache (a pick already answered is read back)."""

    def __init__(self, prompted: PromptedLLM, candidate_sets: Sequence[Candidates], cache: str | Path) -> None:
        self.sets = candidate_sets
        self.store = AnswerStore(prompted, cache, max_new_tokens=MAX_NEW_TOKENS, progress=False)

    def __call__(self, at: list[int], picks: list[int]) -> list:
        items = [(self.sets[i].question, [self.sets[i].passages[j]]) for i, j in zip(at, picks)]
        return [score_answer(a, self.sets[i].answers) for a, i in zip(self.store.answer(items), at)]


@dataclass(frozen=True)
class Folds:
    """The study's test questions (positions in `candidate_sets`) in cross-fitted folds."""

    study: Study
    folds: list[list[int]]

    @classmethod
    def of(cls, study: Study, n_folds: int) -> Folds:
        test_at = study.test_at
        fold_of = np.random.default_rng(study.seed + 1).permutation(len(test_at)) % n_folds
        return cls(study, [[test_at[j] for j in np.flatnonzero(fold_of == k)] for k in range(n_folds)])

    def training(self, k: int, at_most: int | None = None) -> list[int]:
        """Fold k's students' training questions: every other fold's (a seeded subset of `at_most` of them for
        a learning curve), asserted disjoint from fold k and from the dev questions."""
        sets = self.study.candidate_sets
        rows = [i for f, fold in enumerate(self.folds) if f != k for i in fold]
        if at_most is not None and at_most < len(rows):
            rng = np.random.default_rng(self.study.seed + 2 + k)
            rows = sorted(rng.choice(rows, at_most, replace=False).tolist())
        held = {sets[i].qid for i in self.folds[k]}
        assert not held & {sets[i].qid for i in rows}, "a fold's students saw its questions"
        assert not self.study.dev_ids & {sets[i].qid for i in rows}, "dev questions in training"
        return rows


def zscore(x: np.ndarray) -> np.ndarray:
    return (x - x.mean()) / (x.std() + 1e-9)


def likelihood_choices(base: np.ndarray, ell: np.ndarray, w: float) -> dict[str, int]:
    """The rows that read ℓ without training, one question's Top-1 candidate index each: BM25's first, the base's
    top-1, ℓ's own top-1, the base's top 3 reordered by ℓ, and the fusion z(base) + w·z(ℓ)."""
    top3 = np.argsort(-base, kind="stable")[:3]
    return {
        "bm25": 0,
        "base": int(np.argmax(base)),
        "likelihood": int(np.argmax(ell)),
        "base_top3_by_likelihood": int(top3[np.argmax(ell[top3])]),
        "fusion": int(np.argmax(zscore(base) + w * zscore(ell))),
    }


def utility_labels(outcomes: Outcomes, base: np.ndarray, depth: int, log=None) -> list[np.ndarray]:
    """The `utility` teacher's labels: per question, 1 where the LLM's greedy answer under the candidate alone is
    right (has_answer), 0 where wrong, -1 where not asked (below the base's top `depth`). Generated rank by rank
    over all questions (every question's base top-1 first, then every top-2, ...), so a run stopped early leaves a
    complete shallower depth, and the answer cache is shared with every other row. Two processes asking at once
    split the chunks between them (`AnswerStore`), so one per core uses both."""
    sets = outcomes.sets
    order = [np.argsort(-base[i][: len(c.passages)], kind="stable") for i, c in enumerate(sets)]
    labels = [np.full(len(c.passages), -1, dtype=np.int8) for c in sets]
    for rank in range(depth):
        at = [i for i, c in enumerate(sets) if rank < len(c.passages)]
        picks = [int(order[i][rank]) for i in at]
        for i, j, o in zip(at, picks, outcomes(at, picks)):
            labels[i][j] = int(o.has_answer)
        if log is not None:
            log.info("utility labels: depth %d of %d answered (%d generated so far)", rank + 1, depth,
                     outcomes.store.generated)  # fmt: skip
    return labels


def top1(scores: np.ndarray, at: list[int]) -> list[int]:
    return [int(np.argmax(scores[i])) for i in at]


def earlier_run(folder: str | Path, qids: list[str]) -> dict:
    """An earlier run's picks, choices and diagnostics (its picks.json and metrics.json), refused unless it read the
    same test questions in the same order."""
    picks = json.loads((Path(folder) / "picks.json").read_text())
    metrics = json.loads((Path(folder) / "metrics.json").read_text())
    if picks["qids"] != qids:
        raise ValueError(f"--picks-from {folder}: its test questions are not this study's (other --questions/--seed?)")
    return {"picks": picks["picks"], "chosen": metrics["chosen"], "dev": metrics["dev"]}
