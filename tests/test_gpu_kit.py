"""The GPU kit (benchmarks/gpu_kit.py, docs/gpu_kit.md) between GPU loans.

* Its CPU mode runs every rayflex part on the tiny shape (in-process in two rounds, the
  float8 refusal, both checkpoint uploaders; through Ray once in the slow tier, as
  test_gpu_smoke does) and says why torchtitan is not run there.
* The two trainers' settings describe one workload, and rayflex's model of it has exactly
  the parameters of torchtitan's llama3 1B flavour untied (1,498,482,688).
* The wheels ``make gpu-kit`` fetched install offline (``pip --no-index``) for the GPU
  machine's CPython 3.12, the trimmed Ray wheel's RECORD matches its files, and a trimmed
  Ray for this Python starts ``ray.init``. These skip where ``make gpu-kit`` has not run
  (it needs the network).
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")
sys.path.insert(0, BENCH)
import gpu_kit  # noqa: E402
import gpu_kit_wheels  # noqa: E402
import gpu_kit_workload as wl  # noqa: E402

WHEELS = os.path.join(ROOT, ".gpu_kit", "wheels")
HOST_RAY = os.path.join(ROOT, ".gpu_kit", "host")
NO_WHEELS = "no .gpu_kit/wheels here: run `make gpu-kit` (it needs the network) to test the offline install"


def _env() -> dict:
    return {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "PYTHONPATH")}


def _cpu_kit(tmp_path, *flags: str) -> dict:
    out = tmp_path / "kit.json"
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "gpu_kit.py"), "--cpu", "--out", str(out), *flags],
                          capture_output=True, text=True, timeout=240, env=_env(), cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-4000:]
    kit = json.loads(proc.stdout)
    assert kit == json.loads(out.read_text())
    assert (kit["mode"], kit["device"], kit["skipped"]) == ("cpu", "cpu", [])
    assert all(kit["same_workload"].values()), kit["same_workload"]
    return kit


def _check_trained(runs: list[dict], rounds: int) -> None:
    assert [r["status"] for r in runs] == ["finished"] * rounds, runs
    for r in runs:
        assert r["tokens_per_s"] > 0 and r["steps_completed"] == wl.tiny().steps and r["mfu"] is None


def test_cpu_mode_runs_every_in_process_part(tmp_path):
    kit = _cpu_kit(tmp_path, "--systems", "torchtitan,rayflex-in-process,rayflex-in-process-float8")
    runs = kit["runs"]
    _check_trained(runs["rayflex-in-process"], 2)
    # float8 on CPU workers: refused before any worker, naming the field and the fix.
    for r in runs["rayflex-in-process-float8"]:
        assert r["status"].startswith("refused: PrecisionConfig.float8") and "use_gpu=True" in r["status"]
    assert all("triton" in r["status"] for r in runs["torchtitan"]) and "triton" in kit["torchtitan"]
    assert kit["per_system"]["rayflex-in-process"]["tokens_per_s"] > 0
    assert {k: g["met"] for k, g in kit["goals"].items()} == dict.fromkeys(gpu_kit.GOALS)  # nothing to judge on CPU

    # Saves at steps 2, 4, 6 and the resumed run's 7; the two after the first are back-to-back.
    assert [c["upload"] for c in kit["checkpoint"]] == ["thread", "process"]
    for c in kit["checkpoint"]:
        assert c["status"] == "finished" and not c["errors"], c
        assert [s["step"] for s in c["saves"]] == [2, 4, 6, 7]
        assert len(c["back_to_back_blocked_s"]) == 2 and min(c["back_to_back_blocked_s"]) >= 0
        assert all(rate > 0 for rate in c["persist_gb_per_s"])


@pytest.mark.cluster
@pytest.mark.slow  # ~30 s of embedded Ray; the in-process parts above run in CI
def test_cpu_mode_trains_through_ray(tmp_path):
    kit = _cpu_kit(tmp_path, "--systems", "rayflex-ray", "--uploads", "")
    _check_trained(kit["runs"]["rayflex-ray"], 1)


def test_both_trainers_run_one_workload_of_torchtitans_1b_shape():
    from transformers import LlamaConfig

    from rayflex.models.hf import causal_lm

    w = wl.llama3_1b()
    checks = gpu_kit.same_workload(w, {})
    assert checks.pop("params_built_equal") is None and all(checks.values()), checks
    # torchtitan's llama3 "1B" with enable_weight_tying=False builds 1,498,482,688 parameters
    # (read off its model on the meta device when the kit was written).
    assert w.params() == 1_498_482_688
    spec = causal_lm(LlamaConfig(**wl.hf_llama_config(w)))
    assert sum(spec.param_counts()) == w.params()
    assert w.flops_per_token() == 6 * w.matmul_params() + 12 * 16 * 2048 * 2048
    titan = wl.titan_settings(w)
    assert titan["model"]["flavor"] == "1B" and titan["training"]["global_batch_size"] == 4


@pytest.mark.skipif(not glob.glob(os.path.join(WHEELS, "*.whl")), reason=NO_WHEELS)
def test_fetched_wheels_install_offline_for_the_gpu_machine(tmp_path):
    wheels = sorted(glob.glob(os.path.join(WHEELS, "*.whl")))
    assert sum(os.path.getsize(w) for w in wheels) < gpu_kit_wheels.LIMIT_BYTES
    ray = [w for w in wheels if os.path.basename(w).startswith("ray-")]
    assert len(ray) == 1 and "cp312" in ray[0]
    assert gpu_kit_wheels.record_problems(ray[0]) == []
    import zipfile

    assert not [n for n in zipfile.ZipFile(ray[0]).namelist() if gpu_kit_wheels.dropped(n)]

    target = tmp_path / "site"
    platforms = [f for p in gpu_kit_wheels.PLATFORMS for f in ("--platform", p)]
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--find-links", WHEELS,
                           "--no-deps", "--no-compile", "--target", str(target), "--python-version", "3.12",
                           "--implementation", "cp", "--only-binary=:all:", *platforms, *wheels],
                          capture_output=True, text=True, timeout=120, env=_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    installed = {d.split("-")[0].lower().replace("_", "-") for d in os.listdir(target) if d.endswith(".dist-info")}
    wanted = {s.split("==")[0].lower().replace("_", "-") for s in gpu_kit_wheels.WHEELS}
    assert installed == wanted
    assert (target / "ray" / "core" / "src" / "ray" / "raylet" / "raylet").exists()
    assert not (target / "ray" / "jars").exists()


@pytest.mark.skipif(not glob.glob(os.path.join(HOST_RAY, "ray-*.whl")), reason=NO_WHEELS)
def test_trimmed_ray_starts_a_local_cluster(tmp_path):
    wheel = glob.glob(os.path.join(HOST_RAY, "ray-*.whl"))[0]
    assert gpu_kit_wheels.record_problems(wheel) == []
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--no-compile",
                    "--target", str(target), wheel], check=True, timeout=120, env=_env())
    script = ("import os, ray\n"
              f"assert ray.__file__.startswith({str(target)!r}), ray.__file__\n"
              "from rayflex.local_ray import init_local\n"
              "init_local(1)\n"
              "@ray.remote\nclass Echo:\n    def pid(self):\n        return os.getpid()\n"
              "assert ray.get(Echo.remote().pid.remote()) != os.getpid()\n"
              "ray.shutdown()\nprint('ok')\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**_env(), "PYTHONPATH": str(target)}, cwd=str(tmp_path))
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
