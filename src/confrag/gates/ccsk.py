"""CCSK (Lu, Lv & Chen): Siamese query similarity + response-quality model, fused by attention.

Three modules, as in the paper (§3.2-3.4), each producing an "IR needed" score in [0, 1]:

- **SN** (Eq. 1-2): cosine similarity between the question's embedding and the training questions';
  F_SN = mean label of the top-k most similar (label: retrieval helped). When even the best similarity
  is below `novelty_threshold` the question is new and F_SN = 1 (default to retrieve).
- **RQM** (Eq. 3-4): LightGBM regression from the closed-book response's features: length L (word
  tokens), vocabulary richness E = unique / L, the response embedding, and the response-question cosine.
  Target Y = w1 ROUGE-1 + w2 cos(response, best answer), and Y = 0 when ROUGE-1 = 0. ROUGE-1 is the
  unigram F1 on SQuAD-normalized tokens (qa_metrics.token_f1, best over the gold answers); the "best
  answer" for the cosine is the first gold answer. F_RQM = 1 - Y.
- **Fusion** (Eq. 5-6): J = MultiHead(q, r, r) over the pooled question and response embeddings,
  P = ReLU(W_c [q ; r ; J ; F] + b_c), g_a = sigmoid(W_a P), g_w = softmax(W_w P), g = g_a*g_w / sum.
  With one pooled vector per side (the paper's 2306 = 3 x 768 + 2 inputs) the attention has a single
  key, so J is a learned map of r, exactly as Eq. 5 reads. Trained with binary cross-entropy of g.F
  against "retrieval helped", on out-of-fold F (SN leaves the question itself out, RQM is cross-fitted),
  so it does not learn to trust in-sample predictions.

The decision (Eq. 7, read with its explanation in §3.4): when the fused output is trusted, max(g) >
thresholds.conf, retrieve iff g.F > thresholds.pred; otherwise take the module with the larger distribution weight
g_w and retrieve iff its F > thresholds.single. Note that g is normalized over two modules, so max(g) >= 0.5:
any thresholds.conf below 0.5 (the paper's best is 0.3) always trusts the fused output.

The gate's options travel in three groups, one typed object each (`thresholds`, `rqm`, `fusion`), as its YAML node
(conf/gate/ccsk.yaml) holds them.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

import lightgbm as lgb
import numpy as np
import torch
from sklearn.model_selection import KFold, train_test_split
from torch import nn

from confrag.data.qa_metrics import token_f1
from confrag.gates.base import Decision, Gate, GateSignals, GateTrainingData
from confrag.gates.skr import knn_vote, unit_rows
from confrag.infra import checks

_WORD = re.compile(r"\w+")
T = TypeVar("T")


# ------------------------------------------------------------------ SN


def siamese_scores(
    query: np.ndarray, history: np.ndarray, labels: np.ndarray, k: int, novelty_threshold: float
) -> np.ndarray:
    """F_SN per query (Eq. 2), 1 for queries whose best similarity is below `novelty_threshold`."""
    fractions, best = knn_vote(query, history, labels, k)
    return np.where(best < novelty_threshold, 1.0, fractions)


def leave_one_out_siamese(embeddings: np.ndarray, labels: np.ndarray, k: int, novelty_threshold: float) -> np.ndarray:
    """F_SN of each training question against all the others (its own label would leak otherwise)."""
    out = np.empty(len(embeddings))
    for i in range(len(embeddings)):
        others = np.arange(len(embeddings)) != i
        out[i] = siamese_scores(embeddings[i : i + 1], embeddings[others], labels[others], k, novelty_threshold)[0]
    return out


# ------------------------------------------------------------------ RQM


def response_features(
    responses: Sequence[str], response_embedding: np.ndarray, question_embedding: np.ndarray
) -> np.ndarray:
    """Eq. 3: [L, E, C(r, q), phi(r)] per response."""
    lengths, richness = [], []
    for response in responses:
        words = _WORD.findall(response.lower())
        lengths.append(len(words))
        richness.append(len(set(words)) / len(words) if words else 0.0)
    r, q = unit_rows(response_embedding), unit_rows(question_embedding)
    cosine = np.sum(r * q, axis=1)
    return np.column_stack([lengths, richness, cosine, r])


def rqm_targets(
    responses: Sequence[str],
    answers: Sequence[Sequence[str]],
    response_embedding: np.ndarray,
    answer_embedding: np.ndarray,
    rouge_weight: float,
    cosine_weight: float,
) -> np.ndarray:
    """Y_RQM = W^T [ROUGE-1; CS(r, R)] with weights normalized to sum 1, and 0 when ROUGE-1 is 0."""
    rouge = np.array([token_f1(response, list(gold)) for response, gold in zip(responses, answers)])
    cosine = np.clip(np.sum(unit_rows(response_embedding) * unit_rows(answer_embedding), axis=1), 0.0, 1.0)
    total = rouge_weight + cosine_weight
    return np.where(rouge > 0, (rouge_weight * rouge + cosine_weight * cosine) / total, 0.0)


# ------------------------------------------------------------------ fusion


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """The fusion module is tiny: with several threads on a busy CPU each step waits on the others
    (measured 80x slower on 2 shared cores), so it runs on one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class FusionModule(nn.Module):
    """Eq. 5-6: returns (g, g_w) for pooled question/response embeddings and the two module scores."""

    def __init__(self, dim: int, heads: int, hidden: int, dropout: float) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(dim, heads, dropout=dropout, batch_first=True)
        self.combine = nn.Sequential(nn.Linear(3 * dim + 2, hidden), nn.ReLU(), nn.Dropout(dropout))
        self.confidence = nn.Linear(hidden, 2)
        self.distribution = nn.Linear(hidden, 2)

    def forward(self, q: torch.Tensor, r: torch.Tensor, f: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        joint, _ = self.attention(q[:, None], r[:, None], r[:, None], need_weights=False)
        p = self.combine(torch.cat([q, r, joint[:, 0], f], dim=1))
        g_a = torch.sigmoid(self.confidence(p))
        g_w = torch.softmax(self.distribution(p), dim=1)
        g = g_a * g_w
        return g / g.sum(dim=1, keepdim=True).clamp_min(1e-12), g_w


def ccsk_rule(
    f: np.ndarray, g: np.ndarray, g_w: np.ndarray, tau_pred: float, tau_conf: float, tau_single: float
) -> np.ndarray:
    """Eq. 7 per question (True = retrieve). Columns of f, g, g_w: (SN, RQM). A tie in g_w picks SN."""
    f, g, g_w = (np.asarray(x, dtype=np.float64) for x in (f, g, g_w))
    trusted = g.max(axis=1) > tau_conf
    fused = np.sum(g * f, axis=1) > tau_pred
    single = f[np.arange(len(f)), g_w.argmax(axis=1)] > tau_single
    return np.where(trusted, fused, single)


# ------------------------------------------------------------------ gate


@dataclass(frozen=True)
class CCSKThresholds:
    """Eq. 7's thresholds, each in [0, 1] (`thresholds`): when max(g) > `conf` the fused output is trusted and the
    gate retrieves iff g·F > `pred`; otherwise iff the F of the module with the larger weight g_w is > `single`."""

    pred: float
    conf: float
    single: float

    @classmethod
    def of(cls, values: Any, key: str = "thresholds") -> CCSKThresholds:
        options = _of(cls, values, key)
        for name in ("pred", "conf", "single"):
            checks.number(getattr(options, name), f"{key}.{name}", 0.0, 1.0)
        return options


@dataclass(frozen=True)
class RQMOptions:
    """The response-quality model (`rqm`): its target's weights (w1 ROUGE-1 + w2 cosine) and its LightGBM."""

    rouge_weight: float
    cosine_weight: float
    learning_rate: float
    num_leaves: int
    max_rounds: int
    early_stopping: int  # rounds without improvement on the hold-out before training stops

    @classmethod
    def of(cls, values: Any, key: str = "rqm") -> RQMOptions:
        options = _of(cls, values, key)
        checks.number(options.rouge_weight, f"{key}.rouge_weight", 0.0)
        checks.number(options.cosine_weight, f"{key}.cosine_weight", 0.0)
        if options.rouge_weight + options.cosine_weight <= 0:
            raise ValueError(f"{key}.rouge_weight + {key}.cosine_weight must be > 0")
        checks.number(options.learning_rate, f"{key}.learning_rate", 1e-6, 1.0)
        checks.integer(options.num_leaves, f"{key}.num_leaves", 2)
        checks.positive_int(options.max_rounds, f"{key}.max_rounds")
        checks.positive_int(options.early_stopping, f"{key}.early_stopping")
        return options


@dataclass(frozen=True)
class FusionOptions:
    """The attention fusion module (`fusion`, Eq. 5-6) and its training."""

    heads: int  # must divide the embedding width
    hidden: int
    dropout: float
    epochs: int
    lr: float

    @classmethod
    def of(cls, values: Any, key: str = "fusion") -> FusionOptions:
        options = _of(cls, values, key)
        checks.positive_int(options.heads, f"{key}.heads")
        checks.positive_int(options.hidden, f"{key}.hidden")
        checks.number(options.dropout, f"{key}.dropout", 0.0, 0.99)
        checks.positive_int(options.epochs, f"{key}.epochs")
        checks.number(options.lr, f"{key}.lr", 1e-8, 1.0)
        return options


def _of(cls: type[T], values: Any, key: str) -> T:
    return values if isinstance(values, cls) else checks.dataclass_from(cls, values, key)


class CCSKGate(Gate):
    name = "ccsk"
    needs = frozenset({"question_embedding", "responses", "response_embedding"})
    training_needs = frozenset(
        {"outcomes", "question_embedding", "responses", "response_embedding", "answers", "answer_embedding"}
    )
    decision_passes = 1  # the response r is the closed-book answer
    decision_is_closed_book = True

    def __init__(
        self,
        k: int,
        novelty_threshold: float,
        thresholds: CCSKThresholds | dict[str, Any],
        rqm: RQMOptions | dict[str, Any],
        fusion: FusionOptions | dict[str, Any],
        folds: int,
        seed: int,
    ) -> None:
        """SN's `k` nearest training questions and its `novelty_threshold` (below this best cosine the question is
        new: F_SN = 1), Eq. 7's `thresholds`, the `rqm` and `fusion` modules, the cross-fitting `folds` of the RQM
        scores the fusion trains on, and the `seed` of both."""
        checks.positive_int(k, "k")
        checks.number(novelty_threshold, "novelty_threshold", -1.0, 1.0)
        self.thresholds = CCSKThresholds.of(thresholds)
        self.rqm_options = RQMOptions.of(rqm)
        self.fusion_options = FusionOptions.of(fusion)
        checks.integer(folds, "folds", 2)
        checks.integer(seed, "seed")
        self.k, self.novelty_threshold, self.folds, self.seed = k, novelty_threshold, folds, seed
        groups = {"thresholds": self.thresholds, "rqm": self.rqm_options, "fusion": self.fusion_options}
        super().__init__(
            k=k,
            novelty_threshold=novelty_threshold,
            **{n: asdict(g) for n, g in groups.items()},
            folds=folds,
            seed=seed,
        )
        self._history: np.ndarray | None = None
        self._labels: np.ndarray | None = None
        self.rqm: lgb.Booster | None = None
        self.fusion: FusionModule | None = None

    # --- RQM ---------------------------------------------------------------------------------
    def _train_rqm(self, x: np.ndarray, y: np.ndarray, rounds: int, valid: tuple | None = None) -> lgb.Booster:
        params = {
            "objective": "regression",
            "learning_rate": self.rqm_options.learning_rate,
            "num_leaves": self.rqm_options.num_leaves,
            "seed": self.seed,
            "deterministic": True,
            "num_threads": 1,
            "verbosity": -1,
        }
        if valid is None:
            return lgb.train(params, lgb.Dataset(x, y), num_boost_round=rounds)
        return lgb.train(
            params,
            lgb.Dataset(x, y),
            num_boost_round=rounds,
            valid_sets=[lgb.Dataset(*valid)],
            callbacks=[lgb.early_stopping(self.rqm_options.early_stopping, verbose=False)],
        )

    def _fit_rqm(self, x: np.ndarray, y: np.ndarray) -> int:
        """Fit the RQM with early stopping on a seeded 20 % hold-out; returns the rounds kept."""
        if len(y) < 10:  # too few to hold any out: all rounds, no early stopping
            self.rqm = self._train_rqm(x, y, self.rqm_options.max_rounds)
            return self.rqm_options.max_rounds
        x_fit, x_val, y_fit, y_val = train_test_split(x, y, test_size=0.2, random_state=self.seed)
        self.rqm = self._train_rqm(x_fit, y_fit, self.rqm_options.max_rounds, valid=(x_val, y_val))
        return max(1, self.rqm.best_iteration or self.rqm_options.max_rounds)

    def _out_of_fold_rqm(self, x: np.ndarray, y: np.ndarray, rounds: int) -> np.ndarray:
        out = np.empty(len(y))
        folds = KFold(n_splits=min(self.folds, len(y)), shuffle=True, random_state=self.seed)
        for fit_rows, held_rows in folds.split(x):
            out[held_rows] = self._train_rqm(x[fit_rows], y[fit_rows], rounds).predict(x[held_rows])
        return 1.0 - np.clip(out, 0.0, 1.0)

    def rqm_scores(self, signals: GateSignals) -> np.ndarray:
        """F_RQM = 1 - predicted response quality."""
        x = response_features(signals.responses, signals.response_embedding, signals.question_embedding)
        return 1.0 - np.clip(self.rqm.predict(x), 0.0, 1.0)

    # --- fusion ------------------------------------------------------------------------------
    def _train_fusion(self, q: np.ndarray, r: np.ndarray, f: np.ndarray, y: np.ndarray) -> None:
        dim = q.shape[1]
        if dim % self.fusion_options.heads:
            raise ValueError(f"heads={self.fusion_options.heads} must divide the embedding width {dim}")
        with _one_thread(), torch.random.fork_rng(devices=[]):  # seeded, without touching the caller's RNG
            torch.manual_seed(self.seed)
            module = FusionModule(
                dim, self.fusion_options.heads, self.fusion_options.hidden, self.fusion_options.dropout
            )
            optimizer = torch.optim.Adam(module.parameters(), lr=self.fusion_options.lr)
            tq, tr, tf = (torch.as_tensor(a, dtype=torch.float32) for a in (q, r, f))
            ty = torch.as_tensor(y, dtype=torch.float32)
            module.train()
            for _ in range(self.fusion_options.epochs):
                g, _ = module(tq, tr, tf)
                prediction = (g * tf).sum(dim=1).clamp(1e-6, 1 - 1e-6)
                loss = nn.functional.binary_cross_entropy(prediction, ty)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
        self.fusion = module.eval()

    def fusion_weights(self, signals: GateSignals, f: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        with _one_thread(), torch.inference_mode():
            g, g_w = self.fusion(
                *(
                    torch.as_tensor(a, dtype=torch.float32)
                    for a in (unit_rows(signals.question_embedding), unit_rows(signals.response_embedding), f)
                )
            )
        return g.numpy().astype(np.float64), g_w.numpy().astype(np.float64)

    # --- gate --------------------------------------------------------------------------------
    def _fit(self, train: GateTrainingData) -> None:
        signals = train.signals
        if len(signals) < 2:
            raise ValueError(f"gate 'ccsk' needs at least 2 training questions; got {len(signals)}")
        labels = train.retrieval_helped
        q = unit_rows(signals.question_embedding)
        self._history, self._labels = q, labels
        x = response_features(signals.responses, signals.response_embedding, q)
        y = rqm_targets(
            signals.responses,
            train.answers,
            signals.response_embedding,
            train.answer_embedding,
            self.rqm_options.rouge_weight,
            self.rqm_options.cosine_weight,
        )
        rounds = self._fit_rqm(x, y)
        f = np.column_stack(
            [leave_one_out_siamese(q, labels, self.k, self.novelty_threshold), self._out_of_fold_rqm(x, y, rounds)]
        )
        self._train_fusion(q, unit_rows(signals.response_embedding), f, labels.astype(np.float64))

    def module_scores(self, signals: GateSignals) -> np.ndarray:
        """(n, 2): F_SN and F_RQM."""
        sn = siamese_scores(signals.question_embedding, self._history, self._labels, self.k, self.novelty_threshold)
        return np.column_stack([sn, self.rqm_scores(signals)])

    def _decide(self, signals: GateSignals) -> list[Decision]:
        f = self.module_scores(signals)
        g, g_w = self.fusion_weights(signals, f)
        retrieve = ccsk_rule(f, g, g_w, self.thresholds.pred, self.thresholds.conf, self.thresholds.single)
        return [Decision.RETRIEVE if r else Decision.PARAMETRIC for r in retrieve]
