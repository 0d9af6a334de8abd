"""Checkpoint cost, measured in one invocation against the same state and endpoint, the
configurations alternating round by round (none, thread, process, sync, none, thread, ...):

* ``none``: no checkpoints (the steps/s every other configuration is compared with);
* ``thread``: async saves, the upload in a background thread of each training process;
* ``process``: async saves, the upload in an uploader process per rank reading shared-memory
  staging (``CheckpointConfig(upload="process")``): no GIL shared with training;
* ``sync``: a synchronous DCP save of the same state (what the peers pay per checkpoint).

Per run: steps/s, the time training was blocked per save, and the **step slowdown around a
save**: for each save, how much longer than the run's median step the steps that ran while
its upload was in flight took (the same accounting as ``every_steps="auto"``'s save cost),
plus what it blocked. Reported per configuration: the median over rounds of each run's
median, and the spread (min, max) over rounds. Plus the bare memory-copy floor for the
same bytes on this machine.

    python benchmarks/checkpoint.py [--storage s3|file] [--steps 40] [--rounds 3]
                                    [--modes none,thread,process,sync] [--out F]

With ``--storage s3`` (default) the benchmark starts moto's S3 server on 127.0.0.1 and
points every Ray process at it, so uploads really go over HTTP through s3fs.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
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
    # werkzeug logs a line per request at INFO, which the benchmarks' logging shows: CPU on
    # the cores being measured, more for a client that sends more requests.
    logging.getLogger("werkzeug").setLevel(logging.WARNING)

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


MODES = ("none", "thread", "process", "sync")


def run(data: str, storage: str, name: str, steps: int, mode: str) -> dict:
    import rayflex as rf
    from rayflex.models import GPTConfig, gpt

    every = 0 if mode == "none" else EVERY
    upload = mode if mode in ("thread", "process") else "auto"
    trainer = rf.Trainer(model=gpt(GPTConfig(vocab_size=4096, seq_len=SEQ, d_model=384, n_layers=4, n_heads=6)),
                         data=rf.DataConfig(uri=data, seq_len=SEQ, global_batch=BATCH),
                         run=rf.RunConfig(name=name, storage=storage, steps=steps),
                         scaling=rf.ScalingConfig(num_workers=WORKERS),
                         checkpoint=rf.CheckpointConfig(every_steps=every, keep=2, async_save=mode != "sync",
                                                        upload=upload, resume=False))
    res = trainer.submit().wait()
    commits = [e for e in _events(storage, name) if e["kind"] == "checkpoint_committed"]
    m = res.metrics
    steps_per_s = (len(m) - 1) / (m[-1]["time"] - m[0]["time"])
    periodic = [c for c in commits if c["step"] < steps]  # the final save has no steps after it
    return {"steps_per_s": steps_per_s, "checkpoints": len(commits),
            "blocked_s": [c["blocked_s"] for c in periodic], "total_s": [c["total_s"] for c in periodic],
            "slowdown_s": [slowdown_around(m, c) for c in periodic],
            "bytes_per_rank": commits[0]["bytes"] if commits else 0,
            "upload": sorted({c.get("upload", "") for c in commits})}


def slowdown_around(metrics: list[dict], save: dict) -> float:
    """What a save cost training: its blocked time plus, for every step that started before
    its upload ended, the step's time over the run's median step (steps 1-2 left out)."""
    from rayflex.control.ledger import steps_excess_s

    lines = {x["step"]: x for x in metrics}
    median = statistics.median(x["step_time_s"] for x in metrics if x["step"] > 2)
    ended = lines[save["step"]]["time"] + save["blocked_s"] + save["total_s"]
    return save["blocked_s"] + steps_excess_s(lines, save["step"] + 1, ended, median)


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "rounds": values}


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
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--modes", default=",".join(MODES), help=f"a comma-separated subset of {','.join(MODES)}")
    ap.add_argument("--endpoint-nice", type=int, default=19,
                    help="niceness of the local S3 endpoint's threads (0: compete with training)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    modes = [x for x in args.modes.split(",") if x]
    if not modes or set(modes) - set(MODES):
        ap.error(f"--modes: choose from {', '.join(MODES)}")
    setup_logging()
    tmp = tempfile.mkdtemp(prefix="rayflex-bench-")
    server = None
    if args.storage == "s3":
        storage, server = start_s3(args.endpoint_nice)
    else:
        storage = f"file://{tmp}/runs"
    from rayflex.data.dataset import write_synthetic_dataset
    from rayflex.local_ray import ensure_ray

    runs: dict[str, list[dict]] = {mode: [] for mode in modes}
    try:
        data = write_synthetic_dataset(f"file://{tmp}/data", num_samples=2048, seq_len=SEQ, vocab_size=4096)
        ensure_ray(WORKERS)
        for r in range(args.rounds):
            for mode in modes:
                got = run(data, storage, f"ckpt-{mode}-{r}", args.steps, mode)
                runs[mode].append(got)
                print(f"round {r} {mode}: {got['steps_per_s']:.3f} steps/s, blocked {got['blocked_s']}, "
                      f"slowdown {got['slowdown_s']}", file=sys.stderr)
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(tmp, ignore_errors=True)  # the dataset and file:// runs
    nbytes = max(x["bytes_per_rank"] for rs in runs.values() for x in rs)
    floor = copy_floor_s(nbytes) if nbytes else None
    results = {}
    for mode, rs in runs.items():
        out = {"steps_per_s": _spread([x["steps_per_s"] for x in rs])}
        if mode != "none":
            out["blocked_s"] = _spread([statistics.median(x["blocked_s"]) for x in rs])
            out["slowdown_around_save_s"] = _spread([statistics.median(x["slowdown_s"]) for x in rs])
            out["upload_s"] = _spread([statistics.median(x["total_s"]) for x in rs])
        results[mode] = out
    ratios = {}
    if "sync" in results:
        sync_cost = results["sync"]["slowdown_around_save_s"]["median"]
        for mode in ("thread", "process"):
            if mode in results:
                ratios[f"{mode}_slowdown_over_sync_save"] = results[mode]["slowdown_around_save_s"]["median"] / sync_cost
    for mode in ("thread", "process"):
        if mode in results and floor:
            ratios[f"{mode}_blocked_over_copy_floor"] = results[mode]["blocked_s"]["median"] / floor
        if mode in results and "none" in results:
            ratios[f"{mode}_steps_per_s_over_none"] = (results[mode]["steps_per_s"]["median"]
                                                       / results["none"]["steps_per_s"]["median"])
    emit({"benchmark": "checkpoint", "machine": machine(), "load_avg": os.getloadavg(),
          "workload": {"model": "gpt-4x384-v4096", "workers": WORKERS, "steps": args.steps, "rounds": args.rounds,
                       "order": modes, "checkpoint_every_steps": EVERY, "storage": args.storage,
                       "s3_endpoint_nice": args.endpoint_nice if args.storage == "s3" else None,
                       "upload_nice": knob("UPLOAD_NICE"), "state_bytes_per_rank": nbytes},
          "results": results, "memory_copy_floor_s": floor, "ratios": ratios,
          "runs": runs}, args.out)


if __name__ == "__main__":
    main()
