"""A crash in the middle of an upload never leaves a checkpoint that loads; a corrupt
committed checkpoint is detected on load and the previous one is used instead."""

import json
import os
import signal

import pytest

import rayflex as rf
from rayflex.cli.main import main as cli_main
from rayflex.checkpoint import manifest as mf

from conftest import small_gpt, wait_for

pytestmark = pytest.mark.cluster


def _trainer(dataset_uri, storage, name, steps):
    return rf.Trainer(model=small_gpt(), data=rf.DataConfig(uri=dataset_uri, seq_len=32, global_batch=8),
                      run=rf.RunConfig(name=name, storage=storage, steps=steps),
                      scaling=rf.ScalingConfig(num_workers=2),
                      # Saves exactly every 2 steps, each waiting for the one before: these tests
                      # place a crash in a known upload (deferral: test_checkpoint_deferral.py).
                      checkpoint=rf.CheckpointConfig(every_steps=2, keep=3, when_busy="wait"))


def _events(tmp_path, name):
    return [json.loads(x) for x in (tmp_path / "runs" / name / "events.jsonl").read_text().splitlines()]


def test_worker_killed_mid_upload_leaves_previous_checkpoint(two_node_cluster, dataset_uri, tmp_path, monkeypatch):
    storage, name = f"file://{tmp_path}/runs", "killed"
    root = f"{storage}/{name}/checkpoints"
    monkeypatch.setenv("RAYFLEX_SLOW_UPLOAD", "4:5:4")  # step 4's upload takes 5 s
    handle = _trainer(dataset_uri, storage, name, steps=12).submit()
    status = wait_for(lambda: (lambda s: s if s["step"] >= 5 else None)(handle.status()), 120, "step 5")
    assert mf.list_committed(root) == [2]
    step4 = tmp_path / "runs" / name / "checkpoints" / "step_00000004"
    assert step4.exists() and not (step4 / mf.MARKER).exists(), "step 4 is being uploaded"
    victim = next(w for w in status["workers"] if w["rank"] == 1)
    os.kill(victim["pid"], signal.SIGKILL)  # a worker process we started dies mid-upload
    monkeypatch.delenv("RAYFLEX_SLOW_UPLOAD")
    result = handle.wait(timeout_s=240)

    # The run heals itself: the half-written step 4 is never loaded; step 2 is.
    assert result.status == "finished" and result.steps_completed == 12
    events = _events(tmp_path, name)
    died = [e for e in events if e["kind"] == "worker_died"]
    assert died and died[0]["rank"] == 1
    loaded = [e for e in events if e["kind"] == "checkpoint_loaded"]
    assert loaded[-1]["step"] == 2
    assert mf.list_committed(root) == [8, 10, 12]
    for step in mf.list_committed(root):
        mf.verify(root, step)


def test_flipped_byte_is_detected_and_previous_step_loaded(two_node_cluster, dataset_uri, tmp_path, capsys):
    storage, name = f"file://{tmp_path}/runs", "corrupt"
    root = f"{storage}/{name}/checkpoints"
    assert _trainer(dataset_uri, storage, name, steps=6).fit(progress=False).status == "finished"
    assert mf.list_committed(root) == [2, 4, 6]

    shard = tmp_path / "runs" / name / "checkpoints" / "step_00000006" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))

    assert cli_main(["ckpt", "verify", root]) == 2
    err = capsys.readouterr().err
    assert "__0_0.distcp" in err and "step 6" in err

    result = _trainer(dataset_uri, storage, name, steps=8).fit(progress=False)
    assert result.status == "finished" and result.steps_completed == 8
    loaded = [e for e in _events(tmp_path, name) if e["kind"] == "checkpoint_loaded"][-1]
    assert loaded["step"] == 4
    assert any("step 6" in s and "__0_0.distcp" in s for s in loaded["skipped"])
    assert mf.list_committed(root) == [4, 6, 8]  # step 6 re-saved cleanly by the resumed run
    assert cli_main(["ckpt", "verify", root]) == 0
