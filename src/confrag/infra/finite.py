"""Finite numbers only: one check for NaN / inf where numbers are produced (hidden states, probe
outputs, Inc, reranker scores, losses), so that a non-finite value stops the run where it appears,
naming the stage, the artifact and the rows, instead of turning every later metric into `null`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

SHOWN_ROWS = 5  # rows named in an error; the count says how many there are


class NonFiniteError(ValueError):
    """A NaN or infinity where only finite numbers make sense."""


def _as_array(values: Any) -> np.ndarray:
    if hasattr(values, "detach"):  # a torch tensor, on any device
        values = values.detach().float().cpu().numpy()
    return np.asarray(values)


def nonfinite_rows(values: Any, axis: int = 0) -> np.ndarray:
    """Indices along `axis` holding a NaN or infinity (empty when all is finite). A plain sum is tried
    first (one vectorized pass, no boolean array the size of the data): a finite sum proves every value
    finite; a non-finite one (a NaN or inf, or an overflow of large finite values) is then looked at
    value by value."""
    array = _as_array(values)
    if array.size == 0 or array.dtype.kind != "f":
        return np.zeros(0, dtype=np.int64)
    with np.errstate(over="ignore", invalid="ignore"):
        total = array.sum()
    if np.isfinite(total):
        return np.zeros(0, dtype=np.int64)
    bad = ~np.isfinite(array)
    if array.ndim == 0:
        return np.zeros(1, dtype=np.int64)
    other = tuple(d for d in range(array.ndim) if d != axis % array.ndim)
    return np.flatnonzero(bad.any(axis=other) if other else bad)


def require_finite(
    values: Any,
    *,
    stage: str,
    artifact: str,
    rows: Sequence[Any] | None = None,
    axis: int = 0,
    row_offset: int = 0,
) -> None:
    """Raise NonFiniteError when `values` hold a NaN or infinity. The error names the stage, the artifact
    and the offending rows along `axis`: `rows[i]` when given (question ids, say), else the index plus
    `row_offset` (the shard's first item)."""
    bad = nonfinite_rows(values, axis)
    if not len(bad):
        return
    array = _as_array(values)
    names = [repr(rows[i]) if rows is not None and i < len(rows) else str(int(i) + row_offset) for i in bad]
    kinds = sorted(
        {"NaN" if np.isnan(v) else "+inf" if v > 0 else "-inf" for v in array[~np.isfinite(array)].ravel()[:1000]}
    )
    shown = ", ".join(names[:SHOWN_ROWS]) + (f", ... ({len(names)} rows)" if len(names) > SHOWN_ROWS else "")
    raise NonFiniteError(
        f"{stage}: {artifact} holds {'/'.join(kinds)} in row(s) {shown}; nothing non-finite is kept or reported, "
        f"the run stops here"
    )
