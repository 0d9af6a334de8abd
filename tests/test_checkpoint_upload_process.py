"""Checkpoint uploads from an uploader process (CheckpointConfig(upload="process")): the
bytes written are the thread upload's, the uploader outlives a kill, and without room in
/dev/shm a save falls back to a thread upload instead of failing."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from checkpoint_helpers import tiny_state
from rayflex.errors import ConfigError


@pytest.fixture(autouse=True, scope="module")
def _stop_uploader():
    yield
    from rayflex.checkpoint.upload_process import stop_uploader

    stop_uploader()


def _save(root: str, state, *, step: int, upload: str) -> dict:
    from rayflex.checkpoint.checkpointer import AsyncCheckpointer
    from rayflex.checkpoint.upload_process import uploader

    if upload == "process":
        uploader()  # started and answering: a save never waits for it (it uploads from a thread meanwhile)
    ckpt = AsyncCheckpointer(root, rank=0, use_async=True, keep=3, upload=upload)
    ckpt.save(state, step=step)
    [report] = ckpt.wait(timeout_s=120)
    assert report.get("committed"), report.get("error")
    return report


def _shards(root: str, step: int) -> dict[str, bytes]:
    from rayflex.checkpoint import manifest as mf

    sdir = mf.step_dir(root, step).removeprefix("file://")
    return {f: open(os.path.join(sdir, f), "rb").read() for f in sorted(os.listdir(sdir)) if f.endswith(".distcp")}


def test_a_process_upload_writes_the_bytes_a_thread_upload_writes_and_loads_back(tmp_path):
    from rayflex.checkpoint.checkpointer import AsyncCheckpointer

    state = tiny_state(seed=3)
    by_thread = _save(f"file://{tmp_path}/thread", state, step=3, upload="thread")
    by_process = _save(f"file://{tmp_path}/process", state, step=3, upload="process")
    assert (by_thread["upload"], by_process["upload"]) == ("thread", "process")
    thread_files, process_files = _shards(f"file://{tmp_path}/thread", 3), _shards(f"file://{tmp_path}/process", 3)
    assert thread_files and thread_files == process_files, "the same shard files, byte for byte"

    fresh = tiny_state(seed=9)
    info = AsyncCheckpointer(f"file://{tmp_path}/process", rank=0).load_latest(fresh)
    assert info["step"] == 3
    for a, b in zip(state.modules[0].parameters(), fresh.modules[0].parameters()):
        assert torch.equal(a, b)
    saved, loaded = state.optimizers[0].state_dict()["state"], fresh.optimizers[0].state_dict()["state"]
    assert all(torch.equal(saved[k][n], loaded[k][n]) for k in saved for n in saved[k])


def test_saves_go_on_while_the_uploader_starts_or_after_it_died(tmp_path):
    import glob

    from rayflex.checkpoint.checkpointer import AsyncCheckpointer
    from rayflex.checkpoint.upload_process import stop_uploader, uploader

    root = f"file://{tmp_path}/ckpt"
    state = tiny_state(seed=4)
    stop_uploader()
    ckpt = AsyncCheckpointer(root, rank=0, use_async=True, keep=5, upload="process")  # starts one meanwhile
    reports = []

    def save(step):
        ckpt.save(state, step=step)
        [report] = ckpt.wait(timeout_s=120)
        assert report.get("committed"), report.get("error")
        reports.append(report["upload"])

    save(1)  # the uploader may still be importing torch: then this save uploads from a thread
    first = uploader().process  # waits until it answers
    save(2)
    os.kill(first.pid, signal.SIGKILL)
    first.wait(10)
    save(3)  # its block died with it: staged anew, uploaded from a thread while a new one starts
    second = uploader().process
    save(4)
    assert reports[1] == reports[3] == "process" and reports[2] == "thread", reports
    assert second.pid != first.pid
    assert _shards(root, 1) == _shards(root, 2) == _shards(root, 3) == _shards(root, 4), "same state, same bytes"
    assert not glob.glob(f"/dev/shm/rayflex-staging-{os.getpid()}-*"), "blocks are unlinked once both map them"


def test_without_room_in_dev_shm_a_save_uploads_from_a_thread(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr("rayflex.checkpoint.upload_process.shm_room_for",
                        lambda nbytes: (False, "/dev/shm has 0.06 GiB free"))
    report = _save(f"file://{tmp_path}/ckpt", tiny_state(seed=5), step=3, upload="process")
    assert report["upload"] == "thread"
    assert "uploads stay in the training process: /dev/shm has 0.06 GiB free" in caplog.text


def test_shm_room_names_the_fix(tmp_path):
    from rayflex.checkpoint.upload_process import shm_room_for

    ok, why = shm_room_for(1 << 60, directory=str(tmp_path))
    assert not ok and "--shm-size" in why and "upload='thread'" in why
    assert shm_room_for(1, directory=str(tmp_path)) == (True, "")


def test_an_unknown_upload_mode_is_refused_with_the_choices():
    import rayflex as rf

    with pytest.raises(ConfigError, match="upload.*'fast'.*auto, process, thread"):
        rf.CheckpointConfig(upload="fast")
    with pytest.raises(ConfigError, match="upload_threads"):
        rf.CheckpointConfig(upload_threads=0)
