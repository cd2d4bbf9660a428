"""The GPU levers as settings: `auto` batch sizes where the library sizes batches from free memory, the
`rag.generation` node, and the per-stage timing record that goes into metrics.json."""

from __future__ import annotations

import pytest
import torch

from confrag.infra.timing import StageTimer
from confrag.instantiators import settings_from
from confrag.llm.generation import GreedyOptions
from confrag.rag.settings import AnswerSettings, EvalSettings
from confrag.recipes import cbdr_recipe
from confrag.stages.nq_rerank import PreferenceSettings
from confrag.stages.retrieval import RetrievalSettings

from helpers.runs import compose_cfg
from helpers.settings import shipped_settings

GPU_EXPERIMENTS = ["cbdr_llama3", "cbdr_qwen2_5", "cbdr_llama3_shape", "reranker_llama3", "reranker_qwen2_5"]


@pytest.mark.parametrize("name", GPU_EXPERIMENTS)
def test_gpu_experiments_size_their_batches_from_free_memory(name, tmp_path):
    cfg = compose_cfg([f"+experiment={name}"], tmp_path)
    assert cfg.probe.data.answers.batch_size == "auto" and cfg.probe.data.extraction.batch_size == "auto"
    preferences = settings_from(PreferenceSettings, cfg.preferences, "preferences")
    assert preferences.extract_batch_size == "auto"
    if name.startswith("cbdr"):
        answers = settings_from(AnswerSettings, cfg.rag, "rag")
        assert (answers.batch_size, answers.extract_batch_size) == ("auto", "auto")
        assert answers.generation == GreedyOptions()  # rag.generation: {} is the library's default path
        retrieval = settings_from(RetrievalSettings, cfg.retrieval, "retrieval")
        cbdr = cbdr_recipe(cfg, answers, settings_from(EvalSettings, cfg.eval, "eval"), retrieval)
        assert cbdr.gate_batch_size == "auto"  # the live gate generates with the answers' batch size


@pytest.mark.parametrize("name", ["probe_llama3", "probe_qwen2_5"])
def test_gpu_probe_experiments_size_their_batches_from_free_memory(name, tmp_path):
    cfg = compose_cfg([f"+experiment={name}"], tmp_path)
    assert cfg.data.answers.batch_size == "auto" and cfg.data.extraction.batch_size == "auto"


def test_rag_generation_node_reaches_the_answer_settings():
    answers = shipped_settings(
        AnswerSettings, "rag", generation={"share_prefix": False, "static_cache": True, "cache_buckets": [128, 256]}
    )
    assert answers.generation == GreedyOptions(share_prefix=False, static_cache=True, cache_buckets=(128, 256))


@pytest.mark.parametrize(
    "cls, values, message",
    [
        (AnswerSettings, {"batch_size": 0}, r"rag.batch_size must be an integer >= 1 or 'auto'; got 0"),
        (AnswerSettings, {"extract_batch_size": "max"}, r"rag.extract_batch_size must be an integer >= 1 or 'auto'"),
        (AnswerSettings, {"chunk_size": "auto"}, r"rag.chunk_size must be an integer >= 1; got 'auto'"),
        (AnswerSettings, {"generation": {"beams": 4}}, r"rag.generation: unknown key\(s\) \['beams'\]; allowed: "),
        (AnswerSettings, {"generation": {"share_prefix": "yes"}}, r"rag.generation.share_prefix must be true or false"),
        (
            PreferenceSettings,
            {"extract_batch_size": "big"},
            r"preferences.extract_batch_size must be an integer >= 1 or 'auto'; got 'big'",
        ),
        (PreferenceSettings, {"top_k": "auto"}, r"preferences.top_k must be an integer >= 1; got 'auto'"),
    ],
)
def test_bad_batch_and_generation_settings_are_named(cls, values, message):
    key = "rag" if cls is AnswerSettings else "preferences"
    with pytest.raises(ValueError, match=message):
        shipped_settings(cls, key, **values)


def test_stage_timer_records_each_stage_even_when_it_fails():
    timer = StageTimer()
    with timer.stage("first"):
        sum(range(1000))
    with pytest.raises(RuntimeError), timer.stage("failed"):
        raise RuntimeError("boom")
    assert list(timer.stages) == ["first", "failed"]
    assert timer.stages["first"]["seconds"] >= 0
    if not torch.cuda.is_available():
        assert timer.stages["first"]["peak_gpu_memory_gib"] is None
    assert set(timer.stages["first"]) == {"seconds", "peak_gpu_memory_gib", "gpu_memory_gib"}
    assert timer.seconds() == {name: record["seconds"] for name, record in timer.stages.items()}
