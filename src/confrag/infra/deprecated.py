"""Old public names kept for one release after a rename: each call of the old name warns and does what the new
one does, so code written against the old name runs while its author is told the new one."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any


def deprecated_alias(old: str, new: Callable[..., Any]) -> Callable[..., Any]:
    """`new` under its old dotted name `old` (e.g. "confrag.data.nq.load_nq_jsonl"): every call warns with a
    DeprecationWarning naming the new function, then calls it with the same arguments."""
    replacement = f"{new.__module__}.{new.__name__}"

    @functools.wraps(new)
    def alias(*args: Any, **kwargs: Any) -> Any:
        warnings.warn(
            f"{old} is deprecated (kept for one release): use {replacement}, which takes the same arguments",
            DeprecationWarning,
            stacklevel=2,
        )
        return new(*args, **kwargs)

    alias.__name__ = alias.__qualname__ = old.rpartition(".")[2]
    alias.__doc__ = f"Deprecated alias of `{replacement}` (kept for one release)."
    return alias
