"""An installable tool: the configs ship inside the package (conf/ -> confrag.conf), so that a built wheel,
installed anywhere, composes and runs an experiment from any folder."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from setuptools import find_packages

from confrag.data.nq import default_questions_path
from confrag.infra.paths import config_dir, project_root, source_checkout

from helpers.runs import MODEL_DIR, ROOT

# What a wheel is built from: the source tree without caches, copied so that a build never leaves
# build/ or *.egg-info in the checkout (and never reuses a stale build/ from it).
SOURCES = ("pyproject.toml", "README.md", "LICENSE", "src", "conf")


def build_wheel(tmp_path: Path) -> Path:
    tree = tmp_path / "tree"
    tree.mkdir()
    for name in SOURCES:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, tree / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        elif source.is_file():
            shutil.copy2(source, tree / name)
    out = tmp_path / "dist"
    # No build isolation: the project's environment's setuptools, nothing downloaded.
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(out)]
    done = subprocess.run([*command, "-v", str(tree)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    # Every config node's folder is declared: setuptools warned once per unlisted folder of package data (23).
    assert "is absent from the `packages` configuration" not in done.stdout + done.stderr
    (wheel,) = out.glob("confrag-*.whl")
    return wheel


def test_the_package_list_is_every_package_of_src_and_every_config_folder() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    listed = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    nodes = [
        "confrag.conf." + ".".join(d.relative_to(ROOT / "conf").parts)
        for d in (ROOT / "conf").rglob("*")
        if d.is_dir() and d.name != "__pycache__"
    ]
    assert len(nodes) >= 23 and "confrag.conf.hydra.launcher" in nodes
    assert sorted(listed) == sorted([*find_packages(ROOT / "src"), "confrag.conf", *nodes])


def test_a_source_checkout_finds_its_own_conf_folder() -> None:
    assert source_checkout() == ROOT and project_root() == ROOT
    assert config_dir() == ROOT / "conf"
    # The default data path is the shared sample next to the checkout, as before.
    assert default_questions_path() == ROOT.parent / "shared" / "data" / "nq_open_gold.jsonl.gz" or (
        os.environ.get("CONFRAG_QUESTIONS_PATH") or os.environ.get("CONFRAG_NQ_PATH")
    )


@pytest.mark.subprocess
def test_the_wheel_carries_every_config_and_its_layout_composes_an_experiment(tmp_path: Path) -> None:
    wheel = build_wheel(tmp_path)
    with zipfile.ZipFile(wheel) as archive:
        shipped = {n.removeprefix("confrag/conf/") for n in archive.namelist() if n.startswith("confrag/conf/")}
        (entry_points,) = [n for n in archive.namelist() if n.endswith(".dist-info/entry_points.txt")]
        commands = archive.read(entry_points).decode()
        archive.extractall(tmp_path / "site")
    # The commands an installed wheel brings (the checkout's scripts are not in it).
    for command in ("confrag-train", "confrag-cache", "confrag-sweep-summary", "confrag-compare-runs"):
        assert f"{command} = confrag." in commands
    expected = {str(p.relative_to(ROOT / "conf")) for p in (ROOT / "conf").rglob("*.yaml")}
    assert expected <= shipped
    # The unpacked wheel as an installed package: no pyproject.toml beside it, so its own copy of the configs.
    code = "import confrag.infra.paths as p; print(p.config_dir()); print(p.project_root())"
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    work = tmp_path / "elsewhere"
    work.mkdir()
    done = subprocess.run([sys.executable, "-c", code], cwd=work, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    found, root = done.stdout.split()
    assert Path(found) == tmp_path / "site" / "confrag" / "conf" and Path(root) == work
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=found, version_base="1.3"):
        cfg = compose(
            config_name="train", overrides=["+experiment=probe_tiny_llama", "paths.questions_path=/data/nq.jsonl"]
        )
    assert cfg.llm.name == "tiny_llama" and cfg.data.questions_path == "/data/nq.jsonl"


@pytest.mark.task
@pytest.mark.subprocess
@pytest.mark.slow
def test_confrag_train_from_an_installed_wheel_runs_in_any_folder(tmp_path: Path) -> None:
    questions_path = default_questions_path()
    if not questions_path.is_file():
        pytest.skip(f"needs the shared NQ sample at {questions_path}")
    wheel = build_wheel(tmp_path)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    # The dependencies come from the project's environment (appended to the new one's path), nothing is
    # downloaded; that environment's editable confrag is not picked up (its .pth files are not processed).
    Path(site, "project_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CONFRAG_CACHE")}
    env.update(CONFRAG_MODEL_DIR=MODEL_DIR, OMP_NUM_THREADS="1")
    # --force-reinstall: the project's environment may list an (editable) confrag of the same version.
    command = [python, "-m", "pip", "install", "--no-deps", "--no-index", "--force-reinstall", str(wheel)]
    install = subprocess.run(command, env=env, capture_output=True, text=True)
    assert install.returncode == 0 and "Successfully installed" in install.stdout, install.stdout + install.stderr
    work = tmp_path / "any_folder"
    work.mkdir()
    where = subprocess.run(
        [python, "-c", "import confrag; print(confrag.__file__)"], cwd=work, env=env, capture_output=True, text=True
    )
    assert where.stdout.strip().startswith(site), where.stdout + where.stderr
    overrides = [
        f"paths.questions_path={questions_path}",
        "logger=none",
        "data.num_questions=24",
        "trainer.max_epochs=1",
    ]
    done = subprocess.run(
        [venv / "bin" / "confrag-train", "+experiment=probe_tiny_llama", *overrides],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Probe on layer" in done.stdout + done.stderr
    runs = list((work / "logs" / "probe" / "runs").iterdir())
    assert len(runs) == 1 and (runs[0] / ".hydra" / "config.yaml").is_file()
    assert (work / ".cache").is_dir()  # caches and logs go to the folder it runs in
