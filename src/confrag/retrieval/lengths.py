"""Passage lengths in a model's own tokens: what one passage may hold in the LLM's prompts, in the dense
encoder's input and in the reranker's, measured from the tokenizers alone (no weights loaded).

A corpus split on whitespace keeps a text without spaces (a CJK document, a 1 MB string) as one passage:
it passed every check and killed the run after the LLM had loaded, asking the allocator for tens of GB,
naming no passage and no limit. Here every passage is measured before the LLM loads; one past the LLM's
limit is refused, naming its id, where it comes from (file and line) and the limit, or, with the option the
user turns on, cut on tokens to fit, with a count. The encoder's and the reranker's tokenizers cut their
inputs themselves (sentence-transformers' `max_seq_length`, the reranker's `passage_max_len`): those are
counted, so a report says how much of the text the retriever and the reranker never read.

A text of at most `limit - 2` UTF-8 bytes is not tokenized: a token covers at least one byte in byte-level
BPE, WordPiece and SentencePiece with byte fallback (SentencePiece may add one leading "▁"), so it cannot
exceed the limit. Only longer texts are measured, which keeps a large corpus's check cheap.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from confrag.infra.atomic import atomic_write_text
from confrag.infra.digests import folder_problem, write_folder_digest
from confrag.retrieval.corpus import CorpusPassage, document_text

log = logging.getLogger(__name__)

SHOWN = 3  # passages named in an error
_BYTE_SLACK = 2  # tokens a tokenizer may add beyond one per byte (SentencePiece's leading "▁")
_BATCH = 256  # long texts tokenized per call
COUNT_FILE = "count.json"  # a kept count (`counted_once`)


class PassageTooLongError(ValueError):
    """A passage longer than what one passage may hold in the LLM's prompts."""


@dataclass(frozen=True)
class TokenBudget:
    """How many of a model's tokens one passage (its title and text, as the retrievers index it) may hold."""

    owner: str  # whose tokens, as messages say it: "the LLM", "the dense encoder", "the reranker"
    tokenizer: Any  # a transformers tokenizer
    limit: int
    option: str  # the setting that sets the limit, named in messages

    def lengths(self, texts: Sequence[str]) -> list[int]:
        """The token count of each text (special tokens not counted); 0 for a text too short in bytes to
        exceed the limit, which is not tokenized."""
        out = [0] * len(texts)
        long = [i for i, t in enumerate(texts) if len(t.encode("utf-8")) + _BYTE_SLACK > self.limit]
        for start in range(0, len(long), _BATCH):
            chunk = long[start : start + _BATCH]
            ids = self.tokenizer([texts[i] for i in chunk], add_special_tokens=False)["input_ids"]
            for i, found in zip(chunk, ids):
                out[i] = len(found)
        return out

    def over(self, texts: Sequence[str]) -> list[tuple[int, int]]:
        """(index, tokens) of each text longer than the limit."""
        return [(i, n) for i, n in enumerate(self.lengths(texts)) if n > self.limit]

    def cut(self, passage: CorpusPassage) -> CorpusPassage:
        """The passage with its text cut on tokens so that its title and text fit the limit (the title kept)."""
        ids = self.tokenizer(passage.text, add_special_tokens=False)["input_ids"]
        keep = len(ids)
        while keep > 0:
            # Decoding and re-encoding may merge tokens differently: measured again, shortened until it fits.
            trial = dataclasses.replace(passage, text=self.tokenizer.decode(ids[:keep]))
            found = len(self.tokenizer(document_text(trial), add_special_tokens=False)["input_ids"])
            if found <= self.limit:
                return trial
            keep -= max(1, found - self.limit)
        raise PassageTooLongError(
            f"passage {passage.pid!r}: its title alone is longer than the {self.limit} tokens {self.option} allows"
        )


def fit_passages(
    passages: Sequence[CorpusPassage],
    budget: TokenBudget,
    cut: bool,
    locate: Callable[[Sequence[int]], list[str]],
    cut_option: str,
) -> tuple[list[CorpusPassage], int]:
    """`passages` with every one longer than `budget.limit` refused (PassageTooLongError naming the first
    SHOWN: id, where `locate` finds them (file and line), characters, tokens, the limit), or with `cut` cut
    to it (a warning counts them). Returns the passages and how many were cut."""
    over = budget.over([document_text(p) for p in passages])
    if not over:
        return list(passages), 0
    if not cut:
        shown = over[:SHOWN]
        places = locate([i for i, _ in shown])
        named = "; ".join(
            f"passage {passages[i].pid!r} ({place}: {len(passages[i].text):,} characters, {n:,} tokens)"
            for (i, n), place in zip(shown, places)
        )
        raise PassageTooLongError(
            f"{len(over)} passage(s) are longer than the {budget.limit} tokens one passage may hold in "
            f"{budget.owner}'s prompts ({budget.option}): {named}{'; ...' if len(over) > SHOWN else ''}. "
            f"Split them (retrieval.words_per_passage, or shorter documents in the file), or set {cut_option}=true "
            f"to cut them to {budget.limit} tokens"
        )
    out = list(passages)
    for i, _ in over:
        out[i] = budget.cut(passages[i])
    log.warning(
        "cut %d of %d passage(s) to the %d tokens one passage may hold in %s's prompts (%s=true), e.g. %r",
        len(over),
        len(passages),
        budget.limit,
        budget.owner,
        cut_option,
        passages[over[0][0]].pid,
    )
    return out, len(over)


def count_over(budget: TokenBudget, texts: Sequence[str]) -> dict[str, int]:
    """How many distinct `texts` are longer than the budget (and so cut by its model's tokenizer)."""
    distinct = list(dict.fromkeys(texts))
    return {"passages": len(distinct), "over_limit": len(budget.over(distinct)), "limit": budget.limit}


def budget_line(model: str, counted: dict[str, Any]) -> str:
    """A count (`count_over`, or the reranker's `PairBudget.count` with what its budget `holds`) as the log and the
    reports say it; `model` as in "the dense encoder's budget"."""
    holds = f": {counted['holds']}" if counted.get("holds") else ""
    return (
        f"passages cut by the {model}'s budget: {counted['over_limit']} of {counted['passages']} "
        f"(budget {counted['limit']} tokens{holds})"
    )


def counted_once(budget: TokenBudget, texts: Sequence[str], directory: Path | None) -> dict[str, int]:
    """`count_over(budget, texts)`, kept in the folder `directory` (with its digest) and read back from it while
    whole: a large corpus is tokenized once, not at every run. The folder's name must say what was counted (the
    texts' fingerprint, the tokenizer, the limit); None keeps nothing."""
    if directory is not None and not folder_problem(directory):
        return json.loads((directory / COUNT_FILE).read_text())
    counted = count_over(budget, texts)
    if directory is not None:
        try:
            directory.mkdir(parents=True, exist_ok=True)
            atomic_write_text(directory / COUNT_FILE, json.dumps(counted))
            write_folder_digest(directory)  # concurrent writers write the same bytes
        except OSError as err:  # a read-only cache: counted again next time
            log.warning("passage count not kept in %s (%s)", directory, err)
    return counted
