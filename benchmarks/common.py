"""Shared bits of the benchmarks: machine description, JSON output, logging to stderr."""

from __future__ import annotations

import json
import logging
import os
import platform
import sys


def machine() -> dict:
    import torch

    try:
        import ray

        ray_version = ray.__version__
    except ImportError:  # pragma: no cover
        ray_version = None
    return {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__.split("+")[0], "ray": ray_version}


def emit(obj: dict, out: str | None = None) -> None:
    """The one JSON object on stdout (and in ``out``); everything else goes to stderr."""
    text = json.dumps(obj, indent=2, default=float)
    sys.stdout.write(text + "\n")
    sys.stdout.flush()
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")


def setup_logging() -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


def run_ranks(target, world: int, cfg: dict):
    """Run ``target(rank, world, port, cfg, results)`` in ``world`` spawned processes (a gloo
    group on a free loopback port) and return what rank 0 put on ``results``; a rank that
    fails ends the benchmark naming the exit codes."""
    import multiprocessing as mp

    from rayflex.local_ray import free_ports

    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    port = free_ports(1)[0]
    procs = [ctx.Process(target=target, args=(r, world, port, cfg, results)) for r in range(world)]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode for p in procs):
            raise SystemExit(f"a rank failed: exit codes {[p.exitcode for p in procs]}")
        return results.get()
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
