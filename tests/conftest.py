"""Shared fixtures: the tiny random models, SmolLM2, the paper's prompt templates, real NQ rows."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from confrag.data.nq import default_nq_path, load_nq_jsonl
from confrag.llm.loading import load_llm
from confrag.llm.prompts import PromptTemplates

ROOT = Path(__file__).resolve().parents[1]
TINY_SHAPE = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2
)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _gate_registries_restored():
    """A test that defines a gate class or registers a signal leaves the registries as it found them (only
    when the gates are imported at all: most tests never do)."""
    tables = []
    if "confrag.gates.registry" in sys.modules:
        registry, base = sys.modules["confrag.gates.registry"], sys.modules["confrag.gates.base"]
        tables = [(table, dict(table)) for table in (base.GATES, registry.SIGNALS, registry.PARTS)]
    yield
    for table, content in tables:
        table.clear()
        table.update(content)


@pytest.fixture(scope="session")
def tiny_llama():
    return load_llm(dict(name="tiny_llama", source="tiny", tiny=dict(arch="llama", **TINY_SHAPE)))


@pytest.fixture(scope="session")
def tiny_qwen2():
    return load_llm(dict(name="tiny_qwen2", source="tiny", tiny=dict(arch="qwen2", **TINY_SHAPE)))


@pytest.fixture(scope="session")
def smollm2():
    cfg = OmegaConf.load(ROOT / "conf" / "llm" / "smollm2_135m.yaml")
    cfg.cache_dir = None  # the default cache (CONFRAG_CACHE or <repo>/.cache)
    return load_llm(OmegaConf.to_container(cfg))


@pytest.fixture(scope="session")
def templates() -> PromptTemplates:
    return PromptTemplates(**OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "prompts" / "paper.yaml")))


@pytest.fixture(scope="session")
def nq_rows():
    return load_nq_jsonl(default_nq_path(), limit=64)
