"""The README's Python example runs as written: its code block is taken from README.md and executed in a folder
holding what it loads (a saved probe for SmolLM2's Layer/2 states and an exported reranker, both built here with
the library's own writers), and what it computes equals the same scores computed another way."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import numpy as np
import torch

from confrag.llm.hidden_states import naive_hidden_states
from confrag.llm.prompts import encode_prompts
from confrag.probe.module import save_probe

from helpers.modules import probe_module, reranker_module

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_README_LINES = 149  # under 150: the README is a map; the details live in docs/


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


def test_the_readme_is_a_map_of_at_most_150_lines_with_one_python_example():
    text = README.read_text()
    assert len(text.splitlines()) <= MAX_README_LINES
    assert len(python_blocks(text)) == 1


def test_python_blocks_are_found_and_only_they():
    text = "intro\n```python\nx = 1\n```\n```bash\nmake demo\n```\n```python\ny = 2\nz = 3\n```\n"
    assert python_blocks(text) == ["x = 1\n", "y = 2\nz = 3\n"]


def test_the_readme_example_scores_candidates_with_a_saved_probe_and_reranker(
    tmp_path, monkeypatch, smollm2, templates
):
    llm = smollm2  # conftest's: conf/llm/smollm2_135m.yaml with the default cache, as the example loads it
    layer = llm.mid_layer
    # A probe for SmolLM2's Layer/2 states with random weights and a standardization, saved as a probe run saves it.
    torch.manual_seed(0)
    probe = probe_module(input_dim=int(llm.model.config.hidden_size), hidden_dims=[16], layer=layer)
    rng = np.random.default_rng(0)
    probe.set_standardization(
        rng.normal(size=probe.hparams.input_dim), rng.uniform(0.5, 2, size=probe.hparams.input_dim)
    )
    activations = {"llm": llm.identity, "prompts": templates.identity(llm.tokenizer), "layer": layer, "key": "readme"}
    save_probe(probe, tmp_path / "probe", activations, {})
    # An exported reranker: MiniLM with a seeded fresh head, written as a rerank run exports it.
    reranker = reranker_module(fresh_head=True, seed=0)
    reranker.export(tmp_path / "reranker")

    monkeypatch.chdir(tmp_path)
    (code,) = python_blocks(README.read_text())
    namespace: dict = {}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, str(README), "exec"), namespace)  # the README's own example, as written

    passages, question = namespace["passages"], namespace["question"]
    assert len(passages) >= 2 and len(printed.getvalue().splitlines()) == len(passages)
    # The same confidences from a plain forward per prompt, and the same scores from the module that exported them.
    prompts = [templates.rag_prompt(llm.tokenizer, question, [p]) for p in passages]
    states = np.stack(
        [naive_hidden_states(llm.model, ids, [layer])[0] for ids in encode_prompts(llm.tokenizer, prompts)]
    )
    np.testing.assert_allclose(namespace["confidence"], probe.confidence(states), atol=1e-4)
    texts = [f"{p.title}\n{p.text}" for p in passages]
    np.testing.assert_allclose(namespace["scores"], reranker.score([question] * len(texts), texts), atol=1e-5)
