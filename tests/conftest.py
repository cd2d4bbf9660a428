"""Shared fixtures: the tiny random models, SmolLM2, the paper's prompt templates, real NQ rows."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from confrag.data.nq import default_questions_path, load_questions_jsonl
from confrag.llm.loading import load_llm
from confrag.llm.prompts import PromptTemplates

from helpers.models import tiny_llm_config
from helpers.tiers import TierGuard

ROOT = Path(__file__).resolve().parents[1]


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


TIERS = TierGuard()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    TIERS.item = item  # through setup (module fixtures included), call and teardown
    yield
    TIERS.item = None


@pytest.fixture(scope="session", autouse=True)
def _tier_marks_kept():
    """A test that runs a task's computation or starts a Python process without its mark (`task`,
    `subprocess`) fails: `make test-fast` leaves the marked ones out (helpers/tiers.py)."""
    from confrag.train import TASKS

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(subprocess.Popen, "__init__", TIERS.popen(subprocess.Popen.__init__))
        for name, module in TASKS.items():
            patch.setattr(module, "run", TIERS.task_run(module.run, name))
        yield


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


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models gain nothing from intra-op threads, and on a shared 2-core machine two OpenMP threads
    contending with other work slow many small forwards down several-fold. A module opts in with
    `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_llama():
    return load_llm(tiny_llm_config("llama"))


@pytest.fixture(scope="session")
def tiny_qwen2():
    return load_llm(tiny_llm_config("qwen2"))


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
    return load_questions_jsonl(default_questions_path(), limit=64)


@pytest.fixture
def nothing_runs(monkeypatch):
    """Fails the test if a stage starts (the LLM loads or the probe's data is built) before the settings are
    checked."""
    import confrag.llm.loading as loading_module
    import confrag.probe.datamodule as datamodule_module

    def refuse(*args, **kwargs):
        raise AssertionError("a stage ran before the settings were checked")

    monkeypatch.setattr(loading_module, "load_llm", refuse)
    monkeypatch.setattr(datamodule_module, "build_confidence_data", refuse)
