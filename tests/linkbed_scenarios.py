"""Training runs for the link bed: ``python -m rayflex.testing.linkbed --call
linkbed_scenarios:NAME`` runs one in the bed's own process, which returns what the test
checks (tests/test_linkbed.py). Its files go under ``$LINKBED_TEST_DIR``."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import rayflex as rf
from rayflex.testing.linkbed.links import subtract

SEQ_LEN = 32
# The pipeline run's traffic is measured over 16 steady steps (after step 8). The node-lost
# run trains on after its restart from step 4 for longer than Ray takes to declare the killed
# node dead (the bed's health check: 5 misses of 1 s + a 2 s timeout), which it names then.
STEPS = 24
NODE_LOST_STEPS = 40


def _trainer(name: str, *, steps: int, workers: int = 4, min_workers: int = 4, **parallel) -> rf.Trainer:
    from rayflex.data.dataset import write_synthetic_dataset
    from rayflex.models import GPTConfig, gpt

    root = Path(os.environ["LINKBED_TEST_DIR"])
    data = root / "tokens"
    if not data.exists():
        write_synthetic_dataset(f"file://{data}", num_samples=512, seq_len=SEQ_LEN, vocab_size=128, num_shards=2, seed=7)
    return rf.Trainer(model=gpt(GPTConfig(vocab_size=128, seq_len=SEQ_LEN, d_model=64, n_layers=4, n_heads=2)),
                      data=rf.DataConfig(uri=f"file://{data}", seq_len=SEQ_LEN, global_batch=8),
                      run=rf.RunConfig(name=name, storage=f"file://{root}/runs", steps=steps,
                                       optimizer=rf.OptimizerConfig(lr=1e-2, warmup_steps=2)),
                      scaling=rf.ScalingConfig(num_workers=workers, min_workers=min_workers, max_workers=workers),
                      parallel=rf.ParallelConfig(**parallel),
                      checkpoint=rf.CheckpointConfig(every_steps=4, keep=2),
                      elastic=rf.ElasticConfig(max_failures=3, resource_wait_s=30))


def _events(name: str) -> list[dict]:
    path = Path(os.environ["LINKBED_TEST_DIR"]) / "runs" / name / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _wait_step(handle, step: int, timeout_s: float = 300) -> int:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        st = handle.status()
        if st["state"] == "RUNNING" and st["step"] >= step:
            return st["step"]
        if handle.done():
            break
        time.sleep(0.05)
    raise AssertionError(f"run not at step {step}: {handle.status()}")


def pipeline_then_node_lost(bed) -> dict:
    """Two runs on one bed of two nodes in two racks: pp=2 x dp=2 and its bytes per link in
    the steady state; then FSDP over 4 ranks whose second node is killed mid-run."""
    return {"pipeline": _pipeline_across_racks(bed), "node_lost": _node_lost(bed)}


def _pipeline_across_racks(bed) -> dict:
    from rayflex.planning.traffic import GLOO, link_bytes

    trainer = _trainer("pp-dp", steps=STEPS, pp=2, microbatches=4)
    plan = trainer.plan(bed.topology)  # the planner's answer on the bed's own topology
    predicted = link_bytes(bed.topology, plan.mesh, plan.profile, plan.rank_to_node, GLOO)
    handle = trainer.submit()
    # From a step the status shows to the end: the steps between are exact, and what the end
    # adds (a checkpoint to local disk, the workers' release) is small beside them.
    first, before = _wait_step(handle, 8), bed.counters()
    result = handle.wait(timeout_s=300)
    traffic = subtract(bed.counters(), before)
    return {"status": result.status, "steps": [first, result.steps_completed], "traffic": traffic,
            "predicted_per_step": predicted, "planned": list(plan.rank_to_node),
            "nodes": {bed.ray_node_id(n.node_id): n.node_id for n in bed.topology.nodes},
            "events": [e for e in _events("pp-dp") if e["kind"] == "plan_chosen"]}


def _node_lost(bed) -> dict:
    lost = bed.topology.nodes[-1].node_id
    handle = _trainer("node-lost", steps=NODE_LOST_STEPS, min_workers=2).submit()
    deadline = time.time() + 300
    while (handle.status().get("last_checkpoint") or {}).get("step", 0) < 4:
        assert time.time() < deadline and not handle.done(), handle.status()
        time.sleep(0.05)
    removed_at = time.time()
    lost_ray_id = bed.remove_node(lost)
    result = handle.wait(timeout_s=300)
    return {"status": result.status, "steps_completed": result.steps_completed, "steps": NODE_LOST_STEPS,
            "removed_at": removed_at,
            "lost": {"node_id": lost_ray_id, "ip": bed.plan.addresses[lost]},
            "events": _events("node-lost")}
