"""DTensor's cached sharding decisions, forgotten when a reused process takes a new rank.

DTensor caches the output sharding of each op keyed by DeviceMesh equality, which ignores
which rank a process is. After an elastic restart renumbers a reused process, a cached
decision hands back the *old* mesh, whose coordinate places this rank's shard where
another rank's is: a ``state_dict()`` (its ``detach``) then claims the old rank's offsets,
so DCP refuses a save ("invalid fill tensor-volume") or, worse, a live snapshot names the
wrong chunks (tests/test_worker_reuse.py shows both).

The C++ dispatch fast path keeps its cache *per thread* (clearing it in one thread leaves
another's), and a Ray actor answers calls on a pool of threads that outlive attempts. So an
attempt is a generation: ``new_attempt()`` starts one (clears the process-wide Python
caches and this thread's), and ``in_this_thread()``, called where a thread starts touching
the attempt's DTensors, clears that thread's cache once per generation.
"""

from __future__ import annotations

import logging
import threading

import torch

log = logging.getLogger(__name__)

_generation = 0
_seen = threading.local()  # .generation: the last one this thread cleared its cache for


def new_attempt() -> None:
    """Forget every cached decision: the process-wide ones now, each thread's before its next op."""
    global _generation
    _generation += 1
    _clear_python_caches()
    in_this_thread()


def in_this_thread() -> None:
    """Clear this thread's fast-path cache if it has not been cleared since ``new_attempt``."""
    if getattr(_seen, "generation", None) == _generation:
        return
    native_clear = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if native_clear is not None:
        native_clear()
    _seen.generation = _generation


def _clear_python_caches() -> None:
    try:
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor import _redistribute

        prop = DTensor._op_dispatcher.sharding_propagator
        cached = prop.propagate_op_sharding
        # A thread-local LRU cache: clearing it would reach only this thread. A new
        # instance empties it for every thread.
        if hasattr(cached, "cache") and hasattr(prop, "propagate_op_sharding_non_cached"):
            prop.propagate_op_sharding = type(cached)(prop.propagate_op_sharding_non_cached)
        for fn in (getattr(prop, "_propagate_tensor_meta_cached", None),
                   getattr(_redistribute, "_gen_transform_infos", None)):
            if hasattr(fn, "cache_clear"):
                fn.cache_clear()
    except Exception as e:  # noqa: BLE001 - private API; a newer torch may not need this
        log.debug("could not clear DTensor sharding caches: %s", e)


def stale_shards(tensors: dict, prefix: str = "") -> list[str]:
    """The keys of ``tensors`` (a state dict, nested or not) whose DTensor claims a mesh
    coordinate other than this process's place in that mesh: what a stale cache leaves.
    Reads the global rank: empty without a default process group."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    if not dist.is_initialized():
        return []
    rank, stale = dist.get_rank(), []
    for key, value in tensors.items():
        if isinstance(value, dict):
            stale.extend(stale_shards(value, f"{prefix}{key}."))
        elif isinstance(value, DTensor):
            mesh = value.device_mesh
            where = (mesh.mesh == rank).nonzero()
            if where.numel() and tuple(where[0].tolist()) != tuple(mesh.get_coordinate() or ()):
                stale.append(f"{prefix}{key}")
    return stale
