"""The control plane without Ray: the Controller driven through a fake cluster and clock.

Each test scripts what happens to the workers (a rank dies, a node goes, a rank freezes or
raises, a spot notice arrives, capacity returns) and asserts what a user of the run sees:
the states it went through, the events in its timeline, its result. Runs in seconds.
"""

from __future__ import annotations

import dataclasses

import pytest

import rayflex as rf
from rayflex.constants import knob
from rayflex.control.controller import Controller
from rayflex.control.states import RunState as S
from rayflex.faults.policy import Fail, FailurePolicy, Policies, Restart
from rayflex.models.summary import ModelSummary
from rayflex.telemetry import events as ev

from rayflex.errors import SetupFailed

from controller_fakes import (FakeClock, FakeCluster, add_node, freeze_node, freeze_rank, kill_rank, lose_node, notice,
                              raise_in_rank, slow_node)

START = [(S.INITIALIZING, S.PLACING), (S.PLACING, S.RUNNING)]
RESTART = [(S.RUNNING, S.RESTARTING), (S.RESTARTING, S.PLACING), (S.PLACING, S.RUNNING)]


@pytest.fixture(autouse=True)
def _production_timing(monkeypatch):
    # The fake clock makes production timing free: one step per 0.2 s poll, notices read
    # every 0.5 s, capacity checked every 2 s (the suite shortens the poll for real runs).
    monkeypatch.setenv("RAYFLEX_POLL_INTERVAL_S", "0.2")
    # The run report (a plot) is tested in test_report.py; here it would only cost time.
    monkeypatch.setattr("rayflex.telemetry.report.write_report", lambda *a, **k: None)


def _spec(tmp_path, *, workers=4, min_workers=None, max_workers=None, steps=8, every=0, parallel=None, prices=None,
          **elastic):
    model = ModelSummary(name="m", num_blocks=4, hidden_size=8, init_seed=1, block_params=(10, 10, 10, 10))
    return rf.TrainSpec(model=model, data=rf.DataConfig(uri="file:///nowhere", seq_len=8, global_batch=8),
                        run=rf.RunConfig(name="r", storage=f"file://{tmp_path}", steps=steps),
                        parallel=parallel or rf.ParallelConfig(),
                        scaling=rf.ScalingConfig(num_workers=workers, min_workers=min_workers,
                                                 max_workers=max_workers, price_per_hour=prices or {}),
                        checkpoint=rf.CheckpointConfig(every_steps=every, resume=True),
                        elastic=rf.ElasticConfig(watch_ray_drain=False, **elastic))


def _run(spec, nodes, *, script=(), watch=False, policies=None):
    clock = FakeClock()
    cluster = FakeCluster(nodes, clock, every_steps=spec.checkpoint.every_steps, watch=watch)
    for step, action in script:
        cluster.at(step, action)
    controller = Controller(spec, cluster=cluster, clock=clock, policies=policies)
    result = controller.run()
    return controller, cluster, result


def _timeline(controller):
    return controller.ctx.recorder.timeline


def test_a_clean_run_places_runs_and_finishes(tmp_path):
    c, cluster, result = _run(_spec(tmp_path), {"a": 2, "b": 2})
    assert c.transitions == START + [(S.RUNNING, S.FINISHED)]
    assert result["status"] == "finished" and result["steps_completed"] == 8 and result["world_size"] == 4
    plan = _timeline(c).of(ev.PlanChosen)[0]
    assert sorted(plan.rank_to_node) == ["a", "a", "b", "b"]
    assert [m["step"] for m in c.metrics()] == list(range(1, 9))
    assert all(a.alive is False for a in cluster.groups[0].actors), "teardown kills every worker"


def test_a_killed_worker_restarts_smaller_when_its_slot_is_gone(tmp_path):
    spec = _spec(tmp_path, min_workers=2, every=2)

    def kill_and_shrink(group):
        kill_rank(3)(group)
        group.cluster.nodes["b"] = 1  # its slot went with it

    c, cluster, result = _run(spec, {"a": 2, "b": 2}, script=[(3, kill_and_shrink)])
    assert c.transitions == START + RESTART + [(S.RUNNING, S.FINISHED)]
    died = _timeline(c).of(ev.WorkerDied)
    assert [e.rank for e in died] == [3]
    restart = _timeline(c).of(ev.Restarted)[0]
    assert restart.world_size == 2 and restart.from_step == 2, "2 is the largest size the batch of 8 allows in 3 slots"
    assert restart.reused_workers == 2, "two survivors keep their processes"
    assert result["status"] == "finished" and result["steps_completed"] == 8 and result["world_size"] == 2
    assert [m["step"] for m in c.metrics()] == list(range(1, 9)), "the rolled-back step 3 is not counted twice"


def test_a_lost_node_is_named_and_the_run_continues_on_the_others(tmp_path):
    spec = _spec(tmp_path, min_workers=2, every=2)
    c, cluster, result = _run(spec, {"a": 2, "b": 2}, script=[(4, lose_node("b"))])
    assert c.transitions == START + RESTART + [(S.RUNNING, S.FINISHED)]
    lost = _timeline(c).of(ev.NodeLost)
    assert [(e.node_id, e.ranks) for e in lost] == [("b", [2, 3])]
    restart = _timeline(c).of(ev.Restarted)[0]
    assert restart.world_size == 2 and restart.from_step == 4
    assert set(_timeline(c).of(ev.PlanChosen)[-1].rank_to_node) == {"a"}
    assert result["status"] == "finished" and result["restarts"] == 1


def test_a_frozen_rank_is_found_by_its_silence_and_replaced(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYFLEX_HEARTBEAT_TIMEOUT_S", "5")
    spec = _spec(tmp_path, every=2)
    c, cluster, result = _run(spec, {"a": 2, "b": 2}, script=[(5, freeze_rank(1))])
    assert c.transitions == START + RESTART + [(S.RUNNING, S.FINISHED)]
    hang = _timeline(c).of(ev.HangDetected)[0]
    assert hang.ranks == [1] and hang.phases["1"] == "unresponsive" and hang.stalled_s > 5
    diagnosed = _timeline(c).of(ev.HangDiagnosed)[0]
    assert diagnosed.diagnosis == "not_responding" and diagnosed.ranks == [1] and diagnosed.answered == [0, 2, 3]
    assert cluster.groups[0].actors[1] in cluster.killed, "the frozen process is killed, not waited for"
    restart = _timeline(c).of(ev.Restarted)[0]
    assert restart.world_size == 4 and restart.from_step == 4
    assert cluster.standbys_started == 1 and restart.reused_workers == 4, \
        "the replacement warmed while the survivors left, and all four processes are reused"
    assert cluster.probed == [], "a node with a rank still answering is not suspected"
    assert result["status"] == "finished"


def test_a_frozen_node_that_runs_no_probe_is_left_out_without_waiting_for_ray(tmp_path, monkeypatch):
    # The whole machine froze: Ray still lists it (its health check takes up to a minute),
    # but it runs no task. The restart does not place ranks there to wait for Ray.
    monkeypatch.setenv("RAYFLEX_HEARTBEAT_TIMEOUT_S", "5")
    spec = _spec(tmp_path, min_workers=2, every=2, restart_while_warming=False)
    c, cluster, result = _run(spec, {"a": 2, "b": 2}, script=[(4, freeze_node("b"))])
    assert _timeline(c).of(ev.HangDetected)[0].ranks == [2, 3]
    assert cluster.probed == [("b",)]
    (lost,) = _timeline(c).of(ev.NodeLost)
    assert (lost.node_id, lost.ranks) == ("b", [2, 3]) and lost.reason.startswith("unreachable: its ranks froze")
    restarts = _timeline(c).of(ev.Restarted)
    assert [r.world_size for r in restarts] == [2] and (S.PLACING, S.PLACING) not in c.transitions, \
        "no attempt was started on the frozen node"
    assert set(_timeline(c).of(ev.PlanChosen)[-1].rank_to_node) == {"a"}
    assert restarts[0].time - _timeline(c).of(ev.HangDetected)[0].time < 15, "the probe's 5 s, not Ray's minute"
    assert result["status"] == "finished" and result["world_size"] == 2


def test_a_frozen_node_that_answers_again_is_used_again(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYFLEX_HEARTBEAT_TIMEOUT_S", "5")
    spec = _spec(tmp_path, min_workers=2, every=2, steps=40, restart_while_warming=False)

    def thaw_b(group):
        group.cluster.frozen_nodes.discard("b")  # its pending probe runs now

    c, cluster, result = _run(spec, {"a": 2, "b": 2}, script=[(4, freeze_node("b")), (6, thaw_b)])
    sizes = [r.world_size for r in _timeline(c).of(ev.Restarted)]
    assert sizes == [2, 4] and "capacity returned" in _timeline(c).of(ev.Restarted)[-1].reason
    assert set(_timeline(c).of(ev.PlanChosen)[-1].rank_to_node) == {"a", "b"}
    assert result["status"] == "finished" and result["world_size"] == 4


def test_a_node_that_dies_while_the_restart_starts_is_a_failure_not_the_end_of_the_run(tmp_path, monkeypatch):
    # A frozen node: its ranks stop answering (the hang detector names them), Ray still lists
    # the node, so the restart places ranks there; they never start, and Ray's health check
    # declares the node dead while the attempt waits for them. The failed start is decided by
    # the failure policy like any failure: the run restarts on what is left and finishes.
    from rayflex.errors import SetupFailed

    monkeypatch.setenv("RAYFLEX_HEARTBEAT_TIMEOUT_S", "5")
    spec = _spec(tmp_path, min_workers=2, every=2, restart_while_warming=False)  # the restart waits for node b

    def node_b_dies_during_setup(group):
        lose_node("b")(group)
        raise SetupFailed("start", {2: "ActorDiedError: its node died"}, [], 300)

    def freeze_node_b(group):
        freeze_rank(2)(group)
        freeze_rank(3)(group)
        group.cluster.setup_failures = [node_b_dies_during_setup]

    c, cluster, result = _run(spec, {"a": 2, "b": 2}, script=[(4, freeze_node_b)])
    assert _timeline(c).of(ev.HangDetected)[0].ranks == [2, 3]
    assert [(e.rank, e.node_id) for e in _timeline(c).of(ev.WorkerDied)] == [(2, "b")]
    assert [(e.node_id, e.ranks) for e in _timeline(c).of(ev.NodeLost)] == [("b", [2, 3])]
    restarts = _timeline(c).of(ev.Restarted)
    assert len(restarts) == 1 and restarts[0].world_size == 2 and "while the attempt started" in restarts[0].reason
    assert set(_timeline(c).of(ev.PlanChosen)[-1].rank_to_node) == {"a"}
    assert (S.PLACING, S.PLACING) in c.transitions
    assert all(not a.alive for a in cluster.groups[1].actors), "the failed attempt's workers are let go"
    assert result["status"] == "finished" and result["steps_completed"] == 8 and result["world_size"] == 2


def test_a_rank_frozen_while_the_attempt_restores_is_named_as_a_hang_and_replaced(tmp_path):
    # Found by the overlap chaos run: a process SIGSTOPped during a restore stalled the
    # restart for the whole setup timeout (300 s) and was never named. The group now pings
    # the ranks while they restore; one silent for the heartbeat timeout fails the start.
    from rayflex.errors import SetupFailed

    def rank_1_freezes_in_the_restore(group):
        group.actors[1].frozen = True
        raise SetupFailed("rendezvous, build and restore", {}, [1], 3.0, frozen=True)

    def kill_then_freeze_during_restore(group):
        kill_rank(3)(group)
        group.cluster.setup_failures = [rank_1_freezes_in_the_restore]

    spec = _spec(tmp_path, every=2, restart_while_warming=False)
    c, cluster, result = _run(spec, {"a": 2, "b": 2}, script=[(4, kill_then_freeze_during_restore)])
    (hang,) = _timeline(c).of(ev.HangDetected)
    assert hang.ranks == [1] and hang.phases == {"1": "setup: rendezvous, build and restore"}, hang
    assert hang.timeout_s == 3.0
    restarts = _timeline(c).of(ev.Restarted)
    assert len(restarts) == 1 and "stopped answering for 3s (frozen?)" in restarts[0].reason
    assert result["status"] == "finished" and result["steps_completed"] == 8 and result["world_size"] == 4


def test_a_worker_that_dies_while_leaving_the_failed_attempt_is_named_and_replaced(tmp_path):
    # Found by the overlap chaos run: a second process killed within a second of the first,
    # while the survivors were leaving the failed attempt, was replaced without a word.
    def second_death_while_leaving(group):
        kill_rank(1)(group)
        group.cluster.die_while_leaving = (0,)

    spec = _spec(tmp_path, every=2, restart_while_warming=False)
    c, cluster, result = _run(spec, {"a": 2, "b": 2}, script=[(4, second_death_while_leaving)])
    died = _timeline(c).of(ev.WorkerDied)
    assert [d.rank for d in died] == [1, 0], died
    assert "while leaving the failed attempt" in died[1].error and died[1].node_id == "a"
    restarted = _timeline(c).of(ev.Restarted)
    assert restarted[0].reused_workers == 2, "the dead leaver is not reused"
    assert result["status"] == "finished" and result["world_size"] == 4


def test_a_worker_that_freezes_while_leaving_the_failed_attempt_is_named_as_a_hang(tmp_path):
    # Found by the overlap chaos run: a process SIGSTOPped while the survivors left a failed
    # attempt was killed after the release timeout without a word.
    def kill_then_freeze_while_leaving(group):
        kill_rank(1)(group)
        group.cluster.on_release = [freeze_rank(0)]

    spec = _spec(tmp_path, every=2, restart_while_warming=False)
    c, cluster, result = _run(spec, {"a": 2, "b": 2}, script=[(4, kill_then_freeze_while_leaving)])
    (hang,) = _timeline(c).of(ev.HangDetected)
    assert hang.ranks == [0] and hang.phases == {"0": "leaving"} and hang.timeout_s > 0, hang
    assert _timeline(c).of(ev.Restarted)[0].reused_workers == 2, "the frozen leaver is not reused"
    assert result["status"] == "finished" and result["world_size"] == 4


def test_a_survivor_still_uploading_is_replaced_without_being_called_a_hang(tmp_path):
    def kill_while_rank_0_uploads(group):
        kill_rank(1)(group)
        group.cluster.upload_while_leaving = (0,)

    spec = _spec(tmp_path, every=2, restart_while_warming=False)
    c, cluster, result = _run(spec, {"a": 2, "b": 2}, script=[(4, kill_while_rank_0_uploads)])
    assert _timeline(c).of(ev.HangDetected) == [], "it left; only its process is not reused"
    assert _timeline(c).of(ev.Restarted)[0].reused_workers == 2, "the uploading leaver is not reused"
    assert result["status"] == "finished" and result["world_size"] == 4


class _InlineExecutor:
    """Runs each submitted call at once (the recorder's background writes, under a fake clock)."""

    def __init__(self, *args, **kwargs):
        pass

    def submit(self, fn, *args):
        from concurrent.futures import Future

        future = Future()
        future.set_result(fn(*args))
        return future

    def shutdown(self, wait=True):
        pass


def test_an_outage_during_the_restore_is_named_while_the_restore_rides_it_out(tmp_path, monkeypatch):
    # Found by the overlap chaos run: the object store went down as a restart began, the
    # restore retried through it, and nothing named the outage (the run directory was only
    # stored while training). Now the controller keeps storing it while the ranks restore.
    from rayflex.storage.rundir import RunDirectory

    failing = {"writes": 0}  # the next this many writes of the run directory fail
    flush = RunDirectory.flush

    def flaky_flush(self):
        if failing["writes"] > 0:
            failing["writes"] -= 1
            return "events.jsonl: ConnectionError: Could not connect to the endpoint URL"
        return flush(self)

    monkeypatch.setattr(RunDirectory, "flush", flaky_flush)
    monkeypatch.setattr("rayflex.control.recorder.ThreadPoolExecutor", _InlineExecutor)  # fake time: no races

    def outage_as_the_restart_begins(group):
        kill_rank(1)(group)
        failing["writes"] = 4  # back after a few seconds of the restore
        group.cluster.restore_s = 12.0  # the restore's reads retry until the store is back

    spec = _spec(tmp_path, every=2, restart_while_warming=False)
    c, cluster, result = _run(spec, {"a": 2, "b": 2}, script=[(4, outage_as_the_restart_begins)])
    down, back = _timeline(c).of(ev.StorageUnavailable), _timeline(c).of(ev.StorageRecovered)
    restarted = _timeline(c).of(ev.Restarted)
    assert down and back and restarted, [(e.kind.value, e.step) for e in _timeline(c).events]
    assert down[0].time < back[0].time < restarted[0].time, "both named while the restore waited, not after it"
    assert result["status"] == "finished" and result["steps_completed"] == 8


def _fits_only_at(size: int, monkeypatch):
    """The capacity planner finds no mesh that holds the model below ``size`` workers."""
    from rayflex.control.context import RunContext
    from rayflex.planning.capacity.memory import CapacityError

    plan_at = RunContext.plan_at

    def plan_or_refuse(self, world, topology):
        if world < size:
            raise CapacityError(f"nothing fits on {world} workers: the smallest peak is 90 GiB of 80 GiB")
        return plan_at(self, world, topology)

    monkeypatch.setattr(RunContext, "plan_at", plan_or_refuse)


def test_a_restart_where_the_model_fits_nowhere_waits_for_capacity_and_resumes(tmp_path, monkeypatch):
    from controller_fakes import FakeCluster

    _fits_only_at(4, monkeypatch)
    requested = FakeCluster.request_capacity

    def autoscaler_brings_b_back(self):  # what `request_resources` gets from a real autoscaler
        requested(self)
        add_node("b", 2)(type("G", (), {"cluster": self})())

    monkeypatch.setattr(FakeCluster, "request_capacity", autoscaler_brings_b_back)
    spec = _spec(tmp_path, min_workers=2, every=2, resource_wait_s=60, restart_while_warming=False)
    c, cluster, result = _run(spec, {"a": 2, "b": 2}, script=[(4, lose_node("b"))])
    assert [(e.node_id, e.ranks) for e in _timeline(c).of(ev.NodeLost)] == [("b", [2, 3])]
    assert cluster.capacity_requests >= 1, "it asked for capacity (node b came back only then)"
    restart = _timeline(c).of(ev.Restarted)[0]
    assert restart.world_size == 4 and restart.from_step == 4, "it resumed once the model fit again"
    assert result["status"] == "finished" and result["steps_completed"] == 8


def test_a_restart_where_the_model_fits_nowhere_fails_after_resource_wait_s(tmp_path, monkeypatch):
    _fits_only_at(4, monkeypatch)
    spec = _spec(tmp_path, min_workers=2, every=2, resource_wait_s=30, restart_while_warming=False)
    c, cluster, result = _run(spec, {"a": 2, "b": 2}, script=[(4, lose_node("b"))])
    assert result["status"] == "failed"
    assert "gave up after waiting 30s for room: the model fits in no mesh of 2 workers" in result["reason"]
    assert "smallest peak is 90 GiB" in result["reason"], "the planner's reason is kept"
    assert all(not a.alive for g in cluster.groups for a in g.actors), "no worker is left behind"


def test_auto_checkpoint_interval_is_chosen_from_measured_cost_and_shortens_after_a_failure(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYFLEX_CHECKPOINT_COST_PRIOR_S", "0.1")
    spec = _spec(tmp_path, steps=160, min_workers=4)
    spec = spec.__class__(**{**spec.__dict__, "checkpoint": rf.CheckpointConfig(every_steps="auto", mtbf_prior_s=60)})
    c, cluster, result = _run(spec, {"a": 2, "b": 2}, script=[(70, kill_rank(1))])
    assert result["status"] == "finished" and result["steps_completed"] == 160
    chosen = _timeline(c).of(ev.CheckpointIntervalChosen)
    measured = [e for e in chosen if e.measured]
    assert chosen[0].measured is False and chosen[0].cost_s == 0.1, "the prior until a save is measured"
    assert measured and measured[0].cost_s == 0.1, "then the blocked time of this run's saves (the fakes': 0.1 s)"
    # Young/Daly from what it measured: a 0.1 s save, one failure a minute, 0.1 s steps.
    first = measured[0]
    assert first.faults == 0 and first.every_steps == round(first.interval_s / first.step_time_s)
    after = next(e for e in chosen if e.faults == 1)
    assert after.every_steps < first.every_steps, "the failure shortens the interval"
    auto = [e.step for e in _timeline(c).of(ev.CheckpointCommitted) if e.reason == "auto"]
    assert auto[0] == 5 + 1, "the first save comes early (asked after 5 steps), to measure its cost"
    # The interval is kept in seconds of training: the fakes finish a step per 0.2 s poll.
    restart = _timeline(c).of(ev.Restarted)[0]
    assert (70 - restart.from_step) * 0.2 <= first.interval_s + 0.4, "the failure lost at most one interval"
    after_restart = [s for s in auto if s > restart.from_step]
    gaps = {b - a for a, b in zip(after_restart, after_restart[1:])}
    # (the interval in force then: it lengthens again as time passes without a failure)
    in_force = [e.interval_s for e in chosen if e.faults == 1]
    assert len(after_restart) >= 2 and all(min(in_force) - 0.4 <= g * 0.2 <= max(in_force) + 0.4 for g in gaps), \
        (auto, in_force)
    assert [r for _, r in cluster.checkpoint_requests] == ["auto"] * len(auto), "one request per save"


def test_a_spot_notice_with_time_takes_an_emergency_checkpoint_first(tmp_path):
    spec = _spec(tmp_path, min_workers=2, every=100, emergency_margin_s=1.0)
    c, cluster, result = _run(spec, {"a": 2, "b": 2}, script=[(3, notice("b", seconds_left=60))], watch=True)
    assert c.transitions == START + RESTART + [(S.RUNNING, S.FINISHED)]
    (n,) = _timeline(c).of(ev.PreemptionNotice)
    assert n.action == "emergency_checkpoint" and n.ranks == [2, 3]
    saved = _timeline(c).of(ev.CheckpointCommitted)[0]
    assert saved.reason == "stop" and saved.step >= 3, "the stop left a checkpoint after the notice"
    restart = _timeline(c).of(ev.Restarted)[0]
    assert restart.from_step == saved.step and restart.world_size == 2 and restart.lost_steps == 0
    assert "preemption" in restart.reason
    assert set(_timeline(c).of(ev.PlanChosen)[-1].rank_to_node) == {"a"}, "the noticed node gets no ranks"
    assert result["preemptions"] == 1 and result["status"] == "finished"


def test_a_spot_notice_without_time_restores_the_last_committed_checkpoint(tmp_path):
    spec = _spec(tmp_path, min_workers=2, every=10, steps=20)
    c, cluster, result = _run(spec, {"a": 2, "b": 2}, script=[(12, notice("b", seconds_left=1))], watch=True)
    assert c.transitions == START + RESTART + [(S.RUNNING, S.FINISHED)]
    (n,) = _timeline(c).of(ev.PreemptionNotice)
    assert n.action == "restore_last_committed" and "checkpoint (step 10)" in n.reason
    restart = _timeline(c).of(ev.Restarted)[0]
    assert restart.from_step == 10 and restart.world_size == 2 and restart.lost_steps >= 2
    assert not [e for e in _timeline(c).of(ev.CheckpointCommitted) if e.reason == "stop"], "no time to save"
    assert result["status"] == "finished" and result["steps_completed"] == 20


def test_a_spot_notice_during_a_restart_leaves_its_node_out_of_the_placement(tmp_path):
    # Found by the overlap chaos run: a second node's notice, 0.1 s after a first notice
    # had stopped the attempt, was never read (notices were polled only while training,
    # and Ray forgets a drained node once it is gone), and the restart placed ranks there.
    def kill_then_notice(group):
        kill_rank(1)(group)
        group.cluster.on_release = [notice("b", seconds_left=60)]  # while the survivors leave

    spec = _spec(tmp_path, min_workers=2, every=2, restart_while_warming=False)
    c, cluster, result = _run(spec, {"a": 2, "b": 2, "c": 2}, script=[(4, kill_then_notice)], watch=True)
    (n,) = _timeline(c).of(ev.PreemptionNotice)
    assert n.action == "excluded_from_placement" and n.node_id == "b", n
    assert "while the run was restarting" in n.reason
    restarted = _timeline(c).of(ev.Restarted)[0]
    assert n.time <= restarted.time
    assert "b" not in _timeline(c).of(ev.PlanChosen)[-1].rank_to_node, "the noticed node gets no ranks"
    assert all(not a.alive for a in cluster.actors.values() if a.node == "b"), "its warm workers are let go"
    assert result["status"] == "finished" and result["steps_completed"] == 8


def test_two_notices_in_one_poll_are_both_acted_on(tmp_path):
    # Found by the overlap chaos run: a short notice and, 0.1 s later, a long one for another
    # node were read in the same poll; the short one restarted the run and the long one was
    # dropped (never named, its node only skipped because Ray listed it as draining).
    def two_notices(group):
        notice("b", seconds_left=1)(group)
        notice("c", seconds_left=60)(group)

    spec = _spec(tmp_path, min_workers=2, every=2, restart_while_warming=False, emergency_margin_s=1.0)
    c, cluster, result = _run(spec, {"a": 2, "b": 2, "c": 2, "d": 2}, script=[(4, two_notices)], watch=True)
    got = {n.node_id: n.action for n in _timeline(c).of(ev.PreemptionNotice)}
    assert got == {"b": "restore_last_committed", "c": "excluded_from_placement"}, got
    assert not {"b", "c"} & set(_timeline(c).of(ev.PlanChosen)[-1].rank_to_node)
    assert result["status"] == "finished" and result["steps_completed"] == 8


def test_a_short_notice_during_an_emergency_checkpoint_restores_the_last_commit(tmp_path):
    # Found by the overlap chaos run: a 1 s notice that came while another node's emergency
    # checkpoint was under way was said to "join" it, though its node went long before
    # that collective save could finish.
    spec = _spec(tmp_path, min_workers=2, every=2, restart_while_warming=False, emergency_margin_s=1.0)
    c, cluster, result = _run(spec, {"a": 2, "b": 1, "c": 1, "d": 2},
                              script=[(3, notice("b", seconds_left=60)), (3, notice("c", seconds_left=0.5))],
                              watch=True)
    got = [(n.node_id, n.action) for n in _timeline(c).of(ev.PreemptionNotice)]
    assert ("c", "restore_last_committed") in got and ("b", "emergency_checkpoint") in got, got
    assert result["status"] == "finished" and result["steps_completed"] == 8


def test_a_spot_notice_while_the_attempt_restores_is_named_even_when_its_node_goes_first(tmp_path):
    # A notice that lands while the new attempt's ranks restore is kept: Ray forgets a
    # drained node once it is gone, so a notice read only at the attempt's first poll would
    # be lost when the node goes during the restore. The start gives up as the node goes
    # (its ranks there can never finish), and the kept notice is named before the next placement.
    def kill_then_notice_during_restore(group):
        kill_rank(1)(group)
        group.cluster.restore_s = 3.0
        group.cluster.during_restore = [notice("b", seconds_left=1.5), lose_node("b")]

    spec = _spec(tmp_path, min_workers=2, every=2, restart_while_warming=False)
    c, cluster, result = _run(spec, {"a": 2, "b": 2}, script=[(4, kill_then_notice_during_restore)], watch=True)
    (n,) = _timeline(c).of(ev.PreemptionNotice)
    lost = _timeline(c).of(ev.NodeLost)
    assert n.node_id == "b" and [e.node_id for e in lost] == ["b"], (n, lost)
    assert lost[0].time <= n.time <= _timeline(c).of(ev.PlanChosen)[-1].time, n
    assert set(_timeline(c).of(ev.PlanChosen)[-1].rank_to_node) == {"a"}
    assert result["status"] == "finished" and result["steps_completed"] == 8


def test_the_run_grows_back_when_capacity_returns(tmp_path):
    spec = _spec(tmp_path, workers=4, min_workers=2, max_workers=4, steps=40, every=2)
    c, cluster, result = _run(spec, {"a": 2}, script=[(3, add_node("b", 2))])
    assert c.transitions == START + [(S.RUNNING, S.PLACING), (S.PLACING, S.RUNNING), (S.RUNNING, S.FINISHED)]
    first, grown = _timeline(c).of(ev.PlanChosen)
    assert first.world_size == 2 and grown.world_size == 4
    restart = _timeline(c).of(ev.Restarted)[0]
    assert restart.reason.startswith("capacity returned: growing from 2 to 4") and restart.lost_steps == 0
    assert restart.reused_workers == 4, "both old workers and both warmed newcomers are reused"
    assert cluster.standbys_started == 2 and cluster.capacity_requests >= 1
    assert result["status"] == "finished" and result["world_size"] == 4


def test_the_same_failure_twice_with_no_progress_fails_the_run(tmp_path):
    # From a checkpoint (the live path re-runs the step the same way; the fake replays a
    # failure only from the step it fired after).
    spec = _spec(tmp_path, every=2, live_recovery=False)
    boom = "ValueError: a poison batch"
    c, cluster, result = _run(spec, {"a": 2, "b": 2}, script=[(3, raise_in_rank(1, boom, every_attempt=True))])
    # the restart from the step-2 checkpoint hits the same failure at the same step
    assert c.transitions == START + RESTART + [(S.RUNNING, S.RESTARTING), (S.RESTARTING, S.FAILED)]
    assert result["status"] == "failed"
    assert "the same failure repeated at step" in result["reason"]
    assert result["error_type"] == "WorkerError" and result["error_rank"] == 1
    assert result["error_node"] == "a" and result["error_step"] == 4, "where and when it failed"


def test_a_repeated_failure_with_progress_in_between_restarts_again(tmp_path):
    spec = _spec(tmp_path, every=2, max_failures=3)
    c, cluster, result = _run(spec, {"a": 2, "b": 2},
                              script=[(3, raise_in_rank(1, "boom")), (7, raise_in_rank(2, "boom"))])
    assert c.transitions == START + RESTART + RESTART + [(S.RUNNING, S.FINISHED)]
    assert [e.rank for e in _timeline(c).of(ev.WorkerFailed)] == [1, 2]
    assert result["status"] == "finished" and result["restarts"] == 2 and result["failures"] == 2


def test_the_failure_budget_ends_the_run(tmp_path):
    spec = _spec(tmp_path, every=1, max_failures=1, steps=12)
    c, cluster, result = _run(spec, {"a": 2, "b": 2}, script=[(2, kill_rank(0)), (5, kill_rank(1))])
    assert c.transitions == START + RESTART + [(S.RUNNING, S.RESTARTING), (S.RESTARTING, S.FAILED)]
    assert result["status"] == "failed" and "failure budget exhausted" in result["reason"]
    assert cluster.groups[-1].actors[0] in cluster.killed and all(not a.alive for a in cluster.groups[-1].actors)


def test_too_few_slots_waits_for_resources_then_gives_up(tmp_path):
    spec = _spec(tmp_path, min_workers=4, every=2, resource_wait_s=30)
    c, cluster, result = _run(spec, {"a": 2, "b": 2}, script=[(3, lose_node("b"))])
    assert c.transitions == START + [(S.RUNNING, S.RESTARTING), (S.RESTARTING, S.FAILED)]
    assert result["status"] == "failed" and "gave up waiting for resources after 30s" in result["reason"]
    assert cluster.capacity_requests >= 1, "the autoscaler was asked for the missing workers"


def _lose_then_return(node: str, after_s: float):
    """``node`` goes, and is back ``after_s`` later (seen by the next topology read)."""
    def act(group):
        lose_node(node, forever=False)(group)
        clock, start = group.cluster.clock, group.cluster.clock.time()
        original = group.cluster.topology

        def topology():
            if clock.time() - start > after_s:
                group.cluster.alive.add(node)
            return original()
        group.cluster.topology = topology
    return act


def test_resources_that_return_in_time_resume_the_run(tmp_path):
    spec = _spec(tmp_path, min_workers=4, every=2, resource_wait_s=30)
    c, cluster, result = _run(spec, {"a": 2, "b": 2}, script=[(3, _lose_then_return("b", 10))])
    assert c.transitions == START + RESTART + [(S.RUNNING, S.FINISHED)]
    assert _timeline(c).of(ev.Restarted)[0].world_size == 4
    assert result["status"] == "finished"
    (waited,) = _timeline(c).of(ev.CapacityWaited)
    # b is back 10 s after it went; the wait began once its loss was handled and ended at the
    # first look at the cluster after b returned (fake clock: only those polls take time).
    assert waited.outcome == "placed" and 10 - 2 <= waited.waited_s <= 10 + knob("RESOURCE_POLL_S")


def test_the_result_says_what_the_run_cost_and_where_the_money_went(tmp_path):
    """Every node at $1/s ("*": 3600 an hour): the run held 2 nodes but while b was gone."""
    spec = _spec(tmp_path, min_workers=4, every=2, resource_wait_s=30, prices={"*": 3600.0})
    c, cluster, result = _run(spec, {"a": 2, "b": 2}, script=[(3, _lose_then_return("b", 10))])
    cost = result["cost"]
    assert all(p == {"a": 3600.0, "b": 3600.0} for p in (e.node_prices for e in _timeline(c).of(ev.PlanChosen)))
    assert cost["total_usd"] == pytest.approx(sum(cost["parts_usd"].values()))
    assert cost["total_usd"] == pytest.approx(cost["node_hours"] * 3600.0)
    assert cost["parts_usd"]["capacity_wait"] > 0 and cost["parts_usd"]["training"] > 0
    per_step = {round(m["tokens_per_s"] * m["step_time_s"]) for m in c.metrics()}
    assert len(per_step) == 1 and cost["tokens"] == 8 * per_step.pop(), "each of the 8 steps counted once"
    assert cost["usd_per_1k_tokens"] == pytest.approx(cost["total_usd"] / (cost["tokens"] / 1000))


def test_a_stop_request_stops_at_a_step_boundary_with_a_checkpoint(tmp_path):
    spec = _spec(tmp_path, steps=50, every=100)
    holder = {}

    def stop(group):
        holder["c"].request_stop("stopped by the test")

    clock = FakeClock()
    cluster = FakeCluster({"a": 2, "b": 2}, clock, every_steps=100)
    cluster.at(4, stop)
    holder["c"] = c = Controller(spec, cluster=cluster, clock=clock)
    result = c.run()
    assert c.transitions == START + [(S.RUNNING, S.STOPPED)]
    assert result["status"] == "stopped" and result["reason"] == "stopped by the test"
    assert _timeline(c).of(ev.CheckpointCommitted)[0].reason == "stop"
    assert _timeline(c).of(ev.RunStopped)[0].reason == "stopped by the test"


def test_an_error_inside_the_controller_fails_the_run_with_its_reason(tmp_path):
    spec = _spec(tmp_path)
    clock = FakeClock()
    cluster = FakeCluster({"a": 1}, clock)  # 4 workers asked, 1 slot: placement cannot succeed
    c = Controller(spec, cluster=cluster, clock=clock)
    result = c.run()
    assert c.transitions == [(S.INITIALIZING, S.PLACING), (S.PLACING, S.FAILED)]
    assert result["status"] == "failed" and result["error_type"] == "PlacementError"


def test_a_collective_mismatch_that_hangs_the_same_step_again_fails_the_run_with_the_diagnosis(tmp_path):
    from rayflex.worker.status import CollectiveEntry, FlightRecord

    def mismatch(group):
        """Rank 2 broadcasts where the others all-reduce, at the step the run hangs in."""
        def at(rank, op):
            e = CollectiveEntry(group="dp", members=(0, 1, 2, 3), seq=7, op=op, sizes=((1,),), dtypes=("float",),
                                completed=op == "broadcast", started=1.0, step=group.step + 1)
            return FlightRecord(rank=rank, step=group.step, phase="collective", entries=(e,))
        return {r: at(r, "broadcast" if r == 2 else "all_reduce") for r in range(4)}, set()

    spec = _spec(tmp_path, every=2, max_failures=5)
    clock = FakeClock()
    cluster = FakeCluster({"a": 2, "b": 2}, clock, every_steps=2)
    cluster.hang_at_step, cluster.flight = 5, mismatch
    controller = Controller(spec, cluster=cluster, clock=clock)
    result = controller.run()
    diagnosed = _timeline(controller).of(ev.HangDiagnosed)
    assert len(diagnosed) == 2, "diagnosed at the first hang and again after the restart"
    assert diagnosed[0].diagnosis == "op_mismatch" and diagnosed[0].ranks == [2] and diagnosed[0].program_level
    assert diagnosed[0].verdict == "rank 2 called broadcast #7 of the dp group (ranks 0-3) where ranks 0, 1, 3 called all_reduce"
    assert len(_timeline(controller).of(ev.Restarted)) == 1, "one restart, then the policy stops looping"
    assert result["status"] == "failed"
    assert "a bug in the training program" in result["reason"] and diagnosed[0].verdict in result["reason"]


@pytest.mark.parametrize("setting, drawn", [(None, True), ("1", True), ("0", False)])
def test_a_run_draws_its_report_when_it_ends_unless_told_not_to(tmp_path, monkeypatch, setting, drawn):
    drawn_for = []
    monkeypatch.setattr("rayflex.telemetry.report.write_report", lambda run_dir, *a, **k: drawn_for.append(run_dir))
    if setting is None:
        monkeypatch.delenv("RAYFLEX_RUN_REPORT", raising=False)
    else:
        monkeypatch.setenv("RAYFLEX_RUN_REPORT", setting)
    spec = _spec(tmp_path)
    _, _, result = _run(spec, {"a": 2, "b": 2})
    assert result["status"] == "finished"
    assert drawn_for == ([spec.run.run_dir] if drawn else [])


def test_an_unreadable_report_setting_fails_before_the_run_starts(tmp_path, monkeypatch):
    from rayflex.models import GPTConfig, gpt

    monkeypatch.setenv("RAYFLEX_RUN_REPORT", "sometimes")
    trainer = rf.Trainer(model=gpt(GPTConfig(vocab_size=16, seq_len=8, d_model=8, n_layers=1, n_heads=1)),
                         data=rf.DataConfig(uri="file:///nowhere", seq_len=8, global_batch=8),
                         run=rf.RunConfig(name="r", storage=f"file://{tmp_path}/runs"))
    with pytest.raises(ValueError, match="RAYFLEX_RUN_REPORT='sometimes'"):
        trainer.preflight()
    assert not (tmp_path / "runs").exists()



def test_a_node_ray_declares_dead_while_the_restart_starts_is_left_at_once(tmp_path):
    # A machine that vanishes without a clean shutdown is declared dead by Ray's health
    # check seconds after its ranks stopped: the survivors' collective breaks first, the
    # restart reuses the ranks there (still listed) and fails as they turn out dead, and the
    # next start, planned while Ray still lists the node, puts new ranks on it that can never
    # start. Seen on the link bed: that start waited out the whole setup timeout (300 s).
    # It must fail at its next look at Ray's node list and restart on what is left.
    spec = _spec(tmp_path, min_workers=2, every=2, restart_while_warming=False)
    declared: list[float] = []
    attempts: list[float] = []  # when each attempt's workers were asked for (the fake clock)

    def b_declared_dead(group):
        declared.append(group.cluster.clock.time())
        lose_node("b")(group)

    def b_vanishes(group):
        raise_in_rank(0, "RuntimeError: gloo: Connection closed by peer")(group)
        cluster, start_group = group.cluster, group.cluster.worker_group

        def its_ranks_are_gone(g):
            raise SetupFailed("reconfigure", {r: "ActorUnavailableError: failed to connect"
                                              for r, a in enumerate(g.actors) if a.node == "b"}, [], 60.0)

        def worker_group(plan, members):
            attempts.append(cluster.clock.time())
            return start_group(plan, members)
        cluster.worker_group = worker_group
        cluster.setup_failures = [its_ranks_are_gone]
        cluster.restore_s = 4.0  # the start after that restores for 4 s, and b is declared dead 2 s in
        cluster.during_restore = [lambda g: None, b_declared_dead]

    c, cluster, result = _run(spec, {"a": 2, "b": 2}, script=[(4, b_vanishes)])
    assert [e.node_id for e in _timeline(c).of(ev.NodeLost)] == ["b"] and declared
    # The start that waited on b gave up at its next look at the node list (about a second),
    # not after the setup timeout; then the run went on where it could.
    next_attempt = min(t for t in attempts if t >= declared[0])
    assert next_attempt - declared[0] <= 1.5, (declared, attempts)
    assert set(_timeline(c).of(ev.PlanChosen)[-1].rank_to_node) == {"a"}
    assert result["status"] == "finished" and result["steps_completed"] == 8 and result["world_size"] == 2


@pytest.mark.parametrize("declared", ["before the restart decides", "before the next start plans"])
def test_a_vanished_node_is_named_when_a_survivor_raised_first_and_its_ranks_were_silent(tmp_path, declared):
    # Seen on the link bed: a node killed outright breaks the survivors' collective first (a
    # rank on the other node raises), its own ranks are silent while the others leave (named
    # as a hang), and Ray declares it dead seconds later. The timeline said only that rank 0
    # failed: the lost node was never named.
    spec = _spec(tmp_path, min_workers=2, every=2, restart_while_warming=False)

    def b_vanishes(group):
        raise_in_rank(0, "RuntimeError: gloo: Connection closed by peer")(group)
        freeze_rank(2)(group)
        freeze_rank(3)(group)
        cluster = group.cluster
        if declared == "before the restart decides":
            cluster.after_release = [lose_node("b")]
            return
        topology = cluster.topology  # the restart's decision reads the topology, then the start plans

        def b_declared_after_the_decision():
            view = topology()
            if cluster.releases and "b" in cluster.alive:
                lose_node("b")(group)
            return view
        cluster.topology = b_declared_after_the_decision

    c, cluster, result = _run(spec, {"a": 2, "b": 2}, script=[(4, b_vanishes)])
    timeline = _timeline(c)
    assert [e.rank for e in timeline.of(ev.WorkerFailed)] == [0]
    assert [(e.node_id, e.ranks) for e in timeline.of(ev.NodeLost)] == [("b", [2, 3])]
    assert set(timeline.of(ev.PlanChosen)[-1].rank_to_node) == {"a"}
    assert result["status"] == "finished" and result["steps_completed"] == 8 and result["world_size"] == 2
    if declared == "before the next start plans":  # the size the restart decided no longer fit: decided again
        assert "4 workers no longer fit in the 2 usable slots" in timeline.of(ev.Restarted)[-1].reason


def test_a_warm_restart_whose_node_goes_before_it_plans_is_decided_again(tmp_path):
    # Seen on the link bed (CI, 8dd31e5): a rank on node a raised (its collective broken by
    # b's loss), rank 2 on b died as the survivors left, and the warm restart chose to go on
    # at once with the workers up (a's two and b's rank 3). Ray declared b dead before the
    # start planned: the workers up no longer formed a mesh, the fallback (the full 4) did
    # not fit the 2 slots left, and the run failed with a PlacementError.
    spec = _spec(tmp_path, min_workers=2, every=2, restart_while_warming=True)

    def b_goes_during_the_restart(group):
        raise_in_rank(1, "RuntimeError: gloo: Connection closed by peer")(group)
        cluster = group.cluster
        cluster.die_while_leaving = (2,)
        topology, reads = cluster.topology, []

        def b_declared_once_the_warm_restart_was_decided():
            # The restart's decision reads the topology, then warming the newcomers does;
            # b goes after that read: the next one is the start's plan.
            view = topology()
            if cluster.releases and "b" in cluster.alive:
                reads.append(1)
                if len(reads) == 2:
                    lose_node("b")(group)
            return view
        cluster.topology = b_declared_once_the_warm_restart_was_decided

    c, cluster, result = _run(spec, {"a": 2, "b": 2}, script=[(4, b_goes_during_the_restart)])
    timeline = _timeline(c)
    assert result["status"] == "finished" and result["world_size"] == 2, result  # was: failed, PlacementError
    assert set(timeline.of(ev.PlanChosen)[-1].rank_to_node) == {"a"}
    reason = timeline.of(ev.Restarted)[-1].reason
    assert "growing to 4 when 2 more are warm; 4 workers no longer fit in the 2 usable slots" in reason, reason


def test_a_vanished_node_is_named_when_ray_declares_it_dead_only_after_the_next_attempt_started(tmp_path):
    # Seen on the link bed (CI, 1059bd6): the killed node's slots were gone from Ray's
    # resources when the restart planned (it ran on the other node alone), but Ray still
    # listed the node alive through the restart; it declared it dead while the next attempt
    # trained. Nothing looked then, and the node was never named.
    spec = _spec(tmp_path, min_workers=2, every=2, restart_while_warming=False)

    def b_vanishes(group):
        raise_in_rank(0, "RuntimeError: gloo: Connection reset by peer")(group)
        freeze_rank(2)(group)
        freeze_rank(3)(group)
        group.cluster.nodes.pop("b")  # no slots there any more; Ray still lists it alive
        group.cluster.at(6, lose_node("b"))  # ... until the next attempt has trained a while

    c, cluster, result = _run(spec, {"a": 2, "b": 2}, script=[(4, b_vanishes)])
    timeline = _timeline(c)
    lost = timeline.of(ev.NodeLost)
    assert [(e.node_id, e.ranks) for e in lost] == [("b", [2, 3])]
    restarted_at = timeline.of(ev.Restarted)[-1].time
    assert lost[0].time > restarted_at, "named while the next attempt ran"
    assert set(timeline.of(ev.PlanChosen)[-1].rank_to_node) == {"a"}
    assert result["status"] == "finished" and result["steps_completed"] == 8 and result["world_size"] == 2


def test_a_node_the_next_attempt_runs_on_or_one_with_a_notice_is_not_watched(tmp_path):
    # A survivor node of the failed attempt that goes later is the new attempt's fault (its
    # detector names it), not a late sighting of the old one's: it is named once, by that.
    spec = _spec(tmp_path, min_workers=2, every=2, restart_while_warming=False)

    def a_rank_raises_then_b_goes_in_the_next_attempt(group):
        raise_in_rank(0, "RuntimeError: injected")(group)
        group.cluster.at(6, lose_node("b"))

    c, cluster, result = _run(spec, {"a": 2, "b": 2, "c": 2},
                              script=[(4, a_rank_raises_then_b_goes_in_the_next_attempt)])
    timeline = _timeline(c)
    assert len([e for e in timeline.of(ev.NodeLost) if e.node_id == "b"]) == 1
    assert result["status"] == "finished"


def test_a_vanished_node_charges_the_failure_budget_once(tmp_path):
    # The node's loss is seen first as a survivor's broken collective (charged: a failure);
    # the restart plans on the node while Ray still lists it, and its start fails when Ray
    # declares it dead. That is the same loss seen late: with max_failures=1 the run goes on.
    spec = _spec(tmp_path, min_workers=2, every=2, restart_while_warming=False, max_failures=1)

    def b_vanishes(group):
        raise_in_rank(0, "RuntimeError: gloo: Connection closed by peer")(group)
        freeze_rank(2)(group)
        freeze_rank(3)(group)
        group.cluster.restore_s = 3.0  # the restart's start restores for 3 s; b is declared dead 2 s in
        group.cluster.during_restore = [lambda g: None, lose_node("b")]

    c, cluster, result = _run(spec, {"a": 2, "b": 2}, script=[(4, b_vanishes)])
    timeline = _timeline(c)
    assert [(e.node_id, e.ranks) for e in timeline.of(ev.NodeLost)] == [("b", [2, 3])]
    assert c.ctx.policies.failure.failures == 1
    assert "the loss being recovered from, not charged again" in timeline.of(ev.Restarted)[-1].reason
    assert result["status"] == "finished" and result["steps_completed"] == 8 and result["world_size"] == 2


def test_a_start_that_fails_on_a_node_the_run_had_not_used_is_charged(tmp_path):
    # A node that joined during the restart and died before its ranks started is a new
    # failure, not the one being recovered from.
    spec = _spec(tmp_path, workers=4, min_workers=2, every=2, restart_while_warming=False, max_failures=1)

    def a_rank_dies_and_c_joins(group):
        kill_rank(3)(group)
        group.cluster.nodes["b"] = 1
        add_node("c", 1)(group)
        group.cluster.restore_s = 2.0
        group.cluster.during_restore = [lose_node("c")]

    c, cluster, result = _run(spec, {"a": 2, "b": 2}, script=[(4, a_rank_dies_and_c_joins)])
    assert c.ctx.policies.failure.failures == 2
    assert result["status"] == "failed" and "failure budget exhausted" in result["reason"]


def test_a_resumed_run_names_no_node_of_the_cluster_its_earlier_job_ran_on(tmp_path):
    # The timeline of a resumed run holds the earlier job's attempts, on nodes of a cluster
    # that is gone: nothing of it is a node this run lost.
    first_c, _, first = _run(_spec(tmp_path, steps=4, every=2), {"a": 2, "b": 2})
    assert first["status"] == "finished"

    def rank_dies(group):
        kill_rank(1)(group)
    c, cluster, result = _run(_spec(tmp_path, steps=8, every=2), {"c": 2, "d": 2}, script=[(6, rank_dies)])
    assert result["status"] == "finished" and result["steps_completed"] == 8
    assert _timeline(c).of(ev.NodeLost) == [], _timeline(c).of(ev.NodeLost)


class QueuedFailures(FailurePolicy):
    """A failure policy that answers each failure with the next queued decision."""

    def __init__(self, spec, decisions):
        super().__init__(spec)
        self.queue, self.asked = list(decisions), []

    def decide(self, **kw):
        self.asked.append(kw)
        return self.queue.pop(0)


@pytest.mark.parametrize("decision", [Restart(world_size=2, reason="queued: restart at 2"),
                                      Fail("queued: give up")])
def test_the_controller_acts_on_what_its_injected_failure_policy_decides(tmp_path, decision):
    spec = _spec(tmp_path, min_workers=2, every=2)
    failures = QueuedFailures(spec, [decision])
    policies = dataclasses.replace(Policies.for_spec(spec), failure=failures)
    c, cluster, result = _run(spec, {"a": 2, "b": 2}, script=[(3, kill_rank(1))], policies=policies)
    assert [a["kind"] for a in failures.asked] == ["failure"] and failures.asked[0]["usable_slots"] == 4
    if isinstance(decision, Restart):  # 4 slots were usable: the size is the policy's, not the cluster's
        (restart,) = _timeline(c).of(ev.Restarted)
        assert (restart.world_size, restart.reason) == (2, "queued: restart at 2")
        assert result["status"] == "finished" and result["world_size"] == 2
    else:
        assert _timeline(c).of(ev.Restarted) == []
        assert result["status"] == "failed" and result["reason"] == "queued: give up"



def test_a_healthy_node_of_the_failed_attempt_lost_while_the_restart_starts_is_charged(tmp_path):
    # The fault struck node a (a killed process); node b was healthy and its ranks survived.
    # b going while the restart starts is a second failure, not the first one seen late.
    spec = _spec(tmp_path, min_workers=2, every=2, restart_while_warming=False, max_failures=1)

    def a_rank_dies_then_b_goes_during_the_restore(group):
        kill_rank(1)(group)
        group.cluster.restore_s = 3.0
        group.cluster.during_restore = [lambda g: None, lose_node("b")]

    c, cluster, result = _run(spec, {"a": 2, "b": 2}, script=[(4, a_rank_dies_then_b_goes_during_the_restore)])
    assert c.ctx.policies.failure.failures == 2
    assert result["status"] == "failed" and "failure budget exhausted" in result["reason"]


# ----------------------------------------------------------------- live recovery
HSDP = rf.ParallelConfig(dp_shard=2)  # 4 ranks: 2 replicas x 2 shards (ranks 0, 2 hold shard 0; 1, 3 shard 1)


def _recovery(c):
    return _timeline(c).of(ev.RecoveryChosen)


def test_a_killed_rank_whose_shard_has_a_live_replica_loses_no_step(tmp_path):
    spec = _spec(tmp_path, every=4, parallel=HSDP, restart_while_warming=False)
    c, cluster, result = _run(spec, {"a": 2, "b": 2}, script=[(3, kill_rank(1))])
    chosen, = _recovery(c)
    assert chosen.source == "live_peers" and chosen.step == 3, chosen
    assert chosen.holders == [0, 3], "one survivor per shard: shard 1's only copy left is rank 3's"
    # Only they were asked for a snapshot: rank 2 holds shard 0 again, and dropped its state.
    assert cluster.live_asked == [(0, 3)] and cluster.live_dropped == [(2,)]
    live = cluster.live_restores[1]
    assert live["step"] == 3 and sorted(live["infos"]) == [0, 3] and live["files"] == {0: "files-0", 3: "files-3"}
    assert live["save"], "past the last commit (none yet): the ranks save it first thing"
    restart, = _timeline(c).of(ev.Restarted)
    assert restart.lost_steps == 0 and restart.from_step == 3
    loaded = _timeline(c).of(ev.CheckpointLoaded)
    assert loaded[-1].uri == "live peers" and loaded[-1].step == 3
    assert [m["step"] for m in c.metrics()] == list(range(1, 9)), "every step once"
    assert result["status"] == "finished"
    # Not committed: the restored step is not claimed as a checkpoint the run could fall back to.
    assert c.ctx.ledger.committed_step != 3


def test_a_failure_that_ends_the_run_records_no_recovery(tmp_path):
    # The survivors hold every shard, but the failure budget is spent: nothing is recovered,
    # and no event says where the state would have come from.
    spec = _spec(tmp_path, every=4, parallel=HSDP, restart_while_warming=False, max_failures=0)
    c, cluster, result = _run(spec, {"a": 2, "b": 2}, script=[(3, kill_rank(1))])
    assert result["status"] == "failed"
    assert _recovery(c) == [] and not _timeline(c).of(ev.Restarted)


def test_a_shard_that_lost_every_copy_falls_back_to_the_checkpoint_and_says_why(tmp_path):
    spec = _spec(tmp_path, every=2, parallel=HSDP, restart_while_warming=False)

    def both_replicas(group):
        kill_rank(1)(group)
        kill_rank(3)(group)
    c, cluster, result = _run(spec, {"a": 2, "b": 2}, script=[(3, both_replicas)])
    chosen, = _recovery(c)
    assert chosen.source == "checkpoint" and "every copy of FSDP shard 1 was lost with ranks 1, 3" in chosen.reason
    assert cluster.live_restores[1] is None and cluster.releases[-1][0] == (0, 2)
    assert _timeline(c).of(ev.Restarted)[0].from_step == 2, "from the checkpoint of step 2"
    assert result["status"] == "finished"


def test_a_plain_fsdp_mesh_says_its_only_copy_went_with_the_rank(tmp_path):
    c, cluster, result = _run(_spec(tmp_path, every=2, restart_while_warming=False), {"a": 2, "b": 2},
                              script=[(3, kill_rank(2))])
    chosen, = _recovery(c)
    assert chosen.source == "checkpoint" and "rank 2 held the only copy" in chosen.reason
    assert "dp_replicate=1" in chosen.reason, "the reason names what would have kept a copy"


def test_a_rank_that_raised_still_hands_over_its_state(tmp_path):
    # No rank died: every shard is alive, even without replicas.
    c, cluster, result = _run(_spec(tmp_path, every=4, restart_while_warming=False), {"a": 2, "b": 2},
                              script=[(3, raise_in_rank(1, "ValueError: transient"))])
    chosen, = _recovery(c)
    assert chosen.source == "live_peers" and chosen.holders == [0, 1, 2, 3]
    assert _timeline(c).of(ev.Restarted)[0].lost_steps == 0
    assert result["status"] == "finished" and [m["step"] for m in c.metrics()] == list(range(1, 9))


def test_a_failed_snapshot_falls_back_naming_the_rank(tmp_path):
    spec = _spec(tmp_path, every=2, parallel=HSDP, restart_while_warming=False)

    def kill_and_break(group):
        group.cluster.snapshot_errors = {3: "snapshot failed: MemoryError"}
        kill_rank(1)(group)
    c, cluster, result = _run(spec, {"a": 2, "b": 2}, script=[(3, kill_and_break)])
    chosen, = _recovery(c)
    assert chosen.source == "checkpoint"
    assert "every copy of FSDP shard 1 was lost" in chosen.reason and "rank 3: snapshot failed: MemoryError" in chosen.reason
    assert cluster.live_asked == [(0, 3), (2,)], "a holder failed: the other survivor was asked too"
    assert cluster.live_dropped == []


def test_live_recovery_off_asks_no_survivor_for_its_state(tmp_path):
    spec = _spec(tmp_path, every=2, parallel=HSDP, restart_while_warming=False, live_recovery=False)
    c, cluster, result = _run(spec, {"a": 2, "b": 2}, script=[(3, kill_rank(1))])
    assert not _recovery(c) and cluster.live_restores[1] is None
    assert _timeline(c).of(ev.Restarted)[0].from_step == 2


def _straggler_run(tmp_path, script, steps=400):
    """4 ranks on 2 of 3 two-slot nodes, one step per 0.2 s poll; ``script`` slows one."""
    spec = _spec(tmp_path, workers=4, min_workers=2, steps=steps, every=50)
    return _run(spec, {"a": 2, "b": 2, "c": 2}, script=script)


def test_a_node_that_stays_slow_is_left_out_when_that_pays(tmp_path):
    c, cluster, result = _straggler_run(tmp_path, [(10, slow_node("b", 0.5))])
    detected = _timeline(c).of(ev.StragglerDetected)
    assert detected and {e.node_id for e in detected} == {"b"}
    (decided,) = _timeline(c).of(ev.StragglerDecided)
    assert decided.action == "evict_node" and decided.node_id == "b" and decided.gain_s > 0, decided
    # Weighed once it had stayed slow STRAGGLER_CONFIRM_S after it was named, on its numbers:
    assert decided.time - detected[0].time >= knob("STRAGGLER_CONFIRM_S")
    assert decided.slow_step_s == pytest.approx(0.6) and decided.healthy_step_s == pytest.approx(0.1)
    assert decided.to_world == 4 and decided.after_step_s == pytest.approx(0.1)  # a and c have 4 slots
    (restart,) = _timeline(c).of(ev.Restarted)
    assert restart.lost_steps == 0 and "straggler" in restart.reason and restart.world_size == 4
    assert "b" not in _timeline(c).of(ev.PlanChosen)[-1].rank_to_node
    assert result["status"] == "finished" and result["steps_completed"] == 400
    assert result["failures"] == 0 and c.ctx.policies.failure.failures == 0, "an eviction charges no failure"


def test_a_node_slow_for_a_while_is_named_but_not_left_out(tmp_path):
    # Named ~20 s (100 polls) after it slowed; healed before the policy weighs it 10 s later.
    c, cluster, result = _straggler_run(tmp_path, [(10, slow_node("b", 0.5)), (125, slow_node("b", 0.0))])
    assert {e.node_id for e in _timeline(c).of(ev.StragglerDetected)} == {"b"}
    decided = _timeline(c).of(ev.StragglerDecided)
    assert decided and all(d.action == "keep" for d in decided), decided
    assert "no longer the straggler" in decided[0].reason and decided[0].slow_step_s == pytest.approx(0.1)
    assert not _timeline(c).of(ev.Restarted) and result["status"] == "finished"

