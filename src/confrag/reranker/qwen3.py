"""Qwen3-Reranker as a one-logit reranker: a causal LM that answers "yes" or "no" after its own prompt.

Qwen3-Reranker-{4B,8B} (Tables 1-2 baselines) are Qwen3 causal LMs, not sequence classifiers. The
official recipe wraps each pair as PREFIX + BODY + SUFFIX (each piece encoded separately, no special
tokens added) and reads p(yes) = softmax([logit(no), logit(yes)])[1] at the last position. That is
sigmoid(logit(yes) − logit(no)), so the raw difference is used as the one logit: group InfoNCE and the
cross-encoders' raw logits then read the same way, and rankings equal the official ones.

`YesNoScorer` gives the causal LM the call shape of a one-logit `AutoModelForSequenceClassification`
(`model(**features).logits` of shape (batch, 1)), and `encode_yes_no_pairs` is the tokenization with the
signature of `encode_pairs`, so `RerankerModule` and the collators only pick one by `model.kind`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers.modeling_outputs import SequenceClassifierOutput

from confrag.reranker.tokenization import EncodedPairs, cut_queries, pair_max_length

__all__ = [
    "PREFIX",
    "SUFFIX",
    "BODY",
    "DEFAULT_INSTRUCTION",
    "LORA_TARGETS",
    "YesNoScorer",
    "answer_token_ids",
    "encode_yes_no_pairs",
    "load_yes_no_scorer",
    "lora_settings",
]

PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
    'Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n'
)
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
BODY = "<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {doc}"
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
ANSWERS = ("yes", "no")
# Qwen3's attention projections: where LoRA goes unless model.lora.target_modules says otherwise.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def answer_token_ids(tokenizer) -> tuple[int, int]:
    """Ids of "yes" and "no", looked up as whole vocabulary tokens as the official code does; a tokenizer
    that would split them (or map them to its unknown token) cannot score this way."""
    ids = []
    for word in ANSWERS:
        index = tokenizer.convert_tokens_to_ids(word)
        if index is None or tokenizer.convert_ids_to_tokens(index) != word:
            raise ValueError(
                f"model.kind=qwen3_yes_no needs {word!r} as a single token of the backbone's "
                f"tokenizer ({type(tokenizer).__name__} has none): is model.backbone a Qwen3-Reranker?"
            )
        ids.append(int(index))
    return ids[0], ids[1]


def _ids(tokenizer, texts: list[str]) -> list[list[int]]:
    return tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]


def _cut_passage(passage: str, offsets: list[tuple[int, int]], budget: int) -> str:
    """The passage's first `budget` tokens, as text (cut where the last kept token ends)."""
    if len(offsets) <= budget:
        return passage
    return passage[: offsets[budget - 1][1]] if budget > 0 else ""


def encode_yes_no_pairs(
    tokenizer,
    queries: Sequence[str],
    passages: Sequence[str],
    query_max_len: int = 128,
    passage_max_len: int = 512,
    instruction: str = DEFAULT_INSTRUCTION,
) -> EncodedPairs:
    """Qwen3-Reranker prompts for (query, passage) pairs, padded on the tokenizer's `padding_side`.

    Budgets as in `encode_pairs`: the query is cut to query_max_len tokens and the passage to what is left
    of query_max_len + passage_max_len; the fixed prompt around them is not counted (it is the same for
    every pair), except that the whole stays within model_max_length. Cuts are made on the text, and the
    body is then tokenized as one string as the official code does, so a token may merge across a cut."""
    if len(queries) != len(passages):
        raise ValueError(f"{len(queries)} queries but {len(passages)} passages")
    prefix, suffix, frame = _ids(tokenizer, [PREFIX, SUFFIX, BODY.format(instruction=instruction, query="", doc="")])
    overhead = len(prefix) + len(suffix) + len(frame)
    max_length = min(
        pair_max_length(tokenizer, query_max_len, passage_max_len), int(tokenizer.model_max_length) - overhead
    )
    cut_q, q_len = cut_queries(tokenizer, list(dict.fromkeys(queries)), query_max_len)
    unique_p = list(dict.fromkeys(passages))
    offsets = dict(
        zip(
            unique_p,
            tokenizer(unique_p, add_special_tokens=False, return_offsets_mapping=True, verbose=False)["offset_mapping"],
        )
    )
    budgets = [max_length - q_len[q] for q in queries]
    bodies = [
        BODY.format(instruction=instruction, query=cut_q[q], doc=_cut_passage(p, offsets[p], b))
        for q, p, b in zip(queries, passages, budgets)
    ]
    ids = [prefix + body + suffix for body in _ids(tokenizer, bodies)]
    features = tokenizer.pad({"input_ids": ids}, padding=True, return_tensors="pt")
    truncated = sum(len(offsets[p]) > b for p, b in zip(passages, budgets))
    return EncodedPairs(dict(features), int(truncated), sum(cut_q[q] != q for q in queries))


class YesNoScorer(nn.Module):
    """A causal LM read as a one-logit classifier: logit(yes) − logit(no) at each row's last real token.

    Only the decoder runs over the sequence; the last real token's hidden state meets just the two LM-head
    rows, so no (batch, length, vocabulary) logits are ever built (152k columns for Qwen3)."""

    # The scorer has no head of its own: `head_module_names` finds nothing outside `lm` to train or save.
    base_model_prefix = "lm"

    def __init__(self, lm: nn.Module, yes_id: int, no_id: int) -> None:
        super().__init__()
        self.lm = lm
        self.answer_ids = (int(yes_id), int(no_id))

    @property
    def config(self):
        return self.lm.config

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **_: Any
    ) -> SequenceClassifierOutput:
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        # Positions count real tokens only: a left-padded row then sees exactly the positions it has unpadded.
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        hidden = self.lm.get_decoder()(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state
        # The largest index holding a real token, whichever side the padding is on.
        last = (attention_mask * torch.arange(input_ids.shape[1], device=input_ids.device)).argmax(-1)
        hidden = hidden[torch.arange(input_ids.shape[0], device=input_ids.device), last]
        head = self.lm.get_output_embeddings()
        rows = head.weight[list(self.answer_ids)]
        bias = head.bias[list(self.answer_ids)] if getattr(head, "bias", None) is not None else None
        # Two rows in float32 cost nothing, and keep the yes − no difference of a bf16 model exact.
        yes_no = nn.functional.linear(hidden.float(), rows.float(), None if bias is None else bias.float())
        return SequenceClassifierOutput(logits=(yes_no[:, 0] - yes_no[:, 1]).unsqueeze(-1))

    def save_pretrained(self, directory: str | Path, **kwargs: Any) -> None:
        """The causal LM itself: the export loads with `AutoModelForCausalLM` like the released checkpoint."""
        self.lm.save_pretrained(directory, **kwargs)


def load_yes_no_scorer(path: str, tokenizer, trust_remote_code: bool = False) -> YesNoScorer:
    """The causal LM at `path` (in its checkpoint's dtype: bf16 for Qwen3-Reranker) as a `YesNoScorer`."""
    from transformers import AutoModelForCausalLM

    yes_id, no_id = answer_token_ids(tokenizer)  # before the weights: a wrong tokenizer fails fast
    lm = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=trust_remote_code)
    return YesNoScorer(lm, yes_id, no_id)


def lora_settings(lora: dict[str, Any]) -> dict[str, Any]:
    """peft settings for the scorer: adapters on the attention projections unless model.lora names other
    modules; no task type (the scorer is none of peft's task models, and SEQ_CLS would add a head) and
    nothing else trainable (the yes/no rows of the LM head stay as released)."""
    kwargs = dict(lora)
    kwargs.setdefault("target_modules", list(LORA_TARGETS))
    kwargs.setdefault("task_type", None)
    kwargs.setdefault("modules_to_save", None)
    return kwargs
