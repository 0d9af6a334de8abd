"""Experiment trackers (RunConfig.loggers): config errors before any actor, one point per
step through restarts and resumes by name, and a failing tracker never failing a run.

The unit tests drive the real Recorder (and through it the real TensorBoard/MLflow/W&B
backends) without Ray; the cluster test SIGKILLs a worker, stops the run and resubmits it
by name, then reads what a user would open: TensorBoard's event files and MLflow's store.
"""

import json
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

import rayflex as rf
from rayflex.control.recorder import Recorder
from rayflex.telemetry import events as ev
from rayflex.telemetry.trackers import tracker_set
from rayflex.telemetry.trackers.tracker import KeyEvent, RunEnd, Tracker

from conftest import small_gpt, wait_until_running


# ----------------------------------------------------------------- config, no Ray
@pytest.mark.parametrize("kw, field, says", [
    (dict(loggers=3), "RunConfig.loggers", "loggers=('tensorboard',)"),
    (dict(loggers=("tensorboard", "comet")), "RunConfig.loggers", "'tensorboard', 'mlflow', 'wandb'"),
    (dict(loggers=("mlflow", "mlflow")), "RunConfig.loggers", "name each tracker once"),
    (dict(wandb_mode="cloud"), "RunConfig.wandb_mode", "'offline'"),
    (dict(mlflow_tracking_uri=""), "RunConfig.mlflow_tracking_uri", "file:///tmp/mlruns"),
    (dict(wandb_project=""), "RunConfig.wandb_project", "project name"),
])
def test_bad_logger_config_names_field_and_fix(kw, field, says):
    with pytest.raises(rf.ConfigError) as info:
        rf.RunConfig(name="r", **kw)
    assert info.value.field == field and says in str(info.value), str(info.value)


def test_missing_tracker_package_names_the_extra(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    with pytest.raises(rf.ConfigError) as info:
        rf.RunConfig(name="r", loggers=["tensorboard", "mlflow"])
    msg = str(info.value)
    assert "'mlflow' needs the 'mlflow-skinny' package" in msg and "pip install 'rayflex[tracking]'" in msg
    assert "tensorboard" not in msg.split("Fix:")[0]
    assert rf.RunConfig(name="r", loggers=["tensorboard"]).loggers == ("tensorboard",)  # a list becomes a tuple


def test_loggers_from_the_command_line():
    spec = rf.Trainer(model=small_gpt(), data=rf.DataConfig(uri="file:///tmp/x", seq_len=32, global_batch=8),
                      run=rf.RunConfig(name="r")).spec
    assert spec.with_overrides({"run.loggers": "tensorboard, mlflow"}).run.loggers == ("tensorboard", "mlflow")
    with pytest.raises(rf.ConfigError, match="unknown tracker 'tb'"):
        spec.with_overrides({"run.loggers": "tb"})


# ----------------------------------------------------------------- Recorder + trackers, no Ray
class Stand(Tracker):
    """A stand-in backend: keeps what it is handed; ``fail_on`` makes one method raise."""

    def __init__(self, name, rewinds=False, fail_on=None):
        self.name, self.rewinds, self.fail_on = name, rewinds, fail_on
        self.points, self.events, self.rewound, self.closed = [], [], [], None

    def _maybe_fail(self, method):
        if method == self.fail_on:
            raise ConnectionError("tracker server at 127.0.0.1:9 refused the connection")

    def open(self, state):
        self._maybe_fail("open")
        return {"opened": (state or {}).get("opened", 0) + 1}

    def log_metrics(self, step, values):
        self._maybe_fail("log_metrics")
        self.points.append((step, values["train/loss"]))

    def rewind(self, step):
        self.rewound.append(step)
        self.points = [p for p in self.points if p[0] <= step]

    def log_event(self, event: KeyEvent):
        self.events.append((event.name, event.count))

    def close(self, end, goodput, step):
        self.closed = (end, goodput, step)


def _recorder(tmp_path, stands, **run):
    rec = Recorder(rf.RunConfig(name="unit", storage=f"file://{tmp_path}/runs", **run),
                   clock=SimpleNamespace(time=time.time))
    rec.trackers = tracker_set.TrackerSet(stands, rec.rundir, on_failure=rec.record)
    return rec


def _train(rec, steps, loss_of):
    for s in steps:
        rec.add_metrics({"step": s, "loss": loss_of(s), "step_time_s": 0.1, "tokens_per_s": 10.0, "time": time.time()})


def _rollback(rec, step):
    """What the ledger and placing do on a restart to the checkpoint at ``step``."""
    rec.rundir.rewrite("metrics.jsonl", lambda line: line["step"] <= step)
    rec.record(ev.Restarted(step=step, from_step=step, world_size=2, reason="worker died"))
    rec.record(ev.WorkersStarted(step=step, world_size=2))


def test_each_step_reaches_a_tracker_once_with_its_final_value(tmp_path):
    live, final = Stand("live", rewinds=True), Stand("final")
    rec = _recorder(tmp_path, [live, final])
    rec.resume()
    rec.record(ev.WorkersStarted(step=0, world_size=2))
    _train(rec, range(1, 6), lambda s: 10.0 - s)
    rec.record(ev.CheckpointCommitted(step=3))
    _rollback(rec, 3)                                  # steps 4, 5 are trained again
    _train(rec, range(4, 7), lambda s: 100.0 - s)
    rec.record(ev.RunFinished(step=6))
    rec.finish()
    want = [(s, 10.0 - s) for s in (1, 2, 3)] + [(s, 100.0 - s) for s in (4, 5, 6)]
    assert final.points == want and live.points == want and live.rewound == [3]
    assert ("restarts", 1) in final.events and ("checkpoints", 1) in final.events
    assert final.closed[0] is RunEnd.FINISHED and final.closed[2] == 6 and final.closed[1] is not None
    stored = json.loads((tmp_path / "runs" / "unit" / "trackers.json").read_text())
    assert stored["logged_step"] == 6 and stored["final"] == {"opened": 1}


def test_a_commit_heard_before_its_steps_line_still_releases_the_step(tmp_path):
    """A stop commits the step it stops at; the ledger hears rank 0's commit before every
    rank's step report is in, so the commit event comes first."""
    final = Stand("final")
    rec = _recorder(tmp_path, [final])
    rec.resume()
    _train(rec, (1, 2), float)
    rec.record(ev.CheckpointCommitted(step=3, reason="stop"))
    _train(rec, (3,), float)
    rec.record(ev.RunStopped(step=3))
    rec.finish()
    assert final.points == [(1, 1.0), (2, 2.0), (3, 3.0)] and final.closed[0] is RunEnd.STOPPED


def test_steps_a_killed_session_never_handed_over_are_released_on_resume(tmp_path):
    """Session 1 dies after its checkpoint at step 3 was stored but before the commit was
    heard; session 2 restores step 3: steps 1..3 are final and reach the tracker then."""
    first = Stand("final")
    rec = _recorder(tmp_path, [first])
    rec.resume()
    _train(rec, range(1, 5), float)
    rec.finish()
    assert first.points == [] and first.closed[0] is RunEnd.STOPPED
    second = Stand("final")
    rec = _recorder(tmp_path, [second])
    rec.resume()
    _rollback(rec, 3)
    _train(rec, (4, 5), lambda s: 10.0 * s)
    rec.record(ev.RunFinished(step=5))
    rec.finish()
    assert second.points == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0), (5, 50.0)]


def test_failing_tracker_is_an_event_and_the_others_go_on(tmp_path):
    broken, fine = Stand("broken", fail_on="log_metrics"), Stand("fine")
    rec = _recorder(tmp_path, [broken, fine])
    rec.resume()
    _train(rec, (1, 2), float)
    rec.record(ev.RunFinished(step=2))
    rec.finish()
    events = [json.loads(line) for line in (tmp_path / "runs" / "unit" / "events.jsonl").read_text().splitlines()]
    failed = [e for e in events if e["kind"] == "tracker_failed"]
    assert len(failed) == 1 and failed[0]["tracker"] == "broken" and "refused" in failed[0]["error"], failed
    assert fine.points == [(1, 1.0), (2, 2.0)] and fine.closed[0] is RunEnd.FINISHED
    assert broken.closed is None


def test_mlflow_server_down_is_an_event_not_a_failed_run(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    rec = _recorder(tmp_path, [], loggers=("mlflow", "tensorboard"), mlflow_tracking_uri="http://127.0.0.1:9")
    rec.trackers = tracker_set.TrackerSet.for_run(rec.run, rec.rundir, rec.record)  # nothing listens on :9
    rec.resume()
    _train(rec, (1, 2), float)
    rec.record(ev.RunFinished(step=2))
    t0 = time.time()
    rec.finish()
    assert time.time() - t0 < 30
    run_dir = tmp_path / "runs" / "unit"
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    failed = [e for e in events if e["kind"] == "tracker_failed"]
    assert [e["tracker"] for e in failed] == ["mlflow"] and "127.0.0.1:9" in failed[0]["error"], failed
    assert [m["step"] for m in _metrics(run_dir)] == [1, 2]
    assert _tb_scalars(run_dir / "tensorboard", "train/loss") == [(1, 1.0), (2, 2.0)], "the other tracker went on"


def test_tensorboard_files_of_a_remote_run_directory_are_uploaded(tmp_path, s3_bucket, monkeypatch):
    import tempfile

    import fsspec

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # where the local copy is written
    (tmp_path / "tmp").mkdir()
    rec = Recorder(rf.RunConfig(name="unit", storage=f"{s3_bucket}/runs", loggers=("tensorboard",)),
                   clock=SimpleNamespace(time=time.time))
    rec.resume()
    _train(rec, (1, 2, 3), float)
    rec.record(ev.CheckpointCommitted(step=3))
    rec.trackers.wait_idle()
    s3 = fsspec.filesystem("s3")
    remote = f"{s3_bucket[len('s3://'):]}/runs/unit/tensorboard"
    assert [p for p in s3.ls(remote) if "tfevents" in p], "uploaded at the checkpoint, before the end"
    assert list((tmp_path / "tmp").iterdir()), "written locally first"
    rec.record(ev.RunFinished(step=3))
    rec.finish()
    assert not list((tmp_path / "tmp").iterdir()), "the local copy goes once the run's files are uploaded"
    s3.invalidate_cache()
    s3.get(remote, str(tmp_path / "tb"), recursive=True)
    assert _tb_scalars(tmp_path / "tb", "train/loss") == [(1, 1.0), (2, 2.0), (3, 3.0)]
    assert _tb_scalars(tmp_path / "tb" / "events", "events/checkpoints") == [(3, 1.0)]


def _tb_scalars(logdir, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    return [(s.step, s.value) for s in acc.Scalars(tag)]


def _metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_real_backends_continue_one_run_across_a_resume_by_name(tmp_path, monkeypatch):
    """Session 1 trains 1..5 (checkpoint at 3) and dies; session 2 resumes by name from the
    checkpoint and trains 4..6 again with other losses: one curve, each step once."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # what the tracker sets for a file: store
    run = dict(loggers=("tensorboard", "mlflow", "wandb"), mlflow_tracking_uri=f"file://{tmp_path}/mlruns",
               wandb_mode="offline", wandb_dir=str(tmp_path / "wandb"))
    os.makedirs(tmp_path / "wandb")
    first = _recorder(tmp_path, [], **run)
    first.trackers = tracker_set.TrackerSet.for_run(first.run, first.rundir, first.record)
    first.resume()
    first.record(ev.WorkersStarted(step=0, world_size=2))
    _train(first, range(1, 6), lambda s: 10.0 - s)
    first.record(ev.CheckpointCommitted(step=3))
    first.finish()  # the session ends without a terminal event: a kill

    second = _recorder(tmp_path, [], **run)
    second.trackers = tracker_set.TrackerSet.for_run(second.run, second.rundir, second.record)
    second.resume()
    _rollback(second, 3)
    _train(second, range(4, 7), lambda s: 100.0 - s)
    second.record(ev.RunFinished(step=6))
    second.finish()

    run_dir = tmp_path / "runs" / "unit"
    want = [(m["step"], m["loss"]) for m in _metrics(run_dir)]
    assert want == [(1, 9.0), (2, 8.0), (3, 7.0), (4, 96.0), (5, 95.0), (6, 94.0)]
    assert _tb_scalars(run_dir / "tensorboard", "train/loss") == want
    assert _tb_scalars(run_dir / "tensorboard" / "events", "events/restarts") == [(3, 1.0)]
    _assert_mlflow(tmp_path, run_dir, want, restarts=1)
    _assert_wandb_sessions(tmp_path, run_dir, 2)


def _assert_mlflow(tmp_path, run_dir, want, *, restarts):
    from mlflow.tracking import MlflowClient

    state = json.loads((run_dir / "trackers.json").read_text())
    client = MlflowClient(f"file://{tmp_path}/mlruns")
    runs = client.search_runs([client.get_experiment_by_name("rayflex").experiment_id])
    assert [r.info.run_id for r in runs] == [state["mlflow"]["run_id"]], "a resume reopens the same MLflow run"
    run_id = runs[0].info.run_id
    history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "train/loss"))
    assert history == [(s, pytest.approx(v)) for s, v in want]
    assert max(m.value for m in client.get_metric_history(run_id, "events/restarts")) == restarts
    assert client.get_metric_history(run_id, "run/goodput"), "the run's goodput is logged at its end"
    assert client.get_run(run_id).info.status == "FINISHED"


def _assert_wandb_sessions(tmp_path, run_dir, sessions):
    """Each session wrote an offline run with the stored W&B id (``wandb sync`` merges them
    into one run; wandb 0.31 has no reader for its offline files to check the points)."""
    run_id = json.loads((run_dir / "trackers.json").read_text())["wandb"]["run_id"]
    dirs = [p for p in (tmp_path / "wandb" / "wandb").iterdir() if p.name.startswith("offline-run")]
    assert len(dirs) == sessions and all((d / f"run-{run_id}.wandb").is_file() for d in dirs), dirs


# ----------------------------------------------------------------- on the cluster
@pytest.fixture
def fast_detection(monkeypatch):
    monkeypatch.setenv("RAYFLEX_HEARTBEAT_TIMEOUT_S", "3")
    monkeypatch.setenv("RAYFLEX_RELEASE_TIMEOUT_S", "5")


STEPS = 30  # enough that the first submission is still training when it is stopped


@pytest.mark.cluster
def test_killed_and_resumed_run_keeps_one_curve_per_tracker(two_node_cluster, dataset_uri, tmp_path, fast_detection,
                                                            monkeypatch):
    import ray

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # this process reads the file store too

    def trainer():
        return rf.Trainer(model=small_gpt(), data=rf.DataConfig(uri=dataset_uri, seq_len=32, global_batch=8),
                          run=rf.RunConfig(name="tracked", storage=f"file://{tmp_path}/runs", steps=STEPS,
                                           optimizer=rf.OptimizerConfig(lr=1e-2, warmup_steps=2),
                                           loggers=("tensorboard", "mlflow", "wandb"),
                                           mlflow_tracking_uri=f"file://{tmp_path}/mlruns",
                                           wandb_mode="offline", wandb_dir=str(tmp_path / "wandb")),
                          scaling=rf.ScalingConfig(num_workers=2), checkpoint=rf.CheckpointConfig(every_steps=3),
                          elastic=rf.ElasticConfig(max_failures=3, resource_wait_s=60))

    os.makedirs(tmp_path / "wandb")
    handle = trainer().submit()
    st = wait_until_running(handle, 4, committed=3)
    controller = ray.get(handle.controller.process_info.remote(), timeout=30)
    os.kill(next(w for w in st["workers"] if w["rank"] == 1)["pid"], signal.SIGKILL)
    deadline = time.time() + 60
    while not (handle.status()["restarts"] >= 1 and handle.status()["step"] >= 5) and time.time() < deadline:
        time.sleep(0.2)
    first = handle.stop()
    assert first.status == "stopped" and first.raw["restarts"] >= 1 and first.steps_completed < STEPS, first.raw
    assert controller["torch_imported"] is False, "the trackers must not bring torch into the controller"

    result = trainer().fit(progress=False)  # resubmitted by name: continues the run and its tracker runs
    assert result.status == "finished" and result.steps_completed == STEPS

    run_dir = tmp_path / "runs" / "tracked"
    metrics = _metrics(run_dir)
    want = [(m["step"], m["loss"]) for m in metrics]
    assert [s for s, _ in want] == list(range(1, STEPS + 1))
    tb = _tb_scalars(run_dir / "tensorboard", "train/loss")
    assert [s for s, _ in tb] == list(range(1, STEPS + 1)) and [v for _, v in tb] == [pytest.approx(v, rel=1e-6) for _, v in want]
    assert _tb_scalars(run_dir / "tensorboard" / "events", "events/restarts")[-1][1] >= 1
    assert _tb_scalars(run_dir / "tensorboard" / "events", "events/checkpoints")
    _assert_mlflow(tmp_path, run_dir, want, restarts=first.raw["restarts"])
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert not [e for e in events if e["kind"] == "tracker_failed"], "no tracker failed"
    _assert_wandb_sessions(tmp_path, run_dir, 2)


def test_a_killed_process_leaves_wandbs_temporary_directories_in_the_run_not_in_tmp(tmp_path):
    # Importing wandb makes two temporary directories that only the interpreter's exit
    # removes: a process killed with its run leaves them — inside the W&B directory.
    code = ("import os, sys\n"
            "from rayflex.telemetry.trackers.wandb import _import_wandb\n"
            "_import_wandb(sys.argv[1])\n"
            "os._exit(0)  # as a kill: no exit handlers\n")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    left = {p.name.rsplit("wandb-", 1)[-1] for p in (tmp_path / ".tmp").iterdir()}
    assert left == {"artifacts", "media"}, left
