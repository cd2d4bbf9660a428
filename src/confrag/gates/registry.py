"""The one table of gate signals: per signal, what produces it, what it costs and how it is described.

A gate names the signals it reads (`Gate.needs`); everything else follows from their entries here: the
errors that say where a missing signal comes from (`description`), how the comparison computes it
(`produce`), which timed parts a gate reading it pays per question (`parts`), how a value is checked
(`check`) and whether an LLM can give it at all (`llm_check`). A new signal is one `register_signal` call;
the built-in ones are registered in `confrag.gates.signal_table`.

This module imports nothing of confrag, so that `gates.base` can read it and every module can add to it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any


class UnavailableSignalError(ValueError):
    """A gate reads a signal that the LLM (or the project) cannot give."""


@dataclass(frozen=True)
class Part:
    """A step timed per question (seconds), fresh and without the cache, on the comparison's timing questions.

    `measure` is called once with the comparison's timing run (`confrag.stages.gate_timing.TimingRun`:
    `fresh` and `maker` signal makers, `questions`, `qa_prompts`, `responses`, `contexts`, `layers`).
    `repeats`: parts that `measure` runs again on its way (timed on their own), subtracted from its time.
    `gives_closed_book`: the part already produces the closed-book answer, so a parametric decision of a
    gate that paid for it costs nothing more."""

    name: str
    measure: Callable[[Any], Any]
    repeats: tuple[str, ...] = ()
    gives_closed_book: bool = False


@dataclass(frozen=True)
class Signal:
    """One per-question signal a gate can read.

    `produce(inputs)` returns the `GateSignals` fields it fills (usually just itself) from the comparison's
    `confrag.gates.signal_maker.SignalInputs` (the `maker`, the `rows`, their `questions`, the closed-book
    `responses`, the hidden-state `layers` and, for `per_context` signals, the `contexts`). `parts`: what a
    gate reading it pays per question, by name; a `Part` given here is registered with the signal.
    `requires`: signals that must come along (its producer or its readers use them). `check(value, signals)`
    validates (and may convert) a value; the default checks one row per question."""

    name: str
    description: str
    produce: Callable[[Any], dict[str, Any]]
    parts: tuple[Part | str, ...] = ()
    requires: tuple[str, ...] = ()
    per_context: bool = False  # depends on the contexts: computed once per context condition
    check: Callable[[Any, Any], Any] | None = None
    llm_check: Callable[[Any], Any] | None = None  # raises UnavailableSignalError when an LLM cannot give it
    cost: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "cost", tuple(p if isinstance(p, str) else p.name for p in self.parts))

    def checked(self, value: Any, signals: Any) -> Any:
        """`value` as `signals` (a `GateSignals`) holds it: through `check`, or one row per question."""
        return (self.check or one_row_each(self.name))(value, signals)


def one_row_each(name: str) -> Callable[[Any, Any], Any]:
    """The default check: one row per question."""

    def check(value: Any, signals: Any) -> Any:
        if len(value) != len(signals):
            raise ValueError(f"signals.{name} has {len(value)} rows for {len(signals)} questions")
        return value

    return check


SIGNALS: dict[str, Signal] = {}
PARTS: dict[str, Part] = {}
# What `GateSignals` already names itself: a signal of one of these names could not be read back.
RESERVED_NAMES = frozenset({"qids", "questions", "hidden_layers", "values", "with_values", "require"})


def register_part(part: Part) -> Part:
    """Add a timed part; the same name twice must be the same part."""
    if part.name in PARTS and PARTS[part.name] != part:
        raise ValueError(f"part {part.name!r} is registered twice with different definitions")
    PARTS[part.name] = part
    return part


def register_signal(signal: Signal) -> Signal:
    """Add a signal (and the new parts it defines). A name already taken by another entry is refused."""
    if not signal.name.isidentifier() or signal.name.startswith("_") or signal.name in RESERVED_NAMES:
        raise ValueError(
            f"signal name {signal.name!r} must be a Python identifier, not private and not one of "
            f"{', '.join(sorted(RESERVED_NAMES))}"
        )
    if signal.name in SIGNALS and SIGNALS[signal.name] != signal:
        raise ValueError(f"signal {signal.name!r} is already registered ({SIGNALS[signal.name].description})")
    for part in signal.parts:
        if isinstance(part, Part):
            register_part(part)
        elif part not in PARTS:
            raise ValueError(f"signal {signal.name!r} costs the part {part!r}, which is not registered")
    unknown = [name for name in signal.requires if name not in SIGNALS]
    if unknown:
        raise ValueError(f"signal {signal.name!r} requires {unknown}, which are not registered (register them first)")
    SIGNALS[signal.name] = signal
    return signal


def check_signal_names(names: Iterable[str], gate: str) -> None:
    """A gate reading a signal the project has no way to compute is refused, the signal named."""
    unknown = sorted(set(names) - set(SIGNALS))
    if unknown:
        raise UnavailableSignalError(
            f"gate '{gate}' reads the signal(s) {', '.join(unknown)}, which no part of confrag computes; "
            f"signals: {', '.join(sorted(SIGNALS))} (a new one is one register_signal(Signal(...)) entry, as in "
            "confrag/gates/signal_table.py)"
        )


def with_required(names: Iterable[str]) -> set[str]:
    """`names` and every signal they require, transitively (unregistered names are kept as they are)."""
    out, todo = set(), list(names)
    while todo:
        name = todo.pop()
        if name not in out:
            out.add(name)
            todo.extend(SIGNALS[name].requires if name in SIGNALS else ())
    return out


def signal_parts(needs: Iterable[str]) -> list[str]:
    """The timed parts a gate reading `needs` pays for every question, in a stable order."""
    return sorted({part for name in needs for part in SIGNALS[name].cost})


def gives_closed_book(parts: Iterable[str]) -> bool:
    return any(PARTS[part].gives_closed_book for part in parts)


# The parts every answer path may pay (the comparison always times them): the closed-book answer, the
# RAG answer over the top-K contexts, and retrieval with reranking.
register_part(Part("closed_book", lambda run: run.closed_book(), gives_closed_book=True))
register_part(Part("rag_answer", lambda run: run.rag_answer()))
register_part(Part("retrieve", lambda run: run.retrieve()))
