"""The core promise on a real (loopback) 2-node Ray cluster: FSDP2 (here with tensor
parallelism inside each node) over Ray actors trains the same model as plain torch,
reports every step, and fails loudly and fast."""

import json
import time

import pytest

import rayflex as rf
from rayflex.testing.reference import single_process_losses

from conftest import small_gpt

pytestmark = pytest.mark.cluster


def _trainer(dataset_uri, storage, name, **over):
    kw = dict(model=small_gpt(), data=rf.DataConfig(uri=dataset_uri, seq_len=32, global_batch=8),
              run=rf.RunConfig(name=name, storage=storage, steps=6,
                               optimizer=rf.OptimizerConfig(lr=1e-2, warmup_steps=2)),
              scaling=rf.ScalingConfig(num_workers=4), checkpoint=rf.CheckpointConfig(resume=False))
    kw.update(over)
    return rf.Trainer(**kw)


def test_tp2_dp2_over_ray_matches_single_process(two_node_cluster, dataset_uri, tmp_path):
    """Tensor parallel inside each node, FSDP2 across the two (the layout a user of NVLink
    nodes runs): every step reported, each tp group on one node, the losses of one process."""
    import ray

    storage = f"file://{tmp_path}/runs"
    trainer = _trainer(dataset_uri, storage, "core", parallel=rf.ParallelConfig(tp=2))
    handle = trainer.submit()
    deadline = time.time() + 120
    while len(handle.metrics()) < 2 and not handle.done() and time.time() < deadline:
        time.sleep(0.2)
    # Planned, placed, and folding in the ranks' steps: still no torch in the controller.
    controller = ray.get(handle.controller.process_info.remote(), timeout=30)
    result = handle.wait()
    run_dir = tmp_path / "runs" / "core"
    assert controller["torch_imported"] is False, controller

    assert result.status == "finished" and result.steps_completed == 6
    saved = json.loads((run_dir / "result.json").read_text())
    assert saved["status"] == "finished" and saved["steps_completed"] == 6
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5, 6]
    assert all(m["ranks_reported"] == 4 and m["world_size"] == 4 for m in metrics)
    assert all(0 <= m["data_wait_s"] < m["step_time_s"] for m in metrics), "each step's wait for its rows"
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    kinds = [e["kind"] for e in events]
    assert kinds[0] == "run_started" and kinds[-1] == "run_finished" and "plan_chosen" in kinds
    plan = next(e for e in events if e["kind"] == "plan_chosen")
    assert (plan["pp"], plan["dp"], plan["tp"]) == (1, 2, 2)
    nodes = plan["rank_to_node"]
    assert len(set(nodes)) == 2, "4 workers on 2 nodes x 2 CPUs use both nodes"
    assert nodes[0] == nodes[1] and nodes[2] == nodes[3], f"a tp group (ranks 2k, 2k+1) spans nodes: {nodes}"

    reference = single_process_losses(trainer.spec, 3)
    for m, ref in zip(metrics[:3], reference):
        assert m["loss"] == pytest.approx(ref, rel=1e-5), (m["step"], m["loss"], ref)


def test_worker_exception_fails_the_run_with_its_traceback(two_node_cluster, dataset_uri, tmp_path,
                                                           monkeypatch):
    monkeypatch.setenv("RAYFLEX_FAIL_AT", "1:3")
    handle = _trainer(dataset_uri, f"file://{tmp_path}/runs", "boom",
                      scaling=rf.ScalingConfig(num_workers=2)).submit()
    with pytest.raises(rf.WorkerError) as info:
        handle.wait(timeout_s=120)
    err = info.value
    assert err.rank == 1 and err.step == 3
    assert len(err.node_id) > 8 and f"worker rank 1 on node {err.node_id[:12]} failed at step 3" in str(err)
    assert "injected failure (RAYFLEX_FAIL_AT) at rank 1 step 3" in err.traceback
    assert "Traceback (most recent call last)" in err.traceback
    saved = json.loads((tmp_path / "runs" / "boom" / "result.json").read_text())
    assert saved["status"] == "failed" and saved["steps_completed"] == 2
    assert "rank 1" in saved["reason"]
