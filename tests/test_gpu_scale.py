"""The GPU scale benchmark runs end to end on tiny models of the same families (CPU, fp32, seconds): the engine's
states equal the batched full forward's, the fast generation path gives the plain path's tokens, the ℓ stage's
likelihoods equal one full forward's, and the last lines are the ratios."""

from __future__ import annotations

import importlib.util
import math

import pytest

from conftest import ROOT

TINY_RUN = [
    "--tiny",
    "--prompts",
    "12",
    "--own-min",
    "8",
    "--own-max",
    "40",
    "--per-prompt",
    "2",
    "--baseline-batch",
    "4",
    "--gen-prompts",
    "6",
    "--gen-batch",
    "3",
    "--new-tokens",
    "3",
    "--repeats",
    "1",
]
RATIOS = [
    "engine_share_of_peak",
    "engine_speedup_vs_batched_forward",
    "engine_speedup_vs_per_prompt",
    "generation_share_of_bound",
    "plain_generation_share_of_bound",
    "generation_speedup_vs_plain_generate",
    "likelihood_share_of_peak",
]


def benchmark_module():
    spec = importlib.util.spec_from_file_location("gpu_scale", ROOT / "benchmarks" / "gpu_scale.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.heavy
@pytest.mark.parametrize("static", [False, True])
def test_tiny_run_prints_every_ratio_and_the_paths_agree(capsys, tmp_path, static):
    # One family each: Llama with the CPU's default path, Qwen2 with the static cache (eager here).
    shapes = ["qwen2_5_7b"] if static else ["llama3_8b"]
    results = benchmark_module().main(
        TINY_RUN
        + [
            "--static-cache" if static else "--no-static-cache",
            "--shapes",
            ",".join(shapes),
            "--json",
            str(tmp_path / "out.json"),
        ]
    )
    lines = capsys.readouterr().out.strip().splitlines()
    assert [r["shape"] for r in results] == shapes
    assert lines[-len(shapes) * len(RATIOS) :] == [
        f"{r['shape']} {key}: {r['ratios'][key]:.3f}" for r in results for key in RATIOS
    ]
    assert any(line.startswith("float32 matmul peak") for line in lines)
    for result in results:
        assert all(math.isfinite(v) and v > 0 for v in result["ratios"].values())
        assert result["engine_vs_forward_rel_error"] <= 1e-5  # fp32: the engine computes the same states
        assert result["same_tokens"] == result["gen_prompts"] == 6  # fp32: the fast path's tokens are the plain path's
        assert result["tokens"] > 12 * 40 and result["layer"] == 2  # the 40-token prefix, Layer/2 of 4 layers
        # The ℓ stage: its rate, and ℓ equal to one full forward of prompt + answer (fp32). Not measured on a GPU.
        assert result["likelihood_pairs_per_s"] > 0 and result["likelihood_vs_forward_abs_error"] <= 1e-4
    assert (tmp_path / "out.json").is_file()


def test_bad_arguments_are_refused(capsys):
    module = benchmark_module()
    with pytest.raises(SystemExit):
        module.main(["--tiny", "--shapes", "gpt5"])
    assert "--shapes: ['gpt5'] not among ['llama3_8b', 'qwen2_5_7b']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        module.main(["--tiny", "--engine-batch", "0"])
    assert "batch size must be an integer >= 1 or 'auto'" in capsys.readouterr().err


@pytest.mark.subprocess
def test_benchmark_imports_with_pytorch_and_transformers_alone():
    """A bare GPU image has PyTorch and transformers, not the project's config stack: the benchmark and the
    library parts it reaches import with OmegaConf, Hydra and bm25s blocked (a lent H100 refused it once)."""
    import subprocess
    import sys

    blocked = "import sys; [sys.modules.__setitem__(m, None) for m in ('omegaconf', 'hydra', 'bm25s', 'faiss')]"
    code = (
        f"{blocked}; import importlib.util as u; "
        f"s = u.spec_from_file_location('gpu_scale', {str(ROOT / 'benchmarks' / 'gpu_scale.py')!r}); "
        "m = u.module_from_spec(s); s.loader.exec_module(m); print('ok')"
    )
    env = {"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
