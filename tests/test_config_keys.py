"""Who names a bad value: the library names the parameter (`k must be ...`), the config boundary that built the
object from a node adds the node's key (`gate.k must be ...`; `confrag.infra.checks.config_key`)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from confrag.infra import checks
from confrag.instantiators import built, settings_from


def test_a_message_opening_with_a_parameter_reads_as_the_full_key():
    assert checks.keyed("k must be an integer >= 1; got 0", "gate", {"k"}) == "gate.k must be an integer >= 1; got 0"
    assert checks.keyed("beta=0.6 must be >= alpha=0.8", "gates.configs.bridge", {"alpha", "beta"}) == (
        "gates.configs.bridge.beta=0.6 must be >= alpha=0.8"
    )
    assert checks.keyed("generation: unknown key(s)", "rag", {"generation"}) == "rag.generation: unknown key(s)"
    assert checks.keyed("layers[0] must be", "gate", {"layers"}) == "gate.layers[0] must be"
    # any other message gets the node as its place; one already under the key is left as it is
    assert checks.keyed("the direction is missing", "gate", {"k"}) == "gate: the direction is missing"
    assert checks.keyed("kind must be one of", "gate", {"k"}) == "gate: kind must be one of"
    assert checks.keyed("gate.k must be", "gate", {"k"}) == "gate.k must be"


def test_config_key_raises_the_same_error_type_under_the_key():
    class Mismatch(ValueError):
        pass

    with pytest.raises(Mismatch, match=r"^model\.lr must be > 0") as err, checks.config_key("model", {"lr"}):
        raise Mismatch("lr must be > 0")
    assert str(err.value.__cause__) == "lr must be > 0"  # chained to the library's own refusal
    with pytest.raises(TypeError, match="^not a value error$"), checks.config_key("model", {"lr"}):
        raise TypeError("not a value error")


def test_only_parameters_are_rekeyed_around_a_stage():
    with pytest.raises(ValueError, match=r"^gate\.heads=3 must divide"), checks.config_key("gate", {"heads"}, False):
        raise ValueError("heads=3 must divide the embedding width 8")
    with pytest.raises(ValueError, match="^gate 'x' is not trained$"), checks.config_key("gate", {"heads"}, False):
        raise ValueError("gate 'x' is not trained")


def test_every_collected_refusal_is_rekeyed():
    problems = []
    checks.collect(problems, checks.positive_int, 0, "top_k")
    checks.collect(problems, checks.choice, "x", "teacher", ("inc", "base"))
    with pytest.raises(checks.Refusals) as err, checks.config_key("preferences", {"top_k", "teacher"}):
        checks.refuse(problems)
    assert err.value.problems == [
        "preferences.top_k must be an integer >= 1; got 0",
        "preferences.teacher='x' is not one of ('inc', 'base')",
    ]
    checks.refuse([])  # nothing gathered: nothing raised


@dataclass(frozen=True)
class Knob:
    top_k: int

    def __post_init__(self) -> None:
        checks.positive_int(self.top_k, "top_k")


def test_settings_from_reports_a_field_under_its_node():
    with pytest.raises(ValueError, match=r"^knob\.top_k must be an integer >= 1; got 0$"):
        settings_from(Knob, {"top_k": 0}, "knob")
    with pytest.raises(ValueError, match=r"^top_k must be an integer >= 1; got 0$"):
        Knob(0)  # the library alone names the parameter


def test_built_takes_off_hydras_wrapper_and_names_the_node():
    node = {"_target_": "confrag.gates.skr.SKRKnnGate", "k": 0, "threshold": 0.5}
    with pytest.raises(ValueError, match=r"^gate\.k must be an integer >= 1; got 0$"):
        built(node, "gate")
    with pytest.raises(ValueError, match=r"^gate: .*unexpected keyword argument 'kk'"):
        built({**node, "k": 3, "kk": 1}, "gate")


def test_a_plain_settings_node_has_its_own_keys_and_logs_no_class_error(caplog):
    """A node without `_target_` (cbdr's, a settings node) once sent `get_class("None")` to Hydra, which logged a red
    "Error getting class at None" at the start of every cbdr run."""
    from confrag.instantiators import node_parameters

    with caplog.at_level("DEBUG"):
        assert node_parameters({"beta": 0.9, "top_k": 3}) == {"beta", "top_k"}
    assert "Error getting class" not in caplog.text
    assert "questions_path" in node_parameters({"_target_": "confrag.probe.datamodule.NQConfidenceDataModule"})
