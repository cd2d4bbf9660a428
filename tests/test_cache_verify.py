"""`python -m confrag.infra.cache_verify verify [CACHE_DIR]`: reports damaged artifacts (exit 1), incomplete ones and
shards without digests (exit 0), and writes nothing."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from confrag.infra.cache_verify import main, verify_cache
from confrag.infra.sharded import ShardedArtifact


def states(start: int, stop: int) -> np.ndarray:
    return np.arange(start * 8, stop * 8, dtype=np.float32).reshape(1, stop - start, 8)


@pytest.fixture()
def cache(tmp_path):
    root = tmp_path / "cache"
    ShardedArtifact(root, "activations", {"n": 1}, 10, shard_size=3).compute(states, progress=False)
    ShardedArtifact(root, "generations", {"n": 1}, 5, shard_size=2, fmt="json").compute(
        lambda a, b: [f"answer {i}" for i in range(a, b)], progress=False
    )
    # Nested kinds, as the answer store lays out its chunks.
    ShardedArtifact(root, "answers/abc", {"n": 2}, 4, shard_size=4, fmt="json").compute(
        lambda a, b: ["x"] * (b - a), progress=False
    )
    return root


def snapshot(root) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def artifact_dir(root, kind: str):
    (manifest,) = (root / kind).glob("*/manifest.json")
    return manifest.parent


def test_a_whole_cache_passes(cache, capsys):
    assert main(["verify", str(cache)]) == 0
    out = capsys.readouterr().out
    assert "3 artifacts, 8 shards: 3 whole, 0 damaged, 0 without digest, 0 incomplete" in out and "DAMAGED" not in out


def test_damage_is_reported_by_artifact_and_shard_and_nothing_is_written(cache, capsys):
    activations = artifact_dir(cache, "activations")
    shard = activations / "shard-00002.npy"
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF  # inside the data; the header is intact
    shard.write_bytes(bytes(data))
    generations = artifact_dir(cache, "generations")
    (generations / "shard-00001.json").write_text('["answer 2", "answer 9"]')
    before = snapshot(cache)

    assert main(["verify", str(cache)]) == 1
    out = capsys.readouterr().out
    assert f"DAMAGED     activations/{activations.name}/shard-00002.npy: checksum mismatch" in out
    assert f"DAMAGED     generations/{generations.name}/shard-00001.json: checksum mismatch" in out
    assert "3 artifacts, 8 shards: 1 whole, 2 damaged, 0 without digest, 0 incomplete" in out
    assert snapshot(cache) == before


def test_incomplete_artifacts_are_listed_but_not_damage(cache, capsys):
    activations = artifact_dir(cache, "activations")
    (activations / "shard-00003.npy").unlink()
    assert main(["verify", str(cache)]) == 0
    out = capsys.readouterr().out
    assert f"INCOMPLETE  activations/{activations.name}: 1 of 4 shards missing" in out
    assert "1 incomplete" in out and "0 damaged" in out


def test_shards_without_digest_fail_unless_adopted(cache, capsys):
    """A deleted digest beside a damaged shard used to read '0 damaged': now it is 'without digest', exit 1,
    and --adopt records digests only for shards that pass every other check."""
    generations = artifact_dir(cache, "generations")
    for digest in generations.glob("*.digest"):
        digest.unlink()  # written before checksums existed (or deleted)
    (generations / "shard-00002.json").write_text('["answer 4", "answer 5"]')  # one item too many
    before = snapshot(cache)
    assert main(["verify", str(cache)]) == 1
    out = capsys.readouterr().out
    assert f"NO DIGEST   generations/{generations.name}: 2 shard(s) without a digest" in out
    assert f"DAMAGED     generations/{generations.name}/shard-00002.json: holds 2 items, expected 1" in out
    assert snapshot(cache) == before  # verify alone writes nothing
    assert main(["verify", "--adopt", str(cache)]) == 1  # the damaged shard stays damaged
    out = capsys.readouterr().out
    assert "adopted: recorded the digest of 2 shard(s)" in out
    assert sorted(p.name for p in generations.glob("*.digest")) == [
        "shard-00000.json.digest",
        "shard-00001.json.digest",
    ]
    (generations / "shard-00002.json").unlink()
    assert main(["verify", str(cache)]) == 0


def test_a_folder_that_is_no_cache_exits_non_zero(tmp_path, capsys):
    (tmp_path / "photos").mkdir()
    (tmp_path / "photos" / "cat.jpg").write_bytes(b"not a cache")
    assert main(["verify", str(tmp_path / "photos")]) == 3
    assert "holds no confrag artifact" in capsys.readouterr().err


def test_a_manifest_that_does_not_match_its_directory_is_damage(cache, capsys):
    manifest = artifact_dir(cache, "activations") / "manifest.json"
    record = json.loads(manifest.read_text())
    record["spec"] = {"n": 2}
    manifest.write_text(json.dumps(record))
    checks = {c.directory: c for c in verify_cache(cache)}
    assert [d.relative_to(cache).parts[0] for d, c in checks.items() if c.is_damaged] == ["activations"]
    assert "describes another artifact than its directory name promises" in checks[manifest.parent].problem
    manifest.write_text("{")
    assert main(["verify", str(cache)]) == 1
    assert "unreadable manifest" in capsys.readouterr().out


@pytest.mark.subprocess
def test_command_line(cache, tmp_path):
    ok = subprocess.run(
        [sys.executable, "-m", "confrag.infra.cache_verify", "verify", str(cache)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ok.returncode == 0 and "3 whole" in ok.stdout, ok.stderr
    missing = subprocess.run(
        [sys.executable, "-m", "confrag.infra.cache_verify", "verify", str(tmp_path / "nowhere")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert missing.returncode == 2 and "not a directory" in missing.stderr


def test_help_shows_the_whole_description(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    # The first docstring line alone stopped mid-sentence ("... shape, length and").
    assert "against its folder digest." in out and "--adopt" in out and "exit status is 1" in out
