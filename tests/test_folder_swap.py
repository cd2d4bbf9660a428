"""The one folder swap (`infra/atomic.replace_folder`, `swapped_in`): at every moment of a swap, and after a writer
killed at any of its steps, the folder is the old one or the new one, whole; never absent, never a mix."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from confrag.infra import atomic
from confrag.infra.atomic import replace_folder, swapped_in

FILES = 12  # enough files that a half-removed or half-moved folder shows


def fill(folder: Path, version: str) -> None:
    folder.mkdir(parents=True)
    for i in range(FILES):
        (folder / f"{version}-{i}.txt").write_text(version)


def version_of(folder: Path) -> str:
    """'old' or 'new' when `folder` is one of them whole; anything else fails the test."""
    assert folder.is_dir(), f"{folder} is absent"
    versions = {path.read_text() for path in folder.iterdir()}
    assert len(versions) == 1, f"{folder} mixes {versions}"
    (version,) = versions
    assert sorted(p.name for p in folder.iterdir()) == sorted(f"{version}-{i}.txt" for i in range(FILES))
    return version


# The writer pauses at the start of the swap and after each file-system step of it (each rename, exchange and
# removal), says so on stdout and waits for a line on stdin; the test looks at the folder there, then lets it
# go on or kills it (SIGKILL: no cleanup runs).
WRITER = textwrap.dedent(
    """
    import os, shutil, sys
    from pathlib import Path
    from confrag.infra import atomic

    steps = 0

    def pause(what):
        global steps
        print(f"{steps} {what}", flush=True)
        steps += 1
        sys.stdin.readline()

    def paused_after(function, what):
        def wrapped(*args, **kwargs):
            try:
                return function(*args, **kwargs)
            finally:
                pause(what)
        return wrapped

    os.rename = paused_after(os.rename, "rename")
    os.replace = paused_after(os.replace, "replace")
    shutil.rmtree = paused_after(shutil.rmtree, "rmtree")
    for name in ("_exchange", "_remove"):
        if hasattr(atomic, name):
            setattr(atomic, name, paused_after(getattr(atomic, name), name))
    built, directory = Path(sys.argv[1]), Path(sys.argv[2])
    pause("start")
    atomic.replace_folder(built, directory)
    print("done", flush=True)
    """
)


def start_writer(tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    directory = tmp_path / "probe"
    fill(directory, "old")
    built = atomic.make_temp_dir(tmp_path, ".tmp-probe-")
    built.rmdir()
    fill(built, "new")
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(built), str(directory)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    return writer, directory


def run_to_step(tmp_path: Path, kill_at: int | None) -> tuple[list[str], str]:
    """Run one writer, checking the folder at each pause; kill it at pause `kill_at` (None: let it finish).
    Returns the pauses seen and the folder's version once the writer is gone."""
    writer, directory = start_writer(tmp_path)
    seen = []
    try:
        for line in writer.stdout:
            if line.strip() == "done":
                break
            seen.append(line.strip())
            version_of(directory)  # a reader in the middle of the swap
            if len(seen) - 1 == kill_at:
                writer.kill()
                break
            writer.stdin.write("\n")
            writer.stdin.flush()
    finally:
        writer.kill()
        writer.wait(timeout=30)
    return seen, version_of(directory)


@pytest.mark.subprocess
def test_a_writer_killed_at_any_step_of_the_swap_leaves_a_whole_folder(tmp_path):
    steps, version = run_to_step(tmp_path / "whole", kill_at=None)
    assert version == "new"
    assert steps[0].endswith("start") and len(steps) >= 3, steps  # the swap has steps to be killed at
    assert not [p for p in (tmp_path / "whole").iterdir() if p.name != "probe"], "the old folder is left behind"
    for kill_at in range(len(steps)):
        seen, version = run_to_step(tmp_path / str(kill_at), kill_at)
        assert len(seen) == kill_at + 1 and version in ("old", "new")  # whole (version_of), whichever it is
        if kill_at == 0:
            assert version == "old"  # killed before the swap began
        if kill_at == len(steps) - 1:
            assert version == "new"  # killed while removing the old folder


def test_replace_folder_puts_the_new_folder_in_place_and_removes_the_old(tmp_path):
    fill(tmp_path / "probe", "old")
    fill(tmp_path / ".tmp-probe-1", "new")
    replace_folder(tmp_path / ".tmp-probe-1", tmp_path / "probe")
    assert version_of(tmp_path / "probe") == "new" and [p.name for p in tmp_path.iterdir()] == ["probe"]
    fill(tmp_path / ".tmp-other-1", "new")
    replace_folder(tmp_path / ".tmp-other-1", tmp_path / "other")  # nothing there yet
    assert version_of(tmp_path / "other") == "new"


def test_where_folders_cannot_be_exchanged_the_swap_still_happens(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)  # e.g. NFS
    fill(tmp_path / "probe", "old")
    fill(tmp_path / ".tmp-probe-1", "new")
    replace_folder(tmp_path / ".tmp-probe-1", tmp_path / "probe")
    assert version_of(tmp_path / "probe") == "new" and [p.name for p in tmp_path.iterdir()] == ["probe"]


def test_swapped_in_leaves_the_old_folder_when_the_build_fails(tmp_path, caplog):
    fill(tmp_path / "probe", "old")
    with pytest.raises(RuntimeError, match="half built"):
        with swapped_in(tmp_path / "probe") as tmp:
            (tmp / "old-0.txt").write_text("new")
            raise RuntimeError("half built")
    assert version_of(tmp_path / "probe") == "old" and [p.name for p in tmp_path.iterdir()] == ["probe"]
    with swapped_in(tmp_path / "probe") as tmp:
        for i in range(FILES):
            (tmp / f"new-{i}.txt").write_text("new")
    assert version_of(tmp_path / "probe") == "new" and [p.name for p in tmp_path.iterdir()] == ["probe"]
    assert (tmp_path / "probe").stat().st_mode & 0o777 == atomic.dir_mode()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]  # this file system exchanges


class _Converted:
    """Stands in for the transformers model / tokenizer of a GGUF file: what a reader of the cache sees while the
    conversion writes is recorded, and `fail` makes the save die half-way (a killed conversion)."""

    seen: list[str] = []
    fail = False
    target = Path()

    def __init__(self) -> None:
        self.config = type("Config", (), {})()
        self.hf_quantizer = None

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        return cls()

    def save_pretrained(self, directory) -> None:
        _Converted.seen.append(version_of(_Converted.target))  # a reader in the middle of the conversion
        (Path(directory) / "new-0.txt").write_text("new")
        if _Converted.fail:
            raise RuntimeError("killed half-way")
        for i in range(1, FILES):
            (Path(directory) / f"new-{i}.txt").write_text("new")


def test_a_model_conversion_replaces_a_damaged_one_without_a_moment_without_the_folder(tmp_path, monkeypatch):
    """The converted model's folder was deleted before the new one was renamed in: a reader (or a conversion
    killed in between) found no folder. Now it is the old folder, whole, until the new one takes its place."""
    from confrag.llm import pretrained

    target = tmp_path / "models" / "model-0123"
    fill(target, "old")  # no digest: a damaged conversion, rebuilt
    monkeypatch.setattr(pretrained, "AutoTokenizer", _Converted)
    monkeypatch.setattr(pretrained, "AutoModelForCausalLM", _Converted)
    monkeypatch.setattr(pretrained, "write_folder_digest", lambda folder: None)  # the digest file would mix versions
    monkeypatch.setattr(_Converted, "target", target)
    monkeypatch.setattr(_Converted, "seen", [])
    monkeypatch.setattr(_Converted, "fail", True)
    with pytest.raises(RuntimeError, match="killed half-way"):
        pretrained.convert_gguf(tmp_path / "model.gguf", target)
    assert version_of(target) == "old" and _Converted.seen == ["old"]
    assert not [p.name for p in target.parent.iterdir() if ".tmp-" in p.name]
    monkeypatch.setattr(_Converted, "fail", False)
    pretrained.convert_gguf(tmp_path / "model.gguf", target)
    assert _Converted.seen == ["old", "old", "old"] and version_of(target) == "new"  # model, then tokenizer
    assert not [p.name for p in target.parent.iterdir() if p.name.startswith(".tmp-")]


def test_written_once_puts_a_whole_folder_in_place_and_keeps_one_already_there(tmp_path):
    """The write-once folder of the BM25 and FAISS indexes: renamed into place whole; a folder another process put
    there first is kept (the same key, the same bytes); a failed build leaves nothing behind."""
    from confrag.infra.atomic import dir_mode, written_once

    index = tmp_path / "indexes" / "key"
    with written_once(index) as tmp:
        assert tmp.parent == index.parent and not index.exists()
        (tmp / "part").write_text("first")
    assert (index / "part").read_text() == "first" and index.stat().st_mode & 0o777 == dir_mode()
    with written_once(index) as tmp:
        (tmp / "part").write_text("second")
    assert (index / "part").read_text() == "first"
    with pytest.raises(RuntimeError, match="build failed"), written_once(tmp_path / "indexes" / "other") as tmp:
        (tmp / "part").write_text("half")
        raise RuntimeError("build failed")
    assert sorted(p.name for p in (tmp_path / "indexes").iterdir()) == ["key"]
