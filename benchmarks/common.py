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
            "torch": torch.__version__.split("+")[0], "ray": ray_version, "commit": _commit()}


def _commit() -> str | None:
    """The commit measured (with "+changes" when the tree differs from it), or None outside git."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+changes" if dirty else "")


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


TENSOR_MB = 64


def rank_state(rank: int, world: int, port: int, gb_per_rank: float):
    """In a rank process of ``run_ranks``: join the gloo group and build ``gb_per_rank`` GB of
    float32 tensors (``TENSOR_MB`` each) as one module with a stateless optimizer; returns
    (tensors, ``TrainState``): the checkpoint is exactly the tensors."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    return state_of_rank(rank, gb_per_rank)


def state_of_rank(rank: int, gb_per_rank: float, fill: bool = True):
    """(tensors, ``TrainState``) of ``rank_state`` without joining a group: also what a new
    attempt's rank restores into (``fill=False``: the same names, zeros)."""
    import torch
    from torch import nn

    from rayflex.checkpoint.checkpointer import TrainState

    n = int(gb_per_rank * 1024 // TENSOR_MB)
    module = nn.Module()
    # Named per rank, as a sharded model's shards are distinct entries: under one name on
    # every rank, DCP takes the tensors for replicas and writes each name once (half the
    # bytes of two ranks on disk, and a restore reads them back on both ranks).
    setattr(module, f"weights_rank{rank}", nn.ParameterList(
        [nn.Parameter(torch.full((TENSOR_MB * 2**20 // 4,), float(rank * n + i) if fill else 0.0))
         for i in range(n)]))
    opt = torch.optim.SGD(module.parameters(), lr=0.0)  # no state: the checkpoint is the tensors
    return [p.data for p in module.parameters()], TrainState(modules=[module], optimizers=[opt], get_step=lambda: 1)


def on_linkbed(topology: str, scale: float, call: str, env: dict, tmp: str) -> dict:
    """Run ``call`` (``MODULE:FUNCTION`` of a module in benchmarks/) in the link bed of
    ``topology`` at ``scale`` (``python -m rayflex.testing.linkbed``), with ``env`` added to
    this environment; the bed's JSON (its plan, the bytes per link, the call's result),
    written under ``tmp``."""
    import subprocess

    raw = os.path.join(tmp, "bed.json")
    path = os.pathsep.join(filter(None, [os.path.dirname(os.path.abspath(__file__)), os.environ.get("PYTHONPATH")]))
    subprocess.run([sys.executable, "-m", "rayflex.testing.linkbed", "--topology", str(topology),
                    "--scale", str(scale), "--out", raw, "--call", call],
                   env={**os.environ, **env, "PYTHONPATH": path}, check=True)
    with open(raw) as f:
        return json.load(f)

