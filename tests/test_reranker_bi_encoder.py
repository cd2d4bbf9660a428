"""The embedded MiniLM as a bi-encoder reranker (model.kind=bi_encoder): scores equal sentence-transformers'
cosines (× the kind's scale), fine-tuning moves them, and the export loads back in sentence-transformers."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from huggingface_hub import ModelCard
from sentence_transformers import SentenceTransformer

from confrag.reports.hub import write_reranker_card
from confrag.reranker.bi_encoder import SCALE, encode_query_passage_pairs
from confrag.retrieval.dense import MeanPoolEncoder
from confrag.retrieval.minilm import minilm_dir
from test_hub_export import exported_folder, run_facts

from helpers.data import TOPICS
from helpers.modules import preference_data, reranker_module
from helpers.reranking import fast_trainer, mean_group_loss

KIND = "bi_encoder"
# A passage past MiniLM's 256-token budget, so that the cut is compared too.
LONG = " ".join(f"word{i}" for i in range(400))
QUERIES = [TOPICS[1][0], TOPICS[2][0], TOPICS[1][0], TOPICS[2][0]]
PASSAGES = [TOPICS[1][1], TOPICS[2][1], TOPICS[3][1], LONG]


def st_scores(model: SentenceTransformer, queries, passages) -> np.ndarray:
    q, p = model.encode(list(queries)), model.encode(list(passages))
    return SCALE * (q * p).sum(-1)


@pytest.fixture(scope="module")
def sentence_transformer():
    return SentenceTransformer(str(minilm_dir()), device="cpu")


def rows() -> list[dict]:
    """Preferences the pretrained encoder does not hold: the next topic's passages positive, the question's own
    and two other topics' negative (as an LLM's confidence may prefer a passage that relevance does not)."""
    n = len(TOPICS)
    return [
        {"query": q, "pos": list(TOPICS[(i + 1) % n][1:]), "neg": [a, TOPICS[(i + 2) % n][1], TOPICS[(i + 3) % n][1]]}
        for i, (q, a, _) in enumerate(TOPICS)
    ]


def test_scores_are_sentence_transformers_cosines(sentence_transformer):
    module = reranker_module(backbone="minilm", kind=KIND)
    np.testing.assert_allclose(
        module.score(QUERIES, PASSAGES), st_scores(sentence_transformer, QUERIES, PASSAGES), atol=1e-4
    )
    # Each distinct query is encoded once; the long passage is cut at the model's 256 tokens, not at 512.
    encoded = encode_query_passage_pairs(module.tokenizer, QUERIES, PASSAGES, 128, 512)
    assert encoded.features["query_input_ids"].shape[0] == 2
    assert encoded.features["query_index"].tolist() == [0, 1, 0, 1]
    assert encoded.features["passage_input_ids"].shape[1] == 256 and encoded.truncated_pairs == 1
    # The data module cuts pairs as the module does.
    dm = preference_data(train=rows(), tokenizer="minilm", kind=KIND)
    assert dm.tokenizer.model_max_length == module.tokenizer.model_max_length == 256


@pytest.mark.heavy
def test_fine_tuning_lowers_the_loss_and_the_export_loads_in_sentence_transformers(tmp_path):
    torch.manual_seed(0)
    module = reranker_module(backbone="minilm", kind=KIND, lr=1e-4)
    before = mean_group_loss(module, rows(), group_size=4)
    trainer = fast_trainer(max_steps=6)
    trainer.fit(module, datamodule=preference_data(train=rows(), batch_size=3, group_size=4, kind=KIND))
    after = mean_group_loss(module, rows(), group_size=4)
    assert after < before - 0.5, (before, after)

    directory = module.export(tmp_path / "bi")
    expected = module.score(QUERIES, PASSAGES)
    np.testing.assert_allclose(
        st_scores(SentenceTransformer(str(directory), device="cpu"), QUERIES, PASSAGES), expected, atol=1e-4
    )
    assert json.loads((directory / "1_Pooling" / "config.json").read_text())["pooling_mode_mean_tokens"] is True
    # confrag reads it back as a reranker, and as the dense retriever's encoder.
    reloaded = reranker_module(backbone=str(directory), kind=KIND)
    np.testing.assert_allclose(reloaded.score(QUERIES, PASSAGES), expected, atol=1e-5)
    cosine = MeanPoolEncoder(directory).cosine(QUERIES[0], [PASSAGES[0], PASSAGES[2]])
    np.testing.assert_allclose(SCALE * cosine, expected[[0, 2]], atol=1e-4)


def test_lora_trains_adapters_only_and_merges_into_the_encoder():
    module = reranker_module(backbone="minilm", kind=KIND, lora={"r": 4, "lora_alpha": 8})
    trainable = {n for n, p in module.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert {n.split(".attention.self.")[1].split(".")[0] for n in trainable} == {"query", "key", "value"}
    merged = module.plain_model()
    assert not any("lora" in n for n in merged.state_dict())
    np.testing.assert_allclose(
        reranker_module(backbone="minilm", kind=KIND).score(QUERIES, PASSAGES),
        module.score(QUERIES, PASSAGES),
        atol=1e-5,
    )


def test_settings_the_kind_cannot_honour_are_refused(tmp_path):
    with pytest.raises(ValueError, match="^fresh_head must be false with kind=bi_encoder"):
        reranker_module(backbone="minilm", kind=KIND, fresh_head=True)
    folder = tmp_path / "cls_pooled"
    (folder / "1_Pooling").mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_cls_token": True}))
    with pytest.raises(ValueError, match="model.kind=bi_encoder implements mean pooling only"):
        reranker_module(backbone=str(minilm_dir()), kind=KIND).kind.load(str(folder), None, False, 0, False)


def test_the_model_card_says_how_a_bi_encoder_loads(tmp_path):
    card = ModelCard.load(write_reranker_card(exported_folder(tmp_path), run_facts(kind=KIND)))
    assert "bi-encoder" in card.data.tags and card.data.library_name == "sentence-transformers"
    assert "SentenceTransformer(" in card.text and "A bi-encoder fine-tuned" in card.text
    assert "CrossEncoder" not in card.text
