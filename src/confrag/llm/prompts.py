"""The papers' two prompts (appendix B, Figure 5), rendered through the model's chat template.

Templates are config values (`conf/prompts/*.yaml`); `identity()` enters every artifact key, so
editing a template never reuses states computed with the old text.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from transformers import PreTrainedTokenizerBase

if TYPE_CHECKING:  # passages only need .title and .text
    from confrag.data.nq import Passage


@dataclass(frozen=True)
class PromptTemplates:
    """The prompts of conf/prompts/*.yaml (which holds their values, each written once there)."""

    qa: str
    rag: str
    context: str
    context_separator: str
    system: str | None  # None: the chat template's own default system prompt

    def __post_init__(self) -> None:
        for name, needed in (("qa", ("{question}",)), ("rag", ("{question}", "{contexts}")), ("context", ("{text}",))):
            template = getattr(self, name)
            missing = [field for field in needed if field not in template]
            if missing:
                raise ValueError(f"prompts.{name} must contain {', '.join(missing)}; got {template!r}")

    def identity(self, tokenizer: PreTrainedTokenizerBase) -> str:
        payload = {**asdict(self), "chat_template": tokenizer.chat_template}
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]

    def format_contexts(self, contexts: Sequence[Passage]) -> str:
        return self.context_separator.join(self.context.format(title=c.title, text=c.text) for c in contexts)

    def qa_prompt(self, tokenizer: PreTrainedTokenizerBase, question: str) -> str:
        return self._chat(tokenizer, self.qa.format(question=question))

    def rag_prompt(self, tokenizer: PreTrainedTokenizerBase, question: str, contexts: Sequence[Passage]) -> str:
        return self._chat(tokenizer, self.rag.format(question=question, contexts=self.format_contexts(contexts)))

    def _chat(self, tokenizer: PreTrainedTokenizerBase, user_text: str) -> str:
        messages = [{"role": "user", "content": user_text}]
        if self.system is not None:
            messages.insert(0, {"role": "system", "content": self.system})
        if tokenizer.chat_template is None:
            raise ValueError("the tokenizer has no chat template; set llm.chat_template")
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def encode_prompts(tokenizer: PreTrainedTokenizerBase, prompts: Sequence[str]) -> list[list[int]]:
    """Token ids of rendered prompts. The chat template already wrote any BOS, so none is added."""
    return [list(ids) for ids in tokenizer(list(prompts), add_special_tokens=False)["input_ids"]]
