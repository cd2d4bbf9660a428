"""LLM-aligned reranker: preference data, group InfoNCE, the Lightning module, ranking metrics."""
