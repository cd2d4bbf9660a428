"""Metrics on few examples, reported with their interval or marked: "test auroc 1.000" from 8 examples with one
positive read like a result. Below `SMALL_N` examples, or on one class, every printed metric says so.

The intervals are closed forms from what a report already holds (the metric, its example and positive counts), so
that no per-example score has to travel to the report: Wilson's score interval for a proportion (accuracy, own
paragraph first; scipy's, through `rag.stats.wilson`), Hanley and McNeil's (1982) standard error for an AUROC
(normal approximation, clipped to [0, 1]). Larger samples keep their plain numbers (the Table 2 rows carry
intervals of their own: `rag.stats.accuracy_ci`, Wilson's below the same SMALL_N).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

# Below SMALL_N examples a metric is printed with its interval, or marked; `wilson` is the one Wilson interval.
from confrag.rag.stats import SMALL_N, wilson

Z95 = 1.959963984540054


def auroc_interval(auroc: float, positives: int, negatives: int, z: float = Z95) -> tuple[float, float]:
    """Hanley and McNeil's 95 % interval of an AUROC from `positives` and `negatives` examples."""
    a = min(max(auroc, 0.0), 1.0)
    q1, q2 = a / (2 - a), 2 * a * a / (1 + a)
    variance = (a * (1 - a) + (positives - 1) * (q1 - a * a) + (negatives - 1) * (q2 - a * a)) / (positives * negatives)
    half = z * math.sqrt(max(variance, 0.0))
    return (max(0.0, a - half), min(1.0, a + half))


def is_small(n: int, positives: int | None = None) -> bool:
    """Fewer than SMALL_N examples, or (with `positives`) one class only."""
    return n < SMALL_N or (positives is not None and positives in (0, n))


def sample_mark(n: int, positives: int | None = None, what: str = "examples") -> str:
    """What a metric's printed line carries beside it when `is_small`: the counts and why it is marked."""
    counts = f"{n} {what}" + ("" if positives is None else f", {positives} positive")
    if positives is not None and positives in (0, n):
        return f"{counts}: one class only, not a result"
    return f"{counts}: below {SMALL_N}, 95 % intervals"


def proportion_text(value: float, n: int, digits: int = 3, scale: float = 1.0, unit: str = "") -> str:
    """`value` of a proportion over `n`, with its Wilson interval when n is below SMALL_N."""
    text = f"{scale * value:.{digits}f}{unit}"
    if n >= SMALL_N:
        return text
    low, high = wilson(value * n, n)
    return f"{text} [{scale * low:.{digits}f}, {scale * high:.{digits}f}]"


def small_mark(n: int, what: str = "questions") -> str:
    """A table title's mark for a table of metrics without intervals over fewer than SMALL_N `what`."""
    return f" (below {SMALL_N} {what}: no interval, not a result)" if n < SMALL_N else ""


def interval_note(values: Sequence[tuple[str, float]], n: int, what: str = "questions", scale: float = 100.0) -> str:
    """The line beside a table of proportions over `n` when n is below SMALL_N: each named value with its Wilson
    interval (in %, with the default `scale`); empty for larger samples."""
    if n >= SMALL_N:
        return ""
    cells = "; ".join(f"{name} {proportion_text(value, n, 1, scale)}" for name, value in values)
    return f"{n} {what}, below {SMALL_N}: 95 % intervals: {cells}"


def interval_fields(values: dict[str, float], n: int) -> dict[str, list[float]]:
    """`<name>_ci` = [low, high] (Wilson) for each proportion of `values` over `n` when n is below SMALL_N (the
    machine-readable rows' version of `interval_note`); empty for larger samples."""
    if n >= SMALL_N:
        return {}
    return {f"{name}_ci": [round(bound, 6) for bound in wilson(value * n, n)] for name, value in values.items()}
