"""TrainWorkerActor: the shell Ray makes remote; the TrainWorker inside it holds the logic.

Spawning an actor means handing Ray its class, and the process that spawns workers (the
controller) must not import torch to do so. The shell is torch-free: its constructor
imports :class:`rayflex.worker.train_worker.TrainWorker` inside the new worker process and
every actor method forwards to it. ``TrainWorker`` stays a plain class, testable without Ray.
"""

from __future__ import annotations

import contextlib
import gc

# TrainWorker's public methods, callable on the actor (tests/test_architecture.py keeps
# this list equal to the class's).
ACTOR_METHODS = ("reconfigure", "node_info", "ping", "setup", "start", "poll", "flight_record", "request_stop",
                 "request_checkpoint", "set_fail_at", "join", "release", "held_step", "take_live",
                 "drop_live", "shutdown")


class TrainWorkerActor:
    def __init__(self, rank: int, spec, plan, knobs=None):
        with cyclic_gc_paused():
            from rayflex.models.summary import loaded
            from rayflex.worker.train_worker import TrainWorker

            self.worker = TrainWorker(rank, loaded(spec), plan, knobs=knobs)


@contextlib.contextmanager
def cyclic_gc_paused():
    """A worker's start imports torch, its distributed packages and the model's code (for
    an HF model, transformers): ~10^6 objects that live as long as the process. The cyclic
    collector would scan the growing heap again and again while they are created (~0.4
    CPU-s of a ~3.5 CPU-s start, measured by benchmarks/worker_start.py); TrainWorker
    freezes them once built, so nothing is left for a collection to find later."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _forward(name: str):
    def method(self, *args, **kwargs):
        return getattr(self.worker, name)(*args, **kwargs)

    method.__name__ = method.__qualname__ = name
    return method


for _name in ACTOR_METHODS:
    setattr(TrainWorkerActor, _name, _forward(_name))
