"""The checks of settings values, in one place: a bad value is refused naming its key and what is allowed.

Every settings dataclass, `_target_` constructor and stage checks its values with these functions instead of
writing `isinstance(x, bool) or not isinstance(x, int) or x < 1` again (bool is an int subclass, and
`true` where a count belongs is always a typo). Each returns the value it checked, so a check reads as an
assignment; each raises `ValueError` (or the `error` type a caller names, e.g. a data file's
`DataFormatError`) with the message `<key> must be <allowed>[ <hint>]; got <value>`.

Who names what (one convention, both halves here): below the config boundary a check names the parameter as the
Python code knows it (`k must be an integer >= 1; got 0`), never a config key, because the library does not know
which node of which run built it (the same gate is `gate.k` after `gate=ccsk` and `gates.configs.ccsk.k` in the
`gates` list). The boundary that builds the object from a config node (`instantiators.settings_from`,
`gates.settings.gate_from_config`, the recipes) runs the constructor inside `config_key(node_key, parameters)`,
which re-raises the refusal under the node's key: `gate.k must be an integer >= 1; got 0`.

No Hydra here: plain values in, plain values out, importable from every layer.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import numpy as np


def is_integer(value: Any, numpy: bool = False) -> bool:
    """An int (a NumPy integer too with `numpy`), never a bool."""
    kinds = (int, np.integer) if numpy else int
    return isinstance(value, kinds) and not isinstance(value, (bool, np.bool_))


def is_number(value: Any, numpy: bool = False) -> bool:
    """A finite int or float (NumPy scalars too with `numpy`), never a bool."""
    kinds = (int, float, np.integer, np.floating) if numpy else (int, float)
    return isinstance(value, kinds) and not isinstance(value, (bool, np.bool_)) and math.isfinite(value)


def _refuse(key: str, allowed: str, value: Any, hint: str, error: type[Exception]) -> Exception:
    return error(f"{key} must be {allowed}{' ' + hint if hint else ''}; got {value!r}")


def _alternatives(allowed: str, also: Sequence[Any], allow_none: bool, none: str) -> str:
    extra = [repr(a) for a in also] + ([none] if allow_none else [])
    return " or ".join([allowed, *extra])


# wide: a validator's keyword options (bounds, None, extra allowed values, the words of the message, the
# error type) are independent and optional: each of the ~80 calls names the one or two it needs; an options
# object would be built at every call for one or two fields.
def integer(
    value: Any,
    key: str,
    minimum: int | None = None,
    maximum: int | None = None,
    *,
    allow_none: bool = False,
    also: Sequence[Any] = (),
    numpy: bool = False,
    describe: str | None = None,
    hint: str = "",
    none: str = "null",
    error: type[Exception] = ValueError,
) -> Any:
    """`value` if it is an integer in [minimum, maximum] (either bound optional), one of `also` (e.g. "auto"),
    or None with `allow_none`. `describe` replaces the generated description of what is allowed; `none` is
    how None is spelled in it ("null" in a config, "None" for a Python argument)."""
    if (value is None and allow_none) or any(value == a and type(value) is type(a) for a in also):
        return value
    if (
        not is_integer(value, numpy)
        or (minimum is not None and value < minimum)
        or (maximum is not None and value > maximum)
    ):
        bounds = (
            f" in [{minimum}, {maximum}]"
            if minimum is not None and maximum is not None
            else f" >= {minimum}"
            if minimum is not None
            else f" <= {maximum}"
            if maximum is not None
            else ""
        )
        allowed = describe or _alternatives(f"an integer{bounds}", also, allow_none, none)
        raise _refuse(key, allowed, value, hint, error)
    return value


def positive_int(value: Any, key: str, **options: Any) -> Any:
    """An integer >= 1 (see `integer` for the options)."""
    return integer(value, key, 1, **options)


def non_negative_int(value: Any, key: str, **options: Any) -> Any:
    """An integer >= 0 (see `integer` for the options)."""
    return integer(value, key, 0, **options)


# wide: as `integer`'s: independent, optional keyword options of a validator (open or closed bounds, None,
# the words of the message, the error type), each caller naming the few it needs.
def number(
    value: Any,
    key: str,
    low: float | None = None,
    high: float | None = None,
    *,
    low_open: bool = False,
    high_open: bool = False,
    allow_none: bool = False,
    numpy: bool = False,
    hint: str = "",
    none: str = "null",
    error: type[Exception] = ValueError,
) -> Any:
    """`value` if it is a finite number in the interval from `low` to `high` (either bound optional;
    `low_open` / `high_open` exclude that bound), or None with `allow_none`."""
    if value is None and allow_none:
        return None
    valid = is_number(value, numpy)
    if valid and low is not None:
        valid = value > low if low_open else value >= low
    if valid and high is not None:
        valid = value < high if high_open else value <= high
    if not valid:
        if low is not None and high is not None:
            bounds = f" in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
        elif low is not None:
            bounds = f" {'>' if low_open else '>='} {low}"
        elif high is not None:
            bounds = f" {'<' if high_open else '<='} {high}"
        else:
            bounds = ""
        kind = "a number" if bounds else "a finite number"
        raise _refuse(key, _alternatives(f"{kind}{bounds}", (), allow_none, none), value, hint, error)
    return value


def probability(value: Any, key: str, **options: Any) -> Any:
    """A number in [0, 1]."""
    return number(value, key, 0, 1, **options)


def fraction(value: Any, key: str, **options: Any) -> Any:
    """A share strictly between 0 and 1: a number in (0, 1)."""
    return number(value, key, 0, 1, low_open=True, high_open=True, **options)


def choice(value: Any, key: str, allowed: Collection[Any], hint: str = "", error: type[Exception] = ValueError) -> Any:
    """`value` if it is one of `allowed`."""
    if value not in allowed:
        raise error(f"{key}={value!r} is not one of {tuple(allowed)!r}{' ' + hint if hint else ''}")
    return value


def flag(value: Any, key: str, hint: str = "", error: type[Exception] = ValueError) -> bool:
    """`value` if it is a bool: `true` or `false` in a config (never 1, 0 or "yes")."""
    if not isinstance(value, bool):
        raise _refuse(key, "true or false", value, hint, error)
    return value


def identifier(value: Any, key: str, error: type[Exception] = ValueError) -> str:
    """A record's id: a non-empty string or an integer (never a bool: True as an id is a data bug), as a string."""
    if not (isinstance(value, str) or is_integer(value)) or str(value).strip() == "":
        raise _refuse(key, "a non-empty string or an integer", value, "", error)
    return str(value)


def existing_path(
    value: Any,
    key: str,
    kind: str = "file",
    allow_none: bool = False,
    hint: str = "",
    error: type[Exception] = ValueError,
) -> Path | None:
    """`value` as a Path if it names an existing file (`kind="file"`), folder ("dir") or either ("any")."""
    if value is None and allow_none:
        return None
    exists = {"file": Path.is_file, "dir": Path.is_dir, "any": Path.exists}[kind]
    if not isinstance(value, (str, Path)) or not exists(Path(value)):
        what = {"file": "an existing file", "dir": "an existing folder", "any": "an existing path"}[kind]
        raise _refuse(key, _alternatives(what, (), allow_none, "null"), value, hint, error)
    return Path(value)


class Refusals(ValueError):
    """Every refusal of a settings object at once (gathered with `collect`): one message, its parts joined by
    "; ", each put under the node's key on its own by `config_key`."""

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = list(problems)
        super().__init__("; ".join(self.problems))


T = TypeVar("T")


def dataclass_from(cls: type[T], values: Mapping[str, Any] | None, key: str, missing_hint: str = "") -> T:
    """The dataclass `cls` from the mapping at `key` (a settings node, or one of its option groups): an unknown
    key is named with the ones `cls` takes, and so is a missing one (a field without a default); the dataclass's
    own refusal of a value is its own."""
    if values is not None and not isinstance(values, Mapping):
        allowed = sorted(f.name for f in dataclasses.fields(cls))
        raise ValueError(f"{key} must be a mapping of {allowed}; got {values!r}")
    values = dict(values or {})
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - fields)
    if unknown:
        raise ValueError(f"{key}: unknown key(s) {unknown}; allowed: {sorted(fields)}")
    required = {
        f.name
        for f in dataclasses.fields(cls)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    }
    missing = sorted(required - set(values))
    if missing:
        raise ValueError(f"{key}: missing key(s) {missing}" + (f"; {missing_hint}" if missing_hint else ""))
    return cls(**values)


def refuse(problems: Sequence[str]) -> None:
    """Raise the refusals `collect` gathered, if any."""
    if problems:
        raise Refusals(problems)


def collect(problems: list[str], check: Callable[..., Any], *args: Any, **options: Any) -> Any:
    """`check(*args, **options)`, its refusal appended to `problems` instead of raised: for settings that
    report every bad value at once. Returns what the check returned (None when it refused)."""
    try:
        return check(*args, **options)
    except ValueError as err:
        problems.append(str(err))
        return None


_LEADING_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def keyed(message: str, node_key: str, parameters: Collection[str]) -> str:
    """A library message under config node `node_key`: one that opens with a parameter's name (`k must be ...`,
    `top_k=5 asks ...`) reads as the full key (`gate.k must be ...`); any other gets the node as its place
    (`gate: the confidence direction ...`)."""
    if message.startswith((f"{node_key}.", f"{node_key}:", f"{node_key}=")):
        return message  # already under its key (a check written at the boundary)
    lead = _LEADING_NAME.match(message)
    if lead and lead.group() in parameters and message[lead.end() : lead.end() + 1] in ("", " ", "=", "[", ".", ":"):
        return f"{node_key}.{message}"
    return f"{node_key}: {message}"


@contextmanager
def config_key(node_key: str, parameters: Collection[str], others: bool = True) -> Iterator[None]:
    """The boundary's half of the convention: a `ValueError` raised inside (a constructor's or a settings
    dataclass's check) is raised again under `node_key` (see `keyed`), of the same type where that type takes
    a message alone, chained to the original. `parameters`: the node's keys the code knows by the same name
    (a dataclass's fields, a constructor's arguments). `others=False`: only a message that opens with a parameter
    is re-keyed (around a stage's use of a built object, whose other errors are not about its settings)."""
    try:
        yield
    except Refusals as err:
        raise Refusals([keyed(p, node_key, parameters) for p in err.problems]) from err
    except ValueError as err:
        message = keyed(str(err), node_key, parameters)
        if not others and message.startswith(f"{node_key}: "):
            raise
        try:
            again = type(err)(message)
        except TypeError:  # an error type whose constructor takes more than the message
            again = ValueError(message)
        raise again from err
