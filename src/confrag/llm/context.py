"""Prompts that fit the model: question and passage lengths checked against the LLM's context before it loads.

A question longer than the context used to pass every check and fail after the model loaded (asking
the allocator for tens of GB, naming neither the row nor the limit). Here every QA prompt is tokenized
with the model's own tokenizer and chat template (exact lengths, not an estimate) and compared with the
context length less the tokens to generate; a row that does not fit is refused by qid, or, when the
user turns truncation on, its question is cut to fit, with a count. When the same questions also go into
RAG prompts, a cut question keeps only half of that budget (`room`), so that the passages have room in
them: cut to fit the QA prompt alone, an overlong question would leave none, and every RAG prompt holding
it would then be refused although both truncation options were on. RAG prompts (question + passages) are
checked the same way, whole (`fit_rag_prompts`): a row whose passages do not fit is refused by name, or
with the user's `truncate_passages` its passages are cut to fit.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from confrag.data.nq import QARow
from confrag.llm.prompts import PromptTemplates, encode_prompts

log = logging.getLogger(__name__)

SHOWN = 3  # rows named in an error


class PromptTooLongError(ValueError):
    """A prompt longer than the model's context (less the tokens to generate)."""


@dataclass(frozen=True)
class PromptLimit:
    """What a prompt is measured against: the templates that write it, the model's tokenizer that counts it,
    the model's context and the tokens to generate after it (a prompt may hold `budget` tokens)."""

    templates: PromptTemplates
    tokenizer: PreTrainedTokenizerBase
    context: int
    max_new_tokens: int

    @property
    def budget(self) -> int:
        return self.context - self.max_new_tokens


def fit_questions(
    rows: Sequence[QARow],
    limit: PromptLimit,
    truncate: bool = False,
    where: str = "data",
    option: str = "data.truncate_questions",
    room: int = 0,
) -> list[QARow]:
    """`rows` whose QA prompt fits `limit` (the context less max_new_tokens). A row that does not is refused
    (PromptTooLongError naming its qid, its length and the limit), or with `truncate` its question is cut
    (on tokens) to fit, with a warning counting the rows cut. With `truncate`, a question is cut so that its
    QA prompt leaves `room` tokens of that budget free (for the passages of the RAG prompts it also goes
    into); refusal without `truncate` stays at the exact limit."""
    templates, tokenizer = limit.templates, limit.tokenizer
    context, max_new_tokens = limit.context, limit.max_new_tokens
    budget = limit.budget
    if not 0 <= room < budget:
        raise ValueError(f"{where}: room must lie in [0, {budget}) tokens; got {room!r}")
    lengths = [
        len(ids) for ids in encode_prompts(tokenizer, [templates.qa_prompt(tokenizer, r.question) for r in rows])
    ]
    too_long = [i for i, n in enumerate(lengths) if n > budget]
    if truncate:
        budget -= room
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


def fit_rag_prompts(
    items: Sequence[tuple[str, Sequence[Any]]],
    labels: Sequence[str],
    limit: PromptLimit,
    truncate: bool = False,
    where: str = "rag",
    option: str = "rag.truncate_passages",
    question_option: str | None = None,
) -> tuple[list[str], list[int]]:
    """The RAG prompts of (question, passages) items (passages: objects with .title / .text), each tokenized
    with the model's tokenizer and chat template and checked against `limit` (context less max_new_tokens). An item
    that does not fit is refused (PromptTooLongError naming its label, its length, its passages' characters
    and the limit), or with `truncate` its passages are cut on tokens from the last one backwards until it
    fits, with a warning counting the items cut. Returns the prompts and the indices of the cut items.
    `question_option` names the option that cuts these questions, when there is one (the error's advice)."""
    templates, tokenizer = limit.templates, limit.tokenizer
    context, max_new_tokens = limit.context, limit.max_new_tokens
    budget = limit.budget
    prompts = [templates.rag_prompt(tokenizer, question, list(passages)) for question, passages in items]
    lengths = [len(ids) for ids in encode_prompts(tokenizer, prompts)] if prompts else []
    too_long = [i for i, n in enumerate(lengths) if n > budget]
    if not too_long:
        return prompts, []
    if truncate:
        fitted = {i: _cut_passages(*items[i], templates, tokenizer, budget) for i in too_long}
        if all(prompt is not None for prompt in fitted.values()):
            for i, prompt in fitted.items():
                prompts[i] = prompt
            log.warning(
                "%s: cut the passages of %d prompt(s) to fit the model's context of %d tokens (%s=true), e.g. %s",
                where,
                len(too_long),
                context,
                option,
                labels[too_long[0]],
            )
            return prompts, too_long
        too_long = [i for i in too_long if fitted[i] is None]  # not even without passages: the question is too long
    named = ", ".join(
        f"{labels[i]!r} ({lengths[i]} tokens; passages of {sum(len(p.text) for p in items[i][1])} characters)"
        for i in too_long[:SHOWN]
    )
    if not truncate:
        advice = f"shorten or remove these passages, or set {option}=true to cut them to fit"
    elif question_option:
        advice = f"their questions alone do not fit: shorten them, or set {question_option}=true to cut them"
    else:
        advice = "their questions alone do not fit: shorten or remove these questions"
    raise PromptTooLongError(
        f"{where}: {len(too_long)} RAG prompt(s) (question + passages) do not fit the model's context of {context} "
        f"tokens less max_new_tokens={max_new_tokens} (a prompt may hold {budget} tokens): {named}"
        f"{', ...' if len(too_long) > SHOWN else ''}; {advice}"
    )


def _cut_passages(
    question: str, passages: Sequence[Any], templates: PromptTemplates, tokenizer: PreTrainedTokenizerBase, budget: int
) -> str | None:
    """The RAG prompt with the passages' texts cut on tokens, the last passage first, to fit `budget`; None
    when even empty passages do not fit."""
    passages = list(passages)

    def length(ps: Sequence[Any]) -> int:
        return len(encode_prompts(tokenizer, [templates.rag_prompt(tokenizer, question, list(ps))])[0])

    for j in reversed(range(len(passages))):
        ids = tokenizer(passages[j].text, add_special_tokens=False)["input_ids"]
        keep = len(ids)
        while keep > 0:
            # Decoding and re-encoding may merge tokens differently: measured again, shortened until it fits.
            trial = [*passages[:j], dataclasses.replace(passages[j], text=tokenizer.decode(ids[:keep]))]
            found = length([*trial, *passages[j + 1 :]])
            if found <= budget:
                return templates.rag_prompt(tokenizer, question, [*trial, *passages[j + 1 :]])
            keep -= max(1, found - budget)
        passages[j] = dataclasses.replace(passages[j], text="")
    return templates.rag_prompt(tokenizer, question, passages) if length(passages) <= budget else None
