"""The GPU paths on the tiny random models: hidden states and the dense index on CUDA match the CPU's, and the
probe, rerank, cbdr and gates tasks run end to end with `llm.device=cuda` and the gpu trainer (also for the probe
stage of the later tasks, as the GPU experiments configure it), training and scoring on the GPU.

Marked `gpu`: skipped without a CUDA device (conftest.py). Run them with `pytest -m gpu tests/test_gpu.py -s` to
see the measured differences and wall times."""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from confrag.llm.hidden_states import HiddenStateEngine, naive_hidden_states
from confrag.llm.loading import load_llm
from confrag.llm.prompts import encode_prompts
from confrag.probe.module import ProbeModule
from confrag.rag import load_outcomes_jsonl
from confrag.recipes import reranker_recipe
from confrag.reranker.module import RerankerModule
from confrag.reranker.systems import BI_ENCODER, confidence_ft
from confrag.retrieval import DenseRetriever, corpus_from_gold_paragraphs
from confrag.stages.rerankers import load_reranker
from confrag.train import run_task

from helpers.models import cpu_llm, tiny_spec
from helpers.runs import check_gates_outputs, compose_cfg

pytestmark = pytest.mark.gpu

# The task's own trainer on the GPU, and (rerank, cbdr) the probe stage's too: what conf/experiment/*_llama3.yaml set.
GPU = ["llm.device=cuda", "trainer=gpu", "logger=csv"]
GPU_WITH_PROBE = [*GPU, "trainer@probe.trainer=gpu"]

# Largest relative L2 error of a last-token state, CUDA against the CPU (same weights, same prompts).
FP32_TOLERANCE = 1e-4
BF16_TOLERANCE = 5e-2  # bf16 keeps 8 bits of mantissa: ~4e-3 per rounding, compounded over 4 layers


def tiny(dtype: str = "float32", device: str = "cpu"):
    return load_llm(cpu_llm(name="tiny_llama", source="tiny", dtype=dtype, device=device, tiny=tiny_spec("llama")))


def worst_relative_error(states: np.ndarray, reference: np.ndarray) -> float:
    error = np.linalg.norm(states - reference, axis=-1)
    return float((error / np.maximum(np.linalg.norm(reference, axis=-1), 1e-12)).max())


def tensors_in(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from tensors_in(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from tensors_in(item)


@pytest.fixture
def devices(monkeypatch):
    """Where the work ran: for each wrapped method, the device types of the module's parameters and inputs."""
    seen: dict[str, set[str]] = {}

    def wrap(cls, name: str, where):
        original = getattr(cls, name)

        def wrapper(self, *args, **kwargs):
            seen.setdefault(f"{cls.__name__}.{name}", set()).update(where(self, args))
            return original(self, *args, **kwargs)

        monkeypatch.setattr(cls, name, wrapper)

    def step(self, args):
        return {p.device.type for p in self.parameters()} | {t.device.type for t in tensors_in(args[0])}

    wrap(ProbeModule, "training_step", step)
    wrap(RerankerModule, "training_step", step)
    wrap(RerankerModule, "score", lambda self, args: {p.device.type for p in self.parameters()})
    wrap(HiddenStateEngine, "extract_ids", lambda self, args: {self.device.type})
    return seen


# --- hidden states ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def prompt_sets(templates, nq_rows, tiny_llama):
    """QA and RAG prompts of 32 NQ questions: each set shares a prompt prefix, so the engine's prefix cache runs."""
    tok = tiny_llama.tokenizer
    rows = nq_rows[:32]
    return {
        "qa": [templates.qa_prompt(tok, row.question) for row in rows],
        "rag": [templates.rag_prompt(tok, row.question, row.contexts[:1]) for row in rows],
    }


def engine_states(llm, prompt_sets, model=None, **options) -> np.ndarray:
    """All layers' states of both prompt sets through the engine, with `llm`'s model or `model` (same tokenizer)."""
    engine = HiddenStateEngine(model or llm.model, llm.tokenizer, batch_size=8, progress=False, **options)
    layers = list(range(llm.num_layers + 1))
    return np.concatenate([engine.extract(prompts, layers) for prompts in prompt_sets.values()], axis=1)


@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_fp32_states_on_cuda_match_the_cpu(tiny_llama, prompt_sets, padding_side):
    cuda = tiny(device="cuda")
    assert cuda.device.type == "cuda" and cuda.identity == tiny_llama.identity  # same weights, same cache keys
    on_cpu = engine_states(tiny_llama, prompt_sets, padding_side=padding_side)
    on_cuda = engine_states(cuda, prompt_sets, padding_side=padding_side)
    # The engine on CUDA against the plain full forward on CUDA, prompt by prompt.
    prompts = prompt_sets["qa"][:4] + prompt_sets["rag"][:4]
    naive = np.stack(
        [
            naive_hidden_states(cuda.model, ids, range(cuda.num_layers + 1))
            for ids in encode_prompts(cuda.tokenizer, prompts)
        ],
        axis=1,
    )
    picked = np.concatenate([on_cuda[:, :4], on_cuda[:, 32:36]], axis=1)
    errors = {
        "cuda vs cpu": worst_relative_error(on_cuda, on_cpu),
        "engine vs full forward (cuda)": worst_relative_error(picked, naive),
    }
    print(f"\nfp32 ({padding_side} padding), worst relative error: {errors}")
    assert max(errors.values()) < FP32_TOLERANCE


def test_bf16_states_on_cuda_match_the_cpu(prompt_sets):
    cuda = tiny("bfloat16", device="cuda")
    assert next(cuda.model.parameters()).dtype == torch.bfloat16
    on_cuda = engine_states(cuda, prompt_sets)
    assert on_cuda.dtype == np.float32 and np.isfinite(on_cuda).all()
    # The reference: the same (bf16-valued) weights computed in fp32 on the CPU. A tiny model drawn in bf16 need
    # not hold the fp32 draw's weights (its identity names the dtype), so the fp32 tiny model is no reference.
    fp32_twin = copy.deepcopy(cuda.model).to("cpu", torch.float32)
    errors = {
        "cuda bf16 vs cpu fp32, same weights": worst_relative_error(
            on_cuda, engine_states(cuda, prompt_sets, fp32_twin)
        ),
        "cuda bf16 vs cpu bf16": worst_relative_error(on_cuda, engine_states(tiny("bfloat16"), prompt_sets)),
    }
    prompts = prompt_sets["qa"][:4] + prompt_sets["rag"][:4]
    naive = np.stack(
        [
            naive_hidden_states(cuda.model, ids, range(cuda.num_layers + 1))
            for ids in encode_prompts(cuda.tokenizer, prompts)
        ],
        axis=1,
    )
    picked = np.concatenate([on_cuda[:, :4], on_cuda[:, 32:36]], axis=1)
    errors["engine vs full forward (cuda bf16)"] = worst_relative_error(picked, naive)
    drawn_apart = max(
        float((p.detach().cpu().float() - q.detach().bfloat16().float()).abs().max())
        for p, q in zip(cuda.model.parameters(), tiny().model.parameters())
    )
    print(
        f"\nbf16, worst relative error: {errors}; bf16 draw vs fp32 draw cast to bf16, max |weight difference|: "
        f"{drawn_apart:.3g}"
    )
    assert max(errors.values()) < BF16_TOLERANCE


def test_dense_index_on_cuda_matches_the_cpu(nq_rows):
    """The bi-encoder picks the GPU by itself whenever there is one: its index must not depend on that."""
    corpus = corpus_from_gold_paragraphs(nq_rows)
    on_cuda = DenseRetriever(corpus, device="cuda", progress=False)
    assert on_cuda.model.device.type == "cuda"
    on_cpu = DenseRetriever(corpus, device="cpu", progress=False)
    difference = float(np.abs(on_cuda.passage_embeddings - on_cpu.passage_embeddings).max())
    query = [row.question for row in nq_rows[:8]]
    hits_agree = [[i for i, _ in hits] for hits in on_cuda.search(query, 5)] == [
        [i for i, _ in hits] for hits in on_cpu.search(query, 5)
    ]
    print(
        f"\ndense index of {len(corpus)} passages, cuda vs cpu: max |embedding difference| {difference:.2e}, "
        f"top-5 hits agree: {hits_agree}"
    )
    assert difference < 1e-5 and hits_agree


# --- the tasks end to end ---------------------------------------------------------------------------


def run_timed(cfg, label: str) -> tuple[Path, dict]:
    start = time.perf_counter()
    run_task(cfg)
    out = Path(cfg.paths.output_dir)
    print(f"\n{label}: {time.perf_counter() - start:.1f} s")
    return out, json.loads((out / "metrics.json").read_text())


def csv_columns(out: Path) -> list[str]:
    """The columns of the CSV logger's metrics file (none when nothing was logged)."""
    assert sorted((out / "csv").glob("version_*/hparams.yaml")), f"no CSV logger output under {out / 'csv'}"
    files = sorted((out / "csv").glob("version_*/metrics.csv"))
    return files[-1].read_text().splitlines()[0].split(",") if files else []


@pytest.mark.task
def test_probe_task_trains_on_the_gpu(tmp_path, devices):
    cfg = compose_cfg(["+experiment=probe_tiny_llama", *GPU], tmp_path)
    out, record = run_timed(cfg, "probe_tiny_llama on cuda")
    assert devices["HiddenStateEngine.extract_ids"] == {"cuda"}
    assert devices["ProbeModule.training_step"] == {"cuda"}
    metrics = record["metrics"]
    print({key: round(value, 4) for key, value in sorted(metrics.items())})
    assert 0.0 <= metrics["test/acc"] <= 1.0 and "test/auroc" in metrics
    assert {"val/auroc", "test/auroc", "train/loss"} <= set(csv_columns(out))
    assert (out / "checkpoints" / "last.ckpt").is_file() and (out / "probe" / "model.safetensors").is_file()


@pytest.mark.task
def test_rerank_task_trains_and_scores_on_the_gpu(tmp_path, devices):
    # bf16-mixed, as conf/experiment/reranker_llama3.yaml trains.
    cfg = compose_cfg(
        [
            "+experiment=reranker_tiny_llama",
            *GPU_WITH_PROBE,
            "+trainer.precision=bf16-mixed",
            "retrieval.bi_encoder=true",
        ],
        tmp_path,
    )
    out, record = run_timed(cfg, "reranker_tiny_llama on cuda (bf16-mixed)")
    assert devices["ProbeModule.training_step"] == devices["RerankerModule.training_step"] == {"cuda"}
    assert devices["HiddenStateEngine.extract_ids"] == {"cuda"}
    assert devices["RerankerModule.score"] == {"cuda"}  # Table 1 scored where the run trained
    assert record["training"]["confidence_shift"]["steps"] > 0
    assert np.isfinite(record["training"]["confidence_shift"]["train_loss"])
    systems = [row["id"] for row in record["table1"]]
    assert systems[1] == BI_ENCODER and confidence_ft("sign") in systems
    if record["training"]["confidence_shift"]["steps"] >= cfg.trainer.log_every_n_steps:
        assert "train/loss" in csv_columns(out)
    # The exported reranker scores the same on both devices (fp32 inference).
    reranker = load_reranker(reranker_recipe(cfg), out / "reranker")
    rows = [json.loads(line) for line in (out / "nq_rerank" / "test.jsonl").read_text().splitlines()]
    queries = [row["query"] for row in rows for _ in row["pos"] + row["neg"]]
    passages = [passage for row in rows for passage in row["pos"] + row["neg"]]
    on_cpu = reranker.score(queries, passages)
    on_cuda = reranker.to("cuda").score(queries, passages)
    assert reranker.device.type == "cuda"
    difference = float(np.abs(on_cuda - on_cpu).max())
    print(f"reranker scores of {len(passages)} pairs, cuda vs cpu: max |difference| {difference:.2e}")
    assert difference < 1e-4


@pytest.mark.task
def test_cbdr_task_runs_on_the_gpu_and_beta_zero_always_retrieves(tmp_path, devices):
    cfg = compose_cfg(["+experiment=cbdr_tiny_llama", *GPU_WITH_PROBE, "trainer.max_epochs=1"], tmp_path)
    out, record = run_timed(cfg, "cbdr_tiny_llama on cuda")
    assert devices["ProbeModule.training_step"] == devices["RerankerModule.training_step"] == {"cuda"}
    assert devices["HiddenStateEngine.extract_ids"] == {"cuda"}
    assert devices["RerankerModule.score"] == {"cuda"}
    k = int(cfg.cbdr.top_k)
    test_qids = set(record["eval"]["test"])
    outcomes = [
        o for o in load_outcomes_jsonl(out / "outcomes" / "nq" / f"{cfg.cbdr.reranker}.jsonl") if o.qid in test_qids
    ]
    always = float(np.mean([o.rag[k].has_answer for o in outcomes]))
    beta_zero = next(r for r in record["table3"] if r["id"] == cfg.cbdr.reranker and r["beta"] == 0.0)
    assert beta_zero["retrieval_rate"] == 1.0
    assert beta_zero[f"top{k}"] == record["metrics"]["test/always_retrieve_accuracy"] == always
    assert record["sweep"]["rows"][0]["beta"] == 0.0 and record["sweep"]["rows"][0][f"top{k}"] == always
    # The live gate (one prefill through model.generate) reads the confidence the batched engine cached.
    check = record["gate_check"]
    print(
        f"β=0 accuracy {always:.3f} on {len(outcomes)} test questions; gate check: "
        f"{check['decisions_agree']}/{check['questions']} decisions, {check['answers_agree']} answers agree, "
        f"max confidence difference {check['max_confidence_difference']:.2e}"
    )
    assert check["decisions_agree"] == check["questions"] > 0
    assert check["max_confidence_difference"] < 1e-4
    assert (out / "report.md").is_file() and (out / "beta_curve_full.png").is_file()


@pytest.mark.task
def test_gates_task_runs_on_the_gpu(tmp_path, devices):
    cfg = compose_cfg(["+experiment=gates_tiny_llama", *GPU_WITH_PROBE, "trainer.fast_dev_run=true"], tmp_path)
    out, record = run_timed(cfg, "gates_tiny_llama on cuda")
    assert devices["HiddenStateEngine.extract_ids"] == {"cuda"} and devices["RerankerModule.score"] == {"cuda"}
    names = list(cfg.gates.names)
    check_gates_outputs(out, names)
    for condition in ("clean", "conflicting"):
        rows = {r["gate"]: r for r in record["table"] if r["contexts"] == condition}
        assert rows["always"]["retrieval_rate"] == 1.0 and rows["never"]["retrieval_rate"] == 0.0
        print(condition, {gate: round(r["accuracy"], 3) for gate, r in rows.items()})
