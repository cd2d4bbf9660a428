"""Greedy generation: every fast path (shared-prefix keys/values, static cache over length buckets) gives the
tokens of the plain `model.generate` path, in fp32 on the CPU, on tiny Llama and Qwen2 models and SmolLM2,
with end-of-sequence stops and the generation config's processors; batch sizes from free memory; options
refused by name."""

from __future__ import annotations

import copy

import pytest
import torch

import confrag.llm.batching as batching
from confrag.llm.generation import (
    _STATIC_CACHES,
    DEFAULT_CACHE_BUCKETS,
    PLAIN,
    GreedyOptions,
    cache_length,
    generate_greedy,
    generate_greedy_ids,
    generation_batch_rows,
    release_static_caches,
)
from confrag.llm.prompted import PromptedLLM
from confrag.llm.prompts import encode_prompts

from helpers.models import cpu_llm
from helpers.modules import confidence_data

NEW = 10
FAST = {
    "shared prefix": GreedyOptions(),
    "static cache": GreedyOptions(share_prefix=False, static_cache=True),
    "shared prefix + static cache": GreedyOptions(static_cache=True, cache_buckets=(64, 128, 256, 512)),
}


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one intra-op thread


def mixed_prompts(llm, templates, rows):
    """RAG prompts of different lengths and QA prompts: they share only the chat template's opening."""
    tok = llm.tokenizer
    return [templates.rag_prompt(tok, r.question, r.contexts[:1]) for r in rows[:5]] + [
        templates.qa_prompt(tok, r.question) for r in rows[5:8]
    ]


def one_by_one(model, ids, pad_id, new=NEW):
    """The reference: `model.generate` on each prompt alone, no padding, no cache given."""
    out = []
    for seq in ids:
        input_ids = torch.tensor([seq])
        tokens = model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=new,
            do_sample=False,
            num_beams=1,
            pad_token_id=pad_id,
        )
        out.append(tokens[0, len(seq) :].tolist())
    return out


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_qwen2"])
def test_fast_paths_give_the_plain_paths_tokens(request, templates, nq_rows, arch):
    llm = request.getfixturevalue(arch)
    ids = encode_prompts(llm.tokenizer, mixed_prompts(llm, templates, nq_rows))
    pad = llm.tokenizer.pad_token_id
    reference = one_by_one(llm.model, ids, pad)
    assert generate_greedy_ids(llm.model, ids, pad, NEW, 3, progress=False, options=PLAIN) == reference
    for name, options in FAST.items():
        for batch_size in (1, 3, 8):
            got = generate_greedy_ids(llm.model, ids, pad, NEW, batch_size, progress=False, options=options)
            assert got == reference, (name, batch_size)
    release_static_caches(llm.model)


def test_end_of_sequence_and_generation_config_processors_apply_alike(tiny_llama, templates, nq_rows):
    """A token the model emits early is made the EOS (rows stop at different steps and are padded) and a
    repetition penalty is set: every path goes through `model.generate`, so both apply identically."""
    model = copy.deepcopy(tiny_llama.model)
    ids = encode_prompts(tiny_llama.tokenizer, mixed_prompts(tiny_llama, templates, nq_rows))
    pad = tiny_llama.tokenizer.pad_token_id
    free_run = generate_greedy_ids(model, ids, pad, NEW, 4, progress=False, options=PLAIN)
    eos = free_run[2][3]  # stops prompt 2 after 4 tokens, maybe others elsewhere
    model.generation_config.eos_token_id = eos
    model.generation_config.repetition_penalty = 1.3
    reference = one_by_one(model, ids, pad)
    stopped = [row for row in reference if len(row) < NEW or eos in row]
    assert stopped, "the chosen EOS must end some generation early"
    for name, options in FAST.items():
        got = generate_greedy_ids(model, ids, pad, NEW, 4, progress=False, options=options)
        # model.generate pads stopped rows up to the batch's longest: compare up to the EOS.
        assert [row[: row.index(eos) + 1] if eos in row else row for row in got] == [
            row[: row.index(eos) + 1] if eos in row else row for row in reference
        ], name
    release_static_caches(model)


@pytest.mark.heavy
def test_smollm2_answers_are_the_same_on_every_path(smollm2, templates, nq_rows):
    tok = smollm2.tokenizer
    prompts = [templates.rag_prompt(tok, r.question, r.contexts[:1]) for r in nq_rows[:2]] + [
        templates.qa_prompt(tok, r.question) for r in nq_rows[2:4]
    ]
    plain = generate_greedy(smollm2.model, tok, prompts, 12, batch_size=2, progress=False, options=PLAIN)
    assert all(plain) and len(set(plain)) > 1  # real, varied answers
    for name in ("shared prefix", "shared prefix + static cache"):
        got = generate_greedy(smollm2.model, tok, prompts, 12, batch_size=2, progress=False, options=FAST[name])
        assert got == plain, name
    release_static_caches(smollm2.model)


def test_static_caches_are_kept_per_rows_and_length_and_released(tiny_llama, templates, nq_rows):
    ids = encode_prompts(tiny_llama.tokenizer, mixed_prompts(tiny_llama, templates, nq_rows))
    pad = tiny_llama.tokenizer.pad_token_id
    options = GreedyOptions(static_cache=True, cache_buckets=(512, 1024))
    release_static_caches(tiny_llama.model)
    generate_greedy_ids(tiny_llama.model, ids, pad, NEW, 4, progress=False, options=options)
    kept = dict(_STATIC_CACHES[tiny_llama.model])
    assert set(kept) <= {(4, 512), (4, 1024)} and kept
    generate_greedy_ids(tiny_llama.model, ids, pad, NEW, 4, progress=False, options=options)
    assert all(_STATIC_CACHES[tiny_llama.model][key] is cache for key, cache in kept.items())  # same buffers
    # A call with fewer prompts than rows: the next power of two above their count, not the full rows.
    assert generation_batch_rows(tiny_llama.model, ids[:3], NEW, 16, options) == 4
    assert generation_batch_rows(tiny_llama.model, ids[:3], NEW, 16, GreedyOptions()) == 16
    release_static_caches(tiny_llama.model)
    assert tiny_llama.model not in _STATIC_CACHES


def test_cache_length_takes_the_smallest_bucket_that_holds_the_sequence():
    assert cache_length(1, DEFAULT_CACHE_BUCKETS) == 256
    assert cache_length(256, DEFAULT_CACHE_BUCKETS) == 256
    assert cache_length(257, DEFAULT_CACHE_BUCKETS) == 512
    assert cache_length(70000, (256, 512)) == 70144  # past the largest: its multiples


def test_auto_rows_come_from_free_memory_on_a_gpu_and_the_cpu_default_here(tiny_llama, templates, nq_rows, monkeypatch):
    ids = encode_prompts(tiny_llama.tokenizer, mixed_prompts(tiny_llama, templates, nq_rows))
    assert generation_batch_rows(tiny_llama.model, ids, NEW, "auto", GreedyOptions()) == batching.CPU_GENERATE_BATCH
    monkeypatch.setattr(batching, "free_device_memory", lambda device: 8 << 20)  # as if 8 MiB were free on a GPU
    small = generation_batch_rows(tiny_llama.model, ids, NEW, "auto", GreedyOptions())
    monkeypatch.setattr(batching, "free_device_memory", lambda device: 64 << 30)
    large = generation_batch_rows(tiny_llama.model, ids, NEW, "auto", GreedyOptions())
    assert 1 <= small < large == batching.MAX_GENERATE_ROWS
    static = generation_batch_rows(tiny_llama.model, ids, NEW, "auto", GreedyOptions(static_cache=True))
    assert static == 8  # a power of two, and no more than the call's 8 prompts need
    monkeypatch.setattr(batching, "free_device_memory", lambda device: 1 << 10)
    with pytest.raises(MemoryError, match="does not hold one sequence"):
        generation_batch_rows(tiny_llama.model, ids, NEW, "auto", GreedyOptions())


def test_bad_settings_are_refused_by_name(tiny_llama):
    ids = [[1, 2, 3]]
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1 or 'auto'"):
        generate_greedy_ids(tiny_llama.model, ids, 0, 4, batch_size=0)
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 1"):
        generate_greedy_ids(tiny_llama.model, ids, 0, 0)
    with pytest.raises(ValueError, match=r"rag.generation: unknown key\(s\) \['static'\]; allowed: \['share_prefix'"):
        GreedyOptions.from_mapping({"static": True}, "rag.generation")
    with pytest.raises(ValueError, match="rag.generation.static_cache must be true or false"):
        GreedyOptions.from_mapping({"static_cache": "yes"}, "rag.generation")
    with pytest.raises(ValueError, match="rag.generation.cache_buckets must be increasing"):
        GreedyOptions.from_mapping({"cache_buckets": [512, 256]}, "rag.generation")
    options = GreedyOptions.from_mapping({"static_cache": True, "cache_buckets": [128, 256]}, "rag.generation")
    assert options == GreedyOptions(static_cache=True, cache_buckets=(128, 256))
    assert GreedyOptions.from_mapping(None) == GreedyOptions()


def test_answer_store_passes_the_path_and_auto_rows_through(tiny_llama, templates, nq_rows, tmp_path):
    from confrag.rag import AnswerStore

    items = [(r.question, r.contexts[:1]) for r in nq_rows[:4]] + [(r.question, ()) for r in nq_rows[4:6]]
    plain = AnswerStore(
        PromptedLLM(tiny_llama, templates), tmp_path / "a", max_new_tokens=6, progress=False, generation=PLAIN
    ).answer(items)
    static = AnswerStore(
        PromptedLLM(tiny_llama, templates),
        tmp_path / "b",
        max_new_tokens=6,
        batch_size="auto",
        progress=False,
        generation=GreedyOptions(static_cache=True),
    )
    assert static.answer(items) == plain and static.generated == len(items)
    # The path is not part of the key: another store with the default path finds those answers.
    again = AnswerStore(PromptedLLM(tiny_llama, templates), tmp_path / "b", max_new_tokens=6, progress=False)
    assert again.answer(items) == plain and again.generated == 0
    with pytest.raises(ValueError, match="^batch_size must be an integer >= 1 or 'auto'"):
        AnswerStore(PromptedLLM(tiny_llama, templates), tmp_path, batch_size="many")
    release_static_caches(tiny_llama.model)


def test_the_probe_data_module_takes_the_levers_and_names_bad_keys(templates):
    from dataclasses import asdict

    common = dict(
        llm=cpu_llm(name="tiny_llama", source="tiny"), prompts=asdict(templates), questions_path="unused.jsonl"
    )
    module = confidence_data(
        **common,
        extraction={"batch_size": "auto", "compile": True},
        answers={"batch_size": "auto", "generation": {"static_cache": True, "cache_buckets": [256, 512]}},
    )
    assert module.answers.generation == GreedyOptions(static_cache=True, cache_buckets=(256, 512))
    assert module.extraction.compile and module.extraction.batch_size == module.answers.batch_size == "auto"
    with pytest.raises(ValueError, match=r"^data.answers.generation: unknown key\(s\) \['static'\]"):
        confidence_data(**common, answers={"generation": {"static": True}})


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_qwen2"])
def test_answers_are_the_same_tokens_on_one_and_on_two_workers(request, templates, nq_rows, arch):
    """Every core: batches decoded on parallel workers, each on one intra-op thread, give one worker's tokens."""
    llm = request.getfixturevalue(arch)
    ids = encode_prompts(
        llm.tokenizer, [templates.rag_prompt(llm.tokenizer, r.question, r.contexts[:1]) for r in nq_rows[:24]]
    )
    pad = llm.tokenizer.eos_token_id
    found = [
        generate_greedy_ids(llm.model, ids, pad, 6, 4, progress=False, options=GreedyOptions(workers=workers))
        for workers in (1, 2)
    ]
    assert found[0] == found[1]
    with pytest.raises(ValueError, match=r"generation.workers must be an integer >= 1 or None"):
        GreedyOptions(workers=0)
