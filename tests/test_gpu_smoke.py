"""benchmarks/gpu_smoke.py's CPU mode: every phase runs and the JSON has the GPU run's keys.

The in-process variant (the TrainWorker in the script's own process, no Ray) runs in CI;
the variant through ``Trainer.fit()`` starts an embedded local Ray in the subprocess, so
it is a cluster test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "gpu_smoke.py")
KEYS = ["benchmark", "mode", "runner", "device", "model", "features", "workload", "tokens_per_s", "step_time_s",
        "mfu", "peak_flops", "peak_gpu_memory_bytes", "checkpoint", "health", "phases", "all_phases_ran", "wall_s",
        "machine"]


def _smoke(tmp_path, *flags: str, timeout_s: float) -> dict:
    out = tmp_path / "smoke.json"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # never join another cluster
    proc = subprocess.run([sys.executable, SCRIPT, "--cpu-smoke", "--storage", str(tmp_path / "smoke"),
                           "--out", str(out), *flags], capture_output=True, text=True, timeout=timeout_s, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    printed = json.loads(proc.stdout)
    assert printed == json.loads(out.read_text())
    return printed


def _check(result: dict, runner: str) -> None:
    assert list(result) == KEYS
    assert (result["mode"], result["runner"], result["device"]) == ("cpu-smoke", runner, "cpu")
    assert result["phases"] == {"setup": True, "steps": True, "checkpoint": True, "resume": True, "health": True}
    assert result["health"]["error"] == "" and result["health"]["gflops"] > 0 and result["health"]["devices"] == 1
    assert result["all_phases_ran"] is True
    assert result["tokens_per_s"] > 0 and result["step_time_s"] > 0
    assert result["mfu"] is None and result["peak_gpu_memory_bytes"] is None  # no GPU, no --peak-tflops
    ckpt = result["checkpoint"]
    # Periodic at 3, final at 6, then the resumed run's final at 8: all committed.
    assert [(s["step"], s["committed"]) for s in ckpt["saves"]] == [(3, True), (6, True), (8, True)]
    assert not ckpt["errors"]
    assert ckpt["state_bytes"] > 0 and ckpt["copy_floor_s"] > 0 and ckpt["blocked_s_min"] >= 0
    assert ckpt["blocked_min_over_floor"] == pytest.approx(ckpt["blocked_s_min"] / ckpt["copy_floor_s"])
    assert result["model"]["params"] > 0


def test_cpu_smoke_in_process_runs_every_phase(tmp_path):
    _check(_smoke(tmp_path, "--in-process", timeout_s=120), "in-process")


@pytest.mark.cluster
@pytest.mark.slow  # 30 s of embedded Ray; the in-process variant above runs in CI
def test_cpu_smoke_through_the_trainer_runs_every_phase(tmp_path):
    # Trainer.fit() in the subprocess starts (and stops) an embedded local Ray of its own.
    _check(_smoke(tmp_path, timeout_s=240), "ray")
