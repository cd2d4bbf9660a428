"""Infrastructure: atomic files, digests, locks, sharded artifacts, ranks, paths, timing, run records and
cache verification. Nothing here knows about LLMs, probes or rerankers."""
