"""Spot notices mid-run: an emergency checkpoint at the current step commits before the
deadline, the node is left, and the run finishes losing no step; a notice too short for a
checkpoint falls back to the last committed one and says why."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

import rayflex as rf
from rayflex.testing.reference import single_process_losses

from conftest import loopback_cluster, run_events, small_gpt, wait_until_running

pytestmark = pytest.mark.cluster
# Long enough that a notice is acted on mid-run even when steps are quick: on an idle
# machine a step takes ~0.04 s, and 40 steps were over before a metadata notice was seen
# (the notice agents, an actor per node, start with the attempt and then poll).
STEPS = 120
# A drain is read by the controller itself, within NOTICE_POLL_S (0.5 s) of the drain: it
# was acted on at step 7-24 (0.04 s steps), and every step after the restart only pads the run.
DRAIN_STEPS = 72


def _trainer(dataset_uri, tmp_path, name, *, every=100, steps=STEPS, prices=None, **elastic):
    return rf.Trainer(model=small_gpt(n_layers=2), data=rf.DataConfig(uri=dataset_uri, seq_len=32, global_batch=12),
                      run=rf.RunConfig(name=name, storage=f"file://{tmp_path}/runs", steps=steps),
                      scaling=rf.ScalingConfig(num_workers=2, min_workers=1, price_per_hour=prices or {}),
                      checkpoint=rf.CheckpointConfig(every_steps=every, keep=2),
                      elastic=rf.ElasticConfig(**elastic))


def _worker_node(status, head_id):
    return next(w["node_id"] for w in status["workers"] if w["node_id"] != head_id)


def _drain(cluster, node_id, seconds):
    """What Ray's autoscaler does for a spot termination (and `ray drain-node` by hand)."""
    import ray
    from ray.core.generated import autoscaler_pb2

    gcs = ray._raylet.GcsClient(address=cluster.address)
    ok, why = gcs.drain_node(node_id, autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
                             "spot termination (test)", int((time.time() + seconds) * 1000))
    assert ok, why


def preempt_and_wait(cluster, node_id, notice_s, handle, timeout_s):
    """A spot notice for ``node_id``, the node removed at its deadline (the cloud takes it),
    and the run's result; returns (result, deadline)."""
    deadline = time.time() + notice_s
    _drain(cluster, node_id, notice_s)
    victim = next(n for n in cluster.list_all_nodes() if n.node_id == node_id)
    timer = threading.Timer(max(0.0, deadline - time.time()), cluster.remove_node, args=(victim,))
    timer.start()
    try:
        return handle.wait(timeout_s=timeout_s), deadline
    finally:
        timer.join()


def _assert_emergency(events, node_id, result, trainer, notice_time, deadline):
    steps = trainer.spec.run.steps
    notice = next(e for e in events if e["kind"] == "preemption_notice")
    assert notice["node_id"] == node_id and notice["action"] == "emergency_checkpoint"
    # Acted on early in its window (the controller checks for notices every NOTICE_POLL_S):
    # the rest of the window is the emergency checkpoint's.
    window_s = deadline - notice_time
    assert notice["time"] - notice_time < window_s / 3, f"the notice is seen in the first third of its {window_s:.0f} s"
    emergency = next(e for e in events if e["kind"] == "checkpoint_committed" and e["reason"] == "emergency")
    assert emergency["time"] < deadline, "the emergency checkpoint commits before the deadline"
    restarted = next(e for e in events if e["kind"] == "restarted")
    assert restarted["lost_steps"] == 0 and restarted["from_step"] == emergency["step"]
    after = next(e for e in events if e["kind"] == "plan_chosen" and e["time"] > restarted["time"] - 1)
    assert node_id not in after["rank_to_node"], "the preempted node is left"
    assert result.status == "finished" and result.steps_completed == steps
    assert [m["step"] for m in result.metrics] == list(range(1, steps + 1))
    assert result.final_loss == pytest.approx(single_process_losses(trainer.spec, steps)[-1], rel=1e-4)


@pytest.fixture(autouse=True)
def quick_emergency_estimate(monkeypatch):
    """Before a run has timed a save, an emergency checkpoint is assumed to take 10 s; a
    3 s guess lets a 10 s notice (not 20 s) be long enough, the drain test's wait for the
    deadline with it. Saves here take well under a second."""
    monkeypatch.setenv("RAYFLEX_EMERGENCY_CHECKPOINT_DEFAULT_S", "3")


@pytest.fixture(scope="module")
def _cluster():
    # One slot per node: two workers on two nodes, and a third node to move to.
    with loopback_cluster([{"num_cpus": 1}, {"num_cpus": 1}, {"num_cpus": 1}]) as c:
        yield c


@pytest.fixture
def three_nodes(_cluster):
    """A head and two live worker nodes: a node an earlier test preempted (removed, or
    left draining) is replaced before the next test, which is quicker than a new cluster
    per test (and the module's last preempted node is never replaced, only shut down)."""
    import ray

    head = _cluster.head_node
    alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    draining = set(ray._private.state.state.get_draining_nodes())
    for node in list(_cluster.worker_nodes):
        if node.node_id not in alive or node.node_id in draining:  # only the preempted one
            _cluster.remove_node(node)
    while len(_cluster.worker_nodes) < 2:
        _cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1")
    _cluster.wait_for_nodes()
    assert _cluster.head_node is head
    return _cluster


def test_drain_notice_triggers_emergency_checkpoint(three_nodes, dataset_uri, tmp_path):
    import ray

    head = ray.get_runtime_context().get_node_id()
    trainer = _trainer(dataset_uri, tmp_path, "drain", steps=DRAIN_STEPS, prices={"*": 3600.0})
    handle = trainer.submit()
    node = _worker_node(wait_until_running(handle, 4), head)
    noticed_at = time.time()
    result, deadline = preempt_and_wait(three_nodes, node, 10, handle, timeout_s=240)
    events = run_events(tmp_path, "drain")
    _assert_emergency(events, node, result, trainer, noticed_at, deadline)
    _assert_cost_is_node_seconds(json.loads((tmp_path / "runs" / "drain" / "result.json").read_text())["cost"],
                                 events, dollars_per_node_s=1.0)


def _assert_cost_is_node_seconds(cost, events, dollars_per_node_s):
    """The run's cost by category sums to what its nodes cost while it held them: each
    placement's nodes from its start (the session's, for the first) to the next placement's
    start, or their loss, or the run's end."""
    t0 = next(e["time"] for e in events if e["kind"] == "run_started")
    end = next(e["time"] for e in events if e["kind"] == "run_finished")
    plans = [e for e in events if e["kind"] == "plan_chosen"]
    starts = [t0] + [e["time"] - e["setup_s"] for e in events if e["kind"] == "workers_started"][1:]
    lost = {e["node_id"]: e["time"] for e in events if e["kind"] == "node_lost"}
    node_s = sum(min(until, lost.get(n, end)) - since
                 for plan, since, until in zip(plans, starts, starts[1:] + [end]) for n in set(plan["rank_to_node"]))
    # A preemption and a restart at once with the ranks that are up; and, where the run is
    # still going once the spare node's worker is warm (a slow host: 72 steps outlast it),
    # the growth back onto it. The identity holds either way.
    sizes = [p["world_size"] for p in plans]
    assert sizes in ([2, 1], [2, 1, 2]), sizes
    assert cost["total_usd"] == pytest.approx(sum(cost["parts_usd"].values()))
    assert cost["total_usd"] == pytest.approx(node_s * dollars_per_node_s, rel=1e-6)
    parts = cost["parts_usd"]
    assert parts["training"] > 0 and parts["setup"] > 0 and parts["recovery"] > 0 and parts["recomputed"] == 0, parts


class _FakeAWSMetadata(BaseHTTPRequestHandler):
    """Answers spot/instance-action like EC2: 404 until a termination is scheduled."""

    notices: dict = {}

    def do_PUT(self):  # IMDSv2 token
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"test-token")

    def do_GET(self):
        node = self.path.strip("/").split("/")[0]
        when = self.notices.get(node)
        if when is None:
            self.send_response(404)
            self.end_headers()
            return
        body = json.dumps({"action": "terminate",
                           "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(when))}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_metadata_endpoint_notice_triggers_emergency_checkpoint(three_nodes, dataset_uri, tmp_path):
    import ray

    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeAWSMetadata)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}/{{node_id}}/latest/meta-data/spot/instance-action"
        head = ray.get_runtime_context().get_node_id()
        # Longer than the others: the notice agents (one small actor per node) must be up
        # and polling before the run would end.
        trainer = _trainer(dataset_uri, tmp_path, "imds", watch_ray_drain=False, metadata_url=url)
        handle = trainer.submit()
        node = _worker_node(wait_until_running(handle, 4), head)
        noticed_at = time.time()
        _FakeAWSMetadata.notices[node] = int(noticed_at) + 21  # whole seconds, as EC2 reports
        result = handle.wait(timeout_s=240)
    finally:
        server.shutdown()
        _FakeAWSMetadata.notices.clear()
    events = run_events(tmp_path, "imds")
    assert next(e for e in events if e["kind"] == "preemption_notice")["source"] == "metadata"
    _assert_emergency(events, node, result, trainer, noticed_at, noticed_at + 20)


def test_notice_too_short_falls_back_to_last_committed(three_nodes, dataset_uri, tmp_path):
    import ray

    head = ray.get_runtime_context().get_node_id()
    trainer = _trainer(dataset_uri, tmp_path, "short", every=3, steps=DRAIN_STEPS)
    handle = trainer.submit()
    # A commit the controller has heard of before the notice (it learns of commits from
    # rank 0's polls, so on a loaded machine step 5 can come first).
    node = _worker_node(wait_until_running(handle, 5, committed=3), head)
    _drain(three_nodes, node, 1)
    result = handle.wait(timeout_s=240)
    events = run_events(tmp_path, "short")
    notice = next(e for e in events if e["kind"] == "preemption_notice")
    assert notice["action"] == "restore_last_committed"
    assert "an emergency checkpoint needs" in notice["reason"] and "last committed" in notice["reason"]
    committed_before = [e["step"] for e in events
                        if e["kind"] == "checkpoint_committed" and e["time"] < notice["time"]]
    # The restore that answers the notice (a later one may follow: the run grows back
    # onto the surviving nodes' free slots once the preempted ranks' resources are free).
    restore = next(e for e in events if e["kind"] == "checkpoint_loaded" and e["time"] > notice["time"])
    # The newest committed checkpoint: the one committed before the notice, or a periodic one
    # whose upload was already under way and committed while the notice was acted on (the
    # controller records a commit only when it next hears from rank 0).
    assert restore["step"] >= max(committed_before) and restore["step"] % 3 == 0, (restore, committed_before)
    assert not any(e["kind"] == "checkpoint_committed" and e["reason"] == "emergency" for e in events)
    assert result.status == "finished" and result.steps_completed == DRAIN_STEPS
