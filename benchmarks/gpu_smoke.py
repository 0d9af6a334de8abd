"""GPU smoke run: a ~1B-parameter GPT on one GPU through the public API, every phase once.

    python benchmarks/gpu_smoke.py [--steps 20] [--every 10] [--peak-tflops 989]
    python benchmarks/gpu_smoke.py --cpu-smoke [--in-process]     # tiny model, gloo, CPU

Phases: setup, ``--steps`` training steps with a checkpoint every ``--every`` steps (and
a final one), then a second run that resumes from that checkpoint and trains
``--resume-steps`` more. ``rayflex.Trainer(...).fit()`` drives both (world size 1,
``ScalingConfig(use_gpu=True)``); ``--in-process`` runs the same TrainWorker in this
process without Ray instead (what the CPU test does). Prints one JSON object:

* ``tokens_per_s``: median over the steps after the first two (warm-up, compilation);
  a step's time excludes its checkpoint, which is measured on its own.
* ``mfu``: 6 x params x tokens/s / the GPU's peak dense bf16 FLOP/s (H200/H100/A100 by
  name, else ``--peak-tflops``), attention FLOPs left out, as is usual for this figure.
* ``peak_gpu_memory_bytes``: ``torch.cuda.max_memory_allocated`` in the training
  process, read at each loss call (the loss function is wrapped to read it).
* ``checkpoint``: each save's blocked time (what training waited for: staging into
  host buffers, plus, for the first save of an attempt, allocating them, plus waiting
  for a previous upload still running) beside the peer measured in the same run: the
  state's bytes over the measured device-to-host bandwidth of a pinned buffer.
* ``phases``: whether setup, steps, checkpoint and resume each ran; the exit code is 1
  unless all did.

Precision and memory features are used when ``rayflex`` has them (``PrecisionConfig``,
``MemoryConfig``): bf16 compute, activation checkpointing of every other block, and
``torch.compile`` on GPU; ``features`` says what was used.
"""

from __future__ import annotations

import argparse
import inspect
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(__file__))
from common import emit, machine, setup_logging  # noqa: E402

# Peak dense bf16 FLOP/s by device name (longest match first).
PEAK_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H200", 989.4), ("H100", 989.4),
                    ("A100", 312.0))
KEYS = ("benchmark", "mode", "runner", "device", "model", "features", "workload", "tokens_per_s", "step_time_s",
        "mfu", "peak_flops", "peak_gpu_memory_bytes", "checkpoint", "health", "phases", "all_phases_ran", "wall_s",
        "machine")


class PeakMemoryProbe:
    """The model's loss, recording ``torch.cuda.max_memory_allocated`` of the process it
    runs in (the training worker) into ``path`` whenever it grew. Defined in the script,
    so it travels to the workers by value with the model spec."""

    def __init__(self, loss_fn, path: str):
        self.loss_fn = loss_fn
        self.path = path
        self.last = -1

    def __call__(self, output, targets):
        import torch

        loss = self.loss_fn(output, targets)
        if output.is_cuda:
            peak = torch.cuda.max_memory_allocated(output.device)
            if peak > self.last:
                self.last = peak
                tmp = f"{self.path}.{os.getpid()}"
                with open(tmp, "w") as f:
                    f.write(str(peak))
                os.replace(tmp, self.path)
        return loss


# ----------------------------------------------------------------- configuration
def model_config(args):
    from rayflex.models import GPTConfig

    if args.cpu_smoke:
        return GPTConfig(vocab_size=128, seq_len=32, d_model=32, n_layers=2, n_heads=2)
    # 16 x 12 x 2048^2 + 2 x 50304 x 2048 (embedding, head) ~ 1.0B parameters.
    return GPTConfig(vocab_size=50304, seq_len=args.seq_len, d_model=args.d_model, n_layers=args.layers,
                     n_heads=args.d_model // 128)


def feature_configs(args) -> tuple[dict, dict]:
    """(Trainer keyword arguments, what they mean) for bf16 / recomputation / compile,
    as far as this rayflex supports them."""
    import rayflex as rf

    accepted = inspect.signature(rf.Trainer.__init__).parameters
    kwargs: dict[str, Any] = {}
    used = {"precision": "fp32", "activation_checkpointing": "none", "compile": False,
            "precision_config": hasattr(rf, "PrecisionConfig") and "precision" in accepted,
            "memory_config": hasattr(rf, "MemoryConfig") and "memory" in accepted}
    if used["precision_config"] and not args.cpu_smoke and not args.fp32:
        kwargs["precision"] = rf.PrecisionConfig(param_dtype="bf16", reduce_dtype="fp32")
        used["precision"] = "bf16 compute, fp32 reduce and master weights"
    if used["memory_config"]:
        compile_ = not args.cpu_smoke and not args.no_compile
        kwargs["memory"] = rf.MemoryConfig(activation_checkpointing=args.ac, ac_every=2, compile=compile_)
        used.update(activation_checkpointing=args.ac if args.ac != "every_k" else "every 2nd block",
                    compile=compile_)
    return kwargs, used


def trainer(args, data: str, storage: str, ckpt: str, name: str, steps: int, resume: bool, probe_path: str):
    import dataclasses

    import rayflex as rf
    from rayflex.models import gpt

    model = gpt(model_config(args))
    model = dataclasses.replace(model, loss_fn=PeakMemoryProbe(model.loss_fn, probe_path))
    kwargs, _ = feature_configs(args)
    return rf.Trainer(model=model, data=rf.DataConfig(uri=data, seq_len=model_config(args).seq_len,
                                                      global_batch=args.batch),
                      run=rf.RunConfig(name=name, storage=storage, steps=steps,
                                       optimizer=rf.OptimizerConfig(lr=3e-4, warmup_steps=2, grad_clip=1.0)),
                      scaling=rf.ScalingConfig(num_workers=1, use_gpu=not args.cpu_smoke),
                      checkpoint=rf.CheckpointConfig(every_steps=args.every, keep=1, uri=ckpt, resume=resume,
                                                     upload=args.upload, upload_threads=args.upload_threads,
                                                     when_busy=args.when_busy),
                      **kwargs)


# ----------------------------------------------------------------- running
def run_with_ray(t) -> dict:
    """One run through ``Trainer.fit()``: per-step (tokens, seconds), the wall time each
    step finished, checkpoint saves, the step it restored (None), setup seconds."""
    from rayflex.storage.rundir import RunDirectory

    result = t.fit(progress=False)
    events = RunDirectory(result.run_dir).read_jsonl("events.jsonl")
    seq = t.spec.data.seq_len
    steps = [(m["step"], t.spec.data.global_batch * seq, m["step_time_s"]) for m in result.metrics]
    saves = [{"step": e["step"], "reason": e.get("reason"), "blocked_s": e["blocked_s"], "total_s": e["total_s"],
              "bytes": e["bytes"], "committed": True, "waited_for_previous_s": None} for e in events if e["kind"] == "checkpoint_committed"]
    failed = [e for e in events if e["kind"] == "checkpoint_failed"]
    loaded = [e["step"] for e in events if e["kind"] == "checkpoint_loaded"]
    started = [e for e in events if e["kind"] == "workers_started"]
    return {"status": result.status, "steps": steps, "times": {m["step"]: m["time"] for m in result.metrics},
            "saves": saves, "save_errors": [e.get("reason") for e in failed],
            "restored_step": loaded[0] if loaded else None,
            "setup_s": started[0]["setup_s"] if started else None, "completed": result.steps_completed}


def run_in_process(t, timeout_s: float = 600) -> dict:
    """The same run with the TrainWorker in this process (world size 1, no Ray)."""
    from rayflex.constants import set_node_ip
    from rayflex.mesh.plan import plan_mesh
    from rayflex.worker.status import WorkerState
    from rayflex.worker.train_worker import TrainWorker

    set_node_ip("127.0.0.1")
    spec = t.spec
    t.preflight()
    worker = TrainWorker(0, spec, plan_mesh(spec.model, spec.parallel, spec.data, 1))
    t0 = time.time()
    info = worker.setup("127.0.0.1", worker.node_info()["port"], restore=spec.checkpoint.resume)
    setup_s = time.time() - t0
    worker.start(spec.run.steps)
    worker.join(timeout_s)
    status = worker.poll()
    worker.release(30, 0)
    seq = spec.data.seq_len
    return {"status": "finished" if status.state == WorkerState.DONE else f"{status.state}: {status.error}",
            "steps": [(r.step, r.samples * seq, r.step_time_s) for r in status.records],
            "times": {r.step: r.time for r in status.records},
            "saves": [{k: c.get(k) for k in ("step", "reason", "blocked_s", "total_s", "bytes", "committed",
                                             "waited_for_previous_s", "upload")} for c in status.checkpoints
                      if c.get("committed")],
            "save_errors": [c["error"] for c in status.checkpoints if c.get("error")],
            "restored_step": (info.get("restored") or {}).get("step"), "setup_s": setup_s,
            "completed": status.step}


# ----------------------------------------------------------------- the peer: copy bandwidth
def copy_bandwidth(cuda: bool, nbytes: int, repeats: int = 5) -> tuple[float, str]:
    """Bytes/s of a device-to-host copy into a pinned buffer (``cudaMemcpy`` D2H), or of
    a host memcpy on CPU; the buffer is capped at 2 GiB."""
    import torch

    n = max(1 << 20, min(nbytes, 2 << 30))
    if cuda:
        src = torch.empty(n, dtype=torch.uint8, device="cuda")
        dst = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        dst.copy_(src, non_blocking=True)  # warm-up
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1e3
        del src, dst
        torch.cuda.empty_cache()
        return n * repeats / seconds, "cudaMemcpy device-to-host into a pinned buffer"
    src = torch.empty(n, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    t0 = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    return n * repeats / (time.perf_counter() - t0), "host memcpy (no GPU)"


def peak_flops(args, device_name: Optional[str]) -> tuple[Optional[float], str]:
    if args.peak_tflops:
        return args.peak_tflops * 1e12, "--peak-tflops"
    for key, tflops in PEAK_BF16_TFLOPS:
        if device_name and key in device_name:
            return tflops * 1e12, f"dense bf16 peak of {key}"
    return None, "unknown device: pass --peak-tflops"


# ----------------------------------------------------------------- main
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny model, gloo, CPU: the same phases in seconds")
    ap.add_argument("--in-process", action="store_true", help="run the worker in this process, without Ray")
    ap.add_argument("--steps", type=int, default=None, help="steps of the first run (20; 6 with --cpu-smoke)")
    ap.add_argument("--every", type=int, default=None, help="checkpoint interval (10; 3 with --cpu-smoke)")
    ap.add_argument("--resume-steps", type=int, default=None, help="steps after resuming (4; 2 with --cpu-smoke)")
    ap.add_argument("--batch", type=int, default=None, help="global batch in sequences (8; 4 with --cpu-smoke)")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--d-model", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--ac", choices=("none", "full", "every_k"), default="every_k",
                    help="activation checkpointing (when MemoryConfig exists)")
    ap.add_argument("--no-compile", action="store_true", help="do not torch.compile the blocks")
    ap.add_argument("--fp32", action="store_true", help="train in fp32 even where bf16 is available")
    ap.add_argument("--upload", choices=("auto", "process", "thread"), default="auto",
                    help="CheckpointConfig.upload: where the checkpoint's bytes are written from")
    ap.add_argument("--upload-threads", type=int, default=1, help="CheckpointConfig.upload_threads")
    ap.add_argument("--when-busy", choices=("defer", "wait"), default="defer",
                    help="CheckpointConfig.when_busy: a save due while the previous one uploads is "
                         "deferred (the default) or waits for it")
    ap.add_argument("--peak-tflops", type=float, default=None, help="the GPU's peak dense bf16 TFLOP/s")
    ap.add_argument("--storage", default=None, help="a directory for data, runs and checkpoints (default: a temp dir)")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args(argv)
    small = args.cpu_smoke
    args.steps = args.steps or (6 if small else 20)
    args.every = args.every or (3 if small else 10)
    args.resume_steps = args.resume_steps or (2 if small else 4)
    args.batch = args.batch or (4 if small else 8)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    setup_logging()
    t_start = time.time()
    import torch

    cuda = not args.cpu_smoke
    if cuda and not torch.cuda.is_available():
        print("no CUDA device here: run with --cpu-smoke", file=sys.stderr)
        return 2
    device_name = torch.cuda.get_device_name(0) if cuda else "cpu"
    flops_peak, flops_source = peak_flops(args, device_name) if cuda else (
        (args.peak_tflops * 1e12, "--peak-tflops") if args.peak_tflops else (None, "no GPU"))
    if cuda and flops_peak is None:
        print(f"unknown GPU {device_name!r}: pass --peak-tflops (its dense bf16 TFLOP/s)", file=sys.stderr)
        return 2

    from rayflex.data.dataset import write_synthetic_dataset

    root = args.storage or tempfile.mkdtemp(prefix="rayflex-gpu-smoke-")
    cfg = model_config(args)
    data = write_synthetic_dataset(f"file://{root}/data", num_samples=max(64, 4 * args.batch),
                                   seq_len=cfg.seq_len, vocab_size=cfg.vocab_size, num_shards=2)
    storage, ckpt, probe = f"file://{root}/runs", f"file://{root}/checkpoints", f"{root}/peak_memory_bytes"
    run = run_in_process if args.in_process else run_with_ray
    first_t = trainer(args, data, storage, ckpt, "gpu-smoke", args.steps, False, probe)
    params = sum(first_t.spec.model.param_counts())
    print(f"model: {params / 1e9:.2f}B parameters on {device_name}", file=sys.stderr)
    first = run(first_t)
    print(f"first run: {first['status']} at step {first['completed']}", file=sys.stderr)
    total = args.steps + args.resume_steps
    second = run(trainer(args, data, storage, ckpt, "gpu-smoke-resume", total, True, probe))
    print(f"resumed run: {second['status']} from step {second['restored_step']} to {second['completed']}",
          file=sys.stderr)

    steady = [(tokens, dt) for step, tokens, dt in first["steps"] if step > 2 and dt > 0]
    step_time = statistics.median(dt for _, dt in steady) if steady else None
    tokens_per_s = statistics.median(tokens / dt for tokens, dt in steady) if steady else None
    saves = first["saves"] + second["saves"]
    state_bytes = max((s["bytes"] or 0 for s in saves), default=0)
    bandwidth, bandwidth_kind = copy_bandwidth(cuda, state_bytes or (1 << 26))
    floor_s = state_bytes / bandwidth if state_bytes else None
    blocked = [s["blocked_s"] for s in saves]
    peak_mem = int(open(probe).read()) if os.path.exists(probe) else None
    # The node health check a run makes before growing onto a node (rayflex/worker/health_probe.py):
    # every GPU visible and computing correctly, and the speed of its timed multiply.
    from rayflex.worker.health_probe import probe_node

    health = probe_node(expected_gpus=torch.cuda.device_count() if cuda else 0)
    phases = {"setup": first["setup_s"] is not None and bool(first["steps"]),
              "steps": first["status"] == "finished" and first["completed"] == args.steps,
              "checkpoint": bool(first["saves"]) and not first["save_errors"]
              and max(s["step"] for s in first["saves"]) == args.steps,
              "resume": second["status"] == "finished" and second["restored_step"] == args.steps
              and second["completed"] == total,
              "health": not health["error"] and health["gflops"] > 0}
    _, features = feature_configs(args)
    out = {
        "benchmark": "gpu_smoke", "mode": "cpu-smoke" if args.cpu_smoke else "gpu",
        "runner": "in-process" if args.in_process else "ray", "device": device_name,
        "model": {"params": params, "gpt": {k: getattr(cfg, k) for k in ("vocab_size", "seq_len", "d_model",
                                                                         "n_layers", "n_heads")}},
        "features": features,
        "workload": {"steps": args.steps, "resume_steps": args.resume_steps, "checkpoint_every": args.every,
                     "upload": args.upload, "upload_threads": args.upload_threads,
                     "global_batch": args.batch, "tokens_per_step": args.batch * cfg.seq_len, "world_size": 1},
        "tokens_per_s": tokens_per_s, "step_time_s": step_time,
        "mfu": 6 * params * tokens_per_s / flops_peak if tokens_per_s and flops_peak else None,
        "peak_flops": {"value": flops_peak, "source": flops_source},
        "peak_gpu_memory_bytes": peak_mem,
        "checkpoint": {"saves": saves, "errors": first["save_errors"] + second["save_errors"],
                       "blocked_s_min": min(blocked) if blocked else None,
                       "blocked_s_median": statistics.median(blocked) if blocked else None,
                       "state_bytes": state_bytes, "copy_bandwidth_bytes_per_s": bandwidth,
                       "copy_bandwidth_kind": bandwidth_kind, "copy_floor_s": floor_s,
                       "blocked_min_over_floor": min(blocked) / floor_s if blocked and floor_s else None},
        "health": health,
        "phases": phases, "all_phases_ran": all(phases.values()), "wall_s": time.time() - t_start,
        "machine": machine(),
    }
    assert tuple(out) == KEYS
    emit(out, args.out)
    return 0 if out["all_phases_ran"] else 1


if __name__ == "__main__":
    sys.exit(main())
