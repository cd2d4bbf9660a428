"""One answer, however many workers: an activation shard's bytes do not depend on the thread count of the
process that computed it (a joblib multirun's workers run with fewer threads than a lone process, and wrote
other bytes under the same key), and what they still depend on (the batch composition) is in the key."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from confrag.infra.sharded import ShardedCache
from confrag.llm.hidden_states import CPU_THREADS, HiddenStateEngine, extraction_key, fixed_threads
from confrag.llm.prompted import PromptedLLM
from confrag.probe.nq_confidence import build_confidence_data

from helpers.settings import data_settings

SETTINGS = dict(
    extraction={"layers": [2]}, splits={"sizes": {"train": 2, "dev": 1, "test": 1}}, answers={"max_new_tokens": 2}
)


@pytest.fixture
def process_threads():
    """Sets the process's intra-op thread count for a test; restored after."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def shard_bytes(data) -> dict[str, bytes]:
    artifact = data.stores["qa"].artifact
    return {
        f"{artifact.key}/{artifact.shard_path(i).name}": artifact.shard_path(i).read_bytes()
        for i in range(artifact.num_shards)
    }


def test_activation_shards_do_not_depend_on_the_process_thread_count(
    tmp_path, tiny_llama, templates, nq_rows, process_threads
):
    """Before, this tiny model's states at 1 and 2 threads differed in 12 of 32 rows (up to 1.1e-8)."""
    found = {}
    for threads in (1, 2):
        process_threads(threads)
        data = build_confidence_data(
            PromptedLLM(tiny_llama, templates),
            nq_rows[:32],
            settings=data_settings(**SETTINGS),
            cache=ShardedCache(str(tmp_path / f"t{threads}"), progress=False),
        )
        found[threads] = shard_bytes(data)
        assert torch.get_num_threads() == threads  # the engine's fixed count is given back after extraction
    assert list(found[1]) == list(found[2])  # the same key
    assert found[1] == found[2]  # and the same bytes


def test_the_engine_fixes_its_cpu_thread_count_and_restores_the_process_one(tiny_llama, process_threads):
    process_threads(2)
    with fixed_threads(torch.device("cpu"), CPU_THREADS):
        assert torch.get_num_threads() == CPU_THREADS
    assert torch.get_num_threads() == 2
    with fixed_threads(torch.device("cpu"), None):  # None: the process's own count
        assert torch.get_num_threads() == 2
    with pytest.raises(ValueError, match=r"threads must be an integer >= 1 or None"):
        HiddenStateEngine(tiny_llama.model, tiny_llama.tokenizer, threads=0)


def test_a_batch_size_other_than_the_default_keys_its_own_states(tmp_path, tiny_llama, templates, nq_rows):
    """Batches pad to their longest prompt and sum in other shapes: the batch size moves the last bits. Before,
    states extracted with batch 8 were filed under the key of batch 16's (and the reverse)."""
    assert extraction_key() == {} and extraction_key(16, "auto", CPU_THREADS) == {}  # the defaults: keys as before
    assert extraction_key(8) == {"extract_batch_size": 8} and extraction_key(threads=4) == {"extract_threads": 4}
    cache = ShardedCache(str(tmp_path / "cache"), progress=False)
    rows = nq_rows[:32]
    default = build_confidence_data(
        PromptedLLM(tiny_llama, templates), rows, settings=data_settings(**SETTINGS), cache=cache
    )
    other = build_confidence_data(
        PromptedLLM(tiny_llama, templates),
        rows,
        settings=data_settings(**{**SETTINGS, "extraction": {"layers": [2], "batch_size": 8}}),
        cache=cache,
    )
    assert default.stores["qa"].key != other.stores["qa"].key
    assert "extract_batch_size" not in default.stores["qa"].artifact.spec
    # Each key holds what its own settings compute.
    prompts = [templates.qa_prompt(tiny_llama.tokenizer, r.question) for r in rows]
    for data, batch in ((default, 16), (other, 8)):
        engine = HiddenStateEngine(tiny_llama.model, tiny_llama.tokenizer, batch_size=batch, progress=False)
        assert np.array_equal(np.asarray(data.stores["qa"].artifact.shards()[0]), engine.extract(prompts, [2]))


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_qwen2"])
def test_states_are_the_same_bytes_on_one_and_on_two_workers(request, templates, nq_rows, arch):
    """Every core, same bytes: batches run on parallel workers, each on one intra-op thread, give the states of one
    worker bit for bit (the hooks of a batch on one thread never write into another thread's batch)."""
    llm = request.getfixturevalue(arch)
    prompts = [templates.rag_prompt(llm.tokenizer, r.question, r.contexts[:1]) for r in nq_rows[:40]]
    found = {}
    for workers in (1, 2, 3):
        engine = HiddenStateEngine(llm.model, llm.tokenizer, batch_size=4, progress=False, workers=workers)
        assert engine.workers == workers
        found[workers] = engine.extract(prompts, [1, 2])
    assert found[1].tobytes() == found[2].tobytes() == found[3].tobytes()


def test_workers_default_to_the_available_cores_and_bad_counts_are_refused(tiny_llama, monkeypatch):
    from confrag.llm import workers

    monkeypatch.setattr(workers, "available_cores", lambda: 6)
    assert HiddenStateEngine(tiny_llama.model, tiny_llama.tokenizer).workers == 6
    assert HiddenStateEngine(tiny_llama.model, tiny_llama.tokenizer, threads=2).workers == 3
    assert HiddenStateEngine(tiny_llama.model, tiny_llama.tokenizer, threads=None).workers == 1
    with pytest.raises(ValueError, match=r"workers must be an integer >= 1 or None"):
        HiddenStateEngine(tiny_llama.model, tiny_llama.tokenizer, workers=0)


def test_a_worker_thread_runs_on_the_fixed_intra_op_thread_count(process_threads):
    """torch hands the process-wide count to each new thread: a worker started inside `fixed_threads` computes on
    one intra-op thread, so its batch's bytes are one thread's."""
    from confrag.llm.workers import run_batches

    process_threads(2)
    with fixed_threads(torch.device("cpu"), 1):
        seen = dict(run_batches(lambda b: torch.get_num_threads(), [0, 1, 2, 3], torch.device("cpu"), workers=2))
    assert set(seen.values()) == {1}
