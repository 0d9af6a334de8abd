"""Live recovery on a loopback cluster: an HSDP run (2 replicas x 2 shards) whose worker is
SIGKILLed resumes from the survivors' memory — no step lost, nothing read from storage —
and ends with the parameters of a run that never failed, bit for bit."""

import os
import signal

import numpy as np
import pytest
import torch

import rayflex as rf
from rayflex.checkpoint import manifest as mf
from rayflex.checkpoint.reader import CheckpointWeights
from rayflex.data.dataset import TokenDataset

from conftest import run_events, small_gpt, wait_until_running

pytestmark = pytest.mark.cluster
# No checkpoint before step 12: a rollback would lose every step trained before the kill.
STEPS, EVERY = 24, 12


@pytest.fixture(autouse=True)
def fast_detection(monkeypatch):
    monkeypatch.setenv("RAYFLEX_HEARTBEAT_TIMEOUT_S", "3")
    monkeypatch.setenv("RAYFLEX_RELEASE_TIMEOUT_S", "5")


def _trainer(dataset_uri, tmp_path, name):
    return rf.Trainer(model=small_gpt(n_layers=2),
                      data=rf.DataConfig(uri=dataset_uri, seq_len=32, global_batch=8, log_samples=True),
                      run=rf.RunConfig(name=name, storage=f"file://{tmp_path}/runs", steps=STEPS,
                                       optimizer=rf.OptimizerConfig(lr=1e-2, warmup_steps=2)),
                      parallel=rf.ParallelConfig(dp_shard=2),
                      scaling=rf.ScalingConfig(num_workers=4, min_workers=2, cpus_per_worker=1),
                      checkpoint=rf.CheckpointConfig(every_steps=EVERY, keep=3),
                      # The replacement is waited for: the run stays at 4 ranks, so the fault-free
                      # run is the reference "at the same size".
                      elastic=rf.ElasticConfig(max_failures=2, resource_wait_s=60, restart_while_warming=False))


def _final_model(tmp_path, name):
    uri = f"file://{tmp_path}/runs/{name}/checkpoints"
    weights = CheckpointWeights(step_uri=mf.step_dir(uri, STEPS), step=STEPS, model={}, description=name)
    return weights.load(sorted(weights.tensors()))


def test_a_killed_hsdp_worker_loses_no_step_and_ends_bitwise_like_a_fault_free_run(two_node_cluster, dataset_uri,
                                                                                    tmp_path):
    trainer = _trainer(dataset_uri, tmp_path, "live-kill")
    handle = trainer.submit()
    st = wait_until_running(handle, 4)
    victim = next(w for w in st["workers"] if w["rank"] == 1)
    os.kill(victim["pid"], signal.SIGKILL)
    result = handle.wait(timeout_s=240)
    assert result.status == "finished" and result.steps_completed == STEPS

    events = run_events(tmp_path, "live-kill")
    chosen = [e for e in events if e["kind"] == "recovery_chosen"]
    assert len(chosen) == 1 and chosen[0]["source"] == "live_peers", chosen
    live_step = chosen[0]["step"]
    assert 4 <= live_step < EVERY, "recovered past every checkpoint (there was none yet)"
    assert 1 not in chosen[0]["holders"], "the dead rank's shard was read from its live replica"
    restarted, = [e for e in events if e["kind"] == "restarted"]
    assert restarted["lost_steps"] == 0 and restarted["from_step"] == live_step
    loaded, = [e for e in events if e["kind"] == "checkpoint_loaded"]
    assert loaded["uri"] == "live peers" and loaded["step"] == live_step
    # The live step is committed first thing, so a second failure cannot roll back past it.
    committed = [e for e in events if e["kind"] == "checkpoint_committed"]
    assert committed[0]["step"] == live_step and committed[0]["reason"] == "live_recovery", committed[0]

    metrics = run_events(tmp_path, "live-kill", "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1)), "every step trained and recorded once"
    sampler = TokenDataset(dataset_uri).sampler(trainer.spec.data)
    samples = {s["step"]: s["indices"] for s in run_events(tmp_path, "live-kill", "samples.jsonl")}
    assert sorted(samples) == list(range(1, STEPS + 1))
    for step, indices in samples.items():
        np.testing.assert_array_equal(indices, sampler.indices(step - 1, 0, 1))

    reference = _trainer(dataset_uri, tmp_path, "live-ref").fit(progress=False)
    assert reference.status == "finished"
    want, have = _final_model(tmp_path, "live-ref"), _final_model(tmp_path, "live-kill")
    assert want.keys() == have.keys()
    for key in want:
        assert torch.equal(want[key], have[key]), f"{key} differs from the fault-free run's"
