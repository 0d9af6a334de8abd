"""The driver dies (SIGKILL of `rayflex run`: a laptop closed, a notebook kernel killed, the
head's job process OOM-killed) in the middle of a run. Nothing of that attempt may keep
holding the cluster, and the next `rayflex run` with the same name resumes from the newest
committed checkpoint and ends with the loss of a run that never failed."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import SEQ_LEN, run_events, wait_for

# Slow (make test-slow): two driver processes, two controllers and four workers cost ~90 s
# of the 2-core CI machine; the restart logic it exercises is Ray's cleanup plus the
# resume by name that the CI's job-submission and tracker tests cover.
pytestmark = [pytest.mark.cluster, pytest.mark.slow]

STEPS = 30
NAME = "driver-killed"
RAYFLEX = os.path.join(os.path.dirname(sys.executable), "rayflex")

SPEC = textwrap.dedent(f"""
    import os

    import rayflex as rf
    from rayflex.models import GPTConfig, gpt

    trainer = rf.Trainer(
        model=gpt(GPTConfig(vocab_size=128, seq_len={SEQ_LEN}, d_model=32, n_layers=2, n_heads=2)),
        data=rf.DataConfig(uri=os.environ["TEST_DATA"], seq_len={SEQ_LEN}, global_batch=8),
        run=rf.RunConfig(name="{NAME}", storage=os.environ["TEST_STORAGE"], steps={STEPS},
                         optimizer=rf.OptimizerConfig(lr=1e-2, warmup_steps=2)),
        scaling=rf.ScalingConfig(num_workers=2),
        checkpoint=rf.CheckpointConfig(every_steps=2, keep=3))
""")


def _leftovers() -> dict:
    """What is still holding the cluster: live rayflex actors and placement groups not removed
    (from the GCS tables: the test clusters run no dashboard, which ``ray.util.state``
    needs), and CPUs not free."""
    import ray
    from ray._private.state import actors

    alive = sorted(a["ActorClassName"].rsplit(".", 1)[-1] for a in actors().values()
                   if a["State"] != "DEAD" and a["ActorClassName"].rsplit(".", 1)[-1]
                   in ("Controller", "TrainWorkerActor", "NoticeAgent"))
    groups = [g for g, info in ray.util.placement_group_table().items() if info["state"] != "REMOVED"]
    busy = ray.cluster_resources().get("CPU", 0) - ray.available_resources().get("CPU", 0)
    return {"actors": alive, "placement_groups": groups, "cpus_in_use": busy}


def _wait_until_clean(timeout_s: float) -> None:
    deadline, left = time.time() + timeout_s, None
    while time.time() < deadline:
        left = _leftovers()
        if left == {"actors": [], "placement_groups": [], "cpus_in_use": 0}:
            return
        time.sleep(0.2)
    raise AssertionError(f"still held {timeout_s}s after both runs: {left}")


def test_a_killed_driver_leaves_nothing_behind_and_the_next_run_resumes(two_node_cluster, dataset_uri,
                                                                        tmp_path):
    spec_file = tmp_path / "spec.py"
    spec_file.write_text(SPEC)
    env = {**os.environ, "RAY_ADDRESS": two_node_cluster.address, "TEST_DATA": dataset_uri,
           "TEST_STORAGE": f"file://{tmp_path}/runs"}
    run_dir = tmp_path / "runs" / NAME
    committed = lambda: [e["step"] for e in _events(run_dir) if e["kind"] == "checkpoint_committed"]  # noqa: E731

    with open(tmp_path / "first.log", "w") as log:
        driver = subprocess.Popen([RAYFLEX, "run", str(spec_file)], env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_for(lambda: committed() or driver.poll() is not None, 120, "a committed checkpoint", 0.2)
            assert driver.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
        finally:
            driver.kill()  # SIGKILL: no handler runs, nothing is stopped cleanly
            driver.wait(30)
    killed_after = max(committed())
    assert killed_after < STEPS, "the first run was still training when its driver was killed"

    # Resubmitted at once, as a user (or a job retry) would: the dead attempt's controller,
    # workers and placement group are gone, or going, and must not be in the way.
    second = subprocess.run([RAYFLEX, "run", str(spec_file), "--no-progress"], env=env, capture_output=True,
                            text=True, timeout=240)
    assert second.returncode == 0, (second.stdout + second.stderr)[-4000:]

    result = json.loads((run_dir / "result.json").read_text())
    assert result["status"] == "finished" and result["steps_completed"] == STEPS, result
    loaded = [e for e in run_events(tmp_path, NAME) if e["kind"] == "checkpoint_loaded"]
    assert loaded and loaded[-1]["step"] >= killed_after, ("resumed from the newest committed step", loaded)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1)), "every step once, rolled-back steps replaced"

    from rayflex.cli.run import load_trainer
    from rayflex.testing.reference import single_process_losses

    os.environ.update(TEST_DATA=dataset_uri, TEST_STORAGE=f"file://{tmp_path}/runs")
    try:
        reference = single_process_losses(load_trainer(str(spec_file)).spec, STEPS)
    finally:
        for key in ("TEST_DATA", "TEST_STORAGE"):
            os.environ.pop(key, None)
    assert result["final_loss"] == pytest.approx(reference[-1], rel=1e-4)

    # Neither attempt left anything holding the cluster.
    _wait_until_clean(60)


def _events(run_dir) -> list[dict]:
    path = run_dir / "events.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written
            pass
    return out
