"""Access to the target LLM: loading, prompts, generation and hidden states."""

from confrag.llm.config import LLMNotAvailableError
from confrag.llm.hidden_states import HiddenStateEngine
from confrag.llm.loading import LoadedLLM, load_llm
from confrag.llm.prompted import PromptedLLM
from confrag.llm.prompts import PromptTemplates

__all__ = ["LLMNotAvailableError", "LoadedLLM", "load_llm", "PromptTemplates", "PromptedLLM", "HiddenStateEngine"]
