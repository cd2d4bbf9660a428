"""The tiers' marks are kept by the suite itself (conftest.py, helpers/tiers.py): an unmarked test that runs a task's
computation or starts a Python process fails before it does, naming the mark it needs; a marked one goes on."""

from __future__ import annotations

import subprocess
import sys

import pytest

from confrag.train import TASKS


@pytest.mark.parametrize("task", sorted(TASKS))
def test_an_unmarked_test_may_not_run_a_task(task):
    with pytest.raises(pytest.fail.Exception, match=rf"runs the {task} task's computation: mark it @pytest.mark.task"):
        TASKS[task].run(None, None, None)  # stopped before the task reads its arguments


def test_an_unmarked_test_may_not_start_a_python_process():
    for command in ([sys.executable, "-c", "pass"], ["torchrun", "--help"], f"{sys.executable} -c pass"):
        with pytest.raises(pytest.fail.Exception, match=r"starts a Python process .*mark it @pytest.mark.subprocess"):
            subprocess.run(command, shell=isinstance(command, str))


def test_other_programs_are_a_librarys_business():
    assert subprocess.run(["true"]).returncode == 0


@pytest.mark.subprocess
def test_a_marked_test_starts_its_python_process():
    assert subprocess.run([sys.executable, "-c", "print('ran')"], capture_output=True, text=True).stdout == "ran\n"


@pytest.mark.task
def test_a_marked_test_reaches_the_tasks_own_code():
    with pytest.raises(AttributeError):  # the probe task's own run, on arguments it cannot read
        TASKS["probe"].run(None, None, None)
