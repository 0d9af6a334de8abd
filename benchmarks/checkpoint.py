"""Checkpoint cost, measured in one run against the same state and endpoint:

* blocked time per checkpoint with async saves (what training waits for),
* the time of a synchronous save of the same state,
* the bare memory-copy floor for the same bytes on this machine,
* steps/s of a run checkpointing every 10 steps vs the same run without checkpoints.

    python benchmarks/checkpoint.py [--storage s3|file] [--steps 30]

With ``--storage s3`` (default) the benchmark starts moto's S3 server on 127.0.0.1 and
points every Ray process at it, so uploads really go over HTTP through s3fs.
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

from rayflex.constants import knob  # noqa: E402

SEQ, BATCH, WORKERS, EVERY = 64, 8, 2, 10


def start_s3(nice: int = 0) -> tuple[str, object]:
    """moto's S3 server in this process. ``nice`` > 0 lowers the priority of its threads
    (inherited from the thread that starts it): on a real cluster the object store is
    another machine, here it shares the 2 cores the workers train on."""
    import threading

    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)

    def start():
        if nice:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
        server.start()

    starter = threading.Thread(target=start)
    starter.start()
    starter.join()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    # Ray worker processes inherit this environment.
    os.environ.update({"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
                       "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL_S3": endpoint})
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="rayflex-bench")
    return "s3://rayflex-bench/runs", server


def run(data: str, storage: str, name: str, steps: int, *, every: int, async_save: bool) -> dict:
    import rayflex as rf
    from rayflex.models import GPTConfig, gpt

    trainer = rf.Trainer(model=gpt(GPTConfig(vocab_size=4096, seq_len=SEQ, d_model=384, n_layers=4, n_heads=6)),
                         data=rf.DataConfig(uri=data, seq_len=SEQ, global_batch=BATCH),
                         run=rf.RunConfig(name=name, storage=storage, steps=steps),
                         scaling=rf.ScalingConfig(num_workers=WORKERS),
                         checkpoint=rf.CheckpointConfig(every_steps=every, keep=2, async_save=async_save,
                                                        resume=False))
    handle = trainer.submit()
    res = handle.wait()
    commits = [e for e in _events(storage, name) if e["kind"] == "checkpoint_committed"]
    m = res.metrics
    steps_per_s = (len(m) - 1) / (m[-1]["time"] - m[0]["time"])
    return {"steps_per_s": steps_per_s, "checkpoints": len(commits),
            "blocked_s": [c["blocked_s"] for c in commits], "total_s": [c["total_s"] for c in commits],
            "bytes_per_rank": commits[0]["bytes"] if commits else 0}


def _events(storage: str, name: str) -> list[dict]:
    from rayflex.storage.rundir import RunDirectory

    return RunDirectory(f"{storage}/{name}").read_jsonl("events.jsonl")


def copy_floor_s(nbytes: int, repeats: int = 7) -> float:
    """Median time to copy ``nbytes`` into memory that already exists (memcpy bandwidth)."""
    import torch

    torch.set_num_threads(1)
    src = torch.randn(nbytes // 4)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--storage", choices=("s3", "file"), default="s3")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--endpoint-nice", type=int, default=19,
                    help="niceness of the local S3 endpoint's threads (0: compete with training)")
    args = ap.parse_args()
    setup_logging()
    tmp = tempfile.mkdtemp(prefix="rayflex-bench-")
    server = None
    if args.storage == "s3":
        storage, server = start_s3(args.endpoint_nice)
    else:
        storage = f"file://{tmp}/runs"
    from rayflex.data.dataset import write_synthetic_dataset
    from rayflex.local_ray import ensure_ray

    data = write_synthetic_dataset(f"file://{tmp}/data", num_samples=2048, seq_len=SEQ, vocab_size=4096)
    ensure_ray(WORKERS)
    try:
        plain = run(data, storage, "ckpt-none", args.steps, every=0, async_save=True)
        print(f"no checkpoints: {plain}", file=sys.stderr)
        async_run = run(data, storage, "ckpt-async", args.steps, every=EVERY, async_save=True)
        print(f"async: {async_run}", file=sys.stderr)
        sync_run = run(data, storage, "ckpt-sync", args.steps, every=EVERY, async_save=False)
        print(f"sync: {sync_run}", file=sys.stderr)
    finally:
        if server is not None:
            server.stop()
    floor = copy_floor_s(async_run["bytes_per_rank"])
    blocked = statistics.median(async_run["blocked_s"])
    sync_s = statistics.median(sync_run["blocked_s"])
    emit({"benchmark": "checkpoint", "machine": machine(),
          "workload": {"model": "gpt-4x384-v4096", "workers": WORKERS, "steps": args.steps,
                       "checkpoint_every_steps": EVERY, "storage": args.storage,
                       "s3_endpoint_nice": args.endpoint_nice if args.storage == "s3" else None,
                       "upload_thread_nice": knob("UPLOAD_NICE"),
                       "state_bytes_per_rank": async_run["bytes_per_rank"]},
          "results": {"async": {"blocked_s_median": blocked, **async_run},
                      "sync": {"save_s_median": sync_s, **sync_run},
                      "memory_copy_floor_s": floor,
                      "no_checkpoints": plain},
          "ratios": {"async_blocked_over_sync_save": blocked / sync_s,
                     "async_blocked_over_copy_floor": blocked / floor,
                     "steps_per_s_async_every_10_over_none": async_run["steps_per_s"] / plain["steps_per_s"]}})


if __name__ == "__main__":
    main()
