"""CBDR inference (Algorithm 1 of the ICLR submission): answer from parametric knowledge when the probe
is confident, else retrieve, rerank and answer with the RAG prompt.

The decision rule, used here and by the β sweep (`should_retrieve`):

- β = 0 means CBDR off: always retrieve (the papers' Table 3 lists β = 0 with a retrieval rate of 100 %);
- β > 0: retrieve iff Conf(H(Q)) < β, i.e. skip retrieval when Conf(H(Q)) ≥ β.

One forward pass serves both the decision and the closed-book answer. The gate starts the greedy
generation of the QA prompt with `model.generate` (the same call and settings as `generate_greedy`,
so the generation config's own processors, e.g. a repetition penalty, apply identically); a forward
hook keeps the probe layer's state at the last prompt token during the prefill, and a stopping
criterion, called once the prefill has produced the first token, computes Conf(H(Q)). Confident:
generation simply goes on from the prefill's KV cache (no second prefill), and the answer equals
`generate_greedy` on the QA prompt. Not confident: generation stops there, and the question goes to
`retrieve_fn` → `rerank_fn` → top-K → RAG prompt → `generate_greedy`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm
from transformers import StoppingCriteria, StoppingCriteriaList

from confrag.data.qa_metrics import exact_match, has_answer, token_f1
from confrag.infra import checks
from confrag.llm.batching import check_batch_size
from confrag.llm.generation import generate_greedy
from confrag.llm.prompted import PromptedLLM
from confrag.llm.prompts import encode_prompts
from confrag.probe.module import SavedProbe
from confrag.rag.pipeline import Reranker, rank_contexts

log = logging.getLogger(__name__)

Retriever = Callable[[str], Sequence[Any]]  # question -> candidate contexts (objects with .title and .text)


class GateAnswer(NamedTuple):
    answer: str
    retrieved: bool
    confidence: float


def check_beta(beta: float, key: str = "beta") -> float:
    hint = "(0 = CBDR off, always retrieve; retrieve iff Conf < beta otherwise)"
    return float(checks.probability(beta, key, numpy=True, hint=hint))


def should_retrieve(confidence: Any, beta: Any) -> np.ndarray:
    """The CBDR rule, broadcast over numpy arrays: β = 0 always retrieves, else retrieve iff Conf < β."""
    confidence, beta = np.asarray(confidence, dtype=np.float64), np.asarray(beta, dtype=np.float64)
    return (beta == 0.0) | (confidence < beta)


def check_probe(prompted: PromptedLLM, probe: SavedProbe, layer: int | None = None) -> None:
    """Refuse a probe trained on another model, prompt template or layer (`layer`, when given, is the
    layer the caller means to read; None = the probe's own), or one of the wrong width."""
    llm = prompted.llm
    probe.check(llm.identity, prompted.prompts_identity, probe.layer if layer is None else layer)
    if not 0 <= probe.layer <= llm.num_layers:
        raise ValueError(f"probe layer {probe.layer} is outside 0..{llm.num_layers} of {llm.identity['name']}")
    width, hidden = probe.input_dim, int(llm.model.config.hidden_size)
    if width != hidden:
        raise ValueError(f"probe input_dim {width} differs from the hidden size {hidden} of {llm.identity['name']}")


def layer_module(model: nn.Module, layer: int) -> nn.Module:
    """The module whose output is `hidden_states[layer]` (0 = embeddings, num_layers = final norm)."""
    base = model.base_model
    if layer == 0:
        return base.get_input_embeddings()
    return base.norm if layer == int(model.config.num_hidden_layers) else base.layers[layer - 1]


class _GateOnFirstToken(StoppingCriteria):
    """Reads the probe layer's last-prompt-token state during the prefill and, once the first token is out,
    stops the generation iff the question should be retrieved for."""

    def __init__(self, module: nn.Module, score: Callable[[torch.Tensor], float], beta: float) -> None:
        self.state: torch.Tensor | None = None
        self.confidence: float | None = None
        self.score, self.beta = score, beta
        self.handle = module.register_forward_hook(self._keep)

    def _keep(self, _module, _inputs, output) -> None:
        if self.state is None:  # the prefill: batch of one, no padding, so the last prompt token is -1
            hidden = output[0] if isinstance(output, tuple) else output
            self.state = hidden[0, -1].detach()

    def decide(self) -> bool:
        """True when the question goes to retrieval; computed once."""
        if self.confidence is None:
            self.handle.remove()
            self.confidence = self.score(self.state)
        return bool(should_retrieve(self.confidence, self.beta))

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        return torch.full((input_ids.shape[0],), self.decide(), dtype=torch.bool, device=input_ids.device)

    def close(self) -> None:
        self.handle.remove()


class ConfidenceGate:
    """CBDR for one LLM, its probe and a retrieval stack: the live pipeline that runs the LLM on a question.
    (`confrag.gates.CBDRGate` applies the same rule, `should_retrieve`, to signals computed beforehand, for
    the comparison of gates; this class computes the signal itself and answers.)

    retrieve_fn(question) -> candidate contexts (objects with .title and .text), best first;
    rerank_fn(question, passage_texts) -> one score per passage (higher first), or None for the
    retriever's order. `top_k` larger than the candidates a question gets is capped (logged). `layer`,
    when given, must be the probe's layer (a probe is refused on states of any other layer).
    `last_state` holds H(Q) of the latest question (float32 numpy), for inspection."""

    # wide: the live pipeline's public constructor, called by keyword as a transformers pipeline is: the
    # model side (prompted, probe, layer), the rule (beta), the retrieval stack (retrieve_fn, rerank_fn, top_k)
    # and generation sizes are independent, and all but the first four are defaulted.
    def __init__(
        self,
        prompted: PromptedLLM,
        probe: SavedProbe,
        beta: float,
        retrieve_fn: Retriever,
        rerank_fn: Reranker | None = None,
        top_k: int = 3,
        max_new_tokens: int = 32,
        batch_size: int = 8,
        layer: int | None = None,
        progress: bool = True,
    ) -> None:
        check_probe(prompted, probe, layer)
        for key, value in (("top_k", top_k), ("max_new_tokens", max_new_tokens)):
            checks.positive_int(value, key)
        check_batch_size(batch_size, "batch_size")  # or "auto", as generate_greedy takes it
        self.prompted, self.llm, self.probe = prompted, prompted.llm, probe
        self.beta = check_beta(beta)
        self.retrieve_fn, self.rerank_fn = retrieve_fn, rerank_fn
        self.top_k, self.max_new_tokens, self.batch_size, self.progress = top_k, max_new_tokens, batch_size, progress
        self._module = layer_module(self.llm.model, probe.layer)
        self.last_state: np.ndarray | None = None

    # --- the two paths ----------------------------------------------------------------------------
    def _confidence(self, state: torch.Tensor) -> float:
        self.last_state = state.float().cpu().numpy()
        return float(self.probe.confidence(self.last_state)[0])

    @torch.inference_mode()
    def closed_book_or_defer(self, question: str) -> tuple[str | None, float]:
        """(closed-book answer, Conf) when confident, else (None, Conf): one prefill of the QA prompt."""
        tokenizer, model = self.llm.tokenizer, self.llm.model
        ids = encode_prompts(tokenizer, [self.prompted.qa_prompt(question)])[0]
        input_ids = torch.tensor([ids], device=self.llm.device)
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        gate = _GateOnFirstToken(self._module, self._confidence, self.beta)
        try:
            output = model.generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=self.max_new_tokens,
                do_sample=False,
                num_beams=1,
                pad_token_id=pad_id,
                stopping_criteria=StoppingCriteriaList([gate]),
            )
            retrieve = gate.decide()  # also when generation ended before asking (EOS first)
        finally:
            gate.close()
        if retrieve:
            return None, gate.confidence
        return tokenizer.decode(output[0, len(ids) :], skip_special_tokens=True).strip(), gate.confidence

    def rag_prompt(self, question: str) -> str:
        """Retrieve, rerank, keep the top K, and render the RAG prompt."""
        contexts = list(self.retrieve_fn(question))
        if not contexts:
            raise ValueError(f"retrieval returned no context for question {question!r}; the RAG path needs one")
        if len(contexts) < self.top_k:
            log.warning(
                "top_k=%d but only %d contexts were retrieved for %r; using them all",
                self.top_k,
                len(contexts),
                question,
            )
        order = rank_contexts(question, contexts, self.rerank_fn)
        return self.prompted.rag_prompt(question, [contexts[i] for i in order[: self.top_k]])

    def _generate(self, prompts: list[str]) -> list[str]:
        return generate_greedy(
            self.llm.model,
            self.llm.tokenizer,
            prompts,
            self.max_new_tokens,
            self.batch_size,
            desc="RAG answers",
            progress=False,
        )

    # --- public API -------------------------------------------------------------------------------
    def answer(self, question: str) -> GateAnswer:
        """(answer, retrieved, Conf(H(Q))) for one question."""
        answer, confidence = self.closed_book_or_defer(question)
        if answer is not None:
            return GateAnswer(answer, False, confidence)
        return GateAnswer(self._generate([self.rag_prompt(question)])[0], True, confidence)

    def answer_batch(self, questions: Sequence[str]) -> list[GateAnswer]:
        """`answer` for many questions; the RAG answers are generated in left-padded batches afterwards
        (batching can move float rounding, so in rare near-ties an answer may differ from `answer`'s)."""
        decided = [self.closed_book_or_defer(q) for q in tqdm(questions, desc="CBDR gate", disable=not self.progress)]
        deferred = [i for i, (answer, _) in enumerate(decided) if answer is None]
        rag_answers = dict(zip(deferred, self._generate([self.rag_prompt(questions[i]) for i in deferred])))
        return [
            GateAnswer(rag_answers[i], True, conf) if answer is None else GateAnswer(answer, False, conf)
            for i, (answer, conf) in enumerate(decided)
        ]


def evaluate_gate(gate: ConfidenceGate, questions: Sequence[str], gold: Sequence[Sequence[str]]) -> dict[str, Any]:
    """Run the gate on a batch and score it: has_answer (main), exact match, token F1, retrieval rate."""
    if len(questions) != len(gold):
        raise ValueError(f"{len(questions)} questions but {len(gold)} gold answer lists")
    results = gate.answer_batch(questions)
    records = [
        {
            "question": q,
            "gold": list(g),
            "answer": r.answer,
            "retrieved": r.retrieved,
            "confidence": r.confidence,
            "has_answer": has_answer(r.answer, g),
            "em": exact_match(r.answer, g),
            "f1": token_f1(r.answer, g),
        }
        for q, g, r in zip(questions, gold, results)
    ]
    n = max(len(records), 1)
    return {
        "n": len(records),
        "beta": gate.beta,
        "accuracy": sum(r["has_answer"] for r in records) / n,
        "em": sum(r["em"] for r in records) / n,
        "f1": sum(r["f1"] for r in records) / n,
        "retrieval_rate": sum(r["retrieved"] for r in records) / n,
        "records": records,
    }


def gate_check(gate: ConfidenceGate, rows: Sequence[Any], outcomes: Sequence[Any], k: int) -> dict[str, Any]:
    """The gate run live on `rows` (QARow) against what the β sweep assumes from the cached outcomes
    (QuestionOutcome) at the same β: its decision (from its own Conf) and its answer (closed-book or top-K RAG)."""
    if not rows:
        return {}
    by_qid = {o.qid: o for o in outcomes}
    results = gate.answer_batch([row.question for row in rows])
    records = []
    for row, result in zip(rows, results):
        cached = by_qid[row.qid]
        expect_retrieve = bool(should_retrieve(cached.confidence, gate.beta))
        expected = cached.rag[k].answer if expect_retrieve else cached.closed_book.answer
        records.append(
            {
                "qid": row.qid,
                "confidence_live": result.confidence,
                "confidence_batch": cached.confidence,
                "decision_agrees": result.retrieved == expect_retrieve,
                "answer_agrees": result.answer == expected,
            }
        )
    return {
        "questions": len(records),
        "beta": gate.beta,
        "k": k,
        "decisions_agree": sum(r["decision_agrees"] for r in records),
        "answers_agree": sum(r["answer_agrees"] for r in records),
        "max_confidence_difference": max(abs(r["confidence_live"] - r["confidence_batch"]) for r in records),
        "records": records,
    }
