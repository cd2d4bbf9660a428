"""Computing the signals gates read: drafts with token entropy and attention (DRAGIN), contrastive
directions (CtrlA), MiniLM embeddings (SKR, CCSK, BRIDGE's allocator), internal passages and matching
scores (BRIDGE). The gates themselves only see the resulting arrays (`GateSignals`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Protocol

import numpy as np
import torch
from sklearn.feature_extraction.text import CountVectorizer
from sklearn.preprocessing import normalize
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from confrag.data.nq import Passage
from confrag.gates.base import DraftSignals, UnavailableSignalError, check_number
from confrag.gates.ctrla import CONFIDENT_TEMPLATE, UNCONFIDENT_TEMPLATE, check_template
from confrag.gates.directions import ConfidenceDirection, direction_from_states
from confrag.llm.generation import generate_greedy
from confrag.llm.hidden_states import HiddenStateEngine, validate_layers
from confrag.llm.loading import LoadedLLM
from confrag.llm.prompts import encode_prompts
from confrag.retrieval.bm25 import BM25_PARAMS
from confrag.retrieval.corpus import document_text

# ------------------------------------------------------------------ DRAGIN: draft tokens


@contextlib.contextmanager
def _eager_attention(model: PreTrainedModel) -> Iterator[None]:
    """SDPA returns no attention weights; switch to eager attention for the block, then switch back."""
    previous = model.config._attn_implementation
    if previous == "eager":
        yield
        return
    model.set_attn_implementation("eager")
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


def _eos_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    configured = model.generation_config.eos_token_id
    ids = set(configured if isinstance(configured, (list, tuple)) else [configured])
    ids.add(tokenizer.eos_token_id)
    return {i for i in ids if i is not None}


def _received_attention(attention: torch.Tensor, length: int) -> np.ndarray:
    """attention: (heads, steps, steps) of query draft token j over key draft token i. Returns, per
    token i < length, the max over queries j with i <= j < length per head, averaged over heads."""
    if length == 0:
        return np.zeros(0)
    sub = attention[:, :length, :length]
    itself_or_later = torch.tril(torch.ones(length, length, dtype=torch.bool))  # j >= i
    received = torch.where(itself_or_later, sub, torch.zeros_like(sub)).amax(dim=1)  # max over queries j
    return received.mean(dim=0).numpy().astype(np.float64)


@torch.inference_mode()
def draft_token_signals(
    llm: LoadedLLM, prompts: Sequence[str], max_new_tokens: int = 32, batch_size: int = 8, progress: bool = False
) -> DraftSignals:
    """One greedy generation per prompt (the closed-book draft) with, per draft token, the entropy of
    the distribution it was drawn from (raw logits), the token's log-probability and that distribution's
    highest probability (the same number for a greedy token, unless the generation config's logits
    processors changed the choice), and the attention it receives in the last layer:
    the max over the token itself and every later draft token, per head, then averaged over heads
    (DRAGIN's code; its paper writes "later tokens", but then a one-token answer could never trigger).

    The draft ends at the first EOS or after `max_new_tokens`; one extra token is generated and dropped
    so that the last draft token has also been read as a query. Eager attention is used for the call
    (SDPA exposes no weights), so a draft can differ from an SDPA greedy answer where two tokens are
    within float rounding of each other."""
    check_number("max_new_tokens", max_new_tokens, 1, integer=True)
    check_number("batch_size", batch_size, 1, integer=True)
    model, tokenizer = llm.model, llm.tokenizer
    ids = encode_prompts(tokenizer, prompts)
    eos = _eos_ids(model, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    texts, tokens, entropies, attentions, logprobs, max_probs = ([None] * len(ids) for _ in range(6))
    batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    with _eager_attention(model):
        for batch in tqdm(batches, desc="drafts", unit="batch", disable=not progress):
            width = max(len(ids[i]) for i in batch)
            input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
            mask = torch.zeros_like(input_ids)
            for row, index in enumerate(batch):  # left padding: every row's next token is at the end
                input_ids[row, width - len(ids[index]) :] = torch.tensor(ids[index])
                mask[row, width - len(ids[index]) :] = 1
            output = model.generate(
                input_ids=input_ids.to(llm.device),
                attention_mask=mask.to(llm.device),
                max_new_tokens=max_new_tokens + 1,
                do_sample=False,
                num_beams=1,
                pad_token_id=pad_id,
                return_dict_in_generate=True,
                output_logits=True,
                output_attentions=True,
            )
            steps = len(output.logits)
            log_probs = torch.log_softmax(torch.stack(output.logits, dim=1).float(), dim=-1)  # (B, steps, V)
            entropy = -(log_probs.exp() * log_probs).sum(dim=-1).cpu()
            max_prob = log_probs.amax(dim=-1).exp().cpu()
            chosen = output.sequences[:, width : width + steps].to(log_probs.device)
            chosen_logprob = log_probs.gather(-1, chosen.unsqueeze(-1)).squeeze(-1).cpu()
            # Step s >= 1 read draft token s-1 as its query (the extra step reads the last kept token).
            heads = output.attentions[0][-1].shape[1]
            attention = torch.zeros(len(batch), heads, steps, steps)
            for step in range(1, steps):
                attention[:, :, step - 1, :step] = (
                    output.attentions[step][-1][:, :, 0, width : width + step].float().cpu()
                )
            for row, index in enumerate(batch):
                generated = output.sequences[row, width:].tolist()
                length = next((i for i, t in enumerate(generated) if t in eos), len(generated))
                length = min(length, max_new_tokens)
                draft_ids = generated[:length]
                texts[index] = tokenizer.decode(draft_ids, skip_special_tokens=True).strip()
                tokens[index] = [tokenizer.decode([t]) for t in draft_ids]
                entropies[index] = entropy[row, :length].numpy().astype(np.float64)
                logprobs[index] = chosen_logprob[row, :length].numpy().astype(np.float64)
                max_probs[index] = max_prob[row, :length].numpy().astype(np.float64)
                attentions[index] = _received_attention(attention[row], length)
    return DraftSignals(
        texts=texts, tokens=tokens, entropy=entropies, attention=attentions, logprob=logprobs, max_prob=max_probs
    )


# ------------------------------------------------------------------ P(True)

# Kadavath et al. (2022), "Language Models (Mostly) Know What They Know": the model judges its own
# proposed answer; P(True) is the probability it gives to "True".
P_TRUE_TEMPLATE = (
    "Question: {question}\nProposed answer: {answer}\nIs the proposed answer true or false? "
    "Reply with one word: True or False."
)
# The surface forms of each verdict whose first token counts for it (with and without the leading space
# a tokenizer may put before a word).
VERDICTS = {"True": ("True", " True", "true", " true"), "False": ("False", " False", "false", " false")}


def verdict_token_ids(tokenizer: PreTrainedTokenizerBase) -> dict[str, list[int]]:
    """The first token ids of each verdict's surface forms. Refused, naming the signal, when the tokenizer
    cannot tell "True" from "False" by their first token (an unknown-word token, or a shared piece): then
    the LLM cannot give P(True)."""
    ids: dict[str, set[int]] = {}
    for verdict, forms in VERDICTS.items():
        firsts = set()
        for form in forms:
            encoded = tokenizer(form, add_special_tokens=False)["input_ids"]
            if encoded and encoded[0] != tokenizer.unk_token_id:
                firsts.add(int(encoded[0]))
        ids[verdict] = firsts
    shared = ids["True"] & ids["False"]
    if not ids["True"] or not ids["False"] or shared:
        raise UnavailableSignalError(
            "signal p_true: this LLM's tokenizer cannot tell 'True' from 'False' by their first token "
            f"(first token ids: True {sorted(ids['True'])}, False {sorted(ids['False'])}"
            + (f", shared {sorted(shared)}" if shared else "")
            + "); gates reading p_true cannot run with it"
        )
    return {verdict: sorted(firsts) for verdict, firsts in ids.items()}


def p_true_prompts(
    tokenizer: PreTrainedTokenizerBase,
    questions: Sequence[str],
    answers: Sequence[str],
    template: str = P_TRUE_TEMPLATE,
) -> list[str]:
    """The self-evaluation prompt per (question, its closed-book answer), through the chat template."""
    if len(questions) != len(answers):
        raise ValueError(f"{len(questions)} questions and {len(answers)} answers; P(True) needs one answer each")
    if tokenizer.chat_template is None:
        raise ValueError("the tokenizer has no chat template; set llm.chat_template")
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": template.format(question=q, answer=a)}],
            tokenize=False,
            add_generation_prompt=True,
        )
        for q, a in zip(questions, answers)
    ]


@torch.inference_mode()
def verdict_probabilities(llm: LoadedLLM, prompts: Sequence[str], batch_size: int = 8) -> np.ndarray:
    """(n, 2): the next-token probability mass of "True" and of "False" (each summed over its surface
    forms' first tokens) after each prompt: one forward per prompt, no generation."""
    check_number("batch_size", batch_size, 1, integer=True)
    verdicts = verdict_token_ids(llm.tokenizer)
    ids = encode_prompts(llm.tokenizer, prompts)
    if any(len(seq) == 0 for seq in ids):
        raise ValueError("a P(True) prompt encodes to zero tokens")
    tokenizer = llm.tokenizer
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    out = np.zeros((len(ids), 2))
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    for start in range(0, len(order), batch_size):
        batch = order[start : start + batch_size]
        width = max(len(ids[i]) for i in batch)
        input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros_like(input_ids)
        for row, index in enumerate(batch):  # left padding: the next token of every row is at the end
            input_ids[row, width - len(ids[index]) :] = torch.tensor(ids[index])
            mask[row, width - len(ids[index]) :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = llm.model(
            input_ids=input_ids.to(llm.device),
            attention_mask=mask.to(llm.device),
            position_ids=positions.to(llm.device),
        ).logits[:, -1]
        probs = torch.softmax(logits.float(), dim=-1).cpu()
        for row, index in enumerate(batch):
            out[index] = [float(probs[row, verdicts[v]].sum()) for v in ("True", "False")]
    if not np.all(np.isfinite(out)):
        bad = int(np.flatnonzero(~np.isfinite(out).all(axis=1))[0])
        raise ValueError(f"P(True): NaN or inf verdict probability for prompt {bad}")
    return out


def p_true_from_verdicts(verdicts: np.ndarray) -> np.ndarray:
    """P(True) = p(True) / (p(True) + p(False)): the verdict's probability among the two verdicts (a small
    model spreads mass over other first tokens; the ratio keeps what it says about its answer)."""
    verdicts = np.asarray(verdicts, dtype=np.float64)
    total = verdicts.sum(axis=1)
    return np.where(total > 0, verdicts[:, 0] / np.where(total > 0, total, 1.0), 0.5)


# ------------------------------------------------------------------ CtrlA: contrastive direction


def contrastive_prompts(
    tokenizer: PreTrainedTokenizerBase,
    questions: Sequence[str],
    confident_template: str = CONFIDENT_TEMPLATE,
    unconfident_template: str = UNCONFIDENT_TEMPLATE,
) -> tuple[list[str], list[str]]:
    """Paired chat prompts (confident, unconfident) per question, through the model's chat template."""
    check_template("gate.confident_template", confident_template)
    check_template("gate.unconfident_template", unconfident_template)
    if tokenizer.chat_template is None:
        raise ValueError("the tokenizer has no chat template; set llm.chat_template")

    def render(template: str, question: str) -> str:
        messages = [{"role": "user", "content": template.format(question=question)}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    return [render(confident_template, q) for q in questions], [render(unconfident_template, q) for q in questions]


def contrastive_direction(
    llm: LoadedLLM,
    layers: Sequence[int],
    confident_prompts: Sequence[str],
    unconfident_prompts: Sequence[str],
    **engine_kwargs,
) -> ConfidenceDirection:
    """CtrlA's confidence direction at `layers` from paired prompts, via the project's hidden-state engine
    (last prompt token, HF indexing)."""
    if len(confident_prompts) != len(unconfident_prompts) or not confident_prompts:
        raise ValueError(
            f"need the same, non-zero number of confident and unconfident prompts; got "
            f"{len(confident_prompts)} and {len(unconfident_prompts)}"
        )
    layers = validate_layers(layers, llm.num_layers)
    engine = HiddenStateEngine(llm.model, llm.tokenizer, **{"progress": False, **engine_kwargs})
    confident = engine.extract(confident_prompts, layers, desc="confident prompts")
    unconfident = engine.extract(unconfident_prompts, layers, desc="unconfident prompts")
    return direction_from_states(confident, unconfident, layers)


# ------------------------------------------------------------------ embeddings


class TextEncoder(Protocol):
    def encode(self, texts: Sequence[str]) -> np.ndarray: ...


def embed_texts(encoder: TextEncoder, texts: Sequence[str]) -> np.ndarray:
    """(n, d) unit vectors. Pass the pipeline's `confrag.retrieval.DenseRetriever` (all-MiniLM-L6-v2),
    or any object with `.encode(texts)`."""
    if not hasattr(encoder, "encode"):
        raise TypeError(
            f"encoder must have an .encode(texts) method (e.g. a DenseRetriever); got {type(encoder).__name__}"
        )
    vectors = np.asarray(encoder.encode(list(texts)), dtype=np.float32)
    if vectors.shape[0] != len(texts) or vectors.ndim != 2:
        raise ValueError(f"encoder returned shape {vectors.shape} for {len(texts)} texts")
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    return vectors / np.where(norms > 0, norms, 1.0)


# ------------------------------------------------------------------ BRIDGE: knowledge and matching

# BRIDGE, appendix A.1.1: the prompt that makes the LLM write out its internal knowledge.
INTERNAL_KNOWLEDGE_TEMPLATE = (
    "Based on the question, create a piece of evidence that answers the question. This piece of evidence "
    "should be informative and well-structured.\n\nQuestion: {question}\n\nEvidence:"
)


def internal_passages(
    llm: LoadedLLM,
    questions: Sequence[str],
    max_new_tokens: int = 128,
    batch_size: int = 16,
    template: str = INTERNAL_KNOWLEDGE_TEMPLATE,
    progress: bool = False,
) -> list[str]:
    """K_int: the LLM's own evidence passage per question (greedy, through the chat template)."""
    if "{question}" not in template:
        raise ValueError(f"the internal-knowledge template must contain {{question}}; got {template!r}")
    prompts = [
        llm.tokenizer.apply_chat_template(
            [{"role": "user", "content": template.format(question=q)}], tokenize=False, add_generation_prompt=True
        )
        for q in questions
    ]
    return generate_greedy(
        llm.model,
        llm.tokenizer,
        prompts,
        max_new_tokens=max_new_tokens,
        batch_size=batch_size,
        desc="internal passages",
        progress=progress,
    )


def external_knowledge(retrieved: Sequence[Sequence[Passage]]) -> tuple[list[str], list[str]]:
    """(K_ext, K_ret) per question from its ranked retrieved passages: the top passage, and the rest
    joined (empty when only one was retrieved)."""
    if any(len(passages) == 0 for passages in retrieved):
        raise ValueError("every question needs at least one retrieved passage for BRIDGE's external knowledge")
    external = [document_text(passages[0]) for passages in retrieved]
    rest = ["\n\n".join(document_text(p) for p in passages[1:]) for passages in retrieved]
    return external, rest


class SparseMatcher:
    """Lexical match in [0, 1]: cosine of BM25-weighted term vectors (Lucene IDF and the k1, b of the
    project's BM25 retriever), standing in for BGE-M3's sparse lexical-weight score. IDF and average
    length come from `reference_texts`; words never seen there carry no weight."""

    def __init__(
        self, reference_texts: Sequence[str], k1: float = BM25_PARAMS["k1"], b: float = BM25_PARAMS["b"]
    ) -> None:
        self.vectorizer = CountVectorizer(lowercase=True, stop_words="english")
        try:
            counts = self.vectorizer.fit_transform(list(reference_texts))
        except ValueError as err:  # an empty vocabulary
            raise ValueError(f"the sparse matcher's reference texts hold no indexable words ({err})") from err
        documents = counts.shape[0]
        frequency = np.asarray((counts > 0).sum(axis=0)).ravel()
        self.idf = np.log1p((documents - frequency + 0.5) / (frequency + 0.5))
        self.mean_length = max(float(counts.sum(axis=1).mean()), 1e-9)
        self.k1, self.b = k1, b

    def vectors(self, texts: Sequence[str]):
        tf = self.vectorizer.transform(list(texts)).astype(np.float64).tocsr()
        lengths = np.asarray(tf.sum(axis=1)).ravel()
        norm = self.k1 * (1 - self.b + self.b * lengths / self.mean_length)
        rows = np.repeat(np.arange(tf.shape[0]), np.diff(tf.indptr))
        tf.data = tf.data * (self.k1 + 1) / (tf.data + norm[rows]) * self.idf[tf.indices]
        return normalize(tf)

    def similarity(self, a: Sequence[str], b: Sequence[str]) -> np.ndarray:
        return np.asarray(self.vectors(a).multiply(self.vectors(b)).sum(axis=1)).ravel()


def bridge_matching_scores(
    encoder: TextEncoder,
    internal: Sequence[str],
    generated: Sequence[str],
    external: Sequence[str],
    retrieved: Sequence[str],
    sparse: SparseMatcher | None = None,
) -> np.ndarray:
    """(n, 4, 2) matching scores S1..S4 x (dense cosine, sparse BM25 match) for BRIDGE.

    BRIDGE's four sources, and what plays them here without its sub-query generator/retriever:
    K_int = the LLM's evidence passage (`internal_passages`); K_gen = a second, independent piece of
    internal knowledge, here the closed-book answer; K_ext = the top retrieved passage; K_ret = the other
    retrieved passages (`external_knowledge`). So S2 measures the self-consistency of internal knowledge
    and S3 the agreement among retrieved passages, as in the paper. `sparse` defaults to a matcher whose
    IDF is fitted on all texts given."""
    n = len(internal)
    if not len(generated) == len(external) == len(retrieved) == n:
        raise ValueError(
            f"internal ({n}), generated ({len(generated)}), external ({len(external)}) and retrieved "
            f"({len(retrieved)}) knowledge must be aligned per question"
        )
    sources = [list(internal), list(generated), list(external), list(retrieved)]
    if sparse is None:
        sparse = SparseMatcher([text for source in sources for text in source])
    embedded = embed_texts(encoder, [text for source in sources for text in source]).reshape(4, n, -1)
    pairs = [(0, 2), (0, 1), (2, 3), (1, 3)]  # S1 int-ext, S2 int-gen, S3 ext-ret, S4 gen-ret
    scores = np.zeros((n, 4, 2))
    for column, (i, j) in enumerate(pairs):
        scores[:, column, 0] = np.sum(embedded[i] * embedded[j], axis=1)
        scores[:, column, 1] = sparse.similarity(sources[i], sources[j])
    return np.clip(scores, 0.0, 1.0)
