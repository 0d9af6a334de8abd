"""The checkpoint commit protocol, against local disk and a real S3 endpoint on loopback.

A "checkpoint" here is a stand-in for what DCP writes (shards, ``.metadata``) plus a
nested rayflex file; the protocol does not look inside the files.
"""

from __future__ import annotations

import json
import logging
import os
import uuid

import pytest

from rayflex.errors import CheckpointError, ConfigError
from rayflex.checkpoint import manifest as mf
from rayflex.storage.fs import exists, join, listdir, read_text, remove_tree, resolve

SHARDS = {"__0_0.distcp": 3000, "__1_0.distcp": 2500, "rayflex/train_state.json": 40}


@pytest.fixture(params=["file", "s3", "memory"])
def backend(request, tmp_path):
    """(kind, checkpoint root URI)."""
    if request.param == "file":
        yield "file", f"file://{tmp_path}/run/checkpoints"
    elif request.param == "memory":
        root = f"memory://rayflex-test-{uuid.uuid4().hex[:8]}/checkpoints"
        yield "memory", root
        remove_tree(root)
    else:
        yield "s3", request.getfixturevalue("s3_bucket") + "/run/checkpoints"


@pytest.fixture
def root(backend):
    return backend[1]


def write_step(root: str, step: int, *, metadata: bool = True, seed: int = 0) -> None:
    """Write the files a finished DCP save leaves in a step directory."""
    fs, path = resolve(mf.step_dir(root, step))
    rng = __import__("random").Random(step * 1000 + seed)
    files = dict(SHARDS)
    if metadata:
        files[mf.METADATA] = 120
    for rel, size in files.items():
        target = f"{path}/{rel}"
        fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
        fs.pipe_file(target, bytes(rng.getrandbits(8) for _ in range(size)))


def commit_step(root: str, step: int, **kw) -> mf.Manifest:
    write_step(root, step, **kw)
    return mf.commit(root, step, world_size=4, mesh={"pp": 2, "dp": 2}, extra={"tokens": step * 10})


def flip_byte(kind: str, root: str, step: int, rel: str, s3_client=None) -> None:
    """Change one byte of a committed file in place, same size, as a foreign writer would."""
    fs, path = resolve(join(mf.step_dir(root, step), rel))
    data = bytearray(fs.cat_file(path))
    data[len(data) // 2] ^= 0x01
    if kind == "s3":  # another process: straight through boto3, not through our s3fs
        bucket, key = path.split("/", 1)
        s3_client.put_object(Bucket=bucket, Key=key, Body=bytes(data))
    elif kind == "file":
        with open(path, "r+b") as f:
            f.write(bytes(data))
    else:
        fs.pipe_file(path, bytes(data))


# --------------------------------------------------------------------------- names


def test_step_names_round_trip():
    assert mf.step_dir("s3://b/ckpt", 42) == "s3://b/ckpt/step_00000042"
    assert mf.parse_step("step_00000042") == 42
    assert mf.parse_step("s3://b/ckpt/step_00000042/") == 42
    assert mf.parse_step("step_123456789") == 123456789
    for other in ("step_42", "latest", "step_0000004x", ".metadata", "step_00000042.tmp"):
        assert mf.parse_step(other) is None
    with pytest.raises(ValueError):
        mf.step_dir("/r", -1)


def test_manifest_json_round_trip_and_malformed():
    m = mf.Manifest(step=7, world_size=8, mesh={"pp": 2, "dp": 4}, created_at="2026-01-01T00:00:00+00:00",
                    files={".metadata": mf.FileRecord(10, "blake2b:ab")}, extra={"seed": 1})
    assert mf.Manifest.from_json(m.to_json()) == m
    for text in ("not json", "{}", '{"step": 1}', json.dumps({**json.loads(m.to_json()), "files": []})):
        with pytest.raises(CheckpointError, match="malformed"):
            mf.Manifest.from_json(text)
    with pytest.raises(CheckpointError, match="upgrade rayflex"):
        mf.Manifest.from_json(json.dumps({**json.loads(m.to_json()), "format": 99}))


# --------------------------------------------------------------------------- protocol


def test_commit_list_latest_and_verify(backend):
    kind, root = backend
    assert mf.list_committed(root) == [] and mf.latest_committed(root) is None
    commit_step(root, 10)
    m20 = commit_step(root, 20)
    assert mf.list_committed(root) == [10, 20] and mf.latest_committed(root) == 20
    assert set(m20.files) == {*SHARDS, mf.METADATA}  # nested paths included, marker not
    assert all(m20.files[rel].size == size for rel, size in SHARDS.items())
    prefix = "etag:" if kind == "s3" else "xxh3:"
    assert all(r.fingerprint.startswith(prefix) for r in m20.files.values())
    assert (m20.world_size, m20.mesh, m20.extra) == (4, {"pp": 2, "dp": 2}, {"tokens": 200})
    # The marker is the manifest, and verify returns it.
    marker = join(mf.step_dir(root, 20), mf.MARKER)
    assert mf.Manifest.from_json(read_text(marker)) == m20
    assert mf.verify(root, 20) == m20 == mf.read_manifest(root, 20)
    resolution = mf.resolve_loadable(root)
    assert resolution.step == 20 and resolution.skipped == ()
    assert resolution.step_uri == mf.step_dir(root, 20)


def test_a_store_resolves_its_root_once_for_a_whole_commit(backend, monkeypatch):
    # A commit, its retention and its collection of leftovers are a dozen small operations
    # under one root: the root is resolved (scheme checked, filesystem built) once, not per
    # operation, and the same steps come out as through plain URIs.
    from rayflex.storage import fs as sfs

    kind, root = backend
    for step in (10, 20, 30):
        write_step(root, step)
    write_step(root, 5, metadata=False)  # a crashed save's leftovers
    calls = []
    real = sfs.resolve
    monkeypatch.setattr(sfs, "resolve", lambda uri, options=None: calls.append(uri) or real(uri, options))
    store = sfs.Store(root)
    for step in (10, 20, 30):
        mf.commit(store, step, world_size=4, mesh={"pp": 2, "dp": 2})
    assert mf.apply_retention(store, 2) == [10] and mf.gc_uncommitted(store) == [5]
    assert mf.list_committed(store) == [20, 30] and mf.verify(store, 30).step == 30
    assert calls == [root], calls
    assert mf.list_committed(root) == [20, 30] and not exists(mf.step_dir(root, 5))


def test_a_store_is_reused_as_resolved_and_other_options_need_its_uri(root):
    from rayflex.storage import fs as sfs

    store = sfs.Store(root)
    assert sfs.Store.of(store) is store and sfs.Store.of(root).path == store.path
    # options belong to the resolution: applying others to a resolved store would be ignored silently
    with pytest.raises(ValueError, match="pass the URI to apply other options"):
        sfs.Store.of(store, sfs.StorageOptions())


def test_uncommitted_dirs_are_ignored_and_collected(root):
    write_step(root, 5)                       # crashed before commit, older than newest
    commit_step(root, 10)
    write_step(root, 15, metadata=False)      # crashed mid-save
    commit_step(root, 20)
    write_step(root, 30, metadata=False)      # a save still in flight: must survive
    assert mf.list_committed(root) == [10, 20]
    assert mf.resolve_loadable(root).step == 20
    assert mf.gc_uncommitted(root) == [5, 15]
    assert [mf.parse_step(n) for n in listdir(root)] == [10, 20, 30]
    # Explicitly abandoned saves go too; committed steps never do, even when listed.
    assert mf.gc_uncommitted(root, steps=[30, 20]) == [30]
    write_step(root, 40, metadata=False)
    assert mf.gc_uncommitted(root, older_than_step=41) == [40]
    assert mf.list_committed(root) == [10, 20]
    assert mf.verify(root, 20).step == 20


def test_gc_without_committed_steps_keeps_everything(root):
    write_step(root, 1, metadata=False)
    assert mf.gc_uncommitted(root) == []
    assert exists(mf.step_dir(root, 1))


def test_retention_keeps_newest_k(root):
    for step in range(1, 6):
        commit_step(root, step)
    assert mf.apply_retention(root, keep=2) == [1, 2, 3]
    assert mf.list_committed(root) == [4, 5]
    assert [mf.parse_step(n) for n in listdir(root)] == [4, 5]  # directories gone, not just markers
    assert mf.apply_retention(root, keep=2) == []
    assert mf.apply_retention(root, keep=1) == [4]
    with pytest.raises(ConfigError, match="keep"):
        mf.apply_retention(root, keep=0)
    assert mf.list_committed(root) == [5]


def test_flipped_byte_is_detected_and_loader_falls_back(backend, request, caplog):
    kind, root = backend
    s3_client = request.getfixturevalue("s3_client") if kind == "s3" else None
    commit_step(root, 10)
    commit_step(root, 20)
    mf.verify(root, 20)  # warm any listing cache before the foreign write
    flip_byte(kind, root, 20, "__1_0.distcp", s3_client)
    with pytest.raises(CheckpointError) as info:
        mf.verify(root, 20)
    message = str(info.value)
    assert "step 20" in message and "__1_0.distcp" in message and "checksum differs" in message
    assert "__0_0.distcp" not in message
    # Same size, so the cheap check passes: that is the trade-off of deep=False.
    assert mf.verify(root, 20, deep=False).step == 20
    with caplog.at_level(logging.WARNING, logger="rayflex.checkpoint.manifest"):
        resolution = mf.resolve_loadable(root)
    assert resolution.step == 10
    assert [s.step for s in resolution.skipped] == [20]
    assert "__1_0.distcp" in resolution.skipped[0].reason
    assert any("skipping checkpoint step 20" in r.getMessage() for r in caplog.records)


def test_a_restores_ranks_split_the_rereading(backend, request):
    """``verify(only=...)``: a restore's ranks each reread (checksum) only their share of
    the files, so no rank reads the whole checkpoint; the union of the shares finds the
    flipped byte, a share without the file does not (sizes are still checked for all)."""
    kind, root = backend
    commit_step(root, 20)
    mf.verify(root, 20)  # warm any listing cache before the foreign write
    flip_byte(kind, root, 20, "__1_0.distcp", request.getfixturevalue("s3_client") if kind == "s3" else None)
    files = sorted(mf.read_manifest(root, 20).files)
    shares = [files[r::2] for r in range(2)]
    found = []
    for share in shares:
        try:
            mf.verify(root, 20, only=share)
        except CheckpointError as err:
            found.append(str(err))
    assert len(found) == 1 and "__1_0.distcp checksum differs" in found[0]
    assert mf.verify(root, 20, only=[]).step == 20


def test_truncated_and_missing_files_are_named(root):
    commit_step(root, 10)
    fs, path = resolve(mf.step_dir(root, 10))
    fs.pipe_file(f"{path}/__0_0.distcp", b"short")
    fs.rm(f"{path}/rayflex/train_state.json")
    with pytest.raises(CheckpointError) as info:
        mf.verify(root, 10, deep=False)
    message = str(info.value)
    assert "__0_0.distcp has size 5 bytes, manifest says 3000" in message
    assert "rayflex/train_state.json is missing" in message
    resolution = mf.resolve_loadable(root)
    assert resolution.manifest is None and resolution.step_uri is None
    assert [s.step for s in resolution.skipped] == [10]


def test_corrupt_marker_is_skipped(root):
    commit_step(root, 10)
    commit_step(root, 20)
    fs, path = resolve(join(mf.step_dir(root, 20), mf.MARKER))
    fs.pipe_file(path, b"{ truncated")
    with pytest.raises(CheckpointError, match="step 20.*malformed"):
        mf.verify(root, 20)
    assert mf.resolve_loadable(root).step == 10


def test_missing_metadata_refuses_commit(root):
    write_step(root, 10, metadata=False)
    with pytest.raises(CheckpointError, match=r"\.metadata is missing"):
        mf.commit(root, 10, world_size=2, mesh={"dp": 2})
    assert not exists(join(mf.step_dir(root, 10), mf.MARKER))
    assert mf.list_committed(root) == []
    with pytest.raises(CheckpointError, match="not committed"):
        mf.verify(root, 10)


def test_empty_step_refuses_commit(root):
    with pytest.raises(CheckpointError, match=r"\.metadata is missing \(0 other files"):
        mf.commit(root, 3, world_size=1, mesh={})


def test_double_commit_is_refused(root):
    first = commit_step(root, 10)
    marker = join(mf.step_dir(root, 10), mf.MARKER)
    before = read_text(marker)
    with pytest.raises(CheckpointError, match="already committed"):
        mf.commit(root, 10, world_size=8, mesh={"dp": 8})
    assert read_text(marker) == before
    assert mf.verify(root, 10) == first


def test_local_marker_write_leaves_no_temp_files(tmp_path):
    root = str(tmp_path / "ckpt")
    commit_step(root, 1)
    assert sorted(os.listdir(tmp_path / "ckpt" / "step_00000001")) == sorted(
        [mf.MARKER, mf.METADATA, "__0_0.distcp", "__1_0.distcp", "rayflex"])
