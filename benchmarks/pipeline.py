"""Pipeline schedules side by side: GPipe, 1F1B and Interleaved 1F1B on the same model,
data and mesh (pp=2 x dp=2, 8 microbatches), in one run.

    python benchmarks/pipeline.py [--steps 20]

Per schedule: tokens/s, stage-0 peak activation bytes (saved-for-backward tensors, counted
with autograd hooks), the theoretical bubble fraction (p-1)/(m+p-1) ((p-1)/(v*m+p-1) with v
stages per rank) beside the measured fraction of forward/backward time each stage spent
blocked on its neighbours.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import emit, machine, setup_logging  # noqa: E402

SEQ, BATCH, PP, DP, M = 64, 32, 2, 2, 8


def run(schedule: str, data: str, storage: str, steps: int) -> dict:
    import rayflex as rf
    from rayflex.models import GPTConfig, gpt

    v = 2 if schedule == "interleaved" else 1
    trainer = rf.Trainer(model=gpt(GPTConfig(vocab_size=256, seq_len=SEQ, d_model=128, n_layers=6, n_heads=4)),
                         data=rf.DataConfig(uri=data, seq_len=SEQ, global_batch=BATCH),
                         run=rf.RunConfig(name=f"pipe-{schedule}", storage=storage, steps=steps),
                         scaling=rf.ScalingConfig(num_workers=PP * DP),
                         parallel=rf.ParallelConfig(pp=PP, schedule=schedule, microbatches=M, stages_per_rank=v),
                         checkpoint=rf.CheckpointConfig(resume=False))
    t0 = time.time()
    res = trainer.fit(progress=False)
    steady = res.metrics[2:]
    return {
        "tokens_per_s": BATCH * SEQ / statistics.median(m["step_time_s"] for m in steady),
        "stage0_peak_activation_bytes": max(m["activation_peak_bytes"][0] for m in res.metrics),
        "peak_activation_bytes_per_stage": [max(m["activation_peak_bytes"][s] for m in res.metrics)
                                            for s in range(PP)],
        "theoretical_bubble_fraction": (PP - 1) / (v * M + PP - 1),
        "measured_wait_fraction_per_stage": [statistics.median(m["pipeline_wait_fraction"][s] for m in steady)
                                             for s in range(PP)],
        "stages_per_rank": v,
        "final_loss": res.final_loss,
        "wall_s": time.time() - t0,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    setup_logging()
    from rayflex.data.dataset import write_synthetic_dataset
    from rayflex.local_ray import ensure_ray

    tmp = tempfile.mkdtemp(prefix="rayflex-bench-")
    data = write_synthetic_dataset(f"file://{tmp}/data", num_samples=4096, seq_len=SEQ)
    ensure_ray(PP * DP)
    results = {}
    for schedule in ("gpipe", "1f1b", "interleaved"):
        results[schedule] = run(schedule, data, f"file://{tmp}/runs", args.steps)
        print(f"{schedule}: {results[schedule]}", file=sys.stderr)
    emit({"benchmark": "pipeline", "machine": machine(),
          "workload": {"model": "gpt-6x128", "seq_len": SEQ, "global_batch": BATCH, "pp": PP, "dp": DP,
                       "microbatches": M, "steps": args.steps,
                       "note": "4 workers share 2 CPU cores: waits include CPU contention, not only the bubble"},
          "results": results,
          "ratios": {"1f1b_over_gpipe_stage0_activation_bytes":
                     results["1f1b"]["stage0_peak_activation_bytes"] / results["gpipe"]["stage0_peak_activation_bytes"],
                     "1f1b_over_gpipe_tokens_per_s": results["1f1b"]["tokens_per_s"] / results["gpipe"]["tokens_per_s"]}})


if __name__ == "__main__":
    main()
