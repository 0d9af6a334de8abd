"""The GPU proof kit: rayflex beside torchtitan on one GPU, float8, and checkpoints at 1B.

    python benchmarks/gpu_kit.py [--rounds 2] [--budget-s 450] --out gpu_kit.json
    python benchmarks/gpu_kit.py --cpu --out kit_cpu.json      # the same parts, tiny, CPU

Parts, each run a fresh process on GPU (its own CUDA context, memory and compile):

* **throughput**: the kit's Llama (``gpu_kit_workload``: torchtitan's llama3 1B flavour,
  untied, seq 2048, global batch 4, AdamW, bf16 + fp32 reduce, compile, no AC) trained
  by torchtitan's trainer (``gpu_kit_titan.py``), by rayflex through Ray
  (``Trainer.fit``, ``ScalingConfig(use_gpu=True)``) and in-process (the TrainWorker
  without Ray), and in-process with ``PrecisionConfig(float8=True)``; the systems
  alternate in rounds (A B C D A B C D, ``rounds.alternate``). Per system: tokens/s
  (wall-clock gaps between finished steps, the first two left out), MFU by one FLOP
  formula for all (``gpu_kit_workload.FLOP_FORMULA``), peak memory; ratios round by
  round: rayflex / torchtitan, float8 / bf16; each against the issue's goal.
* **checkpoint**: ``gpu_smoke.py`` at 1B (the 1.02B GPT, in-process, no compile) with
  the thread and with the process uploader: three saves two steps apart (the second and
  third find the previous upload running: back-to-back), then a resume; blocked time per
  save and persist GB/s (bytes over the save's time to its commit).

A run that would not fit the time left (``--budget-s``, judged by the longest run of its
kind so far) is skipped and named in ``skipped``; the JSON is rewritten after every run,
so whatever ran is in ``--out`` even if the kit is stopped.

``--cpu``: the tiny shape on CPU, one process: rayflex in-process (two rounds) and through
Ray (one), the float8 refusal, ``gpu_smoke.py --cpu-smoke`` with each uploader; torchtitan
cannot run on CPU (it imports triton and picks CUDA as its device type), so the CPU mode
checks its settings against rayflex's instead and says so.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Callable, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import gpu_kit_workload as wl  # noqa: E402
from common import emit, machine, setup_logging  # noqa: E402
from rounds import over_rounds, paired_ratios  # noqa: E402

SYSTEMS = ("torchtitan", "rayflex-ray", "rayflex-in-process", "rayflex-in-process-float8")
GOALS = {"rayflex_in_process_over_torchtitan": 1.0, "rayflex_ray_over_torchtitan": 0.97, "mfu_bf16": 0.45,
         "float8_over_bf16": 1.2}
FIGURES = ("tokens_per_s", "median_step_s", "mfu", "peak_memory_bytes", "time_to_first_step_s")
TITAN_ON_CPU = ("not run: torchtitan cannot run on a CPU-only host (it imports triton unconditionally and falls "
                "back to 'cuda' as its device type); the CPU mode checks the settings it would run with")


class Budget:
    """Seconds left for the kit's runs; a run is started only if the longest earlier run
    of its kind (or ``first_guess_s``) still fits."""

    def __init__(self, seconds: float, first_guess_s: float):
        self.deadline = time.time() + seconds
        self.first_guess_s = first_guess_s
        self.longest: dict[str, float] = {}

    def left(self) -> float:
        return self.deadline - time.time()

    def fits(self, kind: str) -> bool:
        return self.left() >= self.longest.get(kind, self.first_guess_s)

    def spent(self, kind: str, seconds: float) -> None:
        self.longest[kind] = max(seconds, self.longest.get(kind, 0.0))


# ----------------------------------------------------------------- one run
def _subprocess_json(argv: list[str], timeout_s: float) -> dict:
    """Run a kit script in a fresh process; its one JSON object, or why there is none."""
    with tempfile.TemporaryDirectory(prefix="rayflex-gpu-kit-") as root:
        out = os.path.join(root, "result.json")
        try:
            proc = subprocess.run([sys.executable, *argv, "--out", out], stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired as e:
            tail = e.stderr[-2000:] if isinstance(e.stderr, str) else ""
            return {"status": f"timed out after {timeout_s:.0f} s", "stderr_tail": tail}
        if not os.path.exists(out):
            return {"status": f"exited {proc.returncode} without a result", "stderr_tail": proc.stderr[-2000:]}
        with open(out) as f:
            return json.load(f)


def throughput_run(system: str, args) -> dict:
    """One throughput run of ``system`` (a fresh process on GPU; this one with --cpu)."""
    float8 = system.endswith("-float8")
    runner = "ray" if system == "rayflex-ray" else "in-process"
    if args.cpu:
        if system == "torchtitan":
            return {"system": system, "status": TITAN_ON_CPU}
        import gpu_kit_rayflex
        from rayflex.errors import ConfigError

        try:
            with contextlib.redirect_stdout(sys.stderr):
                return gpu_kit_rayflex.run(wl.tiny(), runner=runner, float8=float8, cpu=True)
        except ConfigError as e:  # float8 on CPU: refused before any worker starts
            return {"system": system, "float8": float8, "status": f"refused: {e}"}
        except Exception as e:  # recorded like a failed GPU run's process: the kit goes on
            return {"system": system, "float8": float8, "status": f"failed: {type(e).__name__}: {e}"}
    shape = ["--seq-len", str(args.seq_len), "--global-batch", str(args.global_batch), "--steps", str(args.steps)]
    if system == "torchtitan":
        argv = [os.path.join(HERE, "gpu_kit_titan.py"), *shape] + (["--no-cuda-graphs"] if args.no_cuda_graphs else [])
    else:
        argv = [os.path.join(HERE, "gpu_kit_rayflex.py"), "--runner", runner, *shape] + (["--float8"] if float8 else [])
    return {"system": system, **_subprocess_json(argv, args.run_timeout_s)}


def checkpoint_run(upload: str, args) -> dict:
    """``gpu_smoke.py`` with one uploader: back-to-back saves' blocked time, persist GB/s."""
    # when_busy="wait": every save on time, so the second of two back-to-back saves measures
    # what a save waits for while the one before still uploads (deferred, it would come later).
    flags = ["--in-process", "--steps", "6", "--every", "2", "--resume-steps", "1", "--upload", upload,
             "--when-busy", "wait"]
    if args.cpu:
        import gpu_smoke

        with tempfile.TemporaryDirectory(prefix="rayflex-kit-ckpt-") as root, \
                contextlib.redirect_stdout(sys.stderr):
            out = os.path.join(root, "smoke.json")
            gpu_smoke.main(["--cpu-smoke", *flags, "--storage", os.path.join(root, "s"), "--out", out])
            smoke = json.load(open(out))
    else:
        flags += ["--no-compile", "--upload-threads", str(args.upload_threads)]
        smoke = _subprocess_json([os.path.join(HERE, "gpu_smoke.py"), *flags], args.run_timeout_s)
    return {"upload": upload, **checkpoint_figures(smoke)}


def checkpoint_figures(smoke: dict) -> dict:
    """From gpu_smoke's JSON: per save its blocked seconds and persist GB/s; the saves that
    followed another within the same attempt (back-to-back) apart."""
    ckpt = smoke.get("checkpoint") or {}
    saves = [{"step": s["step"], "reason": s.get("reason"), "upload": s.get("upload"),
              "blocked_s": s["blocked_s"], "total_s": s["total_s"], "bytes": s["bytes"],
              "persist_gb_per_s": s["bytes"] / s["total_s"] / 1e9 if s.get("total_s") else None,
              "waited_for_previous_s": s.get("waited_for_previous_s")} for s in ckpt.get("saves") or []]
    every = (smoke.get("workload") or {}).get("checkpoint_every") or 0
    first_run = [s for s in saves if s["step"] <= (smoke.get("workload") or {}).get("steps", 0)]
    back_to_back = [s for s in first_run[1:] if every]
    return {"status": "finished" if smoke.get("all_phases_ran") else smoke.get("status", "incomplete"),
            "phases": smoke.get("phases"), "saves": saves, "errors": ckpt.get("errors"),
            "back_to_back_blocked_s": [s["blocked_s"] for s in back_to_back],
            "persist_gb_per_s": [s["persist_gb_per_s"] for s in saves],
            "copy_floor_s": ckpt.get("copy_floor_s"), "state_bytes": ckpt.get("state_bytes")}


# ----------------------------------------------------------------- the summary
def with_mfu(run: dict, w: wl.Workload, peak: Optional[float]) -> dict:
    tps = run.get("tokens_per_s")
    return {**run, "mfu": tps * w.flops_per_token() / peak if tps and peak else None}


def summary(runs: dict[str, list[dict]]) -> dict:
    ok = {s: [r for r in rs if r.get("status") == "finished"] for s, rs in runs.items()}
    per_system = {s: over_rounds(rs, FIGURES) for s, rs in ok.items() if rs}
    ratios = {}
    for name, (system, base) in {"rayflex_in_process_over_torchtitan": ("rayflex-in-process", "torchtitan"),
                                 "rayflex_ray_over_torchtitan": ("rayflex-ray", "torchtitan"),
                                 "float8_over_bf16": ("rayflex-in-process-float8", "rayflex-in-process")}.items():
        pairs = [(a, b) for a, b in zip(runs.get(system, []), runs.get(base, []))
                 if a.get("status") == b.get("status") == "finished"]
        got = paired_ratios([a for a, _ in pairs], [b for _, b in pairs], ("tokens_per_s",))
        if got:
            ratios[name] = got["tokens_per_s"]
    mfu = (per_system.get("rayflex-in-process") or {}).get("mfu")
    values = {**{k: v["median"] for k, v in ratios.items()}, "mfu_bf16": mfu}
    goals = {k: {"goal": g, "value": values.get(k), "met": None if values.get(k) is None else values[k] >= g}
             for k, g in GOALS.items()}
    return {"per_system": per_system, "ratios_tokens_per_s": ratios, "goals": goals}


def same_workload(w: wl.Workload, runs: dict[str, list[dict]]) -> dict:
    """What the systems share, from the settings each ran with and the parameters each built."""
    titan, rayflex = wl.titan_settings(w), wl.rayflex_settings(w)
    m = titan["model"]
    checks = {
        "seq_len": titan["training"]["seq_len"] == rayflex["seq_len"],
        "global_batch": titan["training"]["global_batch_size"] == rayflex["global_batch"],
        "shape": (m["dim"], m["n_layers"], m["n_heads"], m["n_kv_heads"], m["ffn_hidden"], m["vocab_size"])
        == tuple(rayflex["model"][k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                               "num_key_value_heads", "intermediate_size", "vocab_size")),
        "untied": m["enable_weight_tying"] is False and rayflex["model"]["tie_word_embeddings"] is False,
        "optimizer": all(titan["optimizer"][k] == rayflex["optimizer"][k]
                         for k in ("implementation", "lr", "betas", "weight_decay")),
        "precision": (titan["training"]["mixed_precision_param"], titan["training"]["mixed_precision_reduce"])
        == ({"bf16": "bfloat16", "fp32": "float32"}[rayflex["precision"]["param_dtype"]],
            {"bf16": "bfloat16", "fp32": "float32"}[rayflex["precision"]["reduce_dtype"]]),
        "compile": titan["compile"]["enable"] == rayflex["memory"]["compile"],
        "activation_checkpointing": titan["activation_checkpoint"] is None
        and rayflex["memory"]["activation_checkpointing"] == "none",
    }
    built = {r["params"] for rs in runs.values() for r in rs if r.get("params")}
    checks["params_built_equal"] = built <= {w.params()} if built else None
    return checks


# ----------------------------------------------------------------- main
def plan(args) -> list[tuple[str, str]]:
    """(part, what) in the order they run: the throughput rounds, then the uploaders."""
    systems = [s for s in SYSTEMS if s in args.systems]
    rounds = [("throughput", s) for _ in range(args.rounds) for s in systems]
    if args.cpu:  # Ray's start is most of a CPU run: one round through Ray is enough there
        seen = set()
        rounds = [(p, s) for p, s in rounds if s != "rayflex-ray" or not (s in seen or seen.add(s))]
    return rounds + [("checkpoint", u) for u in args.uploads]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu", action="store_true", help="tiny shapes on CPU (what the test suite runs)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset of " + ", ".join(SYSTEMS))
    ap.add_argument("--uploads", default="thread,process", help="checkpoint uploaders to measure ('' for none)")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--global-batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--upload-threads", type=int, default=4)
    ap.add_argument("--no-cuda-graphs", action="store_true", help="torchtitan without CUDA graphs")
    ap.add_argument("--budget-s", type=float, default=450.0, help="seconds for all runs together")
    ap.add_argument("--run-timeout-s", type=float, default=240.0)
    ap.add_argument("--peak-tflops", type=float, default=None, help="the GPU's dense bf16 peak (else by name)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    args.systems = [s for s in args.systems.split(",") if s]
    args.uploads = [u for u in args.uploads.split(",") if u]
    unknown = set(args.systems) - set(SYSTEMS)
    if unknown:
        ap.error(f"unknown systems {sorted(unknown)}: use some of {', '.join(SYSTEMS)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    setup_logging()
    t0 = time.time()
    import torch

    import gpu_smoke

    if not args.cpu and not torch.cuda.is_available():
        print("no CUDA device here: run with --cpu", file=sys.stderr)
        return 2
    device = torch.cuda.get_device_name(0) if not args.cpu else "cpu"
    peak, peak_source = gpu_smoke.peak_flops(args, device) if not args.cpu else (None, "no GPU")
    w = wl.tiny() if args.cpu else wl.llama3_1b(seq_len=args.seq_len, global_batch=args.global_batch,
                                                steps=args.steps)
    budget = Budget(args.budget_s, first_guess_s=0 if args.cpu else 60)
    runs: dict[str, list[dict]] = {s: [] for s in SYSTEMS if s in args.systems}
    checkpoints: list[dict] = []
    skipped: list[str] = []

    def report() -> dict:
        out = {"benchmark": "gpu_kit", "mode": "cpu" if args.cpu else "gpu", "device": device,
               "workload": w.to_dict(), "peak_flops": {"value": peak, "source": peak_source},
               "same_workload": same_workload(w, runs), **summary(runs),
               "checkpoint": checkpoints, "runs": runs, "skipped": skipped,
               "torchtitan": TITAN_ON_CPU if args.cpu else "ran", "wall_s": time.time() - t0, "machine": machine()}
        if args.out:  # rewritten after every run: a stopped kit still leaves what it measured
            with open(args.out, "w") as f:
                json.dump(out, f, indent=2, default=float)
        return out

    steps: list[tuple[str, str, Callable[[], dict]]] = [
        (part, what, (lambda s=what: with_mfu(throughput_run(s, args), w, peak)) if part == "throughput"
         else (lambda u=what: checkpoint_run(u, args))) for part, what in plan(args)]
    for part, what, go in steps:
        if not budget.fits(part + what):
            skipped.append(f"{part} {what}: {budget.left():.0f} s left of --budget-s")
            continue
        print(f"[gpu_kit] {part} {what} ({budget.left():.0f} s left)", file=sys.stderr, flush=True)
        started, load = time.time(), os.getloadavg()[0]
        got = go()
        budget.spent(part + what, time.time() - started)
        got.update(load_avg_1m_before=load, wall_s=time.time() - started)
        (runs[what] if part == "throughput" else checkpoints).append(got)
        print(f"[gpu_kit]   -> {got.get('status')} {got.get('tokens_per_s') or ''}", file=sys.stderr, flush=True)
        report()
    out = report()
    emit(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
