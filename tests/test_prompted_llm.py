"""`PromptedLLM`: the loaded LLM and its prompt templates as one object. Its prompts are the templates rendered
through the LLM's tokenizer, and the keys built from it hold what they held when the two travelled apart
(`llm.identity` and `templates.identity(llm.tokenizer)`), so no cache written before it is orphaned."""

from __future__ import annotations

import dataclasses

import pytest

from confrag.infra.sharded import ShardedCache
from confrag.llm.loading import DeferredLLM
from confrag.llm.prompted import PromptedLLM
from confrag.probe.ranking import state_artifact
from confrag.rag.answers import GENERATOR, AnswerStore

from helpers.models import tiny_llm_config


def test_its_prompts_and_limit_are_the_templates_under_the_llms_tokenizer(tiny_llama, tiny_qwen2, templates, nq_rows):
    row, tok = nq_rows[0], tiny_llama.tokenizer
    prompted = PromptedLLM(tiny_llama, templates)
    assert prompted.tokenizer is tok
    assert prompted.qa_prompt(row.question) == templates.qa_prompt(tok, row.question)
    passages = row.contexts[:1]
    assert prompted.rag_prompt(row.question, passages) == templates.rag_prompt(tok, row.question, passages)
    assert prompted.prompts_identity == templates.identity(tok)
    # The chat template is part of the prompts: the same templates under another model are other prompts.
    assert PromptedLLM(tiny_qwen2, templates).prompts_identity != prompted.prompts_identity
    limit = prompted.limit(7)
    assert (limit.templates, limit.tokenizer, limit.context, limit.budget) == (
        templates,
        tok,
        tiny_llama.context,
        tiny_llama.context - 7,
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        prompted.templates = templates


def test_the_cache_keys_hold_the_llm_and_prompts_identities_as_before(tiny_llama, templates, tmp_path):
    prompted = PromptedLLM(tiny_llama, templates)
    prompts = templates.identity(tiny_llama.tokenizer)
    store = AnswerStore(prompted, tmp_path, max_new_tokens=5, progress=False)
    assert store.spec == {"llm": tiny_llama.identity, "prompts": prompts, "max_new_tokens": 5, "generator": GENERATOR}
    spec = state_artifact(ShardedCache(tmp_path, progress=False), prompted, "qa", "rows", 2, 4).spec
    assert (spec["llm"], spec["prompts"]) == (tiny_llama.identity, prompts)


def test_a_deferred_llm_gives_the_same_prompts_without_loading_its_weights(tiny_llama, templates):
    deferred = PromptedLLM(DeferredLLM(tiny_llm_config("llama")), templates)
    assert deferred.prompts_identity == PromptedLLM(tiny_llama, templates).prompts_identity
    assert deferred.qa_prompt("who wrote it") == templates.qa_prompt(tiny_llama.tokenizer, "who wrote it")
    assert deferred.limit(3).budget == tiny_llama.context - 3
    assert deferred.llm._loaded is None
