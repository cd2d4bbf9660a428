"""The likelihood teacher's forward: ℓ equals separate teacher-forced forwards of prompt + answer, and the states
read in the same pass equal the engine's states of the prompt alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from confrag.llm.hidden_states import HiddenStateEngine
from confrag.llm.likelihood import AnswerLikelihood, answer_token_ids
from confrag.llm.prompts import encode_prompts


def naive_likelihood(llm, prompt_ids, answers) -> float:
    """max over answers of the mean log-probability of the answer's tokens, one plain forward per answer."""
    best = -np.inf
    for a in answer_token_ids(llm.tokenizer, answers):
        ids = torch.tensor([list(prompt_ids) + a])
        with torch.inference_mode():
            logp = F.log_softmax(llm.model(input_ids=ids).logits[0].float(), -1)
        n = len(prompt_ids)
        best = max(best, float(np.mean([logp[n - 1 + t, tok].item() for t, tok in enumerate(a)])))
    return best


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_qwen2"])
@pytest.mark.parametrize("workers", [1, 2])
def test_likelihood_and_states_equal_separate_forwards(request, templates, nq_rows, arch, workers):
    llm = request.getfixturevalue(arch)
    rows = nq_rows[:12]
    prompts = [templates.rag_prompt(llm.tokenizer, r.question, r.contexts[:1]) for r in rows]
    answers = [r.answers[:3] for r in rows]
    engine = HiddenStateEngine(llm.model, llm.tokenizer, batch_size=4, progress=False, workers=workers)
    got = AnswerLikelihood(engine).score(prompts, answers, layers=[1, 2])
    ids = encode_prompts(llm.tokenizer, prompts)
    expected = np.array([naive_likelihood(llm, seq, gold) for seq, gold in zip(ids, answers)])
    np.testing.assert_allclose(got.likelihood, expected, rtol=1e-5, atol=1e-5)
    states = engine.extract(prompts, [1, 2])  # the prompt alone: the answer after it changes nothing
    np.testing.assert_allclose(got.states, states, rtol=1e-4, atol=1e-5)
    assert got.states.shape == (2, len(prompts), llm.model.config.hidden_size)


def test_likelihood_bytes_do_not_depend_on_the_worker_count(tiny_llama, templates, nq_rows):
    prompts = [templates.rag_prompt(tiny_llama.tokenizer, r.question, r.contexts[:1]) for r in nq_rows[:20]]
    answers = [r.answers for r in nq_rows[:20]]
    found = [
        AnswerLikelihood(
            HiddenStateEngine(tiny_llama.model, tiny_llama.tokenizer, batch_size=4, progress=False, workers=w)
        ).score(prompts, answers, layers=[2])
        for w in (1, 2)
    ]
    assert found[0].likelihood.tobytes() == found[1].likelihood.tobytes()
    assert found[0].states.tobytes() == found[1].states.tobytes()


def test_a_prompt_without_gold_answers_is_refused_by_index(tiny_llama, templates, nq_rows):
    engine = HiddenStateEngine(tiny_llama.model, tiny_llama.tokenizer, progress=False)
    prompts = [templates.qa_prompt(tiny_llama.tokenizer, r.question) for r in nq_rows[:3]]
    with pytest.raises(ValueError, match=r"prompt\(s\) \[1\] have no gold answer"):
        AnswerLikelihood(engine).score(prompts, [["a"], [], ["b"]])
