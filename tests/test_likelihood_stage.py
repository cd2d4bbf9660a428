"""The ℓ stage of the rerank task (`confrag.stages.likelihood`): its bytes are the library's forward's, read back from
the cache without a second forward, and its key changes with the LLM, its dtype, its device, the prompts and the
candidates."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from confrag.llm.hidden_states import HiddenStateEngine
from confrag.llm.likelihood import AnswerLikelihood
from confrag.llm.loading import load_llm
from confrag.llm.prompted import PromptedLLM
from confrag.reranker import likelihood_teacher
from confrag.reranker.likelihood_teacher import device_key, gold_answers
from confrag.retrieval import BM25Retriever, corpus_from_gold_paragraphs, retrieve_candidates
from confrag.stages.likelihood import likelihood_stage

from helpers.models import tiny_llm_config
from helpers.runs import run_ctx

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def candidates(nq_rows):
    corpus = corpus_from_gold_paragraphs(nq_rows)
    return retrieve_candidates(nq_rows[:3], corpus, BM25Retriever(corpus), top_n=3)


def ell_of(prompted, candidates, tmp_path) -> tuple[np.ndarray, str]:
    found = likelihood_stage(prompted, candidates, run_ctx(tmp_path), batch_size=16, max_answers=3)
    return np.concatenate(found.per_question), found.key


def test_the_stage_holds_the_library_forward_bytes_and_reads_them_back(tiny_llama, templates, candidates, tmp_path):
    prompted = PromptedLLM(tiny_llama, templates)
    ell, key = ell_of(prompted, candidates, tmp_path)
    prompts = [prompted.rag_prompt(c.question, [p]) for c in candidates for p in c.passages]
    answers = [gold_answers(c, 3) for c in candidates for _ in c.passages]
    engine = HiddenStateEngine(tiny_llama.model, tiny_llama.tokenizer, progress=False)
    direct = AnswerLikelihood(engine).score(prompts, answers).likelihood
    assert ell.shape == (9,) and np.isfinite(ell).all() and (ell < 0).all()
    assert ell.tobytes() == direct.tobytes()  # the stage adds nothing to the forward: same bytes
    calls = []
    real = likelihood_teacher.AnswerLikelihood.score
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(likelihood_teacher.AnswerLikelihood, "score", lambda *a, **k: calls.append(1) or real(*a, **k))
        again, key_again = ell_of(prompted, candidates, tmp_path)
    assert not calls and key_again == key and again.tobytes() == ell.tobytes()  # read back, digest-checked


def test_the_key_changes_with_llm_dtype_prompts_and_candidates(tiny_llama, tiny_qwen2, templates, candidates, tmp_path):
    key = ell_of(PromptedLLM(tiny_llama, templates), candidates, tmp_path)[1]
    bf16 = load_llm(tiny_llm_config("llama", dtype="bfloat16"))
    other_prompts = dataclasses.replace(templates, rag=templates.rag.replace("{contexts}", "Passage: {contexts}"))
    moved = [dataclasses.replace(candidates[0], passages=list(reversed(candidates[0].passages))), *candidates[1:]]
    keys = {
        "llm": ell_of(PromptedLLM(tiny_qwen2, templates), candidates, tmp_path)[1],
        "dtype": ell_of(PromptedLLM(bf16, templates), candidates, tmp_path)[1],
        "prompts": ell_of(PromptedLLM(tiny_llama, other_prompts), candidates, tmp_path)[1],
        "candidates": ell_of(PromptedLLM(tiny_llama, templates), moved, tmp_path)[1],
    }
    assert key not in keys.values() and len(set(keys.values())) == len(keys), keys


def test_the_device_is_in_the_key_off_the_cpu_only():
    """A GPU's kernels round otherwise; the CPU adds nothing, so the keys computed before the device was recorded
    (the studies' ℓ blocks) are found again."""
    assert device_key(SimpleNamespace(device=torch.device("cpu"))) == {}
    assert device_key(SimpleNamespace(device=torch.device("cuda", 0))) == {"device": "cuda"}
