"""Access to the target LLM: loading, prompts, generation and hidden states."""

from confrag.llm.loading import LLMNotAvailableError, LoadedLLM, load_llm
from confrag.llm.prompts import PromptTemplates
from confrag.llm.hidden_states import HiddenStateEngine

__all__ = ["LLMNotAvailableError", "LoadedLLM", "load_llm", "PromptTemplates", "HiddenStateEngine"]
