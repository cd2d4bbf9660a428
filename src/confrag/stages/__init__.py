"""The pipeline's stages, each reading the artifacts of the ones before it from the cache.

probe (NQ_Confidence + probe E) → retrieval (corpus, indexes, candidates) → nq_rerank (confidence
shifts, preference rows) → rerankers (fine-tuned, cached) → rerank (the stage the later tasks reuse,
Table 1) → evaluation (held-out questions, answers under every reranker, Table 2's outcomes).
Stages take typed settings and builders (`Recipe` objects that the tasks fill from the config), so
none of them reads a Hydra config.
"""
