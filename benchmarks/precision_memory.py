"""Activation checkpointing and bf16 against the plain fp32 run (the peer), in one invocation.

    python benchmarks/precision_memory.py [--steps 4] [--rounds 3] [--out results/precision_memory.json]

Each configuration trains the same small GPT on the same data as one real TrainWorker in
this process (a world of one rank on gloo; the same setup, FSDP2 sharding and step loop as
a run), rounds alternating between configurations. Per configuration it prints the median
over rounds of the stage-0 activation peak the worker measures (``StepRecord.
activation_peak_bytes``, the largest of the run's steps), of the mean step time, and the
memory model's prediction (``planning/capacity/memory.py``) for the same layout; the peer
(``none``, fp32) is measured in the same run. CPU bf16 matmuls are slow on machines
without bf16 instructions, so step times of bf16 say little about a GPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
from common import emit, machine, setup_logging  # noqa: E402

SEQ, BATCH = 64, 8
CONFIGS = [("none", "fp32"), ("full", "fp32"), ("every_k", "fp32"), ("none", "bf16"), ("full", "bf16")]


def model_spec():
    from rayflex.models import GPTConfig, gpt

    return gpt(GPTConfig(vocab_size=256, seq_len=SEQ, d_model=64, n_layers=4, n_heads=4))


def make_spec(data_uri: str, storage: str, steps: int, ac: str, dtype: str):
    import rayflex as rf

    return rf.TrainSpec(model=model_spec(), data=rf.DataConfig(uri=data_uri, seq_len=SEQ, global_batch=BATCH),
                        run=rf.RunConfig(name="pm-bench", storage=f"file://{storage}", steps=steps),
                        scaling=rf.ScalingConfig(num_workers=1), checkpoint=rf.CheckpointConfig(resume=False),
                        precision=rf.PrecisionConfig(param_dtype=dtype),
                        memory=rf.MemoryConfig(activation_checkpointing=ac, ac_every=2))


def measure(spec) -> dict:
    from rayflex.mesh.plan import plan_mesh
    from rayflex.worker.train_worker import TrainWorker

    worker = TrainWorker(0, spec, plan_mesh(spec.model, spec.parallel, spec.data, 1))
    try:
        worker.setup("127.0.0.1", worker.node_info()["port"])
        worker.start(spec.run.steps)
        if not worker.join(300):
            raise RuntimeError("training did not finish in 300 s")
        status = worker.poll()
        if status.error:
            raise RuntimeError(status.error)
    finally:
        worker.release(timeout_s=10, checkpoint_grace_s=0)
    steps = status.records[1:] or status.records  # the first step pays one-time costs
    return {"activation_peak_bytes": max(r.activation_peak_bytes for r in status.records),
            "step_s": statistics.mean(r.step_time_s for r in steps),
            "final_loss": status.records[-1].loss}


def modeled(spec) -> dict:
    from rayflex.mesh.plan import plan_mesh
    from rayflex.planning.capacity.memory import Runtime, describe_model, estimate_memory

    model = describe_model(spec.model, SEQ).for_run(spec.precision, spec.memory)
    rank = estimate_memory(model, plan_mesh(spec.model, spec.parallel, spec.data, 1),
                           Runtime.cpu()).ranks[0]
    return {"activations_bytes": rank.activations, "backward_workspace_bytes": rank.workspace,
            "peak_bytes": rank.peak_bytes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    setup_logging()
    from rayflex.data.dataset import write_synthetic_dataset

    root = tempfile.mkdtemp(prefix="rayflex-pm-")
    data = write_synthetic_dataset(f"file://{root}/tokens", num_samples=512, seq_len=SEQ, vocab_size=256,
                                   num_shards=2, seed=0)
    rounds: dict[tuple, list[dict]] = {c: [] for c in CONFIGS}
    for _ in range(args.rounds):
        for c in CONFIGS:
            rounds[c].append(measure(make_spec(data, root, args.steps, *c)))
    results, peer = [], None
    for c in CONFIGS:
        med = {k: statistics.median(r[k] for r in rounds[c]) for k in rounds[c][0]}
        model = modeled(make_spec(data, root, args.steps, *c))
        row = {"activation_checkpointing": c[0], "param_dtype": c[1], **med, "modeled": model,
               "modeled_over_measured": model["activations_bytes"] / med["activation_peak_bytes"]}
        if peer is None:
            peer = row
        row["activation_peak_vs_peer"] = med["activation_peak_bytes"] / peer["activation_peak_bytes"]
        row["step_time_vs_peer"] = med["step_s"] / peer["step_s"]
        results.append(row)
    emit({"benchmark": "precision_memory", "machine": machine(), "model": "gpt 4x64, vocab 256",
          "seq_len": SEQ, "global_batch": BATCH, "steps": args.steps, "rounds": args.rounds,
          "peer": "activation_checkpointing=none, fp32", "results": results}, args.out)


if __name__ == "__main__":
    main()
