"""The key/value cache handed to a transformers model, under the keyword its version reads.

transformers 5.x renamed the model's and `generate`'s `past_key_values` argument to `cache`; the old name still
works there but warns on every call (a FutureWarning per generation, removal announced for 5.40 / 6.0). The
keyword is read from the model's own `forward` signature, so the installed transformers gets its current name and
an older one (`transformers>=4.48`, pyproject.toml) its own. The prefix caches the engines share across a batch
are built here too.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from typing import Any

import torch
from transformers import DynamicCache


@functools.cache
def _keyword(model_class: type) -> str:
    parameters = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def cache_argument(model: torch.nn.Module, cache: Any) -> dict[str, Any]:
    """`{"cache": cache}` where the model's `forward` (and its `generate`) take `cache`, else
    `{"past_key_values": cache}`: the keyword argument to pass, for `model(...)` or `model.generate(...)`."""
    return {_keyword(type(model)): cache}


def expanded_cache(layers: Sequence[tuple[torch.Tensor, torch.Tensor]], rows: int) -> DynamicCache:
    """A DynamicCache holding one shared prefix's keys and values (per layer) for each of `rows` prompts, as views
    (no copy): the batch's prompts continue from it."""
    return DynamicCache([(keys.expand(rows, -1, -1, -1), values.expand(rows, -1, -1, -1)) for keys, values in layers])
