"""The rerank stage on the tiny llama: an interrupted preference build resumes to the same rows, the
relevance ablation's labels, and bad settings named by their key."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from confrag.infra.sharded import ShardedCache
from confrag.llm.hidden_states import HiddenStateEngine
from confrag.llm.prompted import PromptedLLM
from confrag.probe.module import SavedProbe
from confrag.reranker.preferences import build_rows, confidence_shifts, relevance_rows
from confrag.retrieval import BM25Retriever, corpus_from_gold_paragraphs, retrieve_candidates
from confrag.retrieval.candidates import make_candidates
from confrag.retrieval.corpus import CorpusPassage
from confrag.stages.retrieval import without_duplicates
from confrag.train import run_task

from helpers.modules import probe_module
from helpers.runs import compose_cfg

LAYER = 2


class Interrupted(RuntimeError):
    pass


class CountingEngine(HiddenStateEngine):
    """The real engine, counting calls, and failing at call `fail_at` (a process killed mid-build)."""

    def __init__(self, *args, fail_at: int | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls, self.fail_at = 0, fail_at

    def extract(self, prompts, layers, desc="hidden states"):
        self.calls += 1
        if self.fail_at is not None and self.calls == self.fail_at:
            raise Interrupted("killed")
        return super().extract(prompts, layers, desc)


@pytest.fixture(scope="module")
def setting(tiny_llama, templates, nq_rows):
    corpus = corpus_from_gold_paragraphs(nq_rows)
    candidates = retrieve_candidates(nq_rows[:6], corpus, BM25Retriever(corpus), top_n=4)
    module = probe_module(input_dim=tiny_llama.model.config.hidden_size, layer=LAYER)
    module.set_standardization(np.zeros(module.hparams.input_dim), np.ones(module.hparams.input_dim))
    identity = {"llm": tiny_llama.identity, "prompts": templates.identity(tiny_llama.tokenizer), "layer": LAYER}
    return {"candidates": candidates, "probe": SavedProbe(module, {"activations": identity})}


def shifts_with(setting, llm, templates, cache_dir, engine):
    return confidence_shifts(
        PromptedLLM(llm, templates),
        setting["probe"],
        setting["candidates"],
        engine=engine,
        cache=ShardedCache(cache_dir, shard_size=4, progress=False),
    )


def test_interrupted_preference_build_resumes_to_the_same_rows(setting, tiny_llama, templates, tmp_path):
    engine = lambda fail_at=None: CountingEngine(
        tiny_llama.model,
        tiny_llama.tokenizer,
        progress=False,  # noqa: E731
        fail_at=fail_at,
    )
    reference = shifts_with(setting, tiny_llama, templates, tmp_path / "fresh", engine())
    # 6 questions: 2 reference shards each for qa and rag_empty; 24 candidate prompts: 6 shards.
    broken = engine(fail_at=7)  # dies on the third candidate shard
    with pytest.raises(Interrupted):
        shifts_with(setting, tiny_llama, templates, tmp_path / "resumed", broken)
    rerun = engine()
    resumed = shifts_with(setting, tiny_llama, templates, tmp_path / "resumed", rerun)
    assert rerun.calls == 4  # only the four candidate shards that were missing
    for ref in ("qa", "rag_empty"):
        assert np.array_equal(resumed.reference[ref], reference.reference[ref])
    assert all(np.array_equal(a, b) for a, b in zip(resumed.candidates, reference.candidates))
    assert build_rows(setting["candidates"], resumed, "qa", 2, "sign") == build_rows(
        setting["candidates"], reference, "qa", 2, "sign"
    )


def test_questions_within_an_extracted_set_read_its_states_instead_of_extracting_again(
    setting, tiny_llama, templates, tmp_path
):
    """The evaluation's diagnostics of cross-fitted questions read NQ_Rerank's states (they were extracted
    again under the test questions' key before: ~12,000 prompts at full size)."""
    engine = CountingEngine(tiny_llama.model, tiny_llama.tokenizer, progress=False)
    whole = shifts_with(setting, tiny_llama, templates, tmp_path, engine)
    calls = engine.calls
    some = [setting["candidates"][i] for i in (4, 1, 2)]
    kwargs = dict(engine=engine, cache=ShardedCache(tmp_path, shard_size=4, progress=False))
    read = confidence_shifts(
        PromptedLLM(tiny_llama, templates), setting["probe"], some, within=setting["candidates"], **kwargs
    )
    assert engine.calls == calls  # nothing extracted
    for ref in ("qa", "rag_empty"):
        assert np.array_equal(read.reference[ref], whole.reference[ref][[4, 1, 2]])
    assert all(np.array_equal(a, whole.candidates[i]) for a, i in zip(read.candidates, (4, 1, 2)))
    # The same questions extracted under their own key agree with what was read.
    own = confidence_shifts(PromptedLLM(tiny_llama, templates), setting["probe"], some, **kwargs)
    assert engine.calls > calls
    assert all(np.allclose(a, b, atol=1e-5) for a, b in zip(read.candidates, own.candidates))
    # A question whose passages differ from the extracted set's is not taken from it.
    changed = [some[0], dataclasses.replace(some[1], passages=some[1].passages[::-1])]
    calls = engine.calls
    confidence_shifts(
        PromptedLLM(tiny_llama, templates), setting["probe"], changed, within=setting["candidates"], **kwargs
    )
    assert engine.calls > calls


def test_probe_of_another_llm_is_refused(setting, tiny_llama, tiny_qwen2, templates, tmp_path):
    other = SavedProbe(
        setting["probe"].module, {"activations": {**setting["probe"].meta["activations"], "llm": tiny_qwen2.identity}}
    )
    engine = HiddenStateEngine(tiny_llama.model, tiny_llama.tokenizer, progress=False)
    with pytest.raises(ValueError, match="llm: trained on"):
        confidence_shifts(
            PromptedLLM(tiny_llama, templates),
            other,
            setting["candidates"],
            engine=engine,
            cache=ShardedCache(tmp_path, progress=False),
        )


def passage(i: int, text: str) -> CorpusPassage:
    return CorpusPassage(f"d{i}#0", f"T{i}", text, f"d{i}")


def test_relevance_rows_label_passages_by_answer_and_skip_one_sided_questions():
    both = make_candidates(
        "q1",
        "who wrote hamlet",
        ["Shakespeare"],
        [
            passage(0, "a play"),
            passage(1, "Hamlet by William Shakespeare"),
            passage(2, "other"),
            passage(3, "Shakespeare again"),
        ],
        [4.0, 3.0, 2.0, 1.0],
        None,
    )
    no_answer = make_candidates(
        "q2", "what is x", ["zeta"], [passage(4, "alpha"), passage(5, "beta")], [2.0, 1.0], None
    )
    rows = relevance_rows([both, no_answer], {"q1", "q2"}, top_k=1)
    assert rows == [
        {
            "qid": "q1",
            "query": "who wrote hamlet",
            "pos": ["T1\nHamlet by William Shakespeare"],
            "neg": ["T0\na play"],
            "prompt": rows[0]["prompt"],
        }
    ]
    assert relevance_rows([both], {"q2"}, top_k=5) == []  # only the given (training) questions


def test_duplicate_candidate_passages_are_removed_and_counted():
    dup = make_candidates(
        "q", "q?", ["a"], [passage(0, "same"), passage(1, "x"), passage(0, "same")], [3.0, 2.0, 1.0], None
    )
    cleaned, removed = without_duplicates(dup)
    assert removed == 1 and [p.text for p in cleaned.passages] == ["same", "x"] and cleaned.scores == [3.0, 2.0]


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.tau=0", "model.tau must be > 0"),
        ("preferences.top_k=0", "preferences.top_k must be an integer >= 1"),
        ("retrieval.retriever=sparse", "retrieval.retriever='sparse' is not one of"),
        ("preferences.reference=gold", "preferences.reference='gold' is not one of"),
        ("data.group_size=1", "data.group_size must be an integer >= 2"),
        ("preferences.test_fraction=1.5", r"preferences.test_fraction must be a number in \(0, 1\); got 1.5"),
        ("preferences.teacher=oracle", r"preferences.teacher='oracle' is not one of \('inc', 'base'\)"),
        ("preferences.mix_relevance=3", r"preferences.mix_relevance must be true or false"),
        ("preferences.cross_fit=1", r"preferences.cross_fit must be 0 \(off\) or an integer >= 2 folds"),
        (
            "model.distill_weight=1.0",  # the relevance control's rows carry no Inc to distil
            r"model.distill_weight > 0 with preferences.teacher=inc .* preferences.relevance_baseline=false, or distil",
        ),
    ],
)
def test_bad_settings_fail_before_any_stage_runs(override, message, tmp_path):
    cfg = compose_cfg(["+experiment=reranker_tiny_llama", override, "logger=csv"], tmp_path)
    with pytest.raises(ValueError, match=message):
        run_task(cfg)
    assert not (tmp_path / "cache").exists()  # nothing computed
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())  # no run files either


@pytest.mark.slow  # make test-all: kept out of make test's 15 minutes
@pytest.mark.task
def test_distilling_toward_the_base_trains_the_relevance_control_on_the_bases_scores_too(tmp_path):
    """The documented option `preferences.teacher=base model.distill_weight=1.0` failed in the relevance control,
    whose rows carried no teacher scores; the control now gets the aligned rerankers' teacher."""
    cfg = compose_cfg(
        ["+experiment=reranker_tiny_llama", "preferences.teacher=base", "model.distill_weight=1.0", "logger=csv"],
        tmp_path,
    )
    run_task(cfg)
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert "relevance" in summary.lower()
    # NQ_Rerank's candidates against the reranker's budget (query_max_len 128 + passage_max_len 64), counted.
    counted = json.loads((tmp_path / "out" / "metrics.json").read_text())["nq_rerank"]["retrieval"]
    reranker = counted["passage_lengths"]["reranker"]
    assert reranker["limit"] == 192 and reranker["passages"] > 0
    assert (
        f"candidate passages cut by the reranker's budget: {reranker['over_limit']} of {reranker['passages']}"
        in summary
    )
