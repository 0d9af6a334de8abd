"""Checkpoints on a real S3 endpoint (moto's threaded server on loopback) through s3fs:
committed with ETag fingerprints, retention applied, resumed with the same losses; and an
endpoint that stops answering mid-run stalls no step."""

import json
import time

import pytest

import rayflex as rf
from rayflex.constants import knob
from rayflex.testing.chaos.bounds import storage_outage_bound_s
from rayflex.testing.chaos.s3_gate import S3Gate
from rayflex.testing.reference import single_process_losses
from rayflex.checkpoint import manifest as mf

from conftest import loopback_cluster, small_gpt, wait_for, wait_until_running
from s3_fixture import TEST_ENV
from test_checkpoint_cluster import STEPS, _crash_at_step_4, _trainer

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def s3_cluster(moto_server, tmp_path_factory):
    """A cluster whose processes see the S3 endpoint and test credentials in their env; the
    endpoint they see is a gate in front of moto that a test can stall. Yields the bucket
    and the gate."""
    import boto3

    host, port = moto_server.removeprefix("http://").rsplit(":", 1)
    gate = S3Gate(host, int(port)).start()
    try:
        with pytest.MonkeyPatch.context() as mp:
            for k, v in TEST_ENV.items():
                mp.setenv(k, v)
            mp.setenv("AWS_ENDPOINT_URL_S3", gate.url)
            boto3.client("s3", endpoint_url=moto_server, region_name="us-east-1").create_bucket(Bucket="rayflex-ckpt")
            with loopback_cluster([{"num_cpus": 4}]):
                yield "s3://rayflex-ckpt", gate
    finally:
        gate.close()


def _run_lines(storage: str, name: str, file: str) -> list[dict]:
    from rayflex.storage import fs as rfs

    fs, path = rfs.resolve(f"{storage}/{name}/{file}")
    return [json.loads(x) for x in fs.cat_file(path).decode().splitlines() if x.strip()]


def test_checkpoint_resume_on_s3(s3_cluster, dataset_uri, monkeypatch):
    bucket, _ = s3_cluster
    storage = f"{bucket}/runs"
    _crash_at_step_4(dataset_uri, storage, "s3run", monkeypatch, workers=2)
    root = f"{storage}/s3run/checkpoints"
    assert mf.list_committed(root) == [2]
    manifest = mf.verify(root, 2)
    assert any(name.endswith(".metadata") for name in manifest.files)
    assert all(f.fingerprint.startswith("etag:") for f in manifest.files.values())
    trainer = _trainer(dataset_uri, storage, "s3run", workers=2)
    result = trainer.fit(progress=False)
    assert result.steps_completed == STEPS
    # Retention keeps the newest 2 committed steps (which steps depends on the uploads' pace:
    # a save due while the one before still uploads is taken a step or more later).
    committed = [e["step"] for e in _run_lines(storage, "s3run", "events.jsonl") if e["kind"] == "checkpoint_committed"]
    assert committed[-1] == STEPS and mf.list_committed(root) == committed[-2:], committed
    reference = single_process_losses(trainer.spec, STEPS)
    assert [m["loss"] for m in result.metrics[2:]] == pytest.approx(reference[2:], rel=1e-5)


def test_a_hung_endpoint_stalls_no_step_and_the_next_commit_follows_its_return(s3_cluster, dataset_uri):
    """The object store stops answering (requests hang, nothing is refused) for longer than
    the save interval and than the outage bound: training goes on at its own speed, the
    stall is named (``storage_unavailable``, within the recorder's promise), the saves due
    meanwhile wait behind the hung one (``checkpoint_deferred``), and the next commit lands
    once the endpoint answers again — no restart, no step lost."""
    bucket, gate = s3_cluster
    storage, name = f"{bucket}/runs", "s3hang"
    named_within_s = storage_outage_bound_s()
    stall_s = named_within_s + 2.0  # long enough to be named; far below the read timeout
    assert stall_s < knob("STORAGE_READ_TIMEOUT_S"), "the hung requests must survive the stall"
    trainer = rf.Trainer(model=small_gpt(), data=rf.DataConfig(uri=dataset_uri, seq_len=32, global_batch=8),
                         run=rf.RunConfig(name=name, storage=storage, steps=100_000),
                         scaling=rf.ScalingConfig(num_workers=1),
                         checkpoint=rf.CheckpointConfig(every_steps=2, keep=2))
    handle = trainer.submit()
    try:
        st = wait_until_running(handle, 3, committed=2)
        gate.stall()
        t_stall = time.time()
        try:
            # Training goes on through the stall (a step waiting on storage would stop this).
            wait_for(lambda: time.time() - t_stall >= stall_s and handle.status()["step"] > st["step"] + 2,
                     stall_s + 60, "steps during the stall")
        finally:
            gate.resume()
        t_resume = time.time()
        # A save taken after the endpoint answers again is of a step past the one the run had
        # finished then; a commit from before the stall is no evidence (a run that has saved
        # a few times by the time the stall starts made this wait pass at once: seen in CI).
        at_resume = handle.status()["step"]
        wait_for(lambda: (handle.status().get("last_checkpoint") or {}).get("step", 0) > at_resume, 120,
                 "a commit after the endpoint answers again")
        result = handle.stop()
    finally:
        gate.resume()
        if not handle.done():
            handle.stop()
    assert result.status == "stopped", result.status

    events = _run_lines(storage, name, "events.jsonl")
    kinds = [e["kind"] for e in events]
    assert "restarted" not in kinds and "worker_failed" not in kinds, kinds
    unavailable = next(e for e in events if e["kind"] == "storage_unavailable")
    assert t_stall < unavailable["time"] <= t_stall + named_within_s, (unavailable, t_stall)
    assert any(e["kind"] == "storage_recovered" and e["time"] >= t_resume for e in events)
    # The save in flight when the endpoint hung went through only once it answered again;
    # the saves due meanwhile waited behind it (deferred, not blocking a step) and one of
    # them was taken right after.
    ckpts = [(e["kind"], e["step"], round(e["time"] - t_stall, 2)) for e in events if "checkpoint" in e["kind"]]
    waiting = [e for e in events if e["kind"] == "checkpoint_deferred" and e["time"] <= t_resume]
    assert waiting, ckpts
    hung = waiting[-1]["behind_step"]
    commits = [e for e in events if e["kind"] == "checkpoint_committed"]
    hung_commit = next(e for e in commits if e["step"] == hung)
    assert hung_commit["time"] >= t_resume, (ckpts, t_resume - t_stall)
    after = next(e for e in commits if e["step"] > hung)
    assert after["due_step"] == waiting[-1]["step"] and after["time"] >= t_resume, (ckpts, t_resume - t_stall)

    metrics = _run_lines(storage, name, "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, result.steps_completed + 1)), "every step once"
    step_times = sorted(m["step_time_s"] for m in metrics)
    median = step_times[len(step_times) // 2]
    # Training went on through the stall: steps kept finishing, and no step waited for the
    # endpoint (the longest gap between finished steps inside the stall is far below it).
    # Not a pace: the suite's other worker shares the host, and how fast steps run is a
    # benchmark's question (a pace bound failed in a 0.6-core quota: 43% of the median).
    inside = sorted(m["time"] for m in metrics if t_stall <= m["time"] <= t_resume)
    gaps = [b - a for a, b in zip([t_stall, *inside], [*inside, t_resume])]
    assert len(inside) >= 3 and max(gaps) < stall_s / 2, (len(inside), max(gaps), median)
    assert step_times[-1] < stall_s, step_times[-5:]
