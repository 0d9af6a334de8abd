"""One rayflex run of the GPU kit's workload; prints one JSON object.

    python benchmarks/gpu_kit_rayflex.py --runner ray|in-process [--float8] [--cpu] [--out F]

The model is the kit's Llama (``gpu_kit_workload``) through rayflex's Hugging Face path
(``rayflex.models.hf.causal_lm`` of a ``LlamaConfig``, initialised from scratch), the data
a synthetic token dataset. ``--runner ray`` trains through ``Trainer.fit()`` with
``ScalingConfig(use_gpu=True)``; ``in-process`` runs the same TrainWorker in this process
without Ray (``gpu_smoke.run_in_process``). Step times are wall-clock gaps between
finished steps (``rounds.step_figures``: the method every system of the kit is measured
by); peak memory is ``torch.cuda.max_memory_allocated`` of the training process, read at
each loss call (``gpu_smoke.PeakMemoryProbe``). ``--cpu``: the tiny shape, gloo, CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
import gpu_kit_workload as wl  # noqa: E402
import gpu_smoke  # noqa: E402
from common import emit, setup_logging  # noqa: E402
from rounds import step_figures  # noqa: E402


def model_spec(w: wl.Workload, probe_path: str):
    from transformers import LlamaConfig

    from rayflex.models.hf import causal_lm

    spec = causal_lm(LlamaConfig(**wl.hf_llama_config(w)), name=w.name, init_seed=w.seed + 1)
    # The probe is defined in gpu_smoke: sent by value, so Ray's workers need not import it.
    return dataclasses.replace(spec, loss_fn=gpu_smoke.PeakMemoryProbe(spec.loss_fn, probe_path))


def trainer(w: wl.Workload, *, runner: str, float8: bool, cpu: bool, root: str):
    import rayflex as rf
    from rayflex.data.dataset import write_synthetic_dataset

    data = write_synthetic_dataset(f"file://{root}/data", num_samples=max(64, 4 * w.global_batch),
                                   seq_len=w.seq_len, vocab_size=w.vocab_size, num_shards=2)
    return rf.Trainer(
        model=model_spec(w, f"{root}/peak_memory_bytes"),
        data=rf.DataConfig(uri=data, seq_len=w.seq_len, global_batch=w.global_batch),
        run=rf.RunConfig(name=f"kit-{runner}{'-float8' if float8 else ''}", storage=f"file://{root}/runs",
                         steps=w.steps,
                         optimizer=rf.OptimizerConfig(lr=w.lr, betas=w.betas, weight_decay=w.weight_decay,
                                                      warmup_steps=w.warmup_steps, grad_clip=w.grad_clip,
                                                      implementation="fused")),
        scaling=rf.ScalingConfig(num_workers=1, use_gpu=not cpu),
        checkpoint=rf.CheckpointConfig(every_steps=0, resume=False),
        precision=rf.PrecisionConfig(param_dtype=w.param_dtype, reduce_dtype=w.reduce_dtype, float8=float8),
        memory=rf.MemoryConfig(activation_checkpointing=w.activation_checkpointing, compile=w.compile))


def run(w: wl.Workload, *, runner: str, float8: bool = False, cpu: bool = False, root: str | None = None) -> dict:
    """One run: throughput figures, peak memory, the settings it ran with."""
    import ray.cloudpickle

    if root is None:  # the run's files go with it (every suite run left one directory a run behind)
        with tempfile.TemporaryDirectory(prefix="rayflex-gpu-kit-") as tmp:
            return run(w, runner=runner, float8=float8, cpu=cpu, root=tmp)
    ray.cloudpickle.register_pickle_by_value(gpu_smoke)  # the probe travels with the spec
    t_launch = time.time()
    t = trainer(w, runner=runner, float8=float8, cpu=cpu, root=root)
    got = gpu_smoke.run_in_process(t) if runner == "in-process" else gpu_smoke.run_with_ray(t)
    figures = step_figures(got["times"], set(), t_launch, w.tokens_per_step)
    probe = f"{root}/peak_memory_bytes"
    return {"system": f"rayflex-{runner}", "float8": float8, "status": got["status"],
            "params": sum(t.spec.model.param_counts()),
            **figures, "setup_s": got["setup_s"],
            "peak_memory_bytes": int(open(probe).read()) if os.path.exists(probe) else None,
            "settings": wl.rayflex_settings(w, float8=float8)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runner", choices=("ray", "in-process"), required=True)
    ap.add_argument("--float8", action="store_true", help="PrecisionConfig(float8=True)")
    ap.add_argument("--cpu", action="store_true", help="the tiny shape on CPU")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--global-batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    setup_logging()
    w = wl.tiny() if args.cpu else wl.llama3_1b(seq_len=args.seq_len, global_batch=args.global_batch,
                                                  steps=args.steps)
    out = run(w, runner=args.runner, float8=args.float8, cpu=args.cpu)
    emit(out, args.out)
    return 0 if out["status"] == "finished" else 1


if __name__ == "__main__":
    sys.exit(main())
