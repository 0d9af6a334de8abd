"""Setup memory of a rank: building on the meta device, then filling the shards, vs building
the whole stage and sharding it (today's plain build), in the same run.

    python benchmarks/meta_init.py [--rounds 3] [--world 4] [--layers 20] [--d-model 1024]

Each build runs in ``world`` fresh gloo processes (dp = world, no pipeline); rounds
alternate which build goes first. A rank's setup memory is its peak RSS while building
and sharding minus its RSS just before (the peak is reset then through
``/proc/self/clear_refs``). Prints JSON: per build the median over rounds of the largest
rank's setup memory, the spread, and the meta/plain ratio (claim: <= 0.5).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import emit, machine, setup_logging  # noqa: E402

MB = 1 << 20


def model_spec(layers: int, d_model: int):
    from rayflex.models import GPTConfig, gpt

    return gpt(GPTConfig(vocab_size=32000, seq_len=1024, d_model=d_model, n_layers=layers,
                         n_heads=max(1, d_model // 64)))


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> bool:
    """Make VmHWM start again from the current RSS (Linux >= 4.0); False where it cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _rank(rank: int, world: int, port: int, build: str, layers: int, d_model: int, out) -> None:
    import resource
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import rayflex as rf
    from rayflex.mesh.plan import plan_mesh
    from rayflex.worker.meta_init import build_sharded_stages
    from rayflex.worker.parallelize import build_device_mesh, build_local_stages, data_parallel_mesh, shard_stage

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=600))
    spec = model_spec(layers, d_model)
    plan = plan_mesh(spec, rf.ParallelConfig(), rf.DataConfig(uri="file:///unused", global_batch=world), world)
    dp_mesh = data_parallel_mesh(build_device_mesh(plan, "cpu"), plan)
    device = torch.device("cpu")
    dist.barrier()
    base_kb = _status_kb("VmRSS")
    reset = _reset_peak()
    base_maxrss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    if build == "meta":
        stages = build_sharded_stages(spec, plan, rank, device,
                                      shard=lambda s, m: shard_stage(m, dp_mesh, pipelined=False))
    else:  # what TrainWorker.setup did before: the whole stage, then fully_shard
        stages = build_local_stages(spec, plan, rank, device)
        for _, module in stages:
            shard_stage(module, dp_mesh, pipelined=False)
    build_s = time.perf_counter() - t0
    peak_kb = _status_kb("VmHWM") if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    shard_bytes = sum(p.to_local().numel() * p.element_size() for _, m in stages for p in m.parameters())
    dist.barrier()
    out.put((rank, {"setup_mb": (peak_kb - base_kb) / 1024, "shard_mb": shard_bytes / MB, "build_s": build_s,
                    "peak_reset": reset, "baseline_mb": base_kb / 1024,
                    "baseline_peak_mb": base_maxrss_kb / 1024}))
    dist.destroy_process_group()


def run_build(build: str, world: int, layers: int, d_model: int) -> list[dict]:
    import multiprocessing as mp

    from rayflex.local_ray import free_ports

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_ports(1)[0]
    procs = [ctx.Process(target=_rank, args=(r, world, port, build, layers, d_model, out)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        got = dict(out.get(timeout=900) for _ in procs)
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    return [got[r] for r in range(world)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--layers", type=int, default=20)
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    setup_logging()
    spec = model_spec(args.layers, args.d_model)
    counts = spec.param_counts()
    runs: dict[str, list[list[dict]]] = {"meta": [], "plain": []}
    for r in range(args.rounds):
        for build in (("meta", "plain") if r % 2 == 0 else ("plain", "meta")):
            ranks = run_build(build, args.world, args.layers, args.d_model)
            runs[build].append(ranks)
            print(f"round {r} {build}: setup MB per rank {[round(x['setup_mb']) for x in ranks]}", file=sys.stderr)

    def summary(build: str) -> dict:
        worst = [max(x["setup_mb"] for x in ranks) for ranks in runs[build]]  # the rank that must fit
        return {"setup_mb_median": statistics.median(worst), "setup_mb_min": min(worst), "setup_mb_max": max(worst),
                "setup_mb_per_round_per_rank": [[round(x["setup_mb"], 1) for x in ranks] for ranks in runs[build]],
                "shard_mb": round(statistics.mean(x["shard_mb"] for x in runs[build][0]), 1),
                "build_s_median": statistics.median(max(x["build_s"] for x in ranks) for ranks in runs[build]),
                "peak_reset": all(x["peak_reset"] for ranks in runs[build] for x in ranks)}

    meta, plain = summary("meta"), summary("plain")
    ratio = meta["setup_mb_median"] / plain["setup_mb_median"]
    emit({"benchmark": "meta_init", "machine": machine(), "world": args.world, "dp": args.world, "pp": 1,
          "rounds": args.rounds, "model": spec.name, "params": sum(counts),
          "full_model_mb": sum(counts) * 4 / MB, "largest_block_mb": max(counts) * 4 / MB,
          "meta": meta, "plain": plain, "meta_over_plain": ratio, "claim": "meta <= 0.5 x plain",
          "claim_holds": ratio <= 0.5}, args.out)


if __name__ == "__main__":
    main()
