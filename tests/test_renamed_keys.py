"""Keys renamed for what they hold (`nq_path` -> `questions_path`: any question set, not only NQ's) are still read
under their old names for one release (`confrag.instantiators.RENAMED`): an old key set on the command line or in
a config runs, with a warning naming the new key; the old and the new key set to different values are refused,
naming both. The old environment variable `CONFRAG_NQ_PATH` likewise."""

from __future__ import annotations

import copy

import pytest
from omegaconf import OmegaConf, open_dict

from confrag.data import default_questions_path, load_questions_jsonl
from confrag.instantiators import GROUPED, RENAMED, grouped_overrides, renamed_keys, settings_from
from confrag.rag.settings import EvalSettings
from confrag.tasks import cbdr, probe

from helpers.questions import write_questions
from helpers.runs import ROOT, compose_cfg

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


# --- the probe data node's flat keys, moved into its option groups (GROUPED) -------------------------------------


def test_every_grouped_key_has_its_place_in_the_shipped_node_and_the_old_one_is_gone():
    node = OmegaConf.load(ROOT / "conf" / "data" / "nq_confidence.yaml")
    for old, new in GROUPED.items():
        assert old not in node, f"conf/data/nq_confidence.yaml still holds {old}"
        group, _, field = new.partition(".")
        assert field in node[group], f"{new} is not in conf/data/nq_confidence.yaml"


def test_an_old_command_line_key_is_rewritten_to_its_group_with_a_warning(caplog):
    arguments = [
        "+experiment=probe_tiny_llama",
        "data.balance=false",
        "probe.data.gen_batch_size=4",
        "+data.extract_compile=true",  # added a key the YAML lacked; its group holds it now
        "data.generation.static_cache=true",
        "data.layers=1,2",  # a sweep's values pass unchanged
        "data.num_questions=10",  # not moved
        "--multirun",
    ]
    with caplog.at_level("WARNING", logger=LOGGER):
        rewritten = grouped_overrides(arguments)
    assert rewritten == [
        "+experiment=probe_tiny_llama",
        "data.splits.balance=false",
        "probe.data.answers.batch_size=4",
        "data.extraction.compile=true",
        "data.answers.generation.static_cache=true",
        "data.extraction.layers=1,2",
        "data.num_questions=10",
        "--multirun",
    ]
    assert "data.balance is deprecated (read for one release): it is now data.splits.balance" in caplog.text
    assert "(probe.data.splits.balance in the rerank, cbdr and gates tasks)" in caplog.text
    assert caplog.text.count("is deprecated") == 5
    assert grouped_overrides(rewritten) == rewritten  # the new keys pass as they are


def test_a_rewritten_command_line_composes_and_lands_in_the_group(tmp_path):
    old = ["+experiment=probe_tiny_llama", "data.balance=true", "data.extract_batch_size=3", "data.ranking_top_n=7"]
    cfg = compose_cfg(grouped_overrides(old), tmp_path)
    assert cfg.data.splits.balance is True and cfg.data.extraction.batch_size == 3 and cfg.data.ranking.top_n == 7
    with pytest.raises(Exception, match="Could not override 'data.balance'"):  # Hydra, to the old key unrewritten
        compose_cfg(old, tmp_path)


def test_an_old_key_in_a_config_file_moves_into_its_group_and_wins(composed, caplog):
    cfg = copy_of(composed, "cbdr_tiny_llama", "shipped")
    with open_dict(cfg):
        cfg.probe.data.extract_batch_size = 5  # as a user's own experiment file written before the groups sets it
        cfg.probe.data.question_splits = {"train": 8, "dev": 1, "test": 1}
    with caplog.at_level("WARNING", logger=LOGGER):
        renamed_keys(cfg)
    assert cfg.probe.data.extraction.batch_size == 5 and "extract_batch_size" not in cfg.probe.data
    assert cfg.probe.data.splits.proportions == {"train": 8, "dev": 1, "test": 1}
    assert "probe.data.extract_batch_size is deprecated (read for one release): it is now " in caplog.text
    assert "probe.data.extraction.batch_size=5 (it replaces probe.data.extraction.batch_size=16 of the config" in (
        caplog.text
    )
    caplog.clear()
    with caplog.at_level("WARNING", logger=LOGGER):
        renamed_keys(cfg)  # a second call changes nothing
    assert not caplog.text and cfg.probe.data.extraction.batch_size == 5


def test_an_old_command_line_key_beside_its_new_key_is_refused_naming_both():
    with pytest.raises(ValueError, match=r"data.balance=true and data.splits.balance=false are both set: .*set data"):
        grouped_overrides(["+experiment=probe_tiny_llama", "data.balance=true", "data.splits.balance=false"])
    with pytest.raises(ValueError, match=r"probe.data.layers=mid and probe.data.extraction.layers=all are both set"):
        grouped_overrides(["probe.data.extraction.layers=all", "probe.data.layers=mid"])


def test_the_command_line_wins_over_an_old_key_in_a_config_file(composed, caplog, monkeypatch):
    """A user's experiment file written before the groups (`extract_batch_size: 5`) and a command line that sets the
    new key: the command line's value is the one read, and the file's old key is named as not read."""
    import confrag.instantiators as instantiators

    cfg = copy_of(composed, "cbdr_tiny_llama", "shipped")
    with open_dict(cfg):
        cfg.probe.data.extraction.batch_size = 2  # what the command line set
        cfg.probe.data.extract_batch_size = 5  # what the user's file set under the old name
    monkeypatch.setattr(instantiators, "_command_line_keys", lambda: {"probe.data.extraction.batch_size"})
    with caplog.at_level("WARNING", logger=LOGGER):
        renamed_keys(cfg)
    assert cfg.probe.data.extraction.batch_size == 2 and "extract_batch_size" not in cfg.probe.data
    assert (
        "probe.data.extract_batch_size=5 (a config file's, deprecated: it is now probe.data.extraction" in caplog.text
    )
    assert "is not read: the command line sets probe.data.extraction.batch_size=2" in caplog.text
