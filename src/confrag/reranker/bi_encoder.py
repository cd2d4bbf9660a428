"""A sentence-transformers bi-encoder as a reranker: the score of (query, passage) is the cosine of their
mean-pooled embeddings, each text encoded on its own.

all-MiniLM-L6-v2 is such a bi-encoder, trained for ranking; as a cross-encoder it first needs a scoring head
and a relevance training (the base reranker stage). Scored as it was trained, it is a reranker as it comes,
and fine-tuning it on preference rows is FlagEmbedding's embedder fine-tuning (group InfoNCE over cosines).

`BiEncoderScorer` gives the encoder the call shape of a one-logit `AutoModelForSequenceClassification`
(`model(**features).logits` of shape (pairs, 1)), and `encode_query_passage_pairs` is the tokenization with
the signature of `encode_pairs`, so `RerankerModule` and the collators only pick one by `model.kind`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers.modeling_outputs import SequenceClassifierOutput

from confrag.reranker.tokenization import EncodedPairs, cut_queries
from confrag.retrieval.mean_pooling import (
    check_mean_pooling,
    max_seq_length,
    mean_pool,
    write_sentence_transformers_files,
)

__all__ = [
    "SCALE",
    "LORA_TARGETS",
    "BiEncoderScorer",
    "encode_query_passage_pairs",
    "load_bi_encoder",
    "load_tokenizer",
    "lora_settings",
]

# The logit is SCALE · cosine: sentence-transformers' MultipleNegativesRankingLoss scale (a temperature of
# 0.05), the one its bi-encoders are trained at. Group InfoNCE at model.tau = 1 then trains as they were
# trained; a cosine in [-1, 1] at τ = 1 would hardly separate a group's passages.
SCALE = 20.0
# BERT's attention projections: where LoRA goes unless model.lora.target_modules says otherwise.
LORA_TARGETS = ("query", "key", "value")


def encode_query_passage_pairs(
    tokenizer, queries: Sequence[str], passages: Sequence[str], query_max_len: int = 128, passage_max_len: int = 512
) -> EncodedPairs:
    """Each distinct query and each passage tokenized on its own: the query cut to query_max_len tokens, the
    passage to passage_max_len (both within model_max_length), and `query_index` naming each pair's query.

    The queries are deduplicated: a training group or a candidate list encodes its query once."""
    if len(queries) != len(passages):
        raise ValueError(f"{len(queries)} queries but {len(passages)} passages")
    limit = int(tokenizer.model_max_length)
    unique_q = list(dict.fromkeys(queries))
    cut, _ = cut_queries(tokenizer, unique_q, min(query_max_len, limit - 2))
    q = tokenizer(
        [cut[text] for text in unique_q], truncation=True, max_length=limit, padding=True, return_tensors="pt"
    )
    p_max = min(passage_max_len, limit)
    p = tokenizer(list(passages), truncation=True, max_length=p_max, padding=True, return_tensors="pt")
    unique_p = list(dict.fromkeys(passages))
    lengths = tokenizer(unique_p, verbose=False)["input_ids"]
    too_long = {text for text, ids in zip(unique_p, lengths) if len(ids) > p_max}
    position = {text: i for i, text in enumerate(unique_q)}
    features = {
        "query_input_ids": q["input_ids"],
        "query_attention_mask": q["attention_mask"],
        "passage_input_ids": p["input_ids"],
        "passage_attention_mask": p["attention_mask"],
        "query_index": torch.tensor([position[text] for text in queries], dtype=torch.long),
    }
    cut_count = sum(cut[text] != text for text in queries)
    return EncodedPairs(features, sum(text in too_long for text in passages), cut_count)


class BiEncoderScorer(nn.Module):
    """An encoder read as a one-logit pair scorer: SCALE · cos(mean-pool(query), mean-pool(passage))."""

    # The scorer has no head of its own: `head_module_names` finds nothing outside `encoder` to train or save.
    base_model_prefix = "encoder"

    def __init__(self, encoder: nn.Module, max_length: int) -> None:
        super().__init__()
        self.encoder = encoder
        self.max_length = int(max_length)  # the exported sentence_bert_config.json's max_seq_length

    @property
    def config(self):
        return self.encoder.config

    def embed(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return mean_pool(hidden, attention_mask)

    def forward(
        self,
        query_input_ids: torch.Tensor,
        query_attention_mask: torch.Tensor,
        passage_input_ids: torch.Tensor,
        passage_attention_mask: torch.Tensor,
        query_index: torch.Tensor,
        **_: Any,
    ) -> SequenceClassifierOutput:
        queries = self.embed(query_input_ids, query_attention_mask)
        passages = self.embed(passage_input_ids, passage_attention_mask)
        cosine = (queries[query_index] * passages).sum(-1)
        return SequenceClassifierOutput(logits=(SCALE * cosine).unsqueeze(-1))

    def save_pretrained(self, directory: str | Path, **kwargs: Any) -> None:
        """The encoder with its sentence-transformers files: the export loads with `SentenceTransformer` (and
        in confrag's dense retriever) as the backbone did."""
        self.encoder.save_pretrained(directory, **kwargs)
        write_sentence_transformers_files(directory, self.encoder.config.hidden_size, self.max_length)


def load_tokenizer(path: str, trust_remote_code: bool = False):
    """The encoder's tokenizer with the budget sentence-transformers cuts texts at (sentence_bert_config.json's
    max_seq_length: 256 tokens for MiniLM, not the tokenizer's 512), so that training, scoring and the export
    cut every text where `SentenceTransformer` does."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    tokenizer.model_max_length = max_seq_length(path, tokenizer)
    return tokenizer


def load_bi_encoder(path: str, tokenizer, trust_remote_code: bool = False) -> BiEncoderScorer:
    """The encoder at `path` (a sentence-transformers folder with mean pooling, or a plain transformers
    encoder, pooled by mean) as a `BiEncoderScorer`; `tokenizer` from `load_tokenizer`."""
    from transformers import AutoModel

    check_mean_pooling(path, "model.kind=bi_encoder")  # before the weights: a wrong folder fails fast
    encoder = AutoModel.from_pretrained(path, trust_remote_code=trust_remote_code)
    return BiEncoderScorer(encoder, int(tokenizer.model_max_length))


def lora_settings(lora: dict[str, Any]) -> dict[str, Any]:
    """peft settings for the scorer: adapters on the attention projections unless model.lora names other
    modules; no task type (the scorer is none of peft's task models, and SEQ_CLS would add a head) and
    nothing else trainable (there is no head)."""
    kwargs = dict(lora)
    kwargs.setdefault("target_modules", list(LORA_TARGETS))
    kwargs.setdefault("task_type", None)
    kwargs.setdefault("modules_to_save", None)
    return kwargs
