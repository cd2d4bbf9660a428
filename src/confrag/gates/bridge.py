"""BRIDGE's maximum soft-bias decision tree (Dai et al., §3.2.2), with its allocator.

Four matching scores between knowledge sources, each in [0, 1] (BRIDGE's Figure 2 pairs; the text
names S2 = internal vs generated and S3 = external vs retrieved):

    S1 = m(K_int, K_ext)   S2 = m(K_int, K_gen)   S3 = m(K_ext, K_ret)   S4 = m(K_gen, K_ret)

m is a weighted mean of a dense (MiniLM cosine) and a sparse (BM25-weighted lexical) match, standing in
for BGE-M3's dense + sparse + ColBERT scores (the paper's weights 0.4 / 0.2 / 0.4; without ColBERT the
default keeps the 0.4 : 0.2 ratio). Which texts play K_gen and K_ret here, without BRIDGE's sub-query
generator, is described at `confrag.gates.signals.bridge_matching_scores`.

The tree, with r_p the allocator's retrieval dependency and g_p = 1 - r_p:

1. Consistency: S1 + S4 > (1 - S1) + (1 - S4)                       -> FA (use all knowledge)
2. T_Ret = r_p [S3 + (1 - S2)],  T_LLM = g_p [S2 + (1 - S3)]
3. T_Ret < T_LLM:  FI if T_LLM > alpha else RA
   T_Ret >= T_LLM: FE if T_Ret >= beta, RA if T_Ret < alpha, and in between BRIDGE reflects (regenerates
   its sub-queries, up to three times, then falls back to RA); reflection is not implemented, so the
   in-between band goes straight to the paper's fallback, RA.

Strategies: FA answers from internal and external knowledge together, FI from internal knowledge only
(parametric), FE from the retrieved passages, RA refuses ("I don't know").

Allocator: a logistic-regression classifier on the question embedding, trained on the training split
to predict that internal knowledge is insufficient (closed-book answer wrong: BRIDGE's FE/RA hard bias
r_p = 100 %; right: FA/FI, r_p = 0 %), its probability clipped to BRIDGE's soft-bias range [0.1, 0.9].
BRIDGE trains a Llama3-8B allocator with GRPO (out of scope here) or prompts it with the k most similar
training questions (ICL); `allocator: none` is the paper's "w/o Allocator" ablation (r_p = g_p = 1).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from sklearn.linear_model import LogisticRegression

from confrag.data.nq import Passage
from confrag.gates.base import Decision, Gate, GateSignals, GateTrainingData
from confrag.infra import checks

STRATEGIES = ("FA", "FI", "FE", "RA")
STRATEGY_DECISION = {
    "FA": Decision.RETRIEVE,  # retrieval happens, and the internal passage joins the contexts
    "FI": Decision.PARAMETRIC,
    "FE": Decision.RETRIEVE,
    "RA": Decision.REFUSE,
}
ALLOCATORS = ("classifier", "none")


def combine_scores(matching_scores: np.ndarray, dense_weight: float, sparse_weight: float) -> np.ndarray:
    """(n, 4) S1..S4 from (n, 4, 2) dense and sparse matches, each clipped to [0, 1]."""
    scores = np.clip(np.asarray(matching_scores, dtype=np.float64), 0.0, 1.0)
    return (dense_weight * scores[..., 0] + sparse_weight * scores[..., 1]) / (dense_weight + sparse_weight)


def trust_scores(s: np.ndarray, r_p: np.ndarray, g_p: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(T_Ret, T_LLM) per question for S1..S4 `s` of shape (n, 4); `g_p` defaults to 1 - r_p."""
    s = np.asarray(s, dtype=np.float64)
    r_p = np.asarray(r_p, dtype=np.float64)
    g_p = 1.0 - r_p if g_p is None else np.asarray(g_p, dtype=np.float64)
    return r_p * (s[:, 2] + 1.0 - s[:, 1]), g_p * (s[:, 1] + 1.0 - s[:, 2])


def soft_bias_tree(
    s: np.ndarray, r_p: np.ndarray, alpha: float, beta: float, g_p: np.ndarray | None = None
) -> list[str]:
    """The strategy (FA / FI / FE / RA) per question. The "w/o Allocator" ablation passes r_p = g_p = 1."""
    s = np.asarray(s, dtype=np.float64)
    t_ret, t_llm = trust_scores(s, r_p, g_p)
    strategies = []
    for row in range(len(s)):
        if s[row, 0] + s[row, 3] > (1.0 - s[row, 0]) + (1.0 - s[row, 3]):
            strategies.append("FA")
        elif t_ret[row] < t_llm[row]:
            strategies.append("FI" if t_llm[row] > alpha else "RA")
        elif t_ret[row] >= beta:
            strategies.append("FE")
        else:  # below alpha, or the reflection band [alpha, beta) without reflection
            strategies.append("RA")
    return strategies


def answer_contexts(strategy: str, internal_passage: str, retrieved: Sequence[Passage]) -> list[Passage] | None:
    """The contexts each strategy answers with: None = refuse, [] = closed-book (QA prompt)."""
    checks.choice(strategy, "strategy", STRATEGIES)
    internal = Passage(title="", text=internal_passage)
    return {"FA": [internal, *retrieved], "FI": [], "FE": list(retrieved), "RA": None}[strategy]


class BridgeGate(Gate):
    name = "bridge"
    needs = frozenset({"matching_scores", "question_embedding"})
    # Deciding takes two LLM calls: the internal passage K_int and the closed-book answer K_gen its matching
    # reads; FI's answer is that closed-book answer (nothing more), FE/FA answer with a RAG prompt (+1).
    decision_passes = 2
    decision_is_closed_book = True
    decision_retrieves = True  # the matching scores read the retrieved passages of every question
    curve_refusal = (
        "BRIDGE's FA answers are new generations for every new decision, so its curve cannot come from cached answers"
    )

    def __init__(
        self,
        alpha: float,
        beta: float,
        dense_weight: float,
        sparse_weight: float,
        allocator: str,
        soft_bias_min: float,
        soft_bias_max: float,
        seed: int,
    ) -> None:
        # T_Ret and T_LLM lie in [0, 2]; BRIDGE grid-searches both thresholds in [0.1, 2.0].
        checks.number(alpha, "alpha", 0.0, 2.0)
        checks.number(beta, "beta", 0.0, 2.0)
        if beta < alpha:
            raise ValueError(f"beta={beta} must be >= alpha={alpha} (the retriever needs the higher trust)")
        checks.number(dense_weight, "dense_weight", 0.0)
        checks.number(sparse_weight, "sparse_weight", 0.0)
        if dense_weight + sparse_weight <= 0:
            raise ValueError("dense_weight + sparse_weight must be > 0")
        checks.choice(allocator, "allocator", ALLOCATORS)
        checks.number(soft_bias_min, "soft_bias_min", 0.0, 0.5)
        checks.number(soft_bias_max, "soft_bias_max", 0.5, 1.0)
        checks.integer(seed, "seed")
        super().__init__(
            alpha=alpha,
            beta=beta,
            dense_weight=dense_weight,
            sparse_weight=sparse_weight,
            allocator=allocator,
            soft_bias_min=soft_bias_min,
            soft_bias_max=soft_bias_max,
            seed=seed,
        )
        self.alpha, self.beta = float(alpha), float(beta)
        self.dense_weight, self.sparse_weight = float(dense_weight), float(sparse_weight)
        self.allocator = allocator
        self.soft_bias_range = (float(soft_bias_min), float(soft_bias_max))
        self.seed = seed
        self.classifier: LogisticRegression | None = None
        self._constant_r_p: float | None = None
        if allocator == "classifier":  # only the learned allocator needs training data
            self.training_needs = frozenset({"outcomes", "question_embedding"})
            self._fitted = False
        else:  # and only it reads the question
            self.needs = frozenset({"matching_scores"})

    def _fit(self, train: GateTrainingData) -> None:
        insufficient = ~train.closed_book_correct
        if insufficient.all() or not insufficient.any():
            # One class only: the hard bias is the same for every question.
            self._constant_r_p = float(insufficient[0])
            return
        self.classifier = LogisticRegression(max_iter=1000, random_state=self.seed)
        self.classifier.fit(train.signals.question_embedding, insufficient)

    def soft_bias(self, signals: GateSignals) -> tuple[np.ndarray, np.ndarray]:
        """(r_p, g_p) per question."""
        n = len(signals)
        if self.allocator == "none":
            return np.ones(n), np.ones(n)
        if self._constant_r_p is not None:
            r_p = np.full(n, self._constant_r_p)
        else:
            r_p = self.classifier.predict_proba(signals.question_embedding)[:, 1]
        r_p = np.clip(r_p, *self.soft_bias_range)
        return r_p, 1.0 - r_p

    def strategies(self, signals: GateSignals) -> list[str]:
        self._ready(signals)
        s = combine_scores(signals.matching_scores, self.dense_weight, self.sparse_weight)
        r_p, g_p = self.soft_bias(signals)
        return soft_bias_tree(s, r_p, self.alpha, self.beta, g_p=g_p)

    def _decide(self, signals: GateSignals) -> list[Decision]:
        return [STRATEGY_DECISION[s] for s in self.strategies(signals)]

    def retrieve_contexts(self, signals: GateSignals, contexts: Sequence[Any], maker: Any) -> dict[int, list[Any]]:
        """FA answers over the internal passage K_int and the retrieved contexts (`answer_contexts`); FE's
        retrieve answer is the plain top-K one."""
        full = [i for i, s in enumerate(self.strategies(signals)) if s == "FA"]
        if not full:
            return {}
        internal = maker.internal(signals.questions)
        return {i: answer_contexts("FA", internal[i], contexts[i]) for i in full}
