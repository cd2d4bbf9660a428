"""ShardedArtifact / ActivationStore: the guarantees the pipeline's caches rely on.

- shards are computed once and reused;
- the key (and directory) changes with every input that changes the content;
- a manifest that does not match its key is refused;
- damaged shards are detected and recomputed to the same result; stale temp files are removed;
- json artifacts keep record order; activation stores index rows across shard boundaries and are memmaps.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest

from confrag.infra.activation_store import ActivationStore
from confrag.infra.atomic import npy_bytes
from confrag.infra.digests import digest_record, fingerprint
from confrag.infra.finite import NonFiniteError
from confrag.infra.sharded import STALE_TMP_SECONDS, CacheMismatchError, ShardedArtifact

SPEC = {
    "llm": {"name": "tiny", "ref": "tiny:llama@abc"},
    "prompts": "p0",
    "rows": "r0",
    "layers": [0, 2],
    "store": "float32",
}
LAYERS = [0, 2]
DIM = 5


def fake_states(start: int, stop: int) -> np.ndarray:
    """Deterministic (layers, items, dim) block in which every value encodes (layer, item, column)."""
    layer = np.array(LAYERS, dtype=np.float32)[:, None, None]
    item = np.arange(start, stop, dtype=np.float32)[None, :, None]
    column = np.arange(DIM, dtype=np.float32)[None, None, :]
    return (1000 * layer + 10 * item + column / 10).astype(np.float32)


def expected_row(layer: int, item: int) -> np.ndarray:
    return fake_states(item, item + 1)[LAYERS.index(layer), 0]


class Counter:
    """A compute function that records which (start, stop) ranges it was asked for."""

    def __init__(self, fn=fake_states):
        self.fn = fn
        self.calls: list[tuple[int, int]] = []

    def __call__(self, start: int, stop: int):
        self.calls.append((start, stop))
        return self.fn(start, stop)


def must_not_run(start: int, stop: int):
    raise AssertionError(f"compute function called for items {start}:{stop}; the shard should come from the cache")


def npy_artifact(root, num_items=10, shard_size=3, spec=SPEC) -> ShardedArtifact:
    return ShardedArtifact(root, "activations", spec, num_items, shard_size=shard_size)


def all_values(artifact: ShardedArtifact) -> np.ndarray:
    return np.concatenate([np.asarray(s) for s in artifact.shards()], axis=1)


# --- computed once ---------------------------------------------------------------------------------


def test_shards_are_computed_once_and_reused(tmp_path):
    counter = Counter()
    first = npy_artifact(tmp_path).compute(counter, progress=False)
    assert counter.calls == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert first.complete and first.pending() == []

    # A new handle on the same artifact (as a second process would create) computes nothing.
    again = npy_artifact(tmp_path)
    assert again.dir == first.dir
    assert again.complete
    again.compute(must_not_run, progress=False)
    np.testing.assert_array_equal(all_values(again), fake_states(0, 10))


def test_only_missing_shards_are_computed(tmp_path):
    artifact = npy_artifact(tmp_path)
    artifact.write(1, fake_states(3, 6))
    artifact.write(3, fake_states(9, 10))
    counter = Counter()
    artifact.compute(counter, progress=False)
    assert counter.calls == [(0, 3), (6, 9)]
    np.testing.assert_array_equal(all_values(artifact), fake_states(0, 10))


def test_incomplete_artifact_refuses_to_be_read(tmp_path):
    artifact = npy_artifact(tmp_path)
    artifact.write(0, fake_states(0, 3))
    assert artifact.pending() == [1, 2, 3]
    with pytest.raises(CacheMismatchError, match="incomplete"):
        artifact.shards()


# --- keys ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "change",
    [
        {"spec": {**SPEC, "llm": {"name": "tiny", "ref": "tiny:llama@other"}}},
        {"spec": {**SPEC, "prompts": "p1"}},
        {"spec": {**SPEC, "rows": "r1"}},
        {"spec": {**SPEC, "layers": [0, 3]}},
        {"spec": {**SPEC, "store": "float16"}},
        {"spec": {**SPEC, "extra": None}},
        {"kind": "generations"},
        {"num_items": 11},
        {"shard_size": 4},
        {"fmt": "json"},
    ],
    ids=["llm", "prompts", "rows", "layers", "store", "new-field", "kind", "num_items", "shard_size", "fmt"],
)
def test_key_and_directory_change_with_every_input(tmp_path, change):
    base = dict(kind="activations", spec=SPEC, num_items=10, shard_size=3, fmt="npy")
    original = ShardedArtifact(tmp_path, **base)
    changed = ShardedArtifact(tmp_path, **{**base, **change})
    assert changed.key != original.key
    assert changed.dir != original.dir
    assert not changed.dir.is_relative_to(original.dir) and not original.dir.is_relative_to(changed.dir)
    # Different content, so no reuse: the changed artifact has everything still to compute.
    original.compute(Counter(), progress=False)
    assert changed.pending() == list(range(changed.num_shards))


def test_key_is_independent_of_dict_order_and_stable(tmp_path):
    reordered = dict(reversed(list(SPEC.items())))
    assert npy_artifact(tmp_path).key == npy_artifact(tmp_path, spec=reordered).key
    assert fingerprint({"a": 1, "b": [1, 2]}) == fingerprint({"b": [1, 2], "a": 1})
    assert fingerprint({"a": 1}) != fingerprint({"a": 2})


# --- manifest --------------------------------------------------------------------------------------


def test_edited_manifest_spec_is_refused(tmp_path):
    artifact = npy_artifact(tmp_path).compute(Counter(), progress=False)
    manifest = json.loads(artifact.manifest_path.read_text())
    assert manifest["key"] == artifact.key and manifest["spec"] == SPEC
    manifest["spec"]["layers"] = [0, 1]  # states of other layers under this key would be silently wrong
    artifact.manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(CacheMismatchError, match=artifact.key):
        npy_artifact(tmp_path)


def test_unreadable_manifest_is_refused(tmp_path):
    artifact = npy_artifact(tmp_path)
    artifact.manifest_path.write_text('{"kind": "activ')
    with pytest.raises(CacheMismatchError, match="unreadable manifest"):
        npy_artifact(tmp_path)


# --- damaged shards and stale temp files ------------------------------------------------------------


@pytest.mark.parametrize("damage", ["truncated-data", "truncated-header", "garbage", "wrong-row-count"])
def test_damaged_npy_shard_is_recomputed_to_the_same_result(tmp_path, damage):
    artifact = npy_artifact(tmp_path).compute(Counter(), progress=False)
    original = all_values(artifact).copy()
    path = artifact.shard_path(2)
    data = path.read_bytes()
    if damage == "truncated-data":
        path.write_bytes(data[: len(data) - 7])
    elif damage == "truncated-header":
        path.write_bytes(data[:40])
    elif damage == "garbage":
        path.write_bytes(b"not an npy file at all")
    else:
        np.save(path, fake_states(0, 2))

    reopened = npy_artifact(tmp_path)
    assert reopened.pending() == [2]
    counter = Counter()
    reopened.compute(counter, progress=False)
    assert counter.calls == [(6, 9)]
    np.testing.assert_array_equal(all_values(reopened), original)


def test_empty_npy_shard_is_recomputed(tmp_path):
    artifact = npy_artifact(tmp_path).compute(Counter(), progress=False)
    artifact.shard_path(1).write_bytes(b"")
    counter = Counter()
    npy_artifact(tmp_path).compute(counter, progress=False)
    assert counter.calls == [(3, 6)]
    np.testing.assert_array_equal(all_values(artifact), fake_states(0, 10))


@pytest.mark.parametrize("damage", ["truncated", "wrong-count", "bad-utf8"])
def test_damaged_json_shard_is_recomputed(tmp_path, damage):
    records = lambda a, b: [{"i": i, "text": f"réponse {i}"} for i in range(a, b)]  # noqa: E731
    artifact = ShardedArtifact(tmp_path, "generations", SPEC, 7, shard_size=3, fmt="json")
    artifact.compute(records, progress=False)
    path = artifact.shard_path(1)
    data = path.read_bytes()
    if damage == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "wrong-count":
        path.write_text(json.dumps(records(3, 5)))
    else:  # cut in the middle of the two-byte "é"
        path.write_bytes(data[: data.index("é".encode()) + 1])
    reopened = ShardedArtifact(tmp_path, "generations", SPEC, 7, shard_size=3, fmt="json")
    counter = Counter(records)
    reopened.compute(counter, progress=False)
    assert counter.calls == [(3, 6)]
    assert reopened.records() == records(0, 7)


def test_stale_temp_files_are_removed_on_open(tmp_path):
    artifact = npy_artifact(tmp_path).compute(Counter(), progress=False)
    stale = [artifact.dir / ".tmp-abc123.npy", artifact.dir / ".tmp-xyz"]
    for path in stale:
        path.write_bytes(b"half a shard")
        old = time.time() - STALE_TMP_SECONDS - 5
        os.utime(path, (old, old))
    fresh = artifact.dir / ".tmp-being-written-by-another-process"
    fresh.write_bytes(b"in progress")
    reopened = npy_artifact(tmp_path)
    assert not any(path.exists() for path in stale)
    assert fresh.exists()  # a live writer's temp file is left alone
    fresh.unlink()
    shard_files = [f"shard-{i:05d}.npy{suffix}" for i in range(4) for suffix in ("", ".digest", ".lock")]
    assert sorted(p.name for p in reopened.dir.iterdir()) == sorted(["manifest.json", *shard_files])
    reopened.compute(must_not_run, progress=False)


def test_no_temp_files_are_left_after_compute(tmp_path):
    artifact = npy_artifact(tmp_path).compute(Counter(), progress=False)
    assert not list(artifact.dir.glob(".tmp-*"))


def test_failing_compute_keeps_finished_shards_and_leaves_no_temp_files(tmp_path):
    def fails_on_third(start, stop):
        if start == 6:
            raise RuntimeError("boom")
        return fake_states(start, stop)

    with pytest.raises(RuntimeError, match="boom"):
        npy_artifact(tmp_path).compute(fails_on_third, progress=False)
    artifact = npy_artifact(tmp_path)
    assert artifact.pending() == [2, 3]
    assert not list(artifact.dir.glob(".tmp-*"))
    counter = Counter()
    artifact.compute(counter, progress=False)
    assert counter.calls == [(6, 9), (9, 10)]
    np.testing.assert_array_equal(all_values(artifact), fake_states(0, 10))


# --- json artifacts --------------------------------------------------------------------------------


def test_json_records_round_trip_in_order(tmp_path):
    texts = [f"answer {i} — ünïcode" for i in range(10)]
    artifact = ShardedArtifact(tmp_path, "generations", SPEC, 10, shard_size=3, fmt="json")
    artifact.compute(lambda a, b: texts[a:b], progress=False)
    assert ShardedArtifact(tmp_path, "generations", SPEC, 10, shard_size=3, fmt="json").records() == texts
    dicts = [{"q": i, "answers": [str(i), "x"]} for i in range(5)]
    other = ShardedArtifact(tmp_path, "generations", {**SPEC, "rows": "dicts"}, 5, shard_size=2, fmt="json")
    assert other.compute(lambda a, b: dicts[a:b], progress=False).records() == dicts


def test_empty_artifact(tmp_path):
    artifact = ShardedArtifact(tmp_path, "generations", SPEC, 0, shard_size=3, fmt="json")
    assert artifact.num_shards == 0 and artifact.complete
    assert artifact.compute(must_not_run, progress=False).records() == []


def test_invalid_arguments(tmp_path):
    with pytest.raises(ValueError, match="fmt"):
        ShardedArtifact(tmp_path, "x", SPEC, 3, fmt="pickle")
    with pytest.raises(ValueError, match="shard_size"):
        ShardedArtifact(tmp_path, "x", SPEC, 3, shard_size=0)


# --- activation store ------------------------------------------------------------------------------


@pytest.fixture()
def store(tmp_path) -> ActivationStore:
    artifact = npy_artifact(tmp_path, num_items=10, shard_size=3).compute(Counter(), progress=False)
    return ActivationStore(artifact, LAYERS)


def test_store_get_across_shard_boundaries(store):
    assert len(store) == 10 and store.dim == DIM and store.layers == LAYERS
    for layer in LAYERS:
        for index in range(10):
            got = store.get(layer, index)
            assert got.dtype == np.float32 and got.shape == (DIM,)
            np.testing.assert_array_equal(got, expected_row(layer, index))
    row = store.get(2, 4)
    row[:] = -1  # a writable copy: the cache is untouched
    np.testing.assert_array_equal(store.get(2, 4), expected_row(2, 4))


def test_store_take_across_shard_boundaries(store):
    indices = [9, 0, 3, 2, 8, 5, 6, 2, np.int64(7)]  # every shard, unordered, a repeat, a numpy integer
    for layer in LAYERS:
        got = store.take(layer, indices)
        assert got.shape == (len(indices), DIM) and got.dtype == np.float32
        np.testing.assert_array_equal(got, np.stack([expected_row(layer, int(i)) for i in indices]))
    assert store.take(0, []).shape == (0, DIM)


def test_store_rejects_layer_not_stored(store):
    with pytest.raises(ValueError, match=r"layer 1 was not extracted.*\[0, 2\]"):
        store.get(1, 0)
    with pytest.raises(ValueError, match=r"layer 4 was not extracted.*\[0, 2\]"):
        store.take(4, [0, 1])


def test_store_arrays_are_memmaps(store):
    arrays = store.arrays
    assert len(arrays) == 4
    assert all(isinstance(array, np.memmap) for array in arrays)
    assert all(not array.flags.writeable for array in arrays)  # read-only mapping of the cache files
    assert [array.shape for array in arrays] == [(2, 3, DIM)] * 3 + [(2, 1, DIM)]
    assert all(array.dtype == np.float32 for array in arrays)


def test_store_pickles_without_arrays(store):
    import pickle

    store.get(0, 0)
    clone = pickle.loads(pickle.dumps(store))
    assert clone._arrays is None  # the worker maps the files itself
    np.testing.assert_array_equal(clone.take(2, range(10)), store.take(2, range(10)))
    assert isinstance(clone.arrays[0], np.memmap)


# --- checksums -------------------------------------------------------------------------------------


def flip_data_bytes(path, count: int = 8) -> None:
    """Change `count` bytes in the middle of an npy file's data, leaving its header (and size) intact."""
    data = bytearray(path.read_bytes())
    header = 128  # np.save's header is 128 bytes for these small arrays
    middle = header + (len(data) - header) // 2
    for offset in range(middle, middle + count):
        data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_bit_flips_in_shard_data_are_detected_and_the_shard_recomputed(tmp_path, caplog):
    artifact = npy_artifact(tmp_path).compute(Counter(), progress=False)
    path = artifact.shard_path(2)
    flip_data_bytes(path)
    assert np.load(path).shape == (2, 3, DIM)  # still a well-formed array of the right shape: only the digest can tell

    reopened = npy_artifact(tmp_path)
    with caplog.at_level("WARNING", logger="confrag.infra.sharded"):
        assert reopened.pending() == [2]
    assert "shard-00002.npy" in caplog.text and "checksum mismatch" in caplog.text
    counter = Counter()
    reopened.compute(counter, progress=False)
    assert counter.calls == [(6, 9)]
    np.testing.assert_array_equal(all_values(reopened), fake_states(0, 10))
    assert npy_artifact(tmp_path).pending() == []


def test_edited_json_shard_of_the_same_length_is_detected(tmp_path):
    texts = [f"answer {i}" for i in range(7)]
    artifact = ShardedArtifact(tmp_path, "generations", SPEC, 7, shard_size=3, fmt="json")
    artifact.compute(lambda a, b: texts[a:b], progress=False)
    path = artifact.shard_path(1)
    path.write_text(path.read_text().replace("answer 4", "answer 9"))
    reopened = ShardedArtifact(tmp_path, "generations", SPEC, 7, shard_size=3, fmt="json")
    assert reopened.pending() == [1]
    counter = Counter(lambda a, b: texts[a:b])
    reopened.compute(counter, progress=False)
    assert counter.calls == [(3, 6)] and reopened.records() == texts


@pytest.mark.parametrize("damage", ["garbage", "other-digest", "missing-fields"])
def test_damaged_digest_file_means_a_damaged_shard(tmp_path, damage):
    artifact = npy_artifact(tmp_path).compute(Counter(), progress=False)
    digest = artifact.digest_path(0)
    record = json.loads(digest.read_text())
    if damage == "garbage":
        digest.write_text("{not json")
    elif damage == "other-digest":
        digest.write_text(json.dumps({**record, "digest": "0" * 32}))
    else:
        digest.write_text(json.dumps({"algorithm": record["algorithm"]}))
    counter = Counter()
    npy_artifact(tmp_path).compute(counter, progress=False)
    assert counter.calls == [(0, 3)]
    assert json.loads(digest.read_text()) == record  # the recomputed shard has the same bytes


def test_a_shard_without_digest_is_recomputed_not_adopted(tmp_path, caplog):
    """A deleted digest and a damaged shard: before, the damaged bytes got a fresh digest and were used."""
    artifact = npy_artifact(tmp_path).compute(Counter(), progress=False)
    records = {i: artifact.digest_path(i).read_text() for i in range(4)}
    artifact.digest_path(1).unlink()
    flip_data_bytes(artifact.shard_path(1))
    reopened = npy_artifact(tmp_path)
    assert reopened.pending() == [1]
    assert "shard-00001.npy has no digest file; it is recomputed" in caplog.text
    counter = Counter()
    reopened.compute(counter, progress=False)
    assert counter.calls == [(3, 6)]
    np.testing.assert_array_equal(all_values(reopened), fake_states(0, 10))
    assert {i: artifact.digest_path(i).read_text() for i in range(4)} == records


def test_adopt_records_the_digest_of_a_whole_shard_written_before_digests(tmp_path):
    artifact = npy_artifact(tmp_path).compute(Counter(), progress=False)
    records = {i: artifact.digest_path(i).read_text() for i in range(4)}
    for i in range(4):
        artifact.digest_path(i).unlink()  # a cache written before digests existed
    legacy = npy_artifact(tmp_path)
    truncate = artifact.shard_path(2)
    truncate.write_bytes(truncate.read_bytes()[:-8])  # damaged: not adopted
    assert [legacy.adopt(i) for i in range(4)] == [True, True, False, True]
    assert {i: artifact.digest_path(i).read_text() for i in (0, 1, 3)} == {i: records[i] for i in (0, 1, 3)}
    counter = Counter()
    npy_artifact(tmp_path).compute(counter, progress=False)
    assert counter.calls == [(6, 9)]


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_a_non_finite_array_is_never_written(tmp_path, value):
    def states(start, stop):
        out = fake_states(start, stop)
        if start == 3:
            out[1, 1, 0] = value  # item 4, in the second layer
        return out

    artifact = npy_artifact(tmp_path)
    with pytest.raises(NonFiniteError, match=r"activations: shard .*shard-00001.npy holds .* in row\(s\) 4\b"):
        artifact.compute(states, progress=False)
    assert not artifact.shard_path(1).exists() and not artifact.digest_path(1).exists()


def test_nan_in_a_shard_with_a_matching_digest_is_damage(tmp_path, caplog):
    """As if an older version had written what the LLM produced: NaN rows, digest consistent."""
    artifact = npy_artifact(tmp_path).compute(Counter(), progress=False)
    values = np.load(artifact.shard_path(2))
    values[0, 1, :] = np.nan
    values[1, 2, 3] = np.inf
    # The writer refuses it: the bytes and their digest are written by hand.
    data = npy_bytes(values)
    artifact.digest_path(2).write_text(json.dumps(digest_record(data)))
    artifact.shard_path(2).write_bytes(data)
    reopened = npy_artifact(tmp_path)
    assert (
        reopened.inspect(2).state == "damaged"
        and "NaN or inf in 2 item(s) (first: item 7)" in reopened.inspect(2).reason
    )
    counter = Counter()
    reopened.compute(counter, progress=False)
    assert counter.calls == [(6, 9)]
    assert np.isfinite(all_values(reopened)).all()


def test_a_handle_verifies_each_shard_once(tmp_path, monkeypatch):
    import confrag.infra.sharded as sharded

    npy_artifact(tmp_path).compute(Counter(), progress=False)
    reopened = npy_artifact(tmp_path)
    hashed = []
    original = sharded.file_digest
    monkeypatch.setattr(sharded, "file_digest", lambda path: hashed.append(path.name) or original(path))
    reopened.compute(must_not_run, progress=False)
    reopened.shards()
    ActivationStore(reopened, LAYERS).take(0, range(10))
    assert sorted(hashed) == [f"shard-{i:05d}.npy" for i in range(4)]
    # A shard replaced behind the handle's back is looked at again.
    reopened.shard_path(0).write_bytes(reopened.shard_path(0).read_bytes())
    assert reopened.pending() == []
    assert hashed.count("shard-00000.npy") == 2


# --- permissions -----------------------------------------------------------------------------------


@pytest.fixture(params=[0o022, 0o002, 0o077])
def umask(request):
    old = os.umask(request.param)
    yield request.param
    os.umask(old)


def test_written_files_honour_the_umask(tmp_path, umask):
    from confrag.infra.atomic import atomic_save_npy, atomic_save_png, atomic_write_text

    mode = lambda path: path.stat().st_mode & 0o777  # noqa: E731
    atomic_write_text(tmp_path / "metrics.json", "{}")
    atomic_save_npy(tmp_path / "array.npy", np.zeros(3))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure = plt.figure(figsize=(1, 1))
    atomic_save_png(figure, tmp_path / "plot.png")
    plt.close(figure)
    artifact = npy_artifact(tmp_path / "cache").compute(Counter(), progress=False)
    files = [
        tmp_path / "metrics.json",
        tmp_path / "array.npy",
        tmp_path / "plot.png",
        artifact.manifest_path,
        artifact.shard_path(0),
    ]
    assert {path.name: mode(path) for path in files} == {path.name: 0o666 & ~umask for path in files}  # before: 0600
    assert mode(artifact.digest_path(0)) == mode(artifact.lock_path(0)) == 0o666 & ~umask
    assert mode(artifact.dir) == 0o777 & ~umask
    from confrag.infra.atomic import make_temp_dir

    assert mode(make_temp_dir(tmp_path, ".tmp-export-")) == 0o777 & ~umask


def test_exclusive_is_reentrant_and_excludes_other_threads(tmp_path):
    import threading

    from confrag.infra.locks import exclusive

    lock = tmp_path / ".thing.lock"
    order = []

    def other_thread():
        with exclusive(lock, "the thing"):
            order.append("other")

    with exclusive(lock, "the thing"):
        with exclusive(lock, "the thing"):  # an export inside a train-if-missing block: no self-deadlock
            order.append("nested")
        other = threading.Thread(target=other_thread)
        other.start()
        other.join(timeout=0.3)
        assert other.is_alive() and order == ["nested"]  # the other thread waits for the lock
        order.append("released")
    other.join(timeout=30)
    assert order == ["nested", "released", "other"]


def test_claimed_first_leaves_an_item_another_process_is_on_for_last(tmp_path):
    """Two processes filling one cache (e.g. the fold rerankers of a cross-fitted run) work on different items
    instead of queueing on the same one; the results come back in the items' order whatever the claims were."""
    from filelock import FileLock

    from confrag.infra.locks import claimed_first

    other = FileLock(str(tmp_path / "0.claim"))  # another process is on item 0
    other.acquire()
    order = []

    def run(item):
        order.append(item)
        if item == 1:
            other.release()  # ... and finishes it meanwhile
        return item * 10

    assert claimed_first(range(3), lambda i: tmp_path / f"{i}.claim", run, "item") == [0, 10, 20]
    assert order == [1, 2, 0]
    assert claimed_first(range(2), lambda i: tmp_path / f"{i}.claim", lambda i: -i, "item") == [0, -1]


def test_a_full_disk_is_named_with_its_folder_and_leaves_nothing_half_written(tmp_path, monkeypatch):
    """ENOSPC came out as the libraries' own `[Errno 28] No space left on device`, naming no folder."""
    import errno
    import re

    import confrag.infra.atomic as atomic
    from confrag.infra.atomic import DiskFullError, swapped_in

    artifact = npy_artifact(tmp_path / "cache")
    artifact.write(0, fake_states(0, 3))  # the folder and its manifest exist

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(atomic.os, "fsync", full)
    folder = re.escape(str(artifact.dir))
    with pytest.raises(
        DiskFullError, match=rf"^\[Errno 28\] {folder}: the disk is full .*No space left.*MB free there"
    ):
        artifact.write(1, fake_states(3, 6))
    assert not [p for p in artifact.dir.iterdir() if p.name.startswith(".tmp-")]  # no temp file left behind
    assert artifact.pending() == [1, 2, 3]
    monkeypatch.undo()
    # A library writing a folder through its own code (safetensors' error text), inside the folder swap.
    target = tmp_path / "cache" / "probes" / "abc"
    with pytest.raises(DiskFullError, match=rf"{re.escape(str(target.parent))}: the disk is full .*paths.cache_dir"):
        with swapped_in(target):
            raise RuntimeError(
                'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space" })'
            )
    assert not target.exists() and not list(target.parent.iterdir())
    with pytest.raises(RuntimeError, match="another error"):  # anything else passes through as it was
        with swapped_in(target):
            raise RuntimeError("another error")
