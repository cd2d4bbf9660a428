"""The test tiers' marks kept true. `make test-fast` leaves out the tests marked `task` (they run a task's
computation) and `subprocess` (they start a Python process); a test that does either without its mark fails,
naming the mark, so the inner loop stays units only without anyone keeping a list."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest


class TierGuard:
    """Knows the test being run (`item`, None between tests and at collection) and fails it when it does what
    only a test with a given mark may do."""

    def __init__(self) -> None:
        self.item: pytest.Item | None = None

    def require(self, mark: str, what: str) -> None:
        if self.item is None or self.item.get_closest_marker(mark) is not None:
            return
        pytest.fail(
            f"{self.item.nodeid} {what}: mark it @pytest.mark.{mark} (pyproject.toml), so that `make test-fast` "
            f"leaves it out",
            pytrace=False,
        )

    def popen(self, original: Callable[..., None]) -> Callable[..., None]:
        """`subprocess.Popen.__init__` that requires the `subprocess` mark to start a Python process (the
        interpreter, `python…` or `torchrun`); a library's own helper programs (ldconfig, git) are its business."""

        def init(popen: subprocess.Popen, args: Any, *rest: Any, **options: Any) -> None:
            program = args if isinstance(args, str | bytes | Path) else args[0]
            name = Path(str(program).split()[0]).name
            if name.startswith("python") or name == "torchrun" or str(program) == sys.executable:
                self.require("subprocess", f"starts a Python process ({name})")
            original(popen, args, *rest, **options)

        return init

    def task_run(self, original: Callable[..., Any], task: str) -> Callable[..., Any]:
        """A task module's `run` that requires the `task` mark."""

        def run(*args: Any, **kwargs: Any) -> Any:
            self.require("task", f"runs the {task} task's computation")
            return original(*args, **kwargs)

        return run
