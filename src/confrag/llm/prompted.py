"""The target LLM together with the prompt templates it is asked with: one object for the pair that every stage
rendering a prompt, keying a cache by one or running the model on one reads.

A prompt is the templates rendered through the model's tokenizer (its chat template), so neither half means
anything without the other: the prompts' identity that enters every artifact key beside the LLM's identity is
`templates.identity(llm.tokenizer)`, computed here and nowhere else.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from transformers import PreTrainedTokenizerBase

from confrag.llm.context import PromptLimit
from confrag.llm.loading import DeferredLLM, LoadedLLM
from confrag.llm.prompts import PromptTemplates

if TYPE_CHECKING:  # passages only need .title and .text
    from confrag.data.nq import Passage


@dataclass(frozen=True)
class PromptedLLM:
    """`llm` (loaded, or a `DeferredLLM` whose weights load at first use) and its prompt `templates`."""

    llm: LoadedLLM | DeferredLLM
    templates: PromptTemplates

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self.llm.tokenizer

    @property
    def prompts_identity(self) -> str:
        """What artifact keys hold under "prompts": the templates with this LLM's chat template."""
        return self.templates.identity(self.llm.tokenizer)

    def qa_prompt(self, question: str) -> str:
        return self.templates.qa_prompt(self.llm.tokenizer, question)

    def rag_prompt(self, question: str, contexts: Sequence[Passage]) -> str:
        return self.templates.rag_prompt(self.llm.tokenizer, question, contexts)

    def limit(self, max_new_tokens: int) -> PromptLimit:
        """What a prompt of this LLM is measured against when `max_new_tokens` follow it."""
        return PromptLimit(self.templates, self.llm.tokenizer, self.llm.context, max_new_tokens)
