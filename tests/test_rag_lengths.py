"""RAG prompts (question + passages) checked against the LLM's context like QA prompts: refused naming the row
and the limit, before the LLM loads where the data allows it (NQ_Confidence's gold, other and candidate
passages), or cut to fit with `data.truncate_passages` / `rag.truncate_passages`."""

from __future__ import annotations

import dataclasses
import logging

import pytest

import confrag.llm.loading as loading_module
from confrag.data.nq import Passage, default_questions_path, load_questions_jsonl
from confrag.infra.sharded import ShardedCache
from confrag.llm.context import PromptLimit, PromptTooLongError, fit_rag_prompts
from confrag.llm.prompted import PromptedLLM
from confrag.llm.prompts import encode_prompts
from confrag.rag.answers import AnswerStore
from test_input_checks import datamodule, nq_file

from helpers.settings import data_settings

LONG = "The long passage says nothing at all. " * 3000  # about 24,000 tokens: far past 2,048


def length(tokenizer, prompt: str) -> int:
    return len(encode_prompts(tokenizer, [prompt])[0])


def test_a_passage_longer_than_the_context_is_refused_by_row_or_cut_when_asked(tiny_llama, templates, caplog):
    tok = tiny_llama.tokenizer
    limit = PromptLimit(templates, tok, 2048, 24)
    short = [Passage("Paris", "Paris is the capital of France.")]
    items = [("capital of france", short), ("capital of france", [*short, Passage("Long", LONG)])]
    with pytest.raises(PromptTooLongError) as err:
        fit_rag_prompts(items, ["q0", "q1"], limit, where="RAG answers")
    message = str(err.value)
    assert message.startswith("RAG answers: 1 RAG prompt(s) (question + passages) do not fit the model's context")
    assert "2048 tokens less max_new_tokens=24 (a prompt may hold 2024 tokens): 'q1' (" in message
    assert f"passages of {len(short[0].text) + len(LONG)} characters" in message
    assert "rag.truncate_passages=true" in message

    with caplog.at_level(logging.WARNING, logger="confrag.llm.context"):
        prompts, cut = fit_rag_prompts(items, ["q0", "q1"], limit, truncate=True)
    assert cut == [1] and prompts[0] == templates.rag_prompt(tok, *items[0])
    assert 2000 < length(tok, prompts[1]) <= 2024  # cut to fit, not emptied
    assert "Paris is the capital of France." in prompts[1]  # the first passage kept whole, the last one cut
    assert "cut the passages of 1 prompt(s) to fit the model's context of 2048 tokens" in caplog.text

    # A question that does not fit even without passages is not "fixed" by cutting passages.
    with pytest.raises(PromptTooLongError, match=r"their questions alone do not fit") as err:
        fit_rag_prompts([("why " * 5000, short)], ["q2"], limit, truncate=True)
    assert "truncate_questions" not in str(err.value)  # no question option here: none is advised
    with pytest.raises(PromptTooLongError, match=r"set data.truncate_questions=true to cut them"):
        fit_rag_prompts([("why " * 5000, short)], ["q2"], limit, True, question_option="data.truncate_questions")


def test_nq_confidence_refuses_a_long_gold_passage_before_the_llm_loads(tmp_path, monkeypatch):
    rows = load_questions_jsonl(default_questions_path(), limit=6)
    rows[2] = dataclasses.replace(rows[2], contexts=(Passage(rows[2].contexts[0].title, LONG),))
    path = nq_file(tmp_path / "nq.jsonl", rows)

    def refuse(*args, **kwargs):
        raise AssertionError("the LLM was loaded before the passages were checked")

    monkeypatch.setattr(loading_module, "load_llm", refuse)
    with pytest.raises(PromptTooLongError) as err:
        datamodule(tmp_path, path, train_states="qa+rag").build()
    message = str(err.value)
    assert message.startswith("NQ_Confidence [rag_gold]: 1 RAG prompt(s)") and "'nq-00002 [rag_gold]'" in message
    assert "context of 2048 tokens" in message and "data.truncate_passages=true" in message
    # In a later task the probe's settings are under `probe`: the advice names that key.
    with pytest.raises(PromptTooLongError, match=r"set probe.data.truncate_passages=true"):
        datamodule(tmp_path, path, train_states="qa+rag", config_node="probe.data").build()


@pytest.mark.heavy
def test_nq_confidence_cuts_long_passages_when_asked_and_keys_the_cut(tmp_path, tiny_llama, templates):
    from confrag.probe.nq_confidence import build_confidence_data

    rows = load_questions_jsonl(default_questions_path(), limit=8)
    settings = dict(
        extraction={"layers": [1]}, splits={"sizes": {"train": 2, "dev": 1, "test": 1}}, answers={"max_new_tokens": 2}
    )
    cache = ShardedCache(str(tmp_path / "cache"), progress=False)
    rows[2] = dataclasses.replace(rows[2], contexts=(Passage(rows[2].contexts[0].title, LONG),))
    with pytest.raises(PromptTooLongError, match=r"'nq-00002 \[rag_gold\]'"):
        build_confidence_data(
            PromptedLLM(tiny_llama, templates), rows, settings=data_settings("qa+rag", **settings), cache=cache
        )
    cut_settings = data_settings("qa+rag", truncate_passages=True, **settings)
    cut = build_confidence_data(PromptedLLM(tiny_llama, templates), rows, settings=cut_settings, cache=cache)
    specs = {kind: store.artifact.spec for kind, store in cut.stores.items()}
    assert set(specs) == {"qa", "rag_gold", "rag_other"} and all(len(s) == 8 for s in cut.stores.values())
    # The cut prompts (row 2's own, and the row whose partner paragraph it is) are recorded in the key of the
    # states made from them; QA prompts hold no passage and record nothing.
    assert "cut_to_fit" not in specs["qa"]
    assert specs["rag_gold"]["cut_to_fit"] != specs["rag_other"]["cut_to_fit"]


def test_rag_answers_refuse_or_cut_a_prompt_that_does_not_fit(tmp_path, tiny_llama, templates):
    short = [Passage("Paris", "Paris is the capital of France.")]
    store = AnswerStore(PromptedLLM(tiny_llama, templates), tmp_path / "cache", max_new_tokens=2, progress=False)
    with pytest.raises(PromptTooLongError, match=r"^RAG answers: 1 RAG prompt\(s\).*\"question 'capital of france' "):
        store.answer([("capital of france", [*short, Passage("Long", LONG)])])
    assert store.generated == 0
    store = AnswerStore(
        PromptedLLM(tiny_llama, templates), tmp_path / "cache", max_new_tokens=2, progress=False, truncate_passages=True
    )
    answers = store.answer([("capital of france", short), ("capital of france", [*short, Passage("Long", LONG)])])
    assert len(answers) == 2 and store.generated == 2
    with pytest.raises(ValueError, match=r"^truncate_passages must be true or false"):
        AnswerStore(PromptedLLM(tiny_llama, templates), tmp_path / "cache", truncate_passages="yes")
