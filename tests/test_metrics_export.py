"""Run metrics exported through ray.util.metrics: the mapping, without a cluster."""

import pytest

from rayflex.telemetry import events as ev
from rayflex.telemetry.metrics_export import (METRICS, MetricsExporter, Sample, samples_for_event,
                                              samples_for_metrics)


class Recorder:
    """Stands in for ray.util.metrics.Gauge/Counter: records set()/inc() calls."""

    calls: list = []

    def __init__(self, defn):
        self.defn = defn

    def set(self, value, tags):
        Recorder.calls.append((self.defn.name, "set", value, tags))

    def inc(self, value, tags):
        Recorder.calls.append((self.defn.name, "inc", value, tags))


@pytest.fixture
def exporter():
    Recorder.calls = []
    return MetricsExporter("demo", factory=Recorder)


def test_a_metrics_line_sets_step_time_and_throughput(exporter):
    exporter.on_metrics({"step": 7, "loss": 2.5, "step_time_s": 0.5, "tokens_per_s": 2048.0, "world_size": 4})
    got = {(name, op): (value, tags) for name, op, value, tags in Recorder.calls}
    assert got[("rayflex_step_time_seconds", "set")] == (0.5, {"run": "demo"})
    assert got[("rayflex_tokens_per_second", "set")] == (2048.0, {"run": "demo"})
    assert got[("rayflex_step", "set")][0] == 7
    assert got[("rayflex_tokens", "inc")][0] == pytest.approx(1024.0)


def test_events_count_checkpoints_restarts_failures_preemptions(exporter):
    for event in (ev.CheckpointCommitted(step=10, blocked_s=0.25), ev.CheckpointCommitted(step=20, blocked_s=0.5),
                  ev.PreemptionNotice(node_id="n1"), ev.NodeLost(node_id="n1"),
                  ev.Restarted(world_size=2, from_step=20), {"kind": "worker_died", "rank": 1},
                  ev.RunFinished(step=30)):
        exporter.on_event(event)
    incs: dict = {}
    for name, op, value, tags in Recorder.calls:
        if op == "inc":
            key = (name, tags.get("kind"))
            incs[key] = incs.get(key, 0) + value
    assert incs[("rayflex_checkpoints", None)] == 2
    assert incs[("rayflex_checkpoint_blocked_seconds_sum", None)] == pytest.approx(0.75)
    assert incs[("rayflex_restarts", None)] == 1
    assert incs[("rayflex_preemptions", None)] == 1
    assert incs[("rayflex_failures", "node_lost")] == 1 and incs[("rayflex_failures", "worker_died")] == 1
    assert ("rayflex_checkpoint_blocked_seconds", "set", 0.5, {"run": "demo"}) in Recorder.calls
    assert ("rayflex_world_size", "set", 2.0, {"run": "demo"}) in Recorder.calls
    assert all(tags["run"] == "demo" for *_, tags in Recorder.calls)


def test_every_sample_names_a_declared_metric_with_declared_tags():
    samples = samples_for_metrics({"step": 1, "loss": 1.0, "step_time_s": 1.0, "tokens_per_s": 1.0, "world_size": 1})
    for kind in ("checkpoint_committed", "restarted", "worker_failed", "preemption_notice", "plan_chosen"):
        samples += samples_for_event({"kind": kind, "world_size": 2, "blocked_s": 0.1})
    for s in samples:
        assert s.metric in METRICS
        assert {"run", *dict(s.tags)} == set(METRICS[s.metric].tag_keys)


def test_a_stored_event_counts_as_its_typed_event():
    for event in (ev.CheckpointCommitted(step=10, blocked_s=0.25), ev.Restarted(world_size=2, from_step=20),
                  ev.WorkerFailed(rank=1), ev.HangDetected(ranks=[0]), ev.PlanChosen(world_size=4),
                  ev.WorkersStarted(world_size=4), ev.PreemptionNotice(node_id="n1"), ev.RunStarted()):
        assert samples_for_event(event.to_dict()) == samples_for_event(event)
    failure = samples_for_event(ev.WorkerFailed(rank=1))
    assert failure == [Sample("rayflex_failures", 1.0, (("kind", "worker_failed"),))]
    assert type(dict(failure[0].tags)["kind"]) is str  # a plain tag value for Ray


def test_an_unknown_event_kind_counts_nothing(exporter):
    assert samples_for_event({"kind": "elastic_resize_planned", "time": 1.0, "world_size": 8}) == []
    exporter.on_event({"kind": "elastic_resize_planned", "world_size": 8})
    assert Recorder.calls == [] and not exporter._broken


def test_a_broken_backend_never_reaches_the_run():
    def boom(defn):
        raise RuntimeError("metrics agent down")

    exporter = MetricsExporter("demo", factory=boom)
    exporter.on_metrics({"step": 1, "step_time_s": 0.1})  # logs once, then stays quiet
    exporter.on_event({"kind": "restarted"})


def test_the_real_ray_metric_objects_accept_the_samples():
    """ray.util.metrics Gauge/Counter build and record without a cluster (a no-op there)."""
    exporter = MetricsExporter("demo")
    exporter.on_metrics({"step": 1, "loss": 2.0, "step_time_s": 0.5, "tokens_per_s": 100.0, "world_size": 2})
    exporter.on_event({"kind": "checkpoint_committed", "blocked_s": 0.2})
    exporter.on_event({"kind": "worker_died"})
    assert not exporter._broken
