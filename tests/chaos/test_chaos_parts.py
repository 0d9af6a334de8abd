"""The chaos harness's own parts, without a cluster: the plan, the S3 gate, the replay's
segments and the invariants — each shown to catch what it exists to catch."""

import dataclasses
import http.server
import threading
import urllib.request
from unittest import mock

import pytest

from rayflex.telemetry import events as ev
from rayflex.testing.chaos import KINDS, plan_faults
from rayflex.testing.chaos import invariants as inv
from rayflex.testing.chaos.bounds import DetectionTiming
from rayflex.testing.chaos.replay import Segment, segments_from_events


def test_plan_is_seeded_and_has_every_kind():
    a, b, c = plan_faults(1, 12), plan_faults(1, 12), plan_faults(2, 12)
    assert a == b and a != c
    assert len(a) == 12 and set(a) == set(KINDS)
    with pytest.raises(ValueError, match="at least 8 faults"):
        plan_faults(0, 5)
    # A slow node joins a seed's plan without reordering the kinds drawn for it.
    slow = plan_faults(1, 12, ("slow_node",))
    assert slow.count("slow_node") == 1 and set(slow) == set(KINDS) | {"slow_node"} and len(slow) == 12
    with pytest.raises(ValueError, match="at least 9 faults"):
        plan_faults(0, 8, ("slow_node",))


def test_a_slow_node_needs_three_workers_in_sequential_mode():
    from rayflex.testing.chaos.run import ChaosConfig

    assert "slow_node" in ChaosConfig(seed=1, faults=12, slow_node=True).kinds()
    with pytest.raises(ValueError, match="slow_node needs >= 3 workers in sequential mode"):
        ChaosConfig(seed=0, faults=9, workers=2, nodes=3, cpus_per_node=1, slow_node=True)


def test_gate_refuses_while_down_and_keeps_the_data():
    from rayflex.testing.chaos.s3_gate import S3Gate

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"still here")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    gate = S3Gate(*server.server_address).start()
    try:
        assert urllib.request.urlopen(gate.url, timeout=5).read() == b"still here"
        gate.down()
        with pytest.raises(OSError):  # connection refused, as from a dead endpoint
            urllib.request.urlopen(gate.url, timeout=5)
        gate.up()
        assert urllib.request.urlopen(gate.url, timeout=5).read() == b"still here"
    finally:
        gate.close()
        server.shutdown()


def test_segments_follow_the_loaded_checkpoints():
    events = [{"kind": "plan_chosen", "world_size": 4, "time": 0},
              {"kind": "checkpoint_loaded", "step": 10, "world_size": 3, "time": 1},
              {"kind": "checkpoint_loaded", "step": 10, "world_size": 2, "time": 2},  # failed again at once
              {"kind": "checkpoint_loaded", "step": 25, "world_size": 4, "time": 3}]
    assert segments_from_events(events, 40) == [Segment(4, 0, 10), Segment(2, 10, 25), Segment(4, 25, 40)]


def test_the_replay_saves_every_step_a_later_restart_goes_back_to():
    # Found by an overlap chaos run: an attempt resumed from step 120, the next fault
    # corrupted 120 in its first step, and the restart after that loaded 116, a step the
    # replay had trained through but never saved ("restored step 120, expected 116").
    from rayflex.testing.chaos.replay import split_at_restores

    events = [{"kind": "plan_chosen", "world_size": 4, "time": 0},
              {"kind": "checkpoint_loaded", "step": 120, "world_size": 4, "time": 1},
              {"kind": "checkpoint_loaded", "step": 116, "world_size": 2, "time": 2},
              {"kind": "checkpoint_loaded", "step": 150, "world_size": 4, "time": 3}]
    segments = segments_from_events(events, 160)
    assert segments == [Segment(4, 0, 120), Segment(2, 116, 150), Segment(4, 150, 160)]
    assert split_at_restores(segments) == [Segment(4, 0, 116), Segment(4, 116, 120), Segment(2, 116, 150),
                                           Segment(4, 150, 160)]
    sequential = [Segment(4, 0, 10), Segment(2, 10, 25), Segment(4, 25, 40)]
    assert split_at_restores(sequential) == sequential, "a run that never went back is replayed as it ran"


def test_samples_invariant_catches_a_skip_and_a_repeat():
    from rayflex.data.dataset import GlobalSampler

    sampler = GlobalSampler(num_samples=20, global_batch=4, seed=3)
    good = [{"step": s, "indices": sampler.indices(s - 1).tolist()} for s in range(1, 11)]
    assert inv.samples_exact(good, sampler, 10)[0]
    skipped = [dict(line) for line in good]
    skipped[5]["indices"] = sampler.indices(6).tolist()  # step 6 consumed step 7's rows
    ok, why = inv.samples_exact(skipped, sampler, 10)
    assert not ok and "6" in why
    assert not inv.samples_exact(good[:-1], sampler, 10)[0]  # a step never ran


def test_a_straggler_off_a_slowed_node_is_a_false_positive():
    assert inv.stragglers_only_on_slow_nodes([ev.WorkerDied(time=1.0, rank=1)], [])[0]
    named_b = ev.StragglerDetected(time=50.0, step=40, rank=2, node_id="b")
    ok, why = inv.stragglers_only_on_slow_nodes([named_b], [])
    assert not ok and "straggler_detected" in why and "rank=2" in why
    slowed_b = [{"index": 0, "kind": "slow_node", "time": 40.0, "node_id": "b", "detail": {}}]
    assert inv.stragglers_only_on_slow_nodes([named_b], slowed_b)[0]
    ok, why = inv.stragglers_only_on_slow_nodes([ev.StragglerDetected(time=50.0, rank=0, node_id="a")], slowed_b)
    assert not ok and "node_id=a" in why.replace("'", "")
    assert not inv.stragglers_only_on_slow_nodes([dataclasses.replace(named_b, time=30.0)], slowed_b)[0], \
        "named before it slowed"


def test_a_slow_node_is_named_within_its_window_and_its_decisions_reported():
    fault = {"index": 0, "kind": "slow_node", "time": 100.0, "rank": None, "node_id": "b", "detail": {"ranks": [2, 3]}}
    events = [ev.StragglerDetected(time=108.5, step=80, rank=2, node_id="b"),
              ev.StragglerDecided(time=112.0, node_id="b", ranks=[2, 3], action="evict_node", reason="pays",
                                  slow_step_s=0.5),
              ev.NodeHealthChecked(time=130.0, node_id="b", action="kept_out", reason="computes at 0.10x"),
              ev.NodeHealthChecked(time=150.0, node_id="b", passed=True, action="readmitted", reason="healthy")]
    with mock.patch.dict("os.environ", {"RAYFLEX_STRAGGLER_WINDOW_S": "8"}):
        ok, (row,) = inv.faults_accounted([fault], events, TIMING)
    # max(the 8 s window, 10 slow steps of 0.5 s) + a poll + 6 steps of slack
    assert ok and row["detected_by"] == "straggler_detected" and row["bound_s"] == 8.0 + 0.1 + 0.6
    assert [(d["event"], d["action"], d["after_s"]) for d in row["decisions"]] == [
        ("straggler_decided", "evict_node", 12.0), ("node_health_checked", "kept_out", 30.0),
        ("node_health_checked", "readmitted", 50.0)]
    ok, (row,) = inv.faults_accounted([fault], events[1:], TIMING)
    assert not ok and row["detected_by"] is None


# The chaos knobs (0.1 s polls) on a host that steps in 0.1 s: 0.6 s of slack.
TIMING = DetectionTiming(poll_s=0.1, notice_poll_s=0.5, nodes_refresh_s=0.5, heartbeat_s=3.0, step_s=0.1)


def test_every_fault_needs_its_detection_in_time():
    faults = [{"index": 0, "kind": "kill_actor", "time": 100.0, "rank": 2, "node_id": "n1", "detail": {}},
              {"index": 1, "kind": "sigstop", "time": 200.0, "rank": 1, "node_id": "n2", "detail": {}}]
    events = [{"kind": "worker_died", "time": 100.2, "rank": 2, "node_id": "n1"},
              {"kind": "hang_detected", "time": 203.5, "ranks": [1]}]
    ok, rows = inv.faults_accounted(faults, events, TIMING)
    assert ok and [r["detected_by"] for r in rows] == ["worker_died", "hang_detected"]
    assert [r["bound_s"] for r in rows] == [0.7, 3.8]  # poll + slack; heartbeat + 2 polls + slack
    assert inv.faults_accounted(faults, ev.as_events(events), TIMING) == (ok, rows)  # typed: the same
    newer = [{"kind": "elastic_resize_planned", "time": 100.1}, *events]  # a kind this version does not know
    assert inv.faults_accounted(faults, newer, TIMING) == (ok, rows)
    late = [dict(events[0], time=104.0), events[1]]
    ok, rows = inv.faults_accounted(faults, late, TIMING)
    assert not ok and rows[0]["after_s"] == 4.0
    assert not inv.faults_accounted(faults, events[:1], TIMING)[0]


def test_detection_bounds_follow_the_hosts_step_time():
    # The same 4 s detection is late where a step takes 0.1 s and in time where the host
    # is ten times slower: the slack is steps of this run, not seconds of one host.
    faults = [{"index": 0, "kind": "kill_actor", "time": 100.0, "rank": 2, "node_id": "n1", "detail": {}}]
    late = [{"kind": "worker_died", "time": 104.0, "rank": 2, "node_id": "n1"}]
    assert not inv.faults_accounted(faults, late, TIMING)[0]
    slow = DetectionTiming.of_run(3.0, [{"step": s, "step_time_s": t} for s, t in enumerate([0.9, 1.0, 1.1], 1)])
    assert slow.step_s == 1.0 and slow.slack_s == 6.0
    ok, rows = inv.faults_accounted(faults, late, slow)
    assert ok and rows[0]["bound_s"] == slow.poll_s + 6.0


def test_a_fault_inside_a_restart_is_timed_from_its_end():
    # A spot notice at 100.0 while the controller restarts (detected 99.0, restarted 110.0):
    # no attempt is polled until 110, so the notice read at 110.9 is in time.
    faults = [{"index": 0, "kind": "preempt_short", "time": 100.0, "rank": None, "node_id": "n2", "detail": {}}]
    events = [ev.Restarted(time=110.0, fault_time=99.0, world_size=2),
              ev.PreemptionNotice(time=110.9, node_id="n2", action="restore_last_committed")]
    ok, rows = inv.faults_accounted(faults, events, TIMING)
    assert ok and rows[0]["bound_s"] == 10.0 + 0.5 + 0.1 + 0.6
    # The same notice 0.9 s past its window's mechanism in a healthy run is late.
    ok, rows = inv.faults_accounted(faults, events[1:], TIMING)
    assert not ok and rows[0]["bound_s"] == 1.2


def test_each_fault_kind_is_named_by_its_own_event():
    def fault(i, kind, t, **kw):
        return {"index": i, "kind": kind, "time": t, "rank": kw.pop("rank", None), "node_id": kw.pop("node_id", None),
                "detail": kw}

    faults = [fault(0, "remove_node", 10.0, node_id="n3"), fault(1, "preempt_long", 20.0, node_id="n2"),
              fault(2, "preempt_short", 30.0, node_id="n1"), fault(3, "s3_down", 40.0, down_s=12.0),
              fault(4, "corrupt_checkpoint", 50.0, rank=0, step=15)]
    events = [ev.WorkerDied(time=10.5, rank=3, node_id="n3"), ev.NodeLost(time=11.0, node_id="n3"),
              ev.PreemptionNotice(time=20.5, node_id="n2", action="restore_last_committed"),  # not this one
              ev.PreemptionNotice(time=20.6, node_id="n2", action="emergency_checkpoint"),
              ev.PreemptionNotice(time=30.5, node_id="n1", action="restore_last_committed"),
              ev.CheckpointFailed(time=45.0, reason="StorageError"),
              ev.WorkerDied(time=50.2, rank=0, node_id="n0"),
              ev.CheckpointLoaded(time=52.0, step=10, skipped=["step 15: checksum mismatch"]),
              ev.Restarted(time=52.5, fault_time=50.2, world_size=2)]
    ok, rows = inv.faults_accounted(faults, events, TIMING)
    assert ok, rows
    assert [(r["detected_by"], r["after_s"]) for r in rows] == [
        ("worker_died", 0.5), ("preemption_notice", 0.6), ("preemption_notice", 0.5), ("checkpoint_failed", 5.0),
        ("checkpoint_loaded", 2.0)]
    # The object store's bound is the product's promise (no slack); the corruption's is the
    # kill's plus the restart that restores past it (2.3 s here).
    assert rows[3]["bound_s"] == 7.0 and rows[4]["bound_s"] == 0.7 + 2.3
    # The kill alone does not name a corruption: the restart must have skipped that step...
    ok, rows = inv.faults_accounted(faults[4:], events[:-2], TIMING)
    assert not ok and rows[0]["detected_by"] is None
    # ... or read no checkpoint at all (the survivors' memory), but not a checkpoint past it unskipped.
    live = [events[6], ev.RecoveryChosen(time=50.4, step=16, source="live_peers", holders=[1])]
    ok, rows = inv.faults_accounted(faults[4:], live, TIMING)
    assert ok and rows[0]["detected_by"] == "recovery_chosen", rows
    from_storage = [events[6], ev.RecoveryChosen(time=50.4, step=16, source="checkpoint", reason="x"),
                    ev.CheckpointLoaded(time=52.0, step=15, skipped=[])]
    ok, rows = inv.faults_accounted(faults[4:], from_storage, TIMING)
    assert not ok and rows[0]["detected_by"] is None
    with pytest.raises(ValueError, match="unknown fault kind"):
        inv.faults_accounted([fault(5, "meteor", 1.0)], events, TIMING)


def test_injector_leaves_out_faults_too_close_to_the_end():
    from rayflex.testing.chaos.injector import FaultTiming, Injector

    class Handle:
        step = 0

        def status(self):
            workers = [{"rank": r, "node_id": f"n{r}", "pid": -1} for r in range(2)]
            return {"state": "RUNNING", "world_size": 2, "workers": workers, "step": self.step}

        def events(self):
            return [{"kind": "checkpoint_committed", "time": 1e18}]

    handle = Handle()
    injector = Injector(None, handle, None, ["raise_once"], seed=0, workers=2, checkpoint_root="memory://x",
                        timing=FaultTiming(min_steps_between=10), steps=40)
    injector._raise_once = lambda fault, workers: None  # record the decision only
    handle.step = 31  # 9 steps left: no room for the recovery and its checks
    injector.tick()
    assert injector.injected == []
    handle.step = 30
    injector.tick()
    assert [f.kind for f in injector.injected] == ["raise_once"]


def test_raise_once_is_rearmed_after_a_restart_and_timed_from_the_raise(tmp_path):
    """A restart that renumbers the ranks before the armed rank raised takes the arming
    with it: the injector arms the new attempt, and the fault counts from the moment a
    worker recorded the raise — while a raise the controller never reported still fails."""
    import json
    import time as _time

    from rayflex.testing.chaos.injector import FaultTiming, Injector

    class Handle:
        step, evts = 12, [{"kind": "checkpoint_committed", "time": 1.0}]

        def status(self):
            workers = [{"rank": r, "node_id": f"n{r}", "pid": -1} for r in range(2)]
            return {"state": "RUNNING", "world_size": 2, "workers": workers, "step": self.step}

        def events(self):
            return list(self.evts)

    handle, armed = Handle(), []
    log_path = tmp_path / "fired.jsonl"
    injector = Injector(None, handle, None, ["raise_once"], seed=0, workers=2, checkpoint_root="memory://x",
                        timing=FaultTiming(min_steps_between=10), steps=100, fault_log=str(log_path),
                        arm=lambda rank, step, message: armed.append((rank, step, message)) or step - 1)
    injector.tick()
    assert len(armed) == 1 and armed[0][1] == 13 and not injector.done
    injector.tick()
    assert len(armed) == 1, "no restart yet: still armed, not armed twice"

    now = _time.time()
    handle.evts.append({"kind": "restarted", "time": now + 1})  # the arming is gone with that attempt
    handle.step = 20
    injector.tick()
    assert len(armed) == 1, "not re-armed before a checkpoint commits after the restart"
    handle.evts.append({"kind": "checkpoint_committed", "time": now + 2})
    injector.tick()
    assert len(armed) == 2 and armed[1][1] == 21
    fault = injector.injected[0]
    assert fault.detail["rearmed"] == 1 and len(injector.injected) == 1

    message = armed[1][2]
    log_path.write_text(json.dumps({"time": now + 3, "rank": armed[1][0], "step": 21, "message": message}) + "\n")
    injector.tick()
    assert injector.done and fault.time == now + 3 and fault.step == 21
    detected = [{"kind": "worker_failed", "time": now + 3.2, "rank": armed[1][0], "error": f"RuntimeError: {message}"}]
    ok, rows = inv.faults_accounted([fault.to_dict()], detected, TIMING)
    assert ok and rows[0]["after_s"] == pytest.approx(0.2, abs=1e-3)
    assert not inv.faults_accounted([fault.to_dict()], [], TIMING)[0], "a missed raise still fails"


def test_an_armed_failure_is_due_at_or_after_its_step():
    """Armed on a live run (the controller's step lags the workers'), a failure fires at
    the first step started at or after the one asked for; RAYFLEX_FAIL_AT's stays exact."""
    from rayflex.worker.train_worker import InjectedFailure

    armed = InjectedFailure(5, "chaos", or_later=True)
    assert [s for s in range(1, 9) if armed.due(s)] == [5, 6, 7, 8]
    assert [s for s in range(1, 9) if InjectedFailure(5, "env").due(s)] == [5]


def test_a_fault_whose_target_is_gone_is_tried_again():
    """The process picked from the status was replaced before the signal got there: the
    kill did not happen, so it is not recorded as a fault; the next healthy tick kills."""
    import subprocess

    from rayflex.testing.chaos.injector import FaultTiming, Injector

    gone = subprocess.Popen(["true"])
    gone.wait()  # reaped: its pid names no process
    alive = subprocess.Popen(["sleep", "60"])
    try:
        class Handle:
            pid = gone.pid

            def status(self):
                return {"state": "RUNNING", "world_size": 1, "step": 12,
                        "workers": [{"rank": 0, "node_id": "n0", "pid": self.pid}]}

            def events(self):
                return [{"kind": "checkpoint_committed", "time": 1e18}]

        handle = Handle()
        injector = Injector(None, handle, None, ["kill_actor"], seed=0, workers=1, checkpoint_root="memory://x",
                            timing=FaultTiming(min_steps_between=10), steps=100)
        injector.tick()
        assert injector.injected == [] and not injector.done
        handle.pid = alive.pid
        injector.tick()
        assert [f.kind for f in injector.injected] == ["kill_actor"] and injector.done
        assert alive.wait(timeout=10) == -9
    finally:
        alive.kill()


def test_a_node_fault_waits_for_a_rank_off_the_head():
    """The head runs the driver and is never removed: while every rank sits there, a node
    fault would hit nothing and be reported missed, so it waits for a layout where it hits."""
    from rayflex.testing.chaos.injector import FaultTiming, Injector

    class Cluster:
        head_id = "head"
        removed: list = []

        def remove_node(self, node_id):
            self.removed.append(node_id)
            return True

    class Handle:
        nodes = ["head", "head"]

        def status(self):
            workers = [{"rank": r, "node_id": n, "pid": -1} for r, n in enumerate(self.nodes)]
            return {"state": "RUNNING", "world_size": 2, "workers": workers, "step": 12}

        def events(self):
            return [{"kind": "checkpoint_committed", "time": 1e18}]

    cluster, handle = Cluster(), Handle()
    injector = Injector(cluster, handle, None, ["remove_node"], seed=0, workers=2, checkpoint_root="memory://x",
                        timing=FaultTiming(min_steps_between=10), steps=100)
    injector.tick()
    assert injector.injected == [] and cluster.removed == []
    handle.nodes = ["head", "n1"]
    injector.tick()
    assert [(f.kind, f.node_id, f.detail["ranks"]) for f in injector.injected] == [("remove_node", "n1", [1])]
    assert cluster.removed == ["n1"]


def test_a_chaos_run_whose_ranks_fit_on_the_head_is_refused():
    from rayflex.testing.chaos import ChaosConfig

    with pytest.raises(ValueError, match="workers=2 fit on one node of cpus_per_node=2.*more workers than"):
        ChaosConfig(seed=0, faults=8, workers=2, nodes=3, cpus_per_node=2)
    ChaosConfig(seed=0, faults=8, workers=2, nodes=3, cpus_per_node=1)  # the CI short seed's layout


def test_overlap_plan_puts_every_second_fault_in_a_window_it_can_hit():
    from rayflex.testing.chaos.overlap import plan_overlaps, windows_for

    kinds = plan_faults(1, 16)
    plan = plan_overlaps(1, kinds, growth=True)
    assert plan == plan_overlaps(1, kinds, growth=True), "seeded"
    assert set(plan) <= set(range(1, 16, 2))
    for i, o in plan.items():
        assert o.window in windows_for(kinds[i - 1], kinds[i], growth=True)
    # What each kind can hit: a process-killing fault needs a listed process, a raise an
    # attempt that runs, and during an outage only the outage is a window.
    assert windows_for("kill_actor", "raise_once") == ("first_step",)
    assert "placement" not in windows_for("remove_node", "sigstop")
    assert windows_for("s3_down", "preempt_long") == ("outage",)
    assert windows_for("s3_down", "s3_down") == ()
    assert "growth" in windows_for("kill_actor", "preempt_long", growth=True)
    assert "growth" not in windows_for("kill_actor", "preempt_long")
    two_nodes = plan_overlaps(0, ["remove_node", "remove_node"])
    assert two_nodes[1].window == "at_once", "two nodes lost within one second"


def test_overlap_phase_follows_the_recovery():
    from rayflex.testing.chaos.overlap import phase_of, window_over

    def phase(state, restarted=True, restart_step=None, workers=(), step=10, reason="", store_down=False):
        return phase_of({"state": state, "workers": list(workers), "step": step, "reason": reason},
                        restart_step=restart_step, restarted=restarted, store_down=store_down)

    assert phase("RUNNING", restarted=False) == "running"
    assert phase("RESTARTING") == "release"
    assert phase("PLACING") == "placement"
    assert phase("PLACING", workers=[{"rank": 0}]) == "restore"
    assert phase("PLACING", workers=[{"rank": 0}], reason="capacity returned: growing from 2 to 4") == "growth"
    assert phase("RUNNING", restart_step=9, step=10) == "first_step"
    assert phase("RUNNING", restart_step=9, step=11) == "running"
    assert phase("RUNNING", store_down=True) == "outage"
    assert not window_over("restore", "release", since_s=3.0, restart_reasons=[])
    assert window_over("restore", "running", since_s=3.0, restart_reasons=["worker died"])
    assert not window_over("growth", "running", since_s=3.0, restart_reasons=["worker died"])
    assert window_over("growth", "running", since_s=9.0, restart_reasons=["worker died", "capacity returned: ..."])
    assert window_over("at_once", "release", since_s=1.5, restart_reasons=[])


def test_overlap_mode_injects_the_second_fault_in_its_window_or_says_it_missed_it():
    """The second fault waits for its window of the first one's recovery; a recovery that is
    over before the window is seen still gets the fault, marked as not overlapped."""
    from rayflex.testing.chaos.injector import FaultTiming, Injector
    from rayflex.testing.chaos.overlap import Overlap

    class Handle:
        state, step, workers, events_ = "RUNNING", 12, True, []

        def status(self):
            workers = [{"rank": r, "node_id": f"n{r}", "pid": -1} for r in range(2)] if self.workers else []
            return {"state": self.state, "world_size": 2, "workers": workers, "step": self.step}

        def events(self):
            return [{"kind": "checkpoint_committed", "time": 1e18}] + self.events_

    for window, path, overlapped in (("restore", ["RESTARTING", "PLACING-", "PLACING+"], True),
                                     ("release", ["PLACING-", "RUNNING"], False)):
        handle = Handle()
        injector = Injector(None, handle, None, ["raise_once", "kill_actor"], seed=0, workers=2,
                            checkpoint_root="memory://x", timing=FaultTiming(min_steps_between=10), steps=100,
                            mode="overlap")
        injector.overlaps = {1: Overlap(1, window)}
        injector._raise_once = injector._kill_actor = lambda fault, workers: None  # record the decisions only
        injector.tick()
        assert [f.kind for f in injector.injected] == ["raise_once"]
        handle.events_ = [{"kind": "restarted", "time": injector.injected[0].time + 1, "reason": "worker failed"}]
        for state in path:
            handle.state, handle.workers = state.rstrip("+-"), not state.endswith("-")
            handle.step = 20 if state == "RUNNING" else 12
            injector.tick()
            if len(injector.injected) == 2:
                break
        assert [f.kind for f in injector.injected] == ["raise_once", "kill_actor"], window
        second = injector.injected[1].detail["overlap"]
        assert (second["window"], second["overlapped"]) == (window, overlapped), second
        assert second["phase"] == (window if overlapped else "running")


def test_a_corrupted_step_committed_again_after_the_corruption_is_accepted(tmp_path):
    # Found by the CI overlap seed: step 85 was corrupted, skipped and quarantined at the
    # restore, then trained again and committed anew; the check took the new, verifying
    # checkpoint for the corrupted one.
    import time

    from checkpoint_helpers import save_committed, tiny_state
    from rayflex.testing.chaos import invariants as inv

    root = f"file://{tmp_path}/ckpt"
    before = time.time() - 5
    save_committed(root, tiny_state(), step=3)
    ok, detail = inv.checkpoints_verify(root, {3: before})
    assert ok and "re-committed after their corruption: [3]" in detail, detail
    ok, detail = inv.checkpoints_verify(root, {3: time.time() + 5})
    assert not ok and "corrupted still committed: [3]" in detail, detail
