"""Keys renamed for what they hold (`nq_path` -> `questions_path`: any question set, not only NQ's) are still read
under their old names for one release (`confrag.instantiators.RENAMED`): an old key set on the command line or in
a config runs, with a warning naming the new key; the old and the new key set to different values are refused,
naming both. The old environment variable `CONFRAG_NQ_PATH` likewise."""

from __future__ import annotations

import copy

import pytest
from omegaconf import OmegaConf

from confrag.data import default_questions_path, load_questions_jsonl
from confrag.instantiators import RENAMED, renamed_keys, settings_from
from confrag.rag.settings import EvalSettings
from confrag.tasks import cbdr, probe

from helpers.questions import write_questions
from helpers.runs import compose_cfg

LOGGER = "confrag.instantiators"
# (experiment, old key, new key): every renamed key, in a task whose config holds its node.
CASES = [
    ("probe_tiny_llama", "paths.nq_path", "paths.questions_path"),
    ("probe_tiny_llama", "data.nq_path", "data.questions_path"),
    ("cbdr_tiny_llama", "probe.data.nq_path", "probe.data.questions_path"),
    ("cbdr_tiny_llama", "retrieval.nq_path", "retrieval.questions_path"),
    ("cbdr_tiny_llama", "base_reranker.nq_path", "base_reranker.questions_path"),
    ("cbdr_tiny_llama", "eval.nq_path", "eval.questions_path"),
]


@pytest.fixture(autouse=True)
def _no_question_variables(monkeypatch):
    monkeypatch.delenv("CONFRAG_NQ_PATH", raising=False)
    monkeypatch.delenv("CONFRAG_QUESTIONS_PATH", raising=False)


def test_the_cases_cover_every_renamed_key():
    assert sorted(old for _, old, _ in CASES) == sorted(RENAMED)
    assert all(RENAMED[old] == new for _, old, new in CASES)


@pytest.fixture(scope="module")
def composed(tmp_path_factory):
    """Each experiment composed once (composing takes seconds): as shipped, with every old key set on the command
    line, and with every new key set; a test works on a copy."""
    tmp = tmp_path_factory.mktemp("composed")
    configs = {}
    for experiment in sorted({e for e, _, _ in CASES}):
        old = [f"{o}=/data/{o}.jsonl" for e, o, _ in CASES if e == experiment]
        new = [f"{n}=/data/{n}.jsonl" for e, _, n in CASES if e == experiment]
        for name, overrides in (("shipped", []), ("old", old), ("new", new)):
            configs[experiment, name] = compose_cfg([f"+experiment={experiment}", *overrides], tmp)
    return configs


def copy_of(composed, experiment: str, name: str):
    return copy.deepcopy(composed[experiment, name])


@pytest.mark.parametrize(("experiment", "old", "new"), CASES)
def test_an_old_key_still_works_and_warns_naming_the_new_one(experiment, old, new, composed, caplog):
    cfg = copy_of(composed, experiment, "old")
    with caplog.at_level("WARNING", logger=LOGGER):
        renamed_keys(cfg)
    value = f"/data/{old}.jsonl"
    assert f"{old} is deprecated (read for one release): it is now {new}; set {new}={value}" in caplog.text
    parent = old.rpartition(".")[0]
    assert OmegaConf.select(cfg, new) == value
    assert "nq_path" not in OmegaConf.select(cfg, parent)  # what reads the config sees the new name only
    caplog.clear()
    with caplog.at_level("WARNING", logger=LOGGER):
        renamed_keys(cfg)  # a second call changes nothing and warns no more
    assert OmegaConf.select(cfg, new) == value and not caplog.text


@pytest.mark.parametrize(("experiment", "old", "new"), CASES)
def test_the_new_key_works_without_a_warning(experiment, old, new, composed, caplog):
    cfg = copy_of(composed, experiment, "new")
    with caplog.at_level("WARNING", logger=LOGGER):
        renamed_keys(cfg)
    assert OmegaConf.select(cfg, new) == f"/data/{new}.jsonl" and not caplog.text
    assert "nq_path" not in OmegaConf.select(cfg, old.rpartition(".")[0])


@pytest.mark.parametrize(("experiment", "old", "new"), CASES)
def test_old_and_new_keys_set_to_different_values_are_refused_naming_both(experiment, old, new, composed):
    cfg = copy_of(composed, experiment, "shipped")
    OmegaConf.update(cfg, old, "/data/a.jsonl")
    OmegaConf.update(cfg, new, "/data/b.jsonl")
    with pytest.raises(
        ValueError, match=rf"{old}=/data/a.jsonl and {new}=/data/b.jsonl are both set: .*set {new} only"
    ):
        renamed_keys(cfg)
    OmegaConf.update(cfg, new, "/data/a.jsonl")
    renamed_keys(cfg)  # the same file under both names: read
    assert OmegaConf.select(cfg, new) == "/data/a.jsonl"


def test_the_old_paths_key_reaches_every_node_that_reads_the_dataset(composed):
    cfg = copy_of(composed, "cbdr_tiny_llama", "shipped")
    OmegaConf.update(cfg, "paths.nq_path", "/data/mine.jsonl")
    renamed_keys(cfg)
    assert cfg.dataset.questions_path == cfg.probe.data.questions_path == cfg.retrieval.questions_path
    assert cfg.retrieval.questions_path == "/data/mine.jsonl"


def test_the_old_environment_variable_still_works_and_warns(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("CONFRAG_NQ_PATH", "/data/old.jsonl")
    cfg = compose_cfg(["+experiment=probe_tiny_llama"], tmp_path)
    with caplog.at_level("WARNING"):
        renamed_keys(cfg)
    assert cfg.data.questions_path == "/data/old.jsonl"
    assert "CONFRAG_NQ_PATH is deprecated" in caplog.text and "CONFRAG_QUESTIONS_PATH=/data/old.jsonl" in caplog.text
    monkeypatch.setenv("CONFRAG_QUESTIONS_PATH", "/data/new.jsonl")
    cfg = compose_cfg(["+experiment=probe_tiny_llama"], tmp_path)
    with pytest.raises(ValueError, match="CONFRAG_NQ_PATH=/data/old.jsonl and CONFRAG_QUESTIONS_PATH=/data/new.jsonl"):
        renamed_keys(cfg)


def test_a_settings_node_read_on_its_own_reads_its_old_key_too(composed, caplog):
    """A node read without the root's `renamed_keys` (`settings_from` by a caller of its own, a plain dict)."""
    node = dict(composed["cbdr_tiny_llama", "shipped"].eval, nq_path=__file__)
    with caplog.at_level("WARNING", logger=LOGGER):
        assert settings_from(EvalSettings, node, "eval").questions_path == __file__
    assert "eval.nq_path is deprecated" in caplog.text and "nq_path" in node  # the caller's dict left as it was
    with pytest.raises(ValueError, match="eval.nq_path=.* and eval.questions_path=.* are both set"):
        settings_from(EvalSettings, {**node, "questions_path": "other.jsonl"}, "eval")
    shipped = copy_of(composed, "cbdr_tiny_llama", "shipped")  # a DictConfig node: its null old key is dropped
    assert settings_from(EvalSettings, shipped.eval, "eval").questions_path is None and "nq_path" not in shipped.eval


# --- through the tasks' own check, as a command line reaches it ---------------------------------------------------


def test_the_probe_task_reads_its_questions_from_the_old_key(tmp_path, nothing_runs, caplog):
    path = write_questions(tmp_path / "mine.jsonl", load_questions_jsonl(default_questions_path(), limit=40))
    cfg = compose_cfg(["+experiment=probe_tiny_llama", f"data.nq_path={path}"], tmp_path)
    with caplog.at_level("WARNING", logger=LOGGER):
        checked = probe.check(cfg)
    assert checked.recipe.make_datamodule().questions_path == path
    assert "data.nq_path is deprecated" in caplog.text


def test_the_cbdr_task_reads_its_evaluation_file_from_the_old_key(tmp_path, nothing_runs, caplog):
    rows = load_questions_jsonl(default_questions_path(), limit=160)
    train = write_questions(tmp_path / "nq.jsonl", rows[:150])
    mine = write_questions(tmp_path / "mine.jsonl", rows[150:154])
    overrides = [f"paths.nq_path={train}", f"eval.nq_path={mine}", "eval.num_questions=null"]
    cfg = compose_cfg(["+experiment=cbdr_tiny_llama", *overrides], tmp_path)
    with caplog.at_level("WARNING", logger=LOGGER):
        checked = cbdr.check(cfg)
    assert checked.evaluation.questions_path == mine and checked.recipe.retrieval.eval_questions_path == mine
    assert checked.recipe.retrieval.questions_path == train
    assert "eval.nq_path is deprecated" in caplog.text and "paths.nq_path is deprecated" in caplog.text
    clash = compose_cfg(["+experiment=cbdr_tiny_llama", *overrides, f"eval.questions_path={train}"], tmp_path)
    with pytest.raises(ValueError, match=rf"eval.nq_path={mine} and eval.questions_path={train} are both set"):
        cbdr.check(clash)
