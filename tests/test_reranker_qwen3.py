"""Qwen3-Reranker as a reranker (model.kind=qwen3_yes_no), on a tiny random Qwen3 causal LM."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

from confrag.llm.config import LLMConfig
from confrag.llm.random_weights import tiny_tokenizer
from confrag.reranker.qwen3 import (
    BODY,
    DEFAULT_INSTRUCTION,
    PREFIX,
    SUFFIX,
    YesNoScorer,
    answer_token_ids,
    encode_yes_no_pairs,
)
from confrag.reranker.tokenization import encode_pairs

from helpers.data import TOPICS as ALL_TOPICS
from helpers.models import cpu_llm
from helpers.modules import preference_data, reranker_module
from helpers.reranking import fast_trainer, mean_group_loss

KIND = "qwen3_yes_no"
TOPICS = [ALL_TOPICS[i] for i in (1, 2, 3, 5)]  # four of the shared topics
# Pairs of different lengths, so that a batch holds padding.
QUERIES = ["who wrote hamlet", "what is the capital of france, and why did it become the capital", "q"]
PASSAGES = ["Shakespeare.", "Paris is the capital of France; the kings settled there in the middle ages.", "x y"]


def toy_rows() -> list[dict]:
    """4 rows: two positives about the query, the other topics' passages as negatives."""
    return [
        {"query": q, "pos": [a, b], "neg": [TOPICS[(i + d) % 4][1 + d % 2] for d in (1, 2, 3)]}
        for i, (q, a, b) in enumerate(TOPICS)
    ]


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    """A 2-layer random Qwen3 causal LM with the tiny models' tokenizer (SmolLM2's byte-level BPE, which like
    Qwen's has <|im_start|> / <|im_end|> and "yes" / "no" as single tokens), saved as a model folder."""
    tokenizer = tiny_tokenizer(LLMConfig(**cpu_llm(name="tiny_qwen3", source="tiny")))
    for word in ("yes", "no", "<|im_start|>", "<|im_end|>"):
        assert tokenizer.tokenize(word) == [word], word
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    directory = tmp_path_factory.mktemp("tiny_qwen3")
    Qwen3ForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def real_texts(tokenizer, features: dict) -> list[str]:
    """Each row decoded without its padding (found by the mask: the tiny tokenizer pads with <|im_end|>,
    which the prompt holds too)."""
    return [tokenizer.decode(ids[mask.bool()]) for ids, mask in zip(features["input_ids"], features["attention_mask"])]


def plain_yes_minus_no(lm, tokenizer, query: str, passage: str) -> float:
    """The official recipe, one unpadded pair: prefix + body + suffix encoded apart, full-vocabulary logits."""
    body = BODY.format(instruction=DEFAULT_INSTRUCTION, query=query, doc=passage)
    ids = [i for text in (PREFIX, body, SUFFIX) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]
    with torch.no_grad():
        logits = lm(input_ids=torch.tensor([ids])).logits[0, -1]
    return float(logits[tokenizer.convert_tokens_to_ids("yes")] - logits[tokenizer.convert_tokens_to_ids("no")])


@pytest.mark.parametrize("side", ["left", "right"])
def test_score_is_yes_minus_no_of_a_plain_forward(tiny_qwen3, side):
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3, padding_side=side)
    lm = AutoModelForCausalLM.from_pretrained(tiny_qwen3).eval()
    encoded = encode_yes_no_pairs(tokenizer, QUERIES, PASSAGES)
    mask = encoded.features["attention_mask"]
    padded_at = 0 if side == "left" else -1
    assert int((mask[:, padded_at] == 0).sum()) == 2 and bool(mask[1].all())  # only the longest row is unpadded
    head_calls = []
    lm.get_output_embeddings().register_forward_hook(lambda *args: head_calls.append(1))
    with torch.no_grad():
        logits = YesNoScorer(lm, *answer_token_ids(tokenizer))(**encoded.features).logits
    assert logits.shape == (3, 1) and not head_calls  # the full-vocabulary head never ran
    expected = [plain_yes_minus_no(lm, tokenizer, q, p) for q, p in zip(QUERIES, PASSAGES)]
    np.testing.assert_allclose(logits.view(-1).numpy(), expected, atol=1e-5)
    assert np.ptp(expected) > 1e-2  # the pairs score apart: a wrong position would show


def test_prompt_and_truncation_follow_encode_pairs_budgets(tiny_qwen3):
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3)
    long_query = "who " + " ".join(["really"] * 30) + " wrote hamlet"
    long_passage = " ".join(f"word{i}" for i in range(60))
    queries = ["who wrote hamlet", long_query, "who wrote hamlet"]
    passages = ["Shakespeare.", "Shakespeare.", long_passage]
    encoded = encode_yes_no_pairs(tokenizer, queries, passages, query_max_len=8, passage_max_len=16)
    assert encoded.truncated_queries == 1 and encoded.truncated_pairs == 1
    # The same pairs count the same through encode_pairs' own budget rule (query + passage tokens > 8 + 16).
    cross = encode_pairs(tokenizer, queries, passages, query_max_len=8, passage_max_len=16)
    assert (cross.truncated_queries, cross.truncated_pairs) == (1, 1)

    def ids(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    texts = real_texts(tokenizer, encoded.features)
    assert (
        texts[0]
        == PREFIX + BODY.format(instruction=DEFAULT_INSTRUCTION, query="who wrote hamlet", doc="Shakespeare.") + SUFFIX
    )
    assert f"<Query>: {tokenizer.decode(ids(long_query)[:8])}\n<Document>: Shakespeare.{SUFFIX}" in texts[1]
    # The passage keeps what the query left of the 8 + 16 budget.
    kept = tokenizer.decode(ids(long_passage)[: 24 - len(ids("who wrote hamlet"))])
    assert texts[2].endswith(f"<Query>: who wrote hamlet\n<Document>: {kept}{SUFFIX}")


def test_datamodule_tokenizes_by_kind(tiny_qwen3):
    dm = preference_data(train=toy_rows(), tokenizer=str(tiny_qwen3), batch_size=2, group_size=3, kind=KIND)
    batch = next(iter(dm.train_dataloader()))
    assert batch["features"]["input_ids"].shape[0] == 6 and batch["group_size"] == 3
    # Rows come in a seeded order: find each group's query and check its prompt, group-major.
    texts = real_texts(dm.tokenizer, batch["features"])
    for text in texts:
        assert text.startswith(PREFIX + f"<Instruct>: {DEFAULT_INSTRUCTION}\n<Query>: ") and text.endswith(SUFFIX)
    queries = [next(q for q, *_ in TOPICS if f"<Query>: {q}\n" in text) for text in texts]
    assert queries[:3] == [queries[0]] * 3 and queries[3:] == [queries[3]] * 3
    dm.setup("fit")
    assert dm.truncation["train"] == {"pairs": 20, "truncated_pairs": 0, "truncated_queries": 0}


@pytest.mark.heavy
def test_lora_training_lowers_the_loss_and_export_reloads(tiny_qwen3, tmp_path):
    torch.manual_seed(0)
    rows = toy_rows()
    module = reranker_module(
        backbone=str(tiny_qwen3), kind=KIND, lr=2e-2, tau=0.1, lora={"r": 4, "lora_alpha": 8, "lora_dropout": 0.0}
    )
    trainable = {n for n, p in module.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert {n.split(".self_attn.")[1].split(".")[0] for n in trainable} == {"q_proj", "k_proj", "v_proj", "o_proj"}
    before = mean_group_loss(module, rows)
    trainer = fast_trainer(max_steps=8)
    trainer.fit(
        module,
        datamodule=preference_data(train=rows, tokenizer=str(tiny_qwen3), batch_size=4, group_size=3, kind=KIND),
    )
    after = mean_group_loss(module, rows)
    assert after < before - 0.1, (before, after)

    directory = module.export(tmp_path / "qwen3")
    assert not (directory / "adapter_config.json").exists()
    config = json.loads((directory / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and "sentence_transformers" not in config
    expected = module.score(QUERIES, PASSAGES)
    reloaded = reranker_module(backbone=str(directory), kind=KIND)
    np.testing.assert_allclose(reloaded.score(QUERIES, PASSAGES), expected, atol=1e-5)
    # The export is a plain causal LM: the official recipe on it gives the same scores.
    lm = AutoModelForCausalLM.from_pretrained(directory).eval()
    assert not any("lora" in n for n in lm.state_dict())
    tokenizer = AutoTokenizer.from_pretrained(directory)
    np.testing.assert_allclose(
        [plain_yes_minus_no(lm, tokenizer, q, p) for q, p in zip(QUERIES, PASSAGES)], expected, atol=1e-5
    )


def test_bad_kind_and_settings_are_named(tiny_qwen3):
    with pytest.raises(ValueError, match="^kind must be one of cross_encoder, qwen3_yes_no, bi_encoder .got 'qwen3'"):
        reranker_module(backbone=str(tiny_qwen3), kind="qwen3")
    with pytest.raises(ValueError, match="^kind must be one of"):
        preference_data(train=toy_rows(), kind="causal")
    with pytest.raises(ValueError, match="^fresh_head must be false with kind=qwen3_yes_no"):
        reranker_module(backbone=str(tiny_qwen3), kind=KIND, fresh_head=True)


def test_a_datamodule_of_another_kind_is_refused(tiny_qwen3):
    module = reranker_module(backbone=str(tiny_qwen3), kind=KIND)
    trainer = fast_trainer(max_steps=1)
    with pytest.raises(ValueError, match="build PreferenceDataModule with kind=model.kind"):
        trainer.fit(module, datamodule=preference_data(train=toy_rows(), tokenizer=str(tiny_qwen3), group_size=3))
