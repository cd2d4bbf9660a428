"""NQ_Confidence: layer selection, partners, splits, balancing, and the cached stage end to end."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter

import numpy as np
import pytest

import confrag.probe.nq_confidence as nqc
from confrag.data.qa_metrics import exact_match, has_answer
from confrag.infra.sharded import ShardedCache
from confrag.llm.hidden_states import HiddenStateEngine
from confrag.llm.prompted import PromptedLLM
from confrag.probe.confidence_splits import PAPER_SPLIT_SIZES, balanced_examples, stratified_question_splits
from confrag.probe.nq_confidence import (
    build_confidence_data,
    build_prompts,
    partner_indices,
    resolve_layers,
)
from confrag.probe.prompt_kinds import KINDS, Example

# --- resolve_layers --------------------------------------------------------------------------------
from helpers.settings import data_settings


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("all", [0, 1, 2, 3, 4]),
        ("mid", [2]),
        (3, [3]),
        (0, [0]),
        (np.int64(4), [4]),
        ([4, 0, 2, 0], [0, 2, 4]),  # sorted, duplicates dropped
        ((1,), [1]),
    ],
)
def test_resolve_layers(spec, expected):
    assert resolve_layers(spec, 4) == expected


def test_resolve_layers_mid_and_all_follow_the_model():
    assert resolve_layers("mid", 30) == [15]  # SmolLM2-135M: 30 layers, Layer/2 = 15
    assert resolve_layers("mid", 5) == [2]
    assert resolve_layers("all", 30) == list(range(31))


@pytest.mark.parametrize("spec", [5, -1, [0, 7], [-2, 1]])
def test_resolve_layers_out_of_range_lists_valid_range(spec):
    with pytest.raises(ValueError, match=r"valid layers are 0\.\.4"):
        resolve_layers(spec, 4)


def test_resolve_layers_rejects_empty_and_unknown_names():
    with pytest.raises(ValueError, match=r"0\.\.4"):
        resolve_layers([], 4)
    with pytest.raises(ValueError, match="'all', 'mid'"):
        resolve_layers("middle", 4)


# --- partner_indices -------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 3, 10, 257])
def test_partner_indices_is_a_derangement(n):
    for seed in range(5):
        partner = partner_indices(n, seed)
        assert partner.shape == (n,)
        assert sorted(partner.tolist()) == list(range(n))  # a permutation: every paragraph used once
        assert not np.any(partner == np.arange(n))  # nobody gets their own paragraph


def test_partner_indices_is_deterministic_for_a_seed():
    np.testing.assert_array_equal(partner_indices(50, 3), partner_indices(50, 3))
    assert not np.array_equal(partner_indices(50, 3), partner_indices(50, 4))


def test_partner_indices_needs_two_rows():
    with pytest.raises(ValueError, match="at least two"):
        partner_indices(1, 0)


# --- stratified_question_splits -----------------------------------------------------------------------


def split_counts(labels: np.ndarray, split_of: list[str]) -> dict[int, Counter]:
    return {cls: Counter(s for s, label in zip(split_of, labels) if label == cls) for cls in (0, 1)}


def test_splits_follow_the_paper_proportions_per_class():
    labels = np.array([1] * 900 + [0] * 2700)
    np.random.default_rng(0).shuffle(labels)
    split_of = stratified_question_splits(labels, seed=0)
    assert len(split_of) == len(labels) and set(split_of) == {"train", "dev", "test"}
    counts = split_counts(labels, split_of)
    assert counts[1] == {"train": 500, "dev": 150, "test": 250}  # 1000 : 300 : 500
    assert counts[0] == {"train": 1500, "dev": 450, "test": 750}


@pytest.mark.parametrize("n, positives", [(1234, 311), (101, 50), (37, 5)])
def test_splits_assign_every_question_in_proportion(n, positives):
    labels = np.zeros(n, dtype=np.int64)
    labels[np.random.default_rng(n).choice(n, positives, replace=False)] = 1
    split_of = stratified_question_splits(labels, seed=1)
    assert "" not in split_of and set(split_of) <= {"train", "dev", "test"}
    total = sum(PAPER_SPLIT_SIZES.values())
    for cls, counts in split_counts(labels, split_of).items():
        members = int((labels == cls).sum())
        assert sum(counts.values()) == members
        for split, size in PAPER_SPLIT_SIZES.items():
            assert abs(counts[split] - members * size / total) <= 1, (cls, split, counts)


def test_splits_are_seeded():
    labels = np.random.default_rng(0).integers(0, 2, 500)
    assert stratified_question_splits(labels, 7) == stratified_question_splits(labels, 7)
    assert stratified_question_splits(labels, 7) != stratified_question_splits(labels, 8)


def test_splits_with_custom_sizes_and_one_class():
    labels = np.zeros(40, dtype=np.int64)
    split_of = stratified_question_splits(labels, 0, {"train": 2, "dev": 1, "test": 1})
    assert Counter(split_of) == {"train": 20, "dev": 10, "test": 10}


# --- balanced_examples -----------------------------------------------------------------------------


def candidates(positives: int, negatives: int) -> list[Example]:
    labels = [1] * positives + [0] * negatives
    np.random.default_rng(positives * 1000 + negatives).shuffle(labels)
    return [Example(KINDS[i % 3], i, label) for i, label in enumerate(labels)]


def test_balanced_examples_equal_classes():
    pool = candidates(7, 30)
    chosen = balanced_examples(pool, cap=1000, seed=0)
    assert Counter(e.label for e in chosen) == {0: 7, 1: 7}
    assert set(chosen) <= set(pool) and len(set(chosen)) == len(chosen)
    assert {e for e in pool if e.label == 1} <= set(chosen)  # the minority class is kept whole
    assert chosen == sorted(chosen, key=lambda e: (KINDS.index(e.kind), e.index))


def test_balanced_examples_cap_is_respected():
    chosen = balanced_examples(candidates(40, 60), cap=12, seed=0)
    assert Counter(e.label for e in chosen) == {0: 12, 1: 12}


def test_balanced_examples_are_deterministic():
    pool = candidates(25, 80)
    assert balanced_examples(pool, 10, seed=3) == balanced_examples(list(pool), 10, seed=3)
    assert balanced_examples(pool, 10, seed=3) != balanced_examples(pool, 10, seed=4)


def test_balanced_examples_with_a_missing_class_is_empty():
    assert balanced_examples(candidates(0, 9), cap=5, seed=0) == []
    assert balanced_examples([], cap=5, seed=0) == []


# --- build_confidence_data on the tiny llama ----------------------------------------------------------

LAYERS = [0, 2]


def build(llm, templates, rows, cache, candidates=None, train_states="qa+rag", layers=LAYERS, splits=None):
    settings = data_settings(
        train_states,
        extraction={"layers": layers, "batch_size": 4},
        answers={"max_new_tokens": 3, "batch_size": 4},
        splits=splits or {},
    )
    return build_confidence_data(
        PromptedLLM(llm, templates),
        rows,
        settings=settings,
        cache=ShardedCache(str(cache), shard_size=5, progress=False),
        candidates=candidates,
    )


def stored_responses(cache, kind: str) -> list[str]:
    """The generations of one prompt kind, read back from the json shards on disk."""
    found = []
    for manifest_path in cache.glob("generations/*/manifest.json"):
        if json.loads(manifest_path.read_text())["spec"]["kind"] == kind:
            shards = sorted(manifest_path.parent.glob("shard-*.json"))
            found.append([text for shard in shards for text in json.loads(shard.read_text())])
    assert len(found) == 1, f"expected one generations artifact for {kind}, found {len(found)}"
    return found[0]


def refuse(*args, **kwargs):
    raise AssertionError("recomputed although everything should come from the cache")


@pytest.fixture(scope="module")
def rows(nq_rows):
    rows = nq_rows[:12]
    assert all(row.contexts for row in rows)
    return rows


@pytest.mark.heavy
def test_build_confidence_data_end_to_end(tiny_llama, templates, rows, tmp_path, monkeypatch):
    data = build(tiny_llama, templates, rows, tmp_path)

    # Stores: one per prompt kind, (layers, items, hidden) in shards of 5, the requested layers only.
    assert data.layers == LAYERS and data.train_states == "qa+rag"
    assert set(data.stores) == set(KINDS)
    for _, store in data.stores.items():
        assert len(store) == 12 and store.dim == 64 and store.layers == LAYERS
        assert [a.shape for a in store.arrays] == [(2, 5, 64), (2, 5, 64), (2, 2, 64)]
        assert all(isinstance(a, np.memmap) for a in store.arrays)
        for layer in LAYERS:
            assert store.take(layer, range(12)).shape == (12, 64)
        with pytest.raises(ValueError, match="not extracted"):
            store.get(1, 0)
    assert len({store.key for store in data.stores.values()}) == 3
    assert data.identity["activations"] == {kind: store.key for kind, store in data.stores.items()}

    # The stored states are the states of the prompts (checked against a plain engine on the QA prompt).
    prompts = build_prompts(PromptedLLM(tiny_llama, templates), rows, "qa", seed=0)
    reference = HiddenStateEngine(tiny_llama.model, tiny_llama.tokenizer, share_prefix=False, progress=False)
    expected = reference.extract(prompts, LAYERS)
    for position, layer in enumerate(LAYERS):
        np.testing.assert_allclose(data.stores["qa"].take(layer, range(12)), expected[position], rtol=1e-5, atol=1e-5)
    assert not np.allclose(data.stores["qa"].take(2, range(12)), data.stores["rag_gold"].take(2, range(12)))

    # Labels are has_answer (and exact match) of the responses stored on disk.
    for kind in KINDS:
        on_disk = stored_responses(tmp_path, kind)
        assert data.responses[kind] == on_disk and len(on_disk) == 12
        assert data.labels[kind].tolist() == [int(has_answer(r, row.answers)) for r, row in zip(on_disk, rows)]
        assert data.exact[kind].tolist() == [int(exact_match(r, row.answers)) for r, row in zip(on_disk, rows)]

    # Splits and balanced examples.
    assert len(data.split_of) == 12 and set(data.split_of) <= {"train", "dev", "test"}
    for split, examples in data.examples.items():
        assert sum(e.label for e in examples) * 2 == len(examples)
        assert all(data.split_of[e.index] == split and e.label == data.labels[e.kind][e.index] for e in examples)

    # A second call computes nothing: answers and states all come from the cache.
    monkeypatch.setattr(nqc, "generate_greedy", refuse)
    monkeypatch.setattr(HiddenStateEngine, "extract", refuse)
    again = build(tiny_llama, templates, rows, tmp_path)
    assert again.identity == data.identity
    assert again.responses == data.responses and again.split_of == data.split_of and again.examples == data.examples
    for kind in KINDS:
        np.testing.assert_array_equal(again.labels[kind], data.labels[kind])
        np.testing.assert_array_equal(again.stores[kind].take(2, range(12)), data.stores[kind].take(2, range(12)))
    # The QA states do not depend on which other kinds are built alongside.
    qa_only = build(tiny_llama, templates, rows, tmp_path, train_states="qa")
    assert set(qa_only.stores) == {"qa"} and qa_only.stores["qa"].key == data.stores["qa"].key
    monkeypatch.undo()

    # Another QA template: other states, under another key (nothing is reused from the old template).
    edited = dataclasses.replace(templates, qa=templates.qa + "\nAnswer in a few words.")
    changed = build(tiny_llama, edited, rows, tmp_path, train_states="qa")
    assert changed.stores["qa"].key != data.stores["qa"].key
    assert changed.identity["prompts"] != data.identity["prompts"]
    assert not np.array_equal(changed.stores["qa"].take(2, range(12)), data.stores["qa"].take(2, range(12)))
    assert len(list(tmp_path.glob("activations/*/manifest.json"))) == 4

    # Other layers: another key too.
    other_layers = build(tiny_llama, templates, rows, tmp_path, train_states="qa", layers=[0, 2, 4])
    assert other_layers.stores["qa"].key != data.stores["qa"].key
    np.testing.assert_allclose(
        other_layers.stores["qa"].take(2, range(12)), data.stores["qa"].take(2, range(12)), rtol=1e-5, atol=1e-5
    )


def test_build_confidence_data_rejects_bad_settings(tiny_llama, templates, rows, tmp_path):
    with pytest.raises(ValueError, match="train_states"):
        build(tiny_llama, templates, rows, tmp_path, train_states="rag")
    with pytest.raises(ValueError, match=r"splits\.sizes"):
        build(tiny_llama, templates, rows, tmp_path, splits={"sizes": {"train": 1, "dev": 1}})
    with pytest.raises(ValueError, match=r"0\.\.4"):
        build(tiny_llama, templates, rows, tmp_path, layers=[9])
    assert not list(tmp_path.iterdir())  # refused before anything was computed


@pytest.mark.heavy
def test_candidates_option_trains_on_every_candidate_labelled_by_its_answer(tiny_llama, templates, rows, tmp_path):
    """`candidates`: one state per (question, candidate) pair, lists of different lengths, each labelled by the
    LLM's own answer under that candidate; no QA or gold-paragraph state; splits by question."""
    from confrag.probe.prompt_kinds import PAIRS_KIND

    lists = [[row.contexts[0], rows[(i + 1) % len(rows)].contexts[0]][: 1 + i % 2] for i, row in enumerate(rows)]
    data = build(
        tiny_llama, templates, rows, tmp_path, train_states="candidates", candidates=lists, splits={"balance": False}
    )
    assert set(data.stores) == {PAIRS_KIND}
    pairs = sum(len(c) for c in lists)
    assert len(data.stores[PAIRS_KIND]) == pairs == len(data.labels[PAIRS_KIND]) == len(data.pair_question)
    assert data.pair_question.tolist() == [i for i, c in enumerate(lists) for _ in c]
    on_disk = stored_responses(tmp_path, PAIRS_KIND)
    golds = [rows[i].answers for i in data.pair_question]
    assert data.labels[PAIRS_KIND].tolist() == [int(has_answer(r, g)) for r, g in zip(on_disk, golds)]
    prompts = [
        templates.rag_prompt(tiny_llama.tokenizer, rows[i].question, [p]) for i, c in enumerate(lists) for p in c
    ]
    reference = HiddenStateEngine(tiny_llama.model, tiny_llama.tokenizer, share_prefix=False, progress=False)
    np.testing.assert_allclose(
        data.stores[PAIRS_KIND].take(2, range(pairs)), reference.extract(prompts, [2])[0], rtol=1e-5, atol=1e-5
    )
    # Unbalanced: every pair of a split's questions is an example of that split, none elsewhere.
    for split, examples in data.examples.items():
        expected = [j for j, i in enumerate(data.pair_question) if data.split_of[i] == split]
        assert [e.index for e in examples] == expected
    assert data.summary()["candidates/has_answer"] == pytest.approx(data.labels[PAIRS_KIND].mean())
