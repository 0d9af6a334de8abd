"""Live recovery on a loopback cluster: an HSDP run (2 replicas x 2 shards, a replica per
node) that loses a worker (SIGKILL), a whole node, or a frozen worker (SIGSTOP) resumes
from the survivors' memory — no step lost, nothing read from storage — and ends with the
parameters of a run that never failed, bit for bit (it restarts at the same size: the
replacement is waited for)."""

import os
import signal
import time

import numpy as np
import pytest
import torch

import rayflex as rf
from rayflex.checkpoint import manifest as mf
from rayflex.checkpoint.reader import CheckpointWeights
from rayflex.data.dataset import TokenDataset

from conftest import run_events, small_gpt, wait_then_end_frozen, wait_until_running
from test_elastic_cluster import fast_detection  # noqa: F401 - the autouse fixture

pytestmark = pytest.mark.cluster
# No checkpoint before step 12: a rollback would lose every step trained before the kill.
STEPS, EVERY = 24, 12


def _trainer(dataset_uri, tmp_path, name):
    return rf.Trainer(model=small_gpt(n_layers=2),
                      data=rf.DataConfig(uri=dataset_uri, seq_len=32, global_batch=8, log_samples=True),
                      run=rf.RunConfig(name=name, storage=f"file://{tmp_path}/runs", steps=STEPS,
                                       optimizer=rf.OptimizerConfig(lr=1e-2, warmup_steps=2)),
                      parallel=rf.ParallelConfig(dp_shard=2),
                      # min_workers=4: a restart waits for a lost node's replacement.
                      scaling=rf.ScalingConfig(num_workers=4, min_workers=4, cpus_per_worker=1),
                      checkpoint=rf.CheckpointConfig(every_steps=EVERY, keep=3),
                      # The replacement is waited for: the run stays at 4 ranks, so the fault-free
                      # run is the reference "at the same size".
                      elastic=rf.ElasticConfig(max_failures=2, resource_wait_s=60, restart_while_warming=False))


def _final_model(tmp_path, name):
    uri = f"file://{tmp_path}/runs/{name}/checkpoints"
    weights = CheckpointWeights(step_uri=mf.step_dir(uri, STEPS), step=STEPS, model={}, description=name)
    return weights.load(sorted(weights.tensors()))


@pytest.fixture(scope="module")
def fault_free_model(two_node_cluster, dataset_uri, tmp_path_factory):
    root = tmp_path_factory.mktemp("live-ref")
    assert _trainer(dataset_uri, root, "live-ref").fit(progress=False).status == "finished"
    return _final_model(root, "live-ref")


def _assert_live_recovered(trainer, tmp_path, name, result, fault_free, lost_ranks):
    assert result.status == "finished" and result.steps_completed == STEPS
    events = run_events(tmp_path, name)
    chosen = [e for e in events if e["kind"] == "recovery_chosen"]
    assert len(chosen) == 1 and chosen[0]["source"] == "live_peers", chosen
    live_step = chosen[0]["step"]
    assert 4 <= live_step < EVERY, "recovered past every checkpoint (there was none yet)"
    assert not set(lost_ranks) & set(chosen[0]["holders"]), "the lost shards were read from their live replicas"
    restarted, = [e for e in events if e["kind"] == "restarted"]
    assert restarted["lost_steps"] == 0 and restarted["from_step"] == live_step
    loaded, = [e for e in events if e["kind"] == "checkpoint_loaded"]
    assert loaded["uri"] == "live peers" and loaded["step"] == live_step
    # Committed after the first resumed step, so a second failure cannot roll back past it.
    committed = [e for e in events if e["kind"] == "checkpoint_committed"]
    assert committed[0]["step"] == live_step + 1 and committed[0]["reason"] == "live_recovery", committed[0]

    metrics = run_events(tmp_path, name, "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1)), "every step trained and recorded once"
    sampler = TokenDataset(trainer.spec.data.uri).sampler(trainer.spec.data)
    samples = {s["step"]: s["indices"] for s in run_events(tmp_path, name, "samples.jsonl")}
    assert sorted(samples) == list(range(1, STEPS + 1))
    for step, indices in samples.items():
        np.testing.assert_array_equal(indices, sampler.indices(step - 1, 0, 1))

    have = _final_model(tmp_path, name)
    assert fault_free.keys() == have.keys()
    for key in fault_free:
        assert torch.equal(fault_free[key], have[key]), f"{key} differs from the fault-free run's"


def _signal_rank_once_running(trainer, rank: int, sig) -> tuple:
    """Submit the run, wait for step 4, send ``sig`` to ``rank``'s process: (handle, its pid)."""
    handle = trainer.submit()
    st = wait_until_running(handle, 4)
    victim = next(w for w in st["workers"] if w["rank"] == rank)
    os.kill(victim["pid"], sig)
    return handle, victim


def test_a_killed_worker_loses_no_step(two_node_cluster, dataset_uri, tmp_path, fault_free_model):
    trainer = _trainer(dataset_uri, tmp_path, "live-kill")
    handle, _ = _signal_rank_once_running(trainer, 1, signal.SIGKILL)
    _assert_live_recovered(trainer, tmp_path, "live-kill", handle.wait(timeout_s=240), fault_free_model, [1])


def test_a_frozen_worker_loses_no_step(two_node_cluster, dataset_uri, tmp_path, fault_free_model):
    trainer = _trainer(dataset_uri, tmp_path, "live-freeze")
    handle, victim = _signal_rank_once_running(trainer, 2, signal.SIGSTOP)
    result = wait_then_end_frozen(handle, victim["pid"])
    assert any(e["kind"] == "hang_detected" for e in run_events(tmp_path, "live-freeze"))
    _assert_live_recovered(trainer, tmp_path, "live-freeze", result, fault_free_model, [2])


def test_a_lost_node_loses_no_step(two_node_cluster, dataset_uri, tmp_path, fault_free_model):
    cluster = two_node_cluster
    worker_node = next(iter(cluster.worker_nodes))
    trainer = _trainer(dataset_uri, tmp_path, "live-node")
    handle = trainer.submit()
    st = wait_until_running(handle, 4)
    lost_ranks = sorted(w["rank"] for w in st["workers"] if w["node_id"] == worker_node.node_id)
    assert len(lost_ranks) == 2, st["workers"]
    cluster.remove_node(worker_node)
    try:
        # The restart waits for 4 slots (min_workers=4): a node like the lost one joins.
        deadline = time.time() + 60
        while not any(e["kind"] == "recovery_chosen" for e in run_events(tmp_path, "live-node")):
            assert time.time() < deadline, "the loss was never handled"
            time.sleep(0.2)
    finally:
        cluster.add_node(num_cpus=2, node_ip_address="127.0.0.1", labels={"rack": "r1"})
    _assert_live_recovered(trainer, tmp_path, "live-node", handle.wait(timeout_s=240), fault_free_model, lost_ranks)
