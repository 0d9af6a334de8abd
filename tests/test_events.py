"""Typed events: what a run directory's ``events.jsonl`` reads back as.

Lines are written the way the controller writes them (``RunDirectory.add_line`` of
``Event.to_dict()``) and read back the way the report and ``rayflex status`` read them.
"""

import json

import pytest

from rayflex.storage.rundir import RunDirectory
from rayflex.telemetry import events as ev
from rayflex.telemetry.goodput import goodput_breakdown
from rayflex.telemetry.status import row_from_run_dir

T0 = 1_700_000_000.0

# The "kind" strings of events.jsonl: changing one breaks every stored run directory.
STORED_KINDS = {
    "run_started", "plan_chosen", "workers_started", "checkpoint_committed", "checkpoint_failed",
    "checkpoint_loaded", "worker_failed", "worker_died", "node_lost", "node_health_checked", "hang_detected", "hang_diagnosed", "straggler_detected",
    "preemption_notice", "restarted", "storage_unavailable", "storage_recovered", "run_stopped",
    "run_finished", "run_failed", "schedule_changed", "checkpoint_interval_chosen", "memory_replicas_short",
    "checkpoint_deferred", "recovery_chosen", "capacity_waited", "straggler_decided",
}


def one_of_each() -> list[ev.Event]:
    """An event of every class, each with non-default fields, in time order."""
    return [
        ev.RunStarted(time=T0, step=0, name="demo", target_steps=30),
        ev.PlanChosen(time=T0 + 1, world_size=4, pp=2, dp=2, schedule="1f1b", stage_blocks=[[0, 1], [2, 3]],
                      stage_costs=[1.5, 1.25], balance="cost", microbatches=4, micro_batch=2, accum_steps=1,
                      rank_to_node=["a", "a", "b", "b"], planned_rank_to_node=["a", "a", "b", "b"],
                      modeled_comm_s=0.01, naive_comm_s=0.02, explanation="pp=2 x dp=2"),
        ev.WorkersStarted(time=T0 + 2, step=0, world_size=4, setup_s=2.0, spawn_s=0.5, rendezvous_s=0.25,
                          build_s=1.0, restore_s=0.25),
        ev.CheckpointCommitted(time=T0 + 12, step=10, uri="memory://ckpt/10", blocked_s=0.1, total_s=0.5,
                               bytes=1234),
        ev.CheckpointDeferred(time=T0 + 12.5, step=11, behind_step=10),
        ev.StragglerDetected(time=T0 + 13, step=11, rank=3, node_id="b", ratio=2.5),
        ev.StragglerDecided(time=T0 + 13.5, step=11, node_id="b", ranks=[2, 3], action="keep", reason="not worth it",
                            world=4, to_world=2, remaining_steps=19, slow_step_s=0.3, healthy_step_s=0.2,
                            after_step_s=0.4, restart_s=6.0, gain_s=-7.9),
        ev.NodeHealthChecked(time=T0 + 13.7, step=11, node_id="c", passed=False, action="left_out",
                             reason="computes at 0.10x the run's nodes", gflops=1.0, reference_gflops=10.0, probe_s=1.5),
        ev.PreemptionNotice(time=T0 + 14, step=12, node_id="b", deadline=T0 + 34, source="ray_drain", ranks=[2, 3],
                            seconds_left=20.0, needed_s=1.0, action="emergency_checkpoint", reason="enough time"),
        ev.StorageUnavailable(time=T0 + 15, step=13, uri="memory://runs/demo", error="ConnectionError: down"),
        ev.StorageRecovered(time=T0 + 16, step=14, uri="memory://runs/demo", down_s=1.0),
        ev.CheckpointFailed(time=T0 + 17, step=15, reason="StorageError: down"),
        ev.WorkerFailed(time=T0 + 18, step=15, rank=1, node_id="a", error="RuntimeError: boom",
                        detected_after_s=0.1),
        ev.WorkerDied(time=T0 + 19, step=15, rank=2, node_id="b", error="ActorDiedError", detected_after_s=0.2),
        ev.NodeLost(time=T0 + 20, step=15, node_id="b", ranks=[2, 3]),
        ev.HangDetected(time=T0 + 21, step=15, ranks=[0], phases={"0": "allreduce"}, stalled_s=9.0, timeout_s=8.0),
        ev.HangDiagnosed(time=T0 + 21.5, step=15, verdict="rank 0 is not responding; rank 1 waits in all_reduce #9 "
                         "of the dp group (ranks 0, 1)", diagnosis="not_responding", ranks=[0], group="dp",
                         members=[0, 1], op="all_reduce", seq=9, answered=[1],
                         table=[{"rank": 0, "phase": "not responding"}, {"rank": 1, "at": "waits in all_reduce"}]),
        ev.RecoveryChosen(time=T0 + 21.5, step=10, source="live_peers", reason="every shard of step 10 is held",
                          holders=[1, 2], snapshot_s=0.4, snapshot_bytes=1 << 20),
        ev.CapacityWaited(time=T0 + 21.8, waited_s=1.2, reason="need 4 workers, 2 fit"),
        ev.Restarted(time=T0 + 22, step=10, world_size=2, from_step=10, reason="node lost", lost_steps=5,
                     reused_workers=2, fault_time=T0 + 20),
        ev.CheckpointLoaded(time=T0 + 23, step=10, uri="memory://ckpt/10", world_size=2, saved_world_size=4,
                            skipped=["step 15: bad"]),
        ev.ScheduleChanged(time=T0 + 24, step=10, from_total_steps=30, to_total_steps=40, lr_before=3e-4,
                           lr_after=6e-4),
        ev.CheckpointIntervalChosen(time=T0 + 25, step=10, every_steps=12, interval_s=3.6, cost_s=0.25,
                                    mtbf_s=600.0, faults=1, step_time_s=0.3, measured=True),
        ev.MemoryReplicasShort(time=T0 + 26, step=10, wanted=1, fewest=0, nodes=1, reason="one node"),
        ev.RunStopped(time=T0 + 30, step=20, reason="stopped by user"),
        ev.RunStarted(time=T0 + 40, step=20, name="demo", target_steps=30),
        ev.RunFailedEvent(time=T0 + 41, step=20, reason="no workers"),
        ev.RunFinished(time=T0 + 50, step=30),
    ]


def _write_run(uri: str, events: list, metrics: list[dict] = ()) -> RunDirectory:
    rd = RunDirectory(uri)
    rd.ensure()
    for e in events:
        rd.add_line("events.jsonl", e if isinstance(e, dict) else e.to_dict())
    for m in metrics:
        rd.add_line("metrics.jsonl", m)
    assert rd.flush() is None
    return rd


def test_every_stored_kind_has_one_event_class():
    classes = set(ev.Event.__subclasses__()) - {ev.UnknownEvent}
    assert {type(e) for e in one_of_each()} == classes  # the tests below cover every class
    assert sorted(c.kind.value for c in classes) == sorted(STORED_KINDS)
    assert {k.value for k in ev.EventKind} - STORED_KINDS == {"unknown"}  # UnknownEvent's own
    assert all(isinstance(e.kind, ev.EventKind) for e in one_of_each())


def test_a_stored_events_file_reads_back_as_the_same_typed_events(tmp_path):
    written = one_of_each()
    rd = _write_run(f"file://{tmp_path}/demo", written)
    stored = rd.read_jsonl("events.jsonl")
    assert [d["kind"] for d in stored] == [e.kind.value for e in written]

    timeline = ev.Timeline.from_jsonl(rd.read_text("events.jsonl"))
    assert timeline.events == written
    assert [e.to_dict() for e in timeline.events] == stored
    assert ev.Timeline.from_dicts(stored).events == written
    assert [type(e) for e in ev.as_events(stored)] == [type(e) for e in written]
    assert timeline.of(ev.RunStarted) == [e for e in written if isinstance(e, ev.RunStarted)] and len(timeline.of(ev.RunStarted)) == 2
    # Written again, a read-back line is the stored line, byte for byte.
    lines = rd.read_text("events.jsonl").splitlines()
    assert [json.dumps(e.to_dict(), default=str) for e in timeline.events] == lines


def test_an_unknown_kind_is_kept_whole_and_ignored_by_goodput():
    newer = {"kind": "elastic_resize_planned", "time": T0 + 5, "step": 3, "target": 8, "why": "capacity"}
    e = ev.parse_event(newer)
    assert isinstance(e, ev.UnknownEvent) and e.kind is ev.EventKind.UNKNOWN
    assert e.stored_kind == "elastic_resize_planned" and (e.time, e.step) == (T0 + 5, 3)
    assert e.to_dict() == newer
    assert "elastic_resize_planned" in e.describe()

    metrics = [{"step": s, "time": T0 + s, "step_time_s": 1.0} for s in range(1, 11)]
    events = [ev.RunStarted(time=T0, step=0), ev.WorkersStarted(time=T0, step=0),
              ev.RunFinished(time=T0 + 11, step=10)]
    plain = goodput_breakdown(metrics, events)
    assert goodput_breakdown(metrics, events[:2] + [e] + events[2:]) == plain
    assert plain.value == pytest.approx(10 / 11)


def test_a_line_from_another_version_keeps_the_fields_this_one_knows():
    e = ev.parse_event({"kind": "restarted", "time": T0, "step": 4, "world_size": 2, "from_step": 4,
                        "added_in_a_newer_version": True})
    assert e == ev.Restarted(time=T0, step=4, world_size=2, from_step=4)
    # An older line without the fields added since: their defaults.
    assert ev.parse_event({"kind": "checkpoint_committed", "time": T0, "step": 5}).reason == "periodic"


def test_goodput_of_stored_dicts_equals_goodput_of_typed_events():
    events = one_of_each()
    metrics = [{"step": s, "time": T0 + 2 + s, "step_time_s": 1.0} for s in range(1, 16)]
    metrics += [{"step": s, "time": T0 + 13 + s, "step_time_s": 1.0} for s in range(11, 21)]
    typed = goodput_breakdown(metrics, events)
    assert goodput_breakdown(metrics, [e.to_dict() for e in events]) == typed
    assert typed.rolled_back_s == pytest.approx(5) and typed.sessions == 2


def test_status_of_a_run_directory_with_a_newer_kind(tmp_path):
    metrics = [{"step": s, "time": T0 + s, "step_time_s": 1.0, "loss": 3.0, "world_size": 2} for s in range(1, 8)]
    events = [ev.RunStarted(time=T0, step=0, target_steps=20), ev.WorkersStarted(time=T0, step=0, world_size=2),
              {"kind": "something_new", "time": T0 + 3, "step": 3},
              ev.CheckpointCommitted(time=T0 + 5.5, step=5, uri="file:///ckpt/5")]
    _write_run(f"file://{tmp_path}/killed", events, metrics)
    row = row_from_run_dir(f"file://{tmp_path}/killed")
    assert row["state"] == "NO DRIVER" and row["step"] == 7 and row["target_steps"] == 20
    assert row["last_checkpoint"] == {"step": 5, "uri": "file:///ckpt/5"}
    assert row["restarts"] == 0 and row["goodput"] == pytest.approx(5 / 7)
