"""Prompts that fit the model: question lengths checked against the LLM's context before it loads.

A question longer than the context used to pass every check and fail after the model loaded (asking
the allocator for tens of GB, naming neither the row nor the limit). Here every QA prompt is tokenized
with the model's own tokenizer and chat template (exact lengths, not an estimate) and compared with the
context length less the tokens to generate; a row that does not fit is refused by qid, or, when the
user turns truncation on, its question is cut to fit, with a count.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from confrag.data.nq import QARow
from confrag.llm.prompts import PromptTemplates, encode_prompts

log = logging.getLogger(__name__)

SHOWN = 3  # rows named in an error


class PromptTooLongError(ValueError):
    """A prompt longer than the model's context (less the tokens to generate)."""


def fit_questions(
    rows: Sequence[QARow],
    templates: PromptTemplates,
    tokenizer: PreTrainedTokenizerBase,
    context: int,
    max_new_tokens: int,
    truncate: bool = False,
    where: str = "data",
    option: str = "data.truncate_questions",
) -> list[QARow]:
    """`rows` whose QA prompt plus `max_new_tokens` fits `context` tokens. A row that does not is refused
    (PromptTooLongError naming its qid, its length and the limit), or with `truncate` its question is cut
    (on tokens) to fit, with a warning counting the rows cut."""
    budget = context - max_new_tokens
    lengths = [
        len(ids) for ids in encode_prompts(tokenizer, [templates.qa_prompt(tokenizer, r.question) for r in rows])
    ]
    too_long = [i for i, n in enumerate(lengths) if n > budget]
    if not too_long:
        return list(rows)
    overhead = min(
        lengths[i] - len(tokenizer(rows[i].question, add_special_tokens=False)["input_ids"]) for i in too_long
    )
    if not truncate or budget - overhead < 1:
        named = ", ".join(
            f"{rows[i].qid!r} ({len(rows[i].question)} characters, {lengths[i]} tokens)" for i in too_long[:SHOWN]
        )
        raise PromptTooLongError(
            f"{where}: {len(too_long)} question(s) do not fit the model's context of {context} tokens less "
            f"max_new_tokens={max_new_tokens} (a QA prompt may hold {budget} tokens): {named}"
            f"{', ...' if len(too_long) > SHOWN else ''}. Shorten or remove them, or set {option}=true to cut "
            f"them to fit"
        )
    out = list(rows)
    for i in too_long:
        out[i] = dataclasses.replace(rows[i], question=_cut(rows[i].question, templates, tokenizer, budget))
    log.warning(
        "%s: cut %d question(s) to fit the model's context of %d tokens (%s=true), e.g. %s",
        where,
        len(too_long),
        context,
        option,
        rows[too_long[0]].qid,
    )
    return out


def _cut(question: str, templates: PromptTemplates, tokenizer: PreTrainedTokenizerBase, budget: int) -> str:
    ids = tokenizer(question, add_special_tokens=False)["input_ids"]
    keep = len(ids)
    while keep > 0:
        # Decoding and re-encoding may merge tokens differently: measured again, shortened until it fits.
        text = tokenizer.decode(ids[:keep])
        length = len(encode_prompts(tokenizer, [templates.qa_prompt(tokenizer, text)])[0])
        if length <= budget:
            return text
        keep -= max(1, length - budget)
    return ""
