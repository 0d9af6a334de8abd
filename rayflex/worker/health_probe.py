"""A node's health check, run where the node's ranks would run: the accelerators it
advertises are there and compute correctly, and how fast one computes (a matrix multiply
timed for a fixed span). ``probe_node`` runs as a Ray task pinned to a node that is about
to be used (growth, a node held out and checked again); ``compute_speed`` runs in every
rank at setup, so the controller holds the speed of the nodes it trains on to judge a
newcomer against (``faults.health``).

On CPUs both time one BLAS thread through numpy, not torch: a check starts in a new worker
process, where importing torch (~1.4 CPU-s) was most of the check, and on a throttled node
most of its wall time (a tenth of a core: ~15 s before the first multiply). The GPU path
imports torch, inside, never at import: the controller references ``probe_node`` without
loading it.
"""

from __future__ import annotations

import time
from typing import Optional

# Long enough to see a CPU quota's period many times (the slow-node throttle's is 10 ms),
# short beside a rank's setup.
MEASURE_S = 0.05
# The multiply timed: on a CPU a 256-square fp32 one (~34 MFLOP, dozens per span on one
# core); on a GPU a 4096-square bf16 one (~137 GFLOP, ~0.2 ms on an H100: bound by the
# tensor cores, not by kernel launches, so a throttled GPU shows).
CPU_SIZE = 256
GPU_SIZE = 4096


def compute_speed(device: str = "cpu", min_s: float = MEASURE_S) -> float:
    """GFLOP/s of repeated square matrix multiplies on ``device`` for at least ``min_s``
    seconds of wall time (what this process gets of its device now)."""
    if device.split(":")[0] == "cpu":
        return _cpu_speed(min_s)
    import torch

    dev = torch.device(device)
    # Constant operands: the speed does not depend on the values, and a rank's random number
    # generators (restored from a checkpoint at setup) must not move.
    a = torch.full((GPU_SIZE, GPU_SIZE), 0.5, device=dev, dtype=torch.bfloat16)
    b = torch.full((GPU_SIZE, GPU_SIZE), 0.25, device=dev, dtype=torch.bfloat16)
    torch.mm(a, b)  # first-call setup is not the device's speed
    torch.cuda.synchronize(dev)
    speed = _timed(lambda: torch.mm(a, b), lambda: torch.cuda.synchronize(dev), min_s, GPU_SIZE)
    a = b = None
    torch.cuda.empty_cache()  # the rank's own allocations come next
    return speed


def _cpu_speed(min_s: float) -> float:
    """One BLAS thread's GFLOP/s (a rank trains on one thread; BLAS would otherwise take
    every core of the machine for the multiply)."""
    import numpy as np
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=1, user_api="blas"):
        a = np.full((CPU_SIZE, CPU_SIZE), 0.5, dtype=np.float32)
        b = np.full((CPU_SIZE, CPU_SIZE), 0.25, dtype=np.float32)
        a @ b  # first-call setup is not the core's speed
        return _timed(lambda: a @ b, lambda: None, min_s, CPU_SIZE)


def _timed(multiply, sync, min_s: float, size: int) -> float:
    """GFLOP/s of ``multiply`` (a ``size``-square product) repeated for ``min_s``."""
    done, start = 0, time.perf_counter()
    while True:
        multiply()
        done += 1
        if done % 4 == 0:
            sync()
            elapsed = time.perf_counter() - start
            if elapsed >= min_s:
                return 2.0 * size ** 3 * done / elapsed / 1e9


def _computes_correctly(device: str) -> bool:
    """A product whose exact answer is known: identity times a small integer matrix."""
    if device == "cpu":
        import numpy as np

        m = np.arange(64, dtype=np.float32).reshape(8, 8)
        return bool(np.array_equal(np.eye(8, dtype=np.float32) @ m, m))
    import torch

    m = torch.arange(64, dtype=torch.float32).reshape(8, 8).to(device)
    return bool(torch.equal(torch.eye(8, device=device) @ m, m))


# A check measured beside another one (``start_at``) times this long: long beside the load's
# swings on a shared host, which both see in the same window.
WINDOW_S = 0.3


def probe_node(expected_gpus: int = 0, start_at: Optional[float] = None) -> dict:
    """The health report of the node this runs on: ``{"gflops", "devices", "error",
    "probe_s", "late_s", "window_at"}``. ``expected_gpus`` > 0: that many GPUs must be
    visible and each must compute correctly; the slowest one's speed is the node's.
    ``start_at`` (epoch seconds): the speed is timed from then for ``WINDOW_S``, so checks
    started together on several nodes are timed in the same window (``late_s``: how late
    this one began; ``window_at``: when its timing began, epoch seconds). Never raises: a
    check that cannot run is the report's ``error``."""
    t0 = time.perf_counter()
    report: dict = {"gflops": 0.0, "devices": 0, "error": ""}
    try:
        if expected_gpus > 0:
            import torch

            found = torch.cuda.device_count() if torch.cuda.is_available() else 0
            report["devices"] = found
            if found < expected_gpus:
                report["error"] = f"{found} of its {expected_gpus} GPUs visible"
                return report
            devices = [f"cuda:{i}" for i in range(expected_gpus)]
        else:
            devices = ["cpu"]
            report["devices"] = 1
        for device in devices:
            if not _computes_correctly(device):
                report["error"] = f"{device} computed a wrong matrix product"
                return report
        span = MEASURE_S
        if start_at is not None:
            wait = start_at - time.time()
            if wait > 0:
                time.sleep(wait)
            report["late_s"] = max(0.0, -wait)
            span = WINDOW_S
        report["window_at"] = time.time()
        report["gflops"] = min(compute_speed(d, span) for d in devices)
    except Exception as e:  # noqa: BLE001 - a broken driver, out of memory: the node is unhealthy
        report["error"] = f"{type(e).__name__}: {e}"
    finally:
        report["probe_s"] = time.perf_counter() - t0
    return report
