"""Kill -9 in the middle of an activation extraction, rerun, and get bit-identical states.

A real subprocess extracts the tiny llama's hidden states of 40 NQ QA prompts into a ShardedArtifact
(shard_size=4, so 10 shards), sleeping after each shard so that it can be killed part-way. The test
SIGKILLs it once at least two shards exist, checks that only whole shards were left behind, reruns the
same script to completion in the same cache, and compares every vector bitwise with an uninterrupted
run in a fresh cache. The rerun must compute exactly the shards that were missing.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from confrag.data.nq import default_questions_path
from confrag.infra.paths import default_cache_dir

ROOT = Path(__file__).resolve().parents[1]
NUM_ITEMS, SHARD_SIZE, LAYERS, HIDDEN = 40, 4, [0, 2, 4], 64
NUM_SHARDS = NUM_ITEMS // SHARD_SIZE
START_TIMEOUT_S = 45.0

SCRIPT = textwrap.dedent(
    """
    import json, sys, time
    from pathlib import Path

    from omegaconf import OmegaConf

    from confrag.infra.sharded import ShardedArtifact
    from confrag.data.nq import load_questions_jsonl
    from confrag.llm.hidden_states import HiddenStateEngine
    from confrag.llm.loading import load_llm
    from confrag.llm.prompts import PromptTemplates

    root, cache, questions_path, delay = Path(sys.argv[1]), sys.argv[2], sys.argv[3], float(sys.argv[4])
    node = OmegaConf.to_container(OmegaConf.load(root / "conf" / "llm" / "tiny_llama.yaml"))
    llm = load_llm(dict({**node, "cache_dir": None}, tiny=dict(
        arch="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2)))
    templates = PromptTemplates(**OmegaConf.to_container(OmegaConf.load(root / "conf" / "prompts" / "paper.yaml")))
    rows = load_questions_jsonl(questions_path, limit=%(n)d)
    prompts = [templates.qa_prompt(llm.tokenizer, row.question) for row in rows]
    engine = HiddenStateEngine(llm.model, llm.tokenizer, batch_size=3, progress=False)
    spec = {"llm": llm.identity, "prompts": templates.identity(llm.tokenizer), "layers": %(layers)r, "test": "resume"}

    def compute(start, stop):
        states = engine.extract(prompts[start:stop], %(layers)r)
        print(json.dumps({"computed": [start, stop]}), flush=True)
        time.sleep(delay)  # slow enough to be killed part-way
        return states

    artifact = ShardedArtifact(cache, "activations", spec, %(n)d, shard_size=%(shard)d)
    print(json.dumps({"dir": str(artifact.dir)}), flush=True)
    artifact.compute(compute, progress=False)
    print(json.dumps({"done": True}), flush=True)
    """
) % {"n": NUM_ITEMS, "layers": LAYERS, "shard": SHARD_SIZE}


@pytest.fixture(scope="module")
def script(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("resume") / "extract.py"
    path.write_text(SCRIPT)
    return path


def command(script: Path, cache: Path, delay: float) -> list[str]:
    return [sys.executable, str(script), str(ROOT), str(cache), str(default_questions_path()), str(delay)]


def environment() -> dict[str, str]:
    env = dict(os.environ)
    # The converted SmolLM2 tokenizer lives in <cache>/models: reuse the repo's copy, never convert again.
    env["CONFRAG_CACHE"] = str(default_cache_dir())
    # Same single-threaded kernels in every run (and only one of the machine's cores).
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def events(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def computed_shards(stdout: str) -> list[int]:
    return [e["computed"][0] // SHARD_SIZE for e in events(stdout) if "computed" in e]


def shard_files(cache: Path) -> list[Path]:
    return sorted(cache.glob("activations/*/shard-*.npy"))


def load_all(cache: Path) -> np.ndarray:
    files = shard_files(cache)
    assert [f.name for f in files] == [f"shard-{i:05d}.npy" for i in range(NUM_SHARDS)]
    return np.concatenate([np.load(f, allow_pickle=False) for f in files], axis=1)


def read(handle, tail: int | None = 3000) -> str:
    handle.flush()
    handle.seek(0)
    text = handle.read()
    return text if tail is None else text[-tail:]


def run_to_completion(script: Path, cache: Path, delay: float = 0.0) -> subprocess.CompletedProcess:
    done = subprocess.run(command(script, cache, delay), env=environment(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert {"done": True} in events(done.stdout)
    return done


@pytest.fixture()
def children():
    """Processes started by the test; any still running at the end are killed (by their own handle)."""
    started: list[subprocess.Popen] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture()
def logs(tmp_path):
    """Files for the children's output (an unread pipe could fill up and stall a child)."""
    handles = [open(tmp_path / name, "w+") for name in ("ref.out", "ref.err", "victim.err")]
    yield handles
    for handle in handles:
        handle.close()


@pytest.mark.subprocess
def test_killed_extraction_resumes_to_identical_states(script, tmp_path, children, logs):
    killed_cache, fresh_cache = tmp_path / "killed", tmp_path / "fresh"

    # The uninterrupted reference runs beside the victim (its start-up overlaps the victim's).
    ref_out, ref_err, victim_err = logs
    reference = subprocess.Popen(command(script, fresh_cache, 0.0), env=environment(), stdout=ref_out, stderr=ref_err)
    children.append(reference)
    victim = subprocess.Popen(
        command(script, killed_cache, 0.3), env=environment(), stdout=subprocess.DEVNULL, stderr=victim_err
    )
    children.append(victim)

    deadline = time.monotonic() + START_TIMEOUT_S
    while len(shard_files(killed_cache)) < 2:
        if victim.poll() is not None:
            pytest.fail(f"the extraction exited early (rc={victim.returncode}): {read(victim_err)}")
        if time.monotonic() > deadline:
            pytest.fail(f"no 2 shards within {START_TIMEOUT_S} s: {read(victim_err)}")
        time.sleep(0.02)
    victim.send_signal(signal.SIGKILL)
    assert victim.wait(timeout=30) == -signal.SIGKILL

    # Only whole shards were left: each one present loads with its full shape.
    survivors = shard_files(killed_cache)
    print(f"{len(survivors)} of {NUM_SHARDS} shards survived the kill")
    assert 2 <= len(survivors) < NUM_SHARDS, "kill came too late to test resuming"
    for path in survivors:
        array = np.load(path, allow_pickle=False)
        assert array.shape == (len(LAYERS), SHARD_SIZE, HIDDEN) and array.dtype == np.float32, path
        assert np.isfinite(array).all()
    survivor_indices = sorted(int(p.stem.split("-")[1]) for p in survivors)
    assert survivor_indices == list(range(len(survivors)))  # shards are written in order
    before = {path.name: (path.stat().st_mtime_ns, path.stat().st_ino) for path in survivors}

    rerun = run_to_completion(script, killed_cache)
    assert computed_shards(rerun.stdout) == [i for i in range(NUM_SHARDS) if i not in survivor_indices]
    after = {path.name: (path.stat().st_mtime_ns, path.stat().st_ino) for path in shard_files(killed_cache)}
    assert {name: after[name] for name in before} == before, "the rerun rewrote shards that already existed"
    assert not list(killed_cache.glob("activations/*/.tmp-*"))

    assert reference.wait(timeout=120) == 0, read(ref_err)
    assert computed_shards(read(ref_out, tail=None)) == list(range(NUM_SHARDS))

    # Same key in both caches, and every vector bit-identical.
    assert [p.relative_to(killed_cache) for p in shard_files(killed_cache)] == [
        p.relative_to(fresh_cache) for p in shard_files(fresh_cache)
    ]
    resumed, uninterrupted = load_all(killed_cache), load_all(fresh_cache)
    assert resumed.shape == (len(LAYERS), NUM_ITEMS, HIDDEN)
    assert np.array_equal(resumed, uninterrupted)
    # And the states are real, distinct per prompt (not, say, all zeros).
    assert len({row.tobytes() for row in resumed[-1]}) == NUM_ITEMS
