"""Every third-party package the code imports is declared in pyproject.toml, so that `pip install confrag`
(the wheel, outside this checkout's environment) brings what the code needs."""

from __future__ import annotations

import ast
import re
import sys
from importlib import metadata
from pathlib import Path

import pytest

from helpers.runs import ROOT

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def imported_top_level(paths: list[Path]) -> dict[str, Path]:
    """Top-level module -> the first file importing it (module level or inside a function), absolute imports."""
    found: dict[str, Path] = {}
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                found.setdefault(name.split(".")[0], path)
    return found


def declared(extra: str | None = None) -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    specs = project["dependencies"] if extra is None else project["optional-dependencies"][extra]
    return {normalized(re.split(r"[<>=!~ \[;]", spec, maxsplit=1)[0]) for spec in specs}


def test_every_imported_package_is_declared() -> None:
    sources = sorted((ROOT / "src").rglob("*.py")) + [ROOT / "train.py"]
    modules = imported_top_level(sources)
    providers = metadata.packages_distributions()
    deps = declared()
    missing = {}
    for module, path in sorted(modules.items()):
        if module in sys.stdlib_module_names or module == "confrag":
            continue
        distributions = {normalized(d) for d in providers.get(module, [])}
        if not distributions:
            missing[module] = f"not installed (imported by {path.relative_to(ROOT)})"
        elif not distributions & deps:
            missing[module] = f"{sorted(distributions)} undeclared (imported by {path.relative_to(ROOT)})"
    assert not missing, f"imported but not in [project] dependencies: {missing}"


def test_the_dev_extra_runs_the_notebook() -> None:
    assert {"nbconvert", "nbclient", "ipykernel", "jupyter-core", "nbformat"} <= declared("dev")
